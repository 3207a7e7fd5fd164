"""status and doctor say which GPU model runner vLLM picks for a Qwen3.5/3.6 hybrid with LoRA,
and what switches it, read from each real release's code (never a version table in patchkit);
code of a shape they do not understand gives "unknown" with a reason, never a guess."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from patchkit.cli.words import say
from patchkit.codes import Code
from patchkit.fs.safepath import Root
from patchkit.vllmtree import model_runner
from tests.conftest import RELEASES, copy_tree, release_tree, run_cli, run_subprocess
from tests.helpers import REPORT_IMPORTS

ENV = "VLLM_USE_V2_MODEL_RUNNER"
REFUSES = "does not yet support: hybrid/mamba models"

# The test's own expectations, read by hand from each wheel's vllm/config/vllm.py,
# vllm/envs.py and its runner files (not computed from the code under test):
# release range -> (default runner, the value that switches it, what that value gives)
#   0.17.0-0.19.1  envs default "0", no use_v2_model_runner, no V2 check, but V2's
#                  gpu/attn_utils.py knows no MambaSpec: _reshape_kv_cache asserts every
#                  KV cache spec is an AttentionSpec, and a GDN layer's is a MambaSpec
#                  (0.20.0 then refused hybrids in the config)     V1, =1 stops at start
#   0.20.0-0.21.0  envs default "0"; _validate_v2_model_runner refuses has_inner_state
#                  (hybrids): =1 makes vLLM refuse the model                  V1, =1 refused
#   0.22.0-0.22.1  Qwen3ForCausalLM only in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES; with =1
#                  _get_v2_model_runner_unsupported_features lists hybrids   V1, =1 refused
#   0.23.0-0.24.0  architecture list without Qwen3_5*; hybrids only refused in align mode
#                                                                             V1, =1 gives V2
#   0.25.0-0.26.0  _is_default_v2_model_runner_model False for is_hybrid     V1, =1 gives V2
#   0.27.0-0.28.0  hybrids V1 unless the architecture is listed (no Qwen3_5*) V1, =1 gives V2
#   0.29.0-0.33.0  no default-model check, nothing unsupported for hybrid+LoRA V2, =0 gives V1
#   0.34.0         gpu_model_runner.py and the variable removed              V2 only
# And where the variable is set, vLLM's start-up check of its environment (the engine calls
# vllm/platforms/interface.py's validate_environ before it makes any config):
#   0.17.0-0.33.0  it warns only of VLLM_* names vLLM does not know; the variable is known
#   0.34.0         any value but "1" raises ("... is no longer supported: Model Runner V1
#                  has been removed. Unset this variable."); "1" logs that it is redundant
FACTS = {
    **dict.fromkeys(
        ["0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1"], ("v1", "1", "stops")
    ),
    **dict.fromkeys(["0.20.0", "0.20.1", "0.20.2", "0.21.0"], ("v1", "1", "refused")),
    **dict.fromkeys(["0.22.0", "0.22.1"], ("v1", "1", "refused")),
    **dict.fromkeys(["0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0"], ("v1", "1", "v2")),
    **dict.fromkeys(["0.27.0", "0.27.1", "0.28.0"], ("v1", "1", "v2")),
    **dict.fromkeys(["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"], ("v2", "0", "v1")),
    "0.34.0": ("v2", None, None),
}
START_REFUSES = {"0.34.0"}  # releases whose start refuses any value but "1"
PLATFORM = "vllm/platforms/interface.py"


def start_check(release: str) -> tuple[int, int]:
    """The lines of ``release``'s validate_environ that raise for a value other than "1"
    and warn of "1" (read as text)."""
    lines = (release_tree(release) / PLATFORM).read_text().splitlines()
    [test] = [n for n, line in enumerate(lines, 1) if line.strip() == 'if value != "1":']
    assert "raise ValueError(" in lines[test]  # the line after the test
    warns = next(n for n, line in enumerate(lines[test:], test + 1) if "logger.warning(" in line)
    return test + 1, warns


KV_CACHE = "vllm/v1/worker/gpu/attn_utils.py"


def attention_assert(release: str) -> tuple[str, int]:
    """Where V2's KV cache code of ``release`` asserts an AttentionSpec (read as text)."""
    lines = (release_tree(release) / KV_CACHE).read_text().splitlines()
    [number] = [
        n
        for n, line in enumerate(lines, 1)
        if "assert isinstance(kv_cache_spec, AttentionSpec)" in line
    ]
    return KV_CACHE, number


