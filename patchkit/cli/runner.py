"""The model runner, in status's and doctor's words: which runner serves Qwen3.5/3.6 with
LoRA on the tree, what switches it, and a patch whose hooks that runner lacks."""

from __future__ import annotations

from patchkit.cli.render import message, text_message
from patchkit.cli.words import say
from patchkit.codes import Code
from patchkit.patching.assess import Assessment
from patchkit.vllmtree import model_runner

SERVES = "Qwen3.5/3.6 + LoRA"
HOOKS = {frozenset({"v1"}): "V1", frozenset({"v2"}): "Model Runner V2"}


def _runner_name(runner: str | None) -> str:
    return model_runner.NAMES.get(runner or "", runner or "unknown")


def lines(choice, assessments: list[Assessment]) -> list[str]:
    """``runner: ...``: which runner serves here and what switches it; then, where a patch
    that hooks runners is applied or opt-in and the runner that serves is not hooked, one line."""
    said = [f"runner: {_runner_headline(choice)}"]
    probe = _probe_gap(choice, assessments)
    if probe:
        said.append(f"runner: {probe}")
    return said


def _runner_headline(choice) -> str:
    if not choice.known:
        return f"unknown for {SERVES} here: {say(choice.reason)}"
    name = _runner_name(choice.runner)
    if choice.only:
        text = f"{name} serves {SERVES} here, the only runner this vLLM has (nothing switches it)"
    elif choice.flip_to:
        text = (
            f"{name} serves {SERVES} here by default ({choice.flip} gives "
            f"{_runner_name(choice.flip_to)})"
        )
    elif choice.flip_refused:
        text = (
            f"{name} serves {SERVES} here by default ({choice.flip} makes vLLM refuse it: "
            f"{say(choice.flip_refused)})"
        )
    else:
        text = f"{name} serves {SERVES} here by default (no setting switches it)"
    return text + _environment(choice)


def _environment(choice) -> str:
    """What the variable in patchkit's own environment does, after the headline: nothing
    said where it changes nothing and vLLM's start says nothing of it."""
    if choice.env_value is None:
        return ""
    said = f"this environment's {model_runner.ENV}={choice.env_value[:40]}"
    why = choice.effective_reason
    if why is not None and why.code in (Code.RUNNER_ENV_REFUSED, Code.RUNNER_ENV_REDUNDANT):
        return f"; {said}: {say(why)}"
    if choice.effective == "unknown":
        return f"; what {said} does is unknown: {say(why)}"
    if choice.effective == choice.runner or choice.only:
        return ""
    if choice.effective == "refused":
        return f"; {said} makes vLLM refuse it: {say(why)}"
    return f"; {said} gives {_runner_name(choice.effective)}"


def _serving(choice) -> str | None:
    """The runner that serves with this environment: the default, or what its value gives."""
    return choice.effective if choice.effective in ("v1", "v2") else None


def _probe_gap(choice, assessments: list[Assessment]) -> str:
    serving = _serving(choice)
    for a in assessments:
        hooked = model_runner.hooked(a.files)
        state = str(a.state)
        if not hooked or state not in ("applied", "opt-in") or serving is None:
            continue
        if serving in hooked:
            continue
        other = "v1" if serving == "v2" else "v2"
        what = "is applied" if state == "applied" else "is opt-in here"
        switch = ""
        if choice.flip and choice.flip_to == other:
            switch = f"set {choice.flip} or "
        elif choice.env_value is not None and choice.runner == other:
            switch = f"unset {model_runner.ENV} or "
        return (
            f"{a.patch.id} {what} but its hooks are in {HOOKS.get(hooked, 'V1 and V2')}, and "
            f"{_runner_name(serving)} serves here: {switch}use a release whose {a.patch.id} "
            f"variant hooks {_runner_name(serving)}"
        )
    return ""


def as_json(choice, assessments: list[Assessment]) -> dict:
    probe = _probe_gap(choice, assessments)
    hooks = {
        a.patch.id: sorted(model_runner.hooked(a.files))
        for a in assessments
        if model_runner.hooked(a.files) and str(a.state) in ("applied", "opt-in")
    }
    return {
        "model": SERVES,
        "default": choice.runner,
        "name": _runner_name(choice.runner) if choice.known else None,
        "only": choice.only,
        "reason": message(choice.reason),
        "flip": (
            {
                "env": model_runner.ENV,
                "value": str(choice.flip_value),
                "gives": choice.flip_to,
                "refused": message(choice.flip_refused),
            }
            if choice.flip
            else None
        ),
        "environment": {
            "value": choice.env_value,
            "runner": choice.effective,
            "reason": message(choice.effective_reason),
        },
        "hooks": hooks,
        "warning": text_message(Code.RUNNER_NOT_HOOKED, probe),
        "line": f"runner: {_runner_headline(choice)}",
    }
