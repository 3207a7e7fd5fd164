"""The words of the model runner's codes: why a runner serves, why vLLM refuses, and what
made the answer unknown (:mod:`patchkit.cli.words` takes these into its own).

``runner-unknown`` says what the check met in ``kind`` and where in ``file`` and
``line``; each kind has its sentence here, made from that reason's facts alone.
"""

from __future__ import annotations

from collections.abc import Callable

from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason

# the runner's codes and their words; patchkit.cli.words takes them into its own (a
# reason nested in one of these is one of these, so nothing imports back)
WORDS: dict[Code, Words] = {}


words = registrar(WORDS)


def say(reason: Reason) -> str:
    """The words of one of the runner's reasons."""
    return WORDS[reason.code](reason, "")


def _set(r: Reason) -> str:
    """The variable as the outcome had it: `` unset`` or ``=0``/``=1``."""
    return " unset" if r["value"] is None else f"={r['value']}"


@words(Code.RUNNER_BY_CONFIG)
def _by_config(r: Reason, _: str) -> str:
    return f"{r['env']}{_set(r)}: use_v2_model_runner ({r['file']}:{r['line']})"


@words(Code.RUNNER_NO_CONFIG_SWITCH)
def _no_config_switch(r: Reason, _: str) -> str:
    return f"{r['env']}{_set(r)}, and the config has no use_v2_model_runner"


@words(Code.RUNNER_ONLY_ONE)
def _only_one(r: Reason, _: str) -> str:
    return f"{r['missing']} is gone and {r['file']} no longer reads {r['env']}"


@words(Code.RUNNER_REFUSED)
def _refused(r: Reason, _: str) -> str:
    return r["raised"] if r["raised"] is not None else f"vLLM raises at {r['file']}:{r['line']}"


@words(Code.RUNNER_V2_NO_HYBRID)
def _v2_no_hybrid(r: Reason, _: str) -> str:
    return (
        "Model Runner V2 here keeps no Gated DeltaNet (Mamba) state: vLLM stops at start on "
        f"the assert that every KV cache is attention's ({r['file']}:{r['line']})"
    )


@words(Code.RUNNER_BAD_VALUE)
def _bad_value(r: Reason, _: str) -> str:
    return f"vLLM reads {r['env']} with int(), which fails on {r['value']!r}"


@words(Code.RUNNER_ENV_REFUSED)
def _env_refused(r: Reason, _: str) -> str:
    return (
        f'vLLM refuses to start: {r["file"]}:{r["line"]} raises "{r["raised"]}"; unset {r["env"]}'
    )


@words(Code.RUNNER_ENV_REDUNDANT)
def _env_redundant(r: Reason, _: str) -> str:
    where = r["file"] if r["line"] is None else f"{r['file']}:{r['line']}"
    return f"redundant, vLLM warns that it can be unset ({where})"


# runner-unknown about the tree and its files: no "file:line" before them
_TREE: dict[str, Callable[[Reason], str]] = {
    "no-runner-files": lambda r: f"neither {r['v1']} nor {r['v2']} is in the tree",
    "one-runner-env-read": lambda r: (
        f"only one runner file is in the tree, but {r['file']} still reads {r['env']}"
    ),
    "env-not-read": lambda r: (
        f"{r['file']} does not read {r['env']}, yet both runner files are in the tree"
    ),
    "refused-unset": lambda r: (
        f"with {r['env']} unset vLLM refuses the configuration: {say(r['refusal'])}"
    ),
    "file-missing": lambda r: f"{r['file']} is not in the tree",
    "file-too-large": lambda r: f"{r['file']} is larger than {r['limit']} bytes",
    "file-unreadable": lambda r: f"{r['file']} could not be read whole",
    "file-unparsable": lambda r: f"{r['file']} does not parse ({r['error']})",
    "environ-overridden": lambda r: (
        f"{r['file']} has its own validate_environ, which this check does not read"
    ),
    "environ-not-called": lambda r: f"{r['file']} no longer calls validate_environ",
}
_NOT_KNOWN = "this check does not know"
# runner-unknown in the code: said after "file:line: " (or "file: " without a line)
_CODE: dict[str, Callable[[Reason], str]] = {
    "default-not-constant": lambda r: f"os.getenv({r['env']!r}) has no constant default",
    "default-not-understood": lambda r: f"{r['env']}'s default {r['value']} is not understood",
    "not-a-bool": lambda r: f"use_v2_model_runner gave {r['value']}, not a bool",
    "too-many-steps": lambda r: f"more than {r['limit']} steps",
    "takes-arguments": lambda r: f"{r['name']} takes arguments",
    "assignment": lambda r: f"an assignment {_NOT_KNOWN}",
    "statement": lambda r: f"a {r['node']} statement {_NOT_KNOWN}",
    "expression": lambda r: f"a {r['node']} {_NOT_KNOWN}",
    "operation": lambda r: f"an operation {_NOT_KNOWN}",
    "comparison": lambda r: f"a comparison {_NOT_KNOWN}",
    "call": lambda r: f"a call {_NOT_KNOWN}",
    "in-over-unknown": lambda r: f"`in` over something {_NOT_KNOWN}",
    "any-over-unknown": lambda r: f"any() over something {_NOT_KNOWN}",
    "name": lambda r: f"reads {r['name']}, which {_NOT_KNOWN}",
    "attribute": lambda r: f"reads {r['name']}, which {_NOT_KNOWN}",
    "attribute-of-unknown": lambda r: f"reads .{r['name']} of something {_NOT_KNOWN}",
    "other-env": lambda r: f"reads {r['name']}",
    "getattr": lambda r: f"getattr(self, {r['name']!r}) is not known",
    "depends-on-moe": lambda r: "depends on whether the model is MoE",
    "depends-on-model": lambda r: f"depends on {r['name']}",
    "unknown-value": lambda r: str(r["detail"]),
    "environ-not-understood": lambda r: f"validate_environ reads {r['env']} in a way {_NOT_KNOWN}",
}
KINDS = frozenset(_TREE) | frozenset(_CODE)  # every kind runner-unknown may carry


@words(Code.RUNNER_UNKNOWN)
def _unknown(r: Reason, _: str) -> str:
    kind = r["kind"]
    if kind in _TREE:
        return _TREE[kind](r)
    where = r["file"] if r["line"] is None else f"{r['file']}:{r['line']}"
    return f"{where}: {_CODE[kind](r)}"