def decide(root: Path, env: str | None = None) -> model_runner.RunnerChoice:
    with Root.open(root) as fs:
        return model_runner.decide(fs, env)


def test_every_tested_release_has_its_facts_here():
    assert set(RELEASES) <= set(FACTS), sorted(set(RELEASES) - set(FACTS))


@pytest.mark.parametrize("release", RELEASES)
def test_the_runner_each_release_picks(release: str):
    runner, value, gives = FACTS[release]
    choice = decide(release_tree(release))
    assert choice.runner == runner, choice.reason
    assert choice.effective == runner
    if value is None:
        assert choice.only and choice.flip is None
        return
    assert not choice.only and choice.flip == f"{ENV}={value}"
    if gives == "refused":
        assert choice.flip_to is None and choice.flip_refused.code == Code.RUNNER_REFUSED
        assert REFUSES in choice.flip_refused["raised"]
    elif gives == "stops":
        assert choice.flip_to is None and choice.flip_refused.code == Code.RUNNER_V2_NO_HYBRID
        assert (choice.flip_refused["file"], choice.flip_refused["line"]) == attention_assert(
            release
        )
    else:
        assert choice.flip_to == gives and choice.flip_refused is None
    # 0.17-0.21: the variable alone, its default "0"; later: the config's property, unset
    by_config = tuple(map(int, release.split("."))) >= (0, 22)
    assert (choice.reason.code, choice.reason["value"]) == (
        (Code.RUNNER_BY_CONFIG, None) if by_config else (Code.RUNNER_NO_CONFIG_SWITCH, 0)
    )


@pytest.mark.parametrize("release", RELEASES)
def test_the_environment_value_changes_it(release: str):
    runner, value, gives = FACTS[release]
    if value is None:  # the variable is gone from the config: only vLLM's start reads it
        assert release in START_REFUSES
        return
    flipped = decide(release_tree(release), value)
    assert flipped.runner == runner  # the default stays what the code says
    assert flipped.effective == ("refused" if gives == "stops" else gives)
    kept = decide(release_tree(release), "1" if value == "0" else "0")
    assert kept.effective == runner
    for choice in (flipped, kept):  # vLLM's start lets any value through
        assert choice.effective_reason is None or choice.effective_reason.code not in (
            Code.RUNNER_ENV_REFUSED,
            Code.RUNNER_ENV_REDUNDANT,
        )


@pytest.mark.parametrize("release", sorted(START_REFUSES))
def test_a_value_vllm_no_longer_takes_refuses_its_start(release: str):
    """0.34.0 removed V1, and validate_environ refuses the variable at any value but "1"
    (patchkit said nothing switches the runner, and vLLM did not start)."""
    raises, warns = start_check(release)
    runner = FACTS[release][0]
    for value in ("0", "true", " 1"):  # vLLM compares the text: " 1" is not "1"
        choice = decide(release_tree(release), value)
        assert (choice.runner, choice.effective) == (runner, "refused")
        why = choice.effective_reason
        assert why.code == Code.RUNNER_ENV_REFUSED
        assert (why["file"], why["line"], why["value"]) == (PLATFORM, raises, value)
        assert why["raised"] == (
            f"{ENV}={value} is no longer supported: Model Runner V1 has been removed. "
            "Unset this variable."
        )
    redundant = decide(release_tree(release), "1")
    assert redundant.effective == runner
    why = redundant.effective_reason
    assert why.code == Code.RUNNER_ENV_REDUNDANT and (why["file"], why["line"]) == (
        PLATFORM,
        warns,
    )
    assert decide(release_tree(release)).effective_reason is None  # unset: nothing to say


def test_status_and_doctor_say_vllm_refuses_to_start_and_to_unset_it():
    tree = str(release_tree("0.34.0"))
    raises, warns = start_check("0.34.0")
    for command in ("status", "doctor"):
        text = " ".join(run_cli(command, "--target", tree, env={ENV: "0"}).stdout.split())
        assert (
            f"this environment's {ENV}=0: vLLM refuses to start: {PLATFORM}:{raises} raises "
            f'"{ENV}=0 is no longer supported: Model Runner V1 has been removed. Unset this '
            f'variable."; unset {ENV}'
        ) in text, text
        text = " ".join(run_cli(command, "--target", tree, env={ENV: "1"}).stdout.split())
        assert (
            f"this environment's {ENV}=1: redundant, vLLM warns that it can be unset "
            f"({PLATFORM}:{warns})"
        ) in text, text
        data = json.loads(run_cli(command, "--target", tree, "--json", env={ENV: "0"}).stdout)
        environment = data["runner"]["environment"]
        assert (environment["value"], environment["runner"]) == ("0", "refused")
        assert environment["reason"]["code"] == "runner-env-refused"
        assert (environment["reason"]["file"], environment["reason"]["line"]) == (PLATFORM, raises)


def altered(release: str, dest: Path, relpath: str, old: str, new: str) -> Path:
    """A copy of the real ``release`` tree at ``dest`` with ``old``, once in ``relpath``,
    written as ``new``."""
    root = copy_tree(release, dest)
    text = (root / relpath).read_text()
    assert text.count(old) == 1
    (root / relpath).write_text(text.replace(old, new))
    return root


def test_a_start_check_of_another_shape_is_unknown_with_the_line(tmp_path: Path):
    """This alters a copy of the real 0.34.0 tree's validate_environ: it lets a second
    value through, a shape this check does not read; what the value does is unknown, the
    default runner stays what the code says."""
    old, new = 'if value != "1":', 'if value not in ("1", "true"):'
    root = altered("0.34.0", tmp_path / "t", PLATFORM, old, new)
    choice = decide(root, "0")
    assert (choice.runner, choice.effective) == ("v2", "unknown")
    why = choice.effective_reason
    assert (why.code, why["kind"], why["file"]) == (
        Code.RUNNER_UNKNOWN,
        "environ-not-understood",
        PLATFORM,
    )
    assert say(why).startswith(f"{PLATFORM}:{why['line']}: validate_environ reads {ENV}")
    assert decide(root).effective == "v2"


@pytest.mark.parametrize(
    "deep",
    [
        "        _deep = " + "not " * 5000 + "env\n",  # CPython's parser: RecursionError
        "        _deep = " + "-" * 100_000 + "1\n",  # its parser stack: MemoryError
        "        for _ in " + "-" * 1000 + "env:\n            pass\n",  # parses; unparse recursed
        "        (" + "-" * 1000 + "env).warning('x')\n",
    ],
    ids=["not-5000", "minus-100000", "for-iter-1000", "call-1000"],
)
def test_a_start_check_nested_too_deep_is_unknown_not_a_crash(tmp_path: Path, deep: str):
    """This alters a copy of the real 0.34.0 tree's validate_environ: an expression nested
    thousands deep (a few hundred kilobytes at most) before its loop or inside its branch.
    The check's answer is unknown (or the file's shape, where it still reads it), never
    patchkit's internal error, exit 3."""
    if "warning" in deep:
        old = '                logger.warning(\n                    "VLLM_USE_V2_MODEL_RUNNER=1'
        new = deep.replace("        ", "                ", 1) + old
    else:
        old = "        for env, value in os.environ.items():\n"
        new = deep + old
    root = altered("0.34.0", tmp_path / "t", PLATFORM, old, new)
    choice = decide(root, "0")
    parses = "env\n" not in deep and "1\n" not in deep
    # where the file still parses, the deep expression is just not the loop or warning read
    assert choice.effective == ("refused" if parses else "unknown"), choice
    result = run_cli("doctor", "--target", str(root), env={ENV: "0"})
    assert result.exit_code == 0 and "internal error" not in result.output, result.output


def test_a_value_vllm_cannot_read_is_refused_not_guessed():
    choice = decide(release_tree("0.30.0"), "yes")
    assert choice.runner == "v2" and choice.effective == "refused"
    why = choice.effective_reason
    assert why.code == Code.RUNNER_BAD_VALUE and why["value"] == "yes"
    assert "int()" in say(why)


def _copy_runner_files(release: str, dest: Path) -> Path:
    source = release_tree(release)
    for relpath in (
        "vllm/__init__.py",
        model_runner.CONFIG,
        model_runner.ENVS,
        model_runner.V1_FILE,
        model_runner.V2_FILE,
    ):
        (dest / relpath).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / relpath, dest / relpath)
    return dest


def test_a_future_shape_is_unknown_with_the_line(tmp_path: Path):
    """This alters a copy of the real 0.30.0 tree: use_v2_model_runner asks the model
    something new before its Triton check, as a later release might."""
    root = _copy_runner_files("0.30.0", tmp_path / "t")
    config = root / model_runner.CONFIG
    text = config.read_text()
    old = "        use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER\n"
    assert text.count(old) == 1
    new = "        if self.model_config.prefers_v1_runner:\n            return False\n"
    config.write_text(text.replace(old, new + old))
    choice = decide(root)
    assert choice.runner == "unknown" and not choice.known
    why = choice.reason
    assert why.code == Code.RUNNER_UNKNOWN and why["kind"] == "attribute"
    assert why["name"] == "model_config.prefers_v1_runner" and why["file"] == model_runner.CONFIG
    assert say(why) == (
        f"{model_runner.CONFIG}:{why['line']}: reads model_config.prefers_v1_runner, "
        "which this check does not know"
    )
    result = run_cli("status", "--target", str(root), "--vllm-version", "0.30.0")
    assert "runner: unknown for Qwen3.5/3.6 + LoRA here: " in " ".join(result.stdout.split())


def test_a_changed_env_default_is_unknown(tmp_path: Path):
    """This alters a copy of the real 0.26.0 tree's envs.py: a default vLLM never had."""
    root = _copy_runner_files("0.26.0", tmp_path / "t")
    envs = root / model_runner.ENVS
    text = envs.read_text()
    old = 'os.getenv("VLLM_USE_V2_MODEL_RUNNER", None)'
    assert text.count(old) == 1
    envs.write_text(text.replace(old, 'os.getenv("VLLM_USE_V2_MODEL_RUNNER", "auto")'))
    choice = decide(root)
    why = choice.reason
    assert choice.runner == "unknown" and why.code == Code.RUNNER_UNKNOWN
    assert (why["kind"], why["file"], why["value"]) == (
        "default-not-understood",
        model_runner.ENVS,
        "'auto'",
    )
    assert "'auto'" in say(why)


def test_status_text_and_json_show_the_runner():
    tree = str(release_tree("0.30.0"))
    text = run_cli("status", "--target", tree, env={ENV: None}).stdout.splitlines()
    second = text[1] + " " + text[2].strip()  # the header's next line, wrapped
    assert second == (
        "runner: Model Runner V2 serves Qwen3.5/3.6 + LoRA here by default "
        "(VLLM_USE_V2_MODEL_RUNNER=0 gives V1)"
    )
    assert text[3].startswith("  expand-block-n")
    data = json.loads(run_cli("status", "--target", tree, "--json", env={ENV: None}).stdout)
    runner = data["runner"]
    assert runner["default"] == "v2" and runner["flip"]["value"] == "0"
    assert runner["flip"]["gives"] == "v1" and runner["environment"]["value"] is None
    assert runner["hooks"] == {"nan-probe": ["v1", "v2"]} and runner["warning"] is None


def test_status_says_v2_stops_on_a_hybrid_before_0_20():
    """0.17.0: nothing in the config refuses V2 for a hybrid, but V2 cannot hold its GDN
    state: status says =1 stops vLLM at start (it said =1 gives Model Runner V2), and
    warns of no probe gap, for no runner serves then."""
    tree = str(release_tree("0.17.0"))
    where = "{}:{}".format(*attention_assert("0.17.0"))
    stops = (
        "makes vLLM refuse it: Model Runner V2 here keeps no Gated DeltaNet (Mamba) state: "
        f"vLLM stops at start on the assert that every KV cache is attention's ({where})"
    )
    text = " ".join(run_cli("status", "--target", tree, env={ENV: None}).stdout.split())
    assert (
        f"runner: V1 serves Qwen3.5/3.6 + LoRA here by default (VLLM_USE_V2_MODEL_RUNNER=1 {stops})"
        in text
    )
    data = json.loads(run_cli("status", "--target", tree, "--json", env={ENV: "1"}).stdout)
    runner = data["runner"]
    assert runner["flip"]["gives"] is None and runner["flip"]["refused"]["line"] == int(
        where.split(":")[1]
    )
    assert runner["environment"]["runner"] == "refused"
    assert runner["environment"]["reason"]["code"] == "runner-v2-no-hybrid"
    assert runner["warning"] is None


def test_status_names_a_probe_that_does_not_hook_the_runner_that_serves(tmp_path: Path):
    """0.17.0's nan-probe (runner-hooks) hooks V1 only; the environment asks for V2. This
    alters a copy of the real 0.17.0 tree: V2's KV cache code without the assert that
    stops a hybrid there, as if V2 could serve it."""
    old = "assert isinstance(kv_cache_spec, AttentionSpec)"
    tree = str(altered("0.17.0", tmp_path / "t", KV_CACHE, old, "pass"))
    data = json.loads(run_cli("status", "--target", tree, "--json", env={ENV: "1"}).stdout)
    runner = data["runner"]
    assert runner["environment"]["runner"] == "v2"
    assert runner["warning"]["message"].startswith(
        "nan-probe is opt-in here but its hooks are in V1, and Model Runner V2 serves here"
    )
    text = " ".join(run_cli("status", "--target", tree, env={ENV: "1"}).stdout.split())
    assert "runner: nan-probe is opt-in here but its hooks are in V1" in text
    quiet = json.loads(run_cli("status", "--target", tree, "--json", env={ENV: None}).stdout)
    assert quiet["runner"]["warning"] is None


def test_doctor_shows_the_runner():
    tree = str(release_tree("0.34.0"))
    text = " ".join(run_cli("doctor", "--target", tree, env={ENV: None}).stdout.split())
    assert "runner: Model Runner V2 serves Qwen3.5/3.6 + LoRA here, the only runner" in text
    data = json.loads(run_cli("doctor", "--target", tree, "--json", env={ENV: None}).stdout)
    assert data["runner"]["default"] == "v2" and data["runner"]["only"] is True
    assert data["runner"]["hooks"] == {"nan-probe": ["v2"]}


def test_status_still_imports_neither_vllm_nor_torch():
    result = run_subprocess("status", "--target", str(release_tree("0.30.0")), code=REPORT_IMPORTS)
    assert result.returncode == 0, result.stderr
    assert "runner: Model Runner V2" in result.stdout
    assert "IMPORTED: []" in result.stderr


def test_every_unknown_kind_the_check_raises_has_its_words():
    """runner-unknown's words are chosen by its ``kind``: a kind model_runner raises that
    runner_words lacks would fail only when a future tree meets it."""
    import re

    from patchkit.cli import runner_words

    source = Path(model_runner.__file__).read_text()
    raised = set(re.findall(r'_unknown\(\s*"([a-z-]+)"', source))
    assert raised and raised <= runner_words.KINDS, sorted(raised - runner_words.KINDS)
