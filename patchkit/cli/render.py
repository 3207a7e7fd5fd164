"""Render reports for people (aligned text) and for machines (--json).

Objects become text and JSON here and nowhere else. A patch's state is
written with the same word in every command (:mod:`patchkit.vocabulary`);
apply and revert add what the run did to it, and end with one summary line.

One way to print: every line for stdout goes through :func:`out` (a report's
text and its JSON alike), every line for stderr through :func:`warn`, and both
escape control characters (:func:`patchkit.terminal.printable`, the one rule
for text on its way to a terminal): a file name, an index's answer, a model's
config, an adapter's name or a probe record in a line never reaches the
terminal raw, whichever command prints it. A line is one line: a newline in
it is escaped too, so text with several lines (JSON) is given line by line.
Text that must be filtered otherwise (the canary's API key) is filtered on the
way into them, never printed some other way. Each command's JSON is made by
one ``*_json`` function here; no object below the CLI carries a ``to_json``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import textwrap
from collections import Counter

import click
from packaging.version import Version

from patchkit.caches.compiled import CacheResult
from patchkit.catalogue.model import Catalogue, Variant
from patchkit.cli import exits
from patchkit.doctor import sass
from patchkit.patching.assess import Assessment
from patchkit.patching.decide import Step
from patchkit.patching.operations import RunReport
from patchkit.terminal import printable
from patchkit.vllmtree import model_runner
from patchkit.vocabulary import Action, PatchState

# `from patchkit.cli.render import printable` stays valid: it is patchkit.terminal's

SOURCES = {
    "metadata": "dist-info metadata",
    "git": "git describe",
    "file": "vllm/_version.py",
    "override": "--vllm-version / PATCHKIT_VLLM_VERSION",
    "unknown": "not found",
}
DONE = {
    Action.APPLIED: "applied now",
    Action.REVERTED: "reverted now",
    Action.WOULD_APPLY: "would apply",
}


class ReportLost(Exception):
    """stdout could not take a line of the report: a full disk, a reader that left (EPIPE).

    Not an OSError, so that no handler meant for the tree's files takes it for one:
    the CLI decides what it means from what the command had done by then.
    """

    def __init__(self, cause: OSError):
        self.cause = cause
        super().__init__(cause.strerror or str(cause))


def out(line: str = "") -> None:
    """Write one line of a report to stdout, escaped (:func:`printable`): every line of
    every report goes through here."""
    try:
        click.echo(printable(line))
    except OSError as exc:
        raise ReportLost(exc) from None


def warn(line: str) -> None:
    """One line on stderr, escaped (:func:`printable`); a stderr that cannot take it
    costs the line, not the command."""
    try:
        click.echo(printable(line), err=True)
    except OSError:
        pass


def out_lines(text: str) -> None:
    """Text of several lines (a JSON document), each line through :func:`out`."""
    for line in text.split("\n"):
        out(line)


def emit_json(data: dict) -> None:
    """A command's JSON (one of the ``*_json`` functions below), on stdout. json.dumps
    escapes every control character inside a string, so its lines pass :func:`out`
    unchanged and the document stays valid JSON."""
    out_lines(json.dumps(data, indent=2))


def _fields(obj) -> dict:
    """A dataclass's fields as a dict, in their order, values as they are (not walked)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun in its number: "1 file", "2 files", "0 files"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


WIDEST = 100  # no text report is wider, on the widest terminal either
NARROWEST = 40  # a terminal narrower than this is wrapped as if it were this wide
COLUMN = 40  # a column narrower than this continues at INDENT instead of under itself
INDENT = 8


def line_width() -> int:
    """The width every text report wraps at (one rule for status, apply, revert and list):
    the terminal's columns (``COLUMNS`` where set), at most 100; 100 where stdout is not a
    terminal (a pipe, a log, a Docker build), so a report reads the same wherever it lands."""
    columns = shutil.get_terminal_size((WIDEST, 24)).columns
    return max(NARROWEST, min(columns, WIDEST))


LAYOUT = re.compile(r"[ \t\n]+")  # the whitespace that wrapping reflows


def wrap(first: str, text: str, under: int | None = None) -> list[str]:
    """``first`` then ``text`` filled to :func:`line_width`, the next lines under column
    ``under`` (default: where ``text`` starts) or at INDENT when that leaves too little room.
    A word (a path, a URL, a command) is never split; one longer than the line stays whole.

    Spaces, tabs and newlines are reflowed; any other control character (``\r``, ESC)
    is escaped first (:func:`printable`), so it is shown, never taken for a space."""
    width = line_width()
    first = printable(first)
    column = len(first) if under is None else under
    if width - column < COLUMN:
        column = INDENT
    lines = textwrap.wrap(
        " ".join(printable(word) for word in LAYOUT.split(text) if word),
        width,
        initial_indent=first,
        subsequent_indent=" " * column,
        break_on_hyphens=False,
        break_long_words=False,
    )
    return lines or [first.rstrip()]


def blocks(text: str) -> list[str]:
    """``text``'s paragraphs and list items, each on one line: a line that starts with "- "
    is an item of its own, an indented line continues the one before, a blank line or an
    unindented line after an item starts a paragraph. A catalogue entry's list (one line
    per release range) then stays a list instead of running into its neighbours."""
    parts: list[str] = []
    fresh = True
    for line in text.split("\n"):  # not splitlines(): a \r or \x1c is escaped, not a break
        words = line.strip()
        if not words:
            fresh = True
            continue
        after_item = bool(parts) and parts[-1].startswith("- ") and not line[0].isspace()
        if fresh or words.startswith("- ") or after_item:
            parts.append(words)
        else:
            parts[-1] += " " + words
        fresh = False
    return parts


def wrap_blocks(first: str, text: str) -> list[str]:
    """:func:`wrap` for text with list items: the first paragraph after ``first``, each
    further paragraph at INDENT, each item at INDENT as "- " with its next lines under
    its text."""
    parts = blocks(text) or [""]
    if parts[0].startswith("- "):
        lines, rest = [first.rstrip()], parts
    else:
        lines, rest = wrap(first, parts[0], INDENT), parts[1:]
    for part in rest:
        if part.startswith("- "):
            lines += wrap(" " * INDENT + "- ", part[2:], INDENT + 2)
        else:
            lines += wrap(" " * INDENT, part, INDENT)
    return lines


# ----- status, apply, revert -----


def render_run(report: RunReport) -> None:
    """status, apply and revert: one row per catalogue patch (the same rows in all three),
    its state, what the run did to it and why, wrapped at :func:`line_width`; then the
    summary, on one line whatever its length (the line scripts and logs look for)."""
    tree = report.tree
    where = printable(str(tree.root))  # exact: a newline in the path shown as \n, not a space
    header = f"vLLM {tree.version} at {where} (version from {SOURCES[tree.source]})"
    for line in wrap("", header, 4):
        out(line)
    if report.runner is not None and report.command == "status":
        for text in runner_lines(report.runner, [s.assessment for s in report.steps]):
            for line in wrap("", text, 4):
                out(line)
    for note in report.notes:
        for line in wrap("note: ", note, 4):
            out(line)
    width = max((len(s.assessment.patch.id) for s in report.steps), default=0)
    for step in report.steps:
        _render_step(report, step, width)
    for pyc in report.bytecode_removed:
        out(f"removed bytecode: {pyc}")
    _render_caches(report.caches_removed)
    for warning in report.warnings:
        warn(f"warning: {warning}")
    out(summary(report))


def _render_step(report: RunReport, step: Step, width: int) -> None:
    a = step.assessment
    detail = a.reason or (f"variant {a.variant.name}" if a.variant else "")
    if step.action == Action.REVERTED:
        # the reason described the tree before this run ("`patchkit revert --only X`
        # removes the rest"), advice the run has just followed
        detail = f"variant {a.variant.name}" if a.variant else ""
    if step.action in DONE:
        detail = f"{DONE[step.action]}; {detail}" if detail else DONE[step.action]
    for line in wrap(f"  {a.patch.id:<{width}}  {_state_column(report, step):<15}  ", detail):
        out(line)
    if step.action in (Action.APPLIED, Action.WOULD_APPLY):
        for place in a.placements:
            offset = f" (offset {place.offset:+d} lines)" if place.offset else ""
            out(f"      {place.path}: hunk #{place.hunk} at line {place.line}{offset}")
    for notice in report.notices(step):
        for line in wrap("      known issue: ", notice, INDENT):
            out(line)


def _state_column(report: RunReport, step: Step) -> str:
    """The patch's state: after the run, or, for a dry run that wrote nothing, as it is now
    (the detail says what the run would do: "would apply")."""
    return str(step.assessment.state if report.options.dry_run else step.state_after)


def run_changes(report: RunReport) -> list[str]:
    """What a run that changed the tree did, and what went wrong after: the lines that go to
    stderr when stdout cannot take the report."""
    left_alone = [
        f"left {c.name} alone: {c.reason}"
        for c in report.caches_removed
        if c.state not in ("cleared", "absent")
    ]
    return [summary(report)] + [f"warning: {w}" for w in report.warnings] + left_alone


def _render_caches(caches: list[CacheResult]) -> None:
    for cache in caches:
        if cache.state == "cleared":
            out(
                f"cleared {cache.name}: {cache.path} "
                f"({counted(cache.files, 'file')}, {counted(cache.bytes, 'byte')})"
            )
        elif cache.state == "absent":
            out(f"no {cache.name} at {cache.path}: nothing to clear")
        else:
            warn(f"left {cache.name} alone: {cache.reason}")


def summary(report: RunReport) -> str:
    """One line: what the run did, and the state of every patch it looked at after it."""
    states = Counter(s.state_after for s in report.steps)
    now = ", ".join(f"{states[state]} {state}" for state in PatchState if states[state])
    if report.command == "status":
        return f"status: {now}"
    actions = Counter(DONE[s.action] for s in report.steps if s.action in DONE)
    did = ", ".join(f"{n} {what}" for what, n in actions.items()) or "nothing to do"
    removed = len(report.bytecode_removed)
    pyc = f"; {removed} bytecode files removed" if removed else ""
    if report.options.dry_run:  # the states are those the run would leave, not the tree's
        return f"{report.command}: {did}; nothing was written; it would leave {now}"
    return f"{report.command}: {did}{pyc}; now {now}"


def run_json(report: RunReport) -> dict:
    """--json of status, apply and revert: the same keys and the same patches in all three;
    each patch's state after the run and what the run did to it (status: nothing)."""
    patches = [_step_json(report, s) for s in report.steps]
    return {
        "ok": True,
        "command": report.command,
        "vllm": report.tree.describe(),
        "patches": patches,
        "warnings": report.warnings,
        "notices": list(dict.fromkeys(n for p in patches for n in p["notices"])),
        "notes": report.notes,
        "summary": summary(report),
        "dry_run": report.options.dry_run,
        "bytecode_removed": report.bytecode_removed,
        "caches_removed": [_cache_json(c) for c in report.caches_removed],
    } | (
        {"runner": runner_json(report.runner, [s.assessment for s in report.steps])}
        if report.runner is not None
        else {}
    )


# ----- the model runner (status, doctor) -----

SERVES = "Qwen3.5/3.6 + LoRA"
HOOKS = {frozenset({"v1"}): "V1", frozenset({"v2"}): "Model Runner V2"}


def _runner_name(runner: str | None) -> str:
    return model_runner.NAMES.get(runner or "", runner or "unknown")


def runner_lines(choice, assessments: list[Assessment]) -> list[str]:
    """``runner: ...``: which runner serves here and what switches it; then, where a patch
    that hooks runners is applied or opt-in and the runner that serves is not hooked, one line."""
    lines = [f"runner: {_runner_headline(choice)}"]
    probe = _probe_gap(choice, assessments)
    if probe:
        lines.append(f"runner: {probe}")
    return lines


def _runner_headline(choice) -> str:
    if not choice.known:
        return f"unknown for {SERVES} here: {choice.reason}"
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
            f"{choice.flip_refused})"
        )
    else:
        text = f"{name} serves {SERVES} here by default (no setting switches it)"
    if choice.env_value is not None and choice.effective != choice.runner and not choice.only:
        said = f"{model_runner.ENV}={choice.env_value[:40]}"
        if choice.effective == "refused":
            text += f"; this environment's {said} makes vLLM refuse it: {choice.effective_reason}"
        else:
            text += f"; this environment's {said} gives {_runner_name(choice.effective)}"
    return text


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


def runner_json(choice, assessments: list[Assessment]) -> dict:
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
        "reason": choice.reason,
        "flip": (
            {
                "env": model_runner.ENV,
                "value": choice.flip.split("=", 1)[1],
                "gives": choice.flip_to,
                "refused": choice.flip_refused or None,
            }
            if choice.flip
            else None
        ),
        "environment": {
            "value": choice.env_value,
            "runner": choice.effective,
            "reason": choice.effective_reason or None,
        },
        "hooks": hooks,
        "warning": probe or None,
        "line": f"runner: {_runner_headline(choice)}",
    }


def _cache_json(cache: CacheResult) -> dict:
    return {
        "name": cache.name,
        "path": cache.path,
        "state": cache.state,
        "removed": cache.removed,
        "files": cache.files,
        "bytes": cache.bytes,
        "reason": cache.reason,
    }


def _step_json(report: RunReport, step: Step) -> dict:
    data = _assessment_json(step.assessment)
    data["notices"] = report.notices(step)
    data["state"] = _state_column(report, step)
    data["state_before"] = str(step.assessment.state)
    data["action"] = str(step.action)
    if report.options.dry_run:
        data["would_leave"] = str(step.state_after)
    shown = step.action in (Action.APPLIED, Action.WOULD_APPLY)
    data["hunks"] = [_placement_json(p) for p in step.assessment.placements] if shown else []
    return data


def _assessment_json(a: Assessment) -> dict:
    return {
        "id": a.patch.id,
        "state": str(a.state),
        "reason": a.reason or None,
        "variant": a.variant.name if a.variant else None,
        "files": list(a.files),
        "warnings": a.warnings,
        "notices": [n.line for n in a.notices],
    }


def _placement_json(place) -> dict:
    return {"file": place.path, "hunk": place.hunk, "line": place.line, "offset": place.offset}


# ----- refresh -----


def render_refresh(report) -> None:
    for line in report.recovered:  # what it finished or undid before it refreshed
        out(f"note: {line}")
    out(f"refreshed {report.patch_id} (variant {report.variant}): {report.diff}")
    for relpath in report.changed:
        out(f"  diff of {relpath}")
    for path in report.created:
        out(f"  created file copied to {path}")
    for relpath in report.unchanged:
        out(f"  {relpath} is back to its original: left out of the patch")
    out(f"refresh: {_refresh_counts(report)}; review with git diff, then run the tests")


def refresh_summary(report) -> str:
    """One line: what a refresh wrote into the catalogue."""
    return (
        f"refresh: wrote {report.diff} (patch {report.patch_id}, variant {report.variant}): "
        f"{_refresh_counts(report)}"
    )


def _refresh_counts(report) -> str:
    return (
        f"{len(report.changed)} diffed, {len(report.created)} created, "
        f"{len(report.unchanged)} left out"
    )


def refresh_json(report) -> dict:
    return {
        "ok": True,
        "patch": report.patch_id,
        "variant": report.variant,
        "diff": str(report.diff),
        "changed": report.changed,
        "unchanged": report.unchanged,
        "created": [str(p) for p in report.created],
        "added": report.added,
        "recovered": report.recovered,
    }


def render_recover(recovered: list[str]) -> None:
    """`refresh --recover`: what it finished or undid, or that there was nothing."""
    for line in recovered:
        out(f"refresh: {line}")
    if not recovered:
        out("refresh: no interrupted refresh in the catalogue: nothing to do")


def recover_json(recovered: list[str]) -> dict:
    return {"ok": True, "command": "refresh --recover", "recovered": recovered}


# ----- verify -----


def render_verify(report) -> None:
    env = report.environment
    out(
        f"GPU {env['gpu']} (sm {env['compute_capability']}), torch {env['torch']}, "
        f"Triton {env['triton']}, vLLM {env['vllm']} at {env['vllm_path']}"
    )
    out(f"LoRA ops in punica_gpu.py: {env['lora_backend']}; seed {env['seed']}")
    for p in report.patches:
        out(f"  {p['id']:<24}{p['state']}")
    out("")
    out(f"{'kernel check':<84}{'result':<8}{'rel.err':>9}  note")
    for k in report.kernel:
        verdict = ("ok" if k.ok else "FAIL") if k.counts else ("(ok)" if k.ok else "(fail)")
        note = f"{k.nonfinite} NaN/Inf; {k.detail}" if k.nonfinite else k.detail
        out(f"{k.name:<84}{verdict:<8}{k.rel_error:>9.2e}  {note}")
    model_checks = report.model.checks if report.model is not None else []
    for title, found in (("end-to-end check", report.e2e), ("model check", model_checks)):
        if found:
            out("")
            for line in check_table(title, found):
                out(line)
    out("")
    out("(ok)/(fail): a config or backend this install does not run; reported, not counted.")
    if any(not c.ok and not c.decided for c in report.e2e + model_checks):
        out("undecided: the reference could not tell (its own noise); not a failure of vLLM.")
    if report.model is not None:
        out("")
        for line in adapter_verdict_lines(report.model.adapters):
            out(line)
    out(f"verify {_verdict_line(report)} in {report.seconds:.0f} s")


def _check_result(check) -> str:
    return "ok" if check.ok else ("FAIL" if check.decided else "undecided")


def check_table(title: str, found) -> list[str]:
    """The rows of checks under a header, the result column past the longest name."""
    width = max(60, *(len(c.name) + 2 for c in found))
    return [f"{title:<{width}}{'result':<8}detail"] + [
        f"{c.name:<{width}}{_check_result(c):<8}{c.detail}" for c in found
    ]


def adapter_verdict_lines(adapters) -> list[str]:
    """Per adapter: the verdict, the reference and why, what the run could tell apart."""
    lines = []
    for a in adapters:
        lines.append(f"adapter {a.adapter}: {a.verdict} against the {a.reference} reference")
        if a.reference_why:
            lines.append(f"  reference: {a.reference} ({a.reference_why})")
        lines.append(f"  why: {a.why}")
        if a.decides_instead:
            lines.append(f"  what decides instead: {a.decides_instead}")
        if a.controls:
            lines.append(f"  would have caught: {', '.join(a.caught) or 'none of its controls'}")
        for control in a.controls:
            if not control.rejected:
                lines.append(f"  could not tell apart: {control.what} ({control.detail})")
    return lines


def _verdict_line(report) -> str:
    """'PASSED', 'FAILED (3 checks)' or 'INCONCLUSIVE (adapter a0)'."""
    verdict = report.verdict
    model_checks = report.model.checks if report.model is not None else []
    if verdict == "FAILED":
        failed = sum(1 for k in report.kernel if k.counts and not k.ok) + sum(
            1 for c in report.e2e + model_checks if c.failed
        )
        return f"FAILED ({counted(failed, 'check')})"
    if verdict == "INCONCLUSIVE":
        names = (
            [a.adapter for a in report.model.adapters if a.verdict == verdict]
            if (report.model is not None)
            else []
        )
        return (
            f"INCONCLUSIVE ({counted(len(names), 'adapter')}: {', '.join(names)})"
            if names
            else verdict
        )
    return verdict


def verify_json(report) -> dict:
    """verify's JSON: the verdict, the environment, the patches, every check as its fields,
    and per adapter its verdict, reference and controls."""
    model = report.model
    return {
        "ok": report.ok,
        "verdict": report.verdict,
        "environment": report.environment,
        "patches": report.patches,
        "kernel_checks": [dataclasses.asdict(k) for k in report.kernel],
        "e2e_checks": [dataclasses.asdict(c) for c in report.e2e],
        "model_checks": [dataclasses.asdict(c) for c in model.checks] if model else [],
        "adapters": [_adapter_json(a) for a in model.adapters] if model else [],
        "seconds": round(report.seconds, 1),
    }


def _adapter_json(verdict) -> dict:
    return {
        **dataclasses.asdict(verdict),
        "would_have_caught": verdict.caught,
        "could_not_tell_apart": verdict.missed,
    }


# ----- canary -----


def emit_canary(report, as_json: bool, api_key: str | None) -> None:
    """Print the canary's report as JSON or text, with the API key scrubbed from both."""
    from patchkit.canary import check, fields

    if as_json:
        out_lines(check.scrub(json.dumps(canary_json(report), indent=2), api_key))
        return
    for line in canary_lines(report):
        # model ids and answers come from the server: escaped, and no line past LINE
        out(fields.one_line(check.scrub(line, api_key), fields.LINE))


MODEL_NAME = 80  # characters of a model's name in the canary's per-model lines


def canary_lines(report) -> list[str]:
    """The text report: a line per model, the counter, the verdict and the next steps
    (as they are: :func:`emit_canary` scrubs and escapes them on the way out)."""
    from patchkit.canary import check, fields

    version = f"vLLM {report.version}" if report.version else "server"
    lines = [
        f"{version} at {report.url}: {counted(len(report.models), 'model')}, "
        f"prompt ~{report.prompt_tokens}"
        f" tokens, {check.NEW_TOKENS} new, greedy ({report.seconds:.1f} s)"
    ]
    name = {id(v): fields.one_line(v.model, MODEL_NAME) for v in report.models}
    width = max(map(len, name.values()), default=0)
    for v in report.models:
        lines.append(
            f"  {_canary_label(v):<11} {name[id(v)]:<{width}}  {v.kind:<7}  {_canary_detail(v)}"
        )
    if report.recheck:
        r = report.recheck
        again = f"again after the bad adapter: {_canary_detail(r)}"
        recheck_name = fields.one_line(r.model, MODEL_NAME)
        lines.append(f"  {_canary_label(r):<11} {recheck_name:<{width}}  {again}")
    counter = report.counter
    if counter.get("present"):
        lines.append(f"{check.COUNTER}: {counter['before']:g} -> {counter['after']:g}")
    lines += [f"note: {note}" for note in report.notes]
    if report.ok:
        return lines + [f"OK: {report.summary()}"]
    lines.append(f"FAILED: {report.summary()}")
    steps = enumerate(report.next_steps(), start=1)
    return lines + [f"  {number}. {step}" for number, step in steps]


def _canary_label(v) -> str:
    return {"ok": "ok", "bad": "BAD (NaN)"}.get(v.verdict, v.verdict.upper())


def _canary_detail(v) -> str:
    facts = []
    if v.prompt_tokens is not None:
        facts.append(f"{v.prompt_tokens} prompt tokens")
    if v.completion_tokens is not None:
        facts.append(f"{v.completion_tokens} new")
    if v.verdict == "bad" and v.text is not None:
        facts.append(f"text {v.text[:24]!r}")
    facts.append(f"{v.seconds:.1f} s")
    return "; ".join(v.evidence + [", ".join(facts)])


def canary_json(report) -> dict:
    from patchkit.canary import check

    data = {
        "ok": report.ok,
        "exit_code": exits.OK if report.ok else exits.FAILURE,
        "url": report.url,
        "vllm_version": report.version,
        "prompt_tokens": report.prompt_tokens,
        "new_tokens": check.NEW_TOKENS,
        "models": [_canary_verdict_json(v) for v in report.models],
        "recheck": _canary_verdict_json(report.recheck) if report.recheck else None,
        "corrupted_requests": report.counter,
        "notes": report.notes,
        "skipped": len(report.skipped),  # the first few are named in notes
        "next_steps": report.next_steps(),
        "seconds": round(report.seconds, 2),
    }
    if not report.ok:
        data["error"] = report.summary()
    return data


def _canary_verdict_json(v) -> dict:
    return {"kind": v.kind, **dataclasses.asdict(v)}


# ----- list -----


def render_catalogue(catalogue: Catalogue, verbose: bool = False) -> None:
    """`list`: per patch, its id and the releases it covers in the states' words, then what
    it fixes at column 4 (two lines, three where the releases are longer than the line: they
    continue under themselves, a run of releases never split); ``verbose`` (`list -v`): each
    patch's full text, as `show ID` prints it."""
    for patch in catalogue.patches:
        if verbose:
            render_patch(patch, catalogue)
            continue
        for line in wrap_runs(f"{patch.id}: ", coverage_runs(patch, catalogue)):
            out(line)
        for line in wrap("    ", patch.title):
            out(line)
    if verbose:
        for line in wrap("tested releases: ", ", ".join(catalogue.tested_releases), 4):
            out(line)
        return
    span = f"{counted(len(catalogue.tested_releases), 'tested release')}, {catalogue.tested_span}"
    more = "`patchkit show ID` prints a patch's why, upstream links and remove-when"
    for line in wrap("", f"{span}; {more} (`patchkit list -v`: every patch's)", 4):
        out(line)


def render_patch(patch, catalogue: Catalogue) -> None:
    """`show ID` (and `list -v`): the whole entry, every field wrapped at :func:`line_width`."""

    def field(label: str, text: str) -> None:
        for line in wrap_blocks(f"    {label}: ", text):
            out(line)

    for line in wrap(f"{patch.id}: ", patch.title, 4):
        out(line)
    field("releases", coverage(patch, catalogue))
    if patch.opt_in:
        field(
            "opt-in",
            f"plain `patchkit apply` never applies it; after it, `patchkit apply --only "
            f"{patch.id}` adds it (alone it applies only itself), `revert` takes it off",
        )
    field("why", patch.why)
    for variant in patch.variants:
        for line in wrap(f"    {variant.versions}  ", f"variant {variant.name} "
                         f"({variant.diff_path.name})", INDENT):  # fmt: skip
            out(line)
    for decision in patch.decisions:
        field(f"{decision.versions}  {decision.state}", decision.reason)
    for notice in patch.notices:
        field(f"{notice.versions}  known issue", notice.message)
    field("upstream", ", ".join(patch.upstream))
    field("remove when", patch.remove_when)


def wrap_runs(first: str, runs: list[str]) -> list[str]:
    """``first`` then ``runs`` joined by ", " and filled to :func:`line_width`, breaking only
    between runs; the next lines under where the runs start (at INDENT when that leaves too
    little room), so they never read as the title below them."""
    width = line_width()
    column = len(first) if width - len(first) >= COLUMN else INDENT
    pieces = [run + "," for run in runs[:-1]] + runs[-1:]
    if not pieces:
        return [first.rstrip()]
    lines = [first + pieces[0]]
    for piece in pieces[1:]:
        if len(lines[-1]) + 1 + len(piece) <= width:
            lines[-1] += " " + piece
        else:
            lines.append(" " * column + piece)
    return lines


def coverage(patch, catalogue: Catalogue) -> str:
    """The tested releases a patch covers, in runs of one word: "applies to 0.17.0-0.32.0
    (2 variants), upstream 0.33.0"; `upstream` and `not-applicable` as status says them, an
    opt-in patch's runs marked `opt-in`."""
    return ", ".join(coverage_runs(patch, catalogue))


def coverage_runs(patch, catalogue: Catalogue) -> list[str]:
    """:func:`coverage`'s runs, each a word and its releases ("upstream 0.33.0-0.34.0"), an
    opt-in patch's first run "opt-in"."""
    runs: list[list] = []  # [word, first, last, variant names]
    for release in catalogue.tested_releases:
        entry = patch.expected_for(Version(release))
        if isinstance(entry, Variant):
            word, name = "applies to", entry.name
        else:
            word, name = (entry.state if entry else "not covered"), None
        if runs and runs[-1][0] == word:
            runs[-1][2] = release
        else:
            runs.append([word, release, release, []])
        if name and name not in runs[-1][3]:
            runs[-1][3].append(name)
    parts = []
    for word, first, last, names in runs:
        span = first if first == last else f"{first}-{last}"
        variants = f" ({counted(len(names), 'variant')})" if len(names) > 1 else ""
        parts.append(f"{word} {span}{variants}")
    return (["opt-in"] if patch.opt_in else []) + parts


def catalogue_json(catalogue: Catalogue, only: str | None = None) -> dict:
    """`list --json` (every patch, in full) and `show ID --json` (``only`` that one)."""
    return {
        "ok": True,
        "tested_releases": list(catalogue.tested_releases),
        "patches": [
            {
                "id": p.id,
                "title": p.title,
                "opt_in": p.opt_in,
                "why": p.why,
                "upstream": list(p.upstream),
                "remove_when": p.remove_when,
                "runtime_gate": p.runtime_gate or None,
                "covers": p.covers or None,
                "overridden_by": (
                    {
                        "env": p.overridden_by.env,
                        "versions": str(p.overridden_by.versions),
                        "detail": p.overridden_by.detail,
                    }
                    if p.overridden_by
                    else None
                ),
                "variants": [
                    {"name": v.name, "diff": v.diff_path.name, "versions": str(v.versions)}
                    for v in p.variants
                ],
                "decisions": [
                    {"state": d.state, "versions": str(d.versions), "reason": d.reason}
                    for d in p.decisions
                ],
            }
            for p in catalogue.patches
            if only is None or p.id == only
        ],
    }


# ----- doctor -----


def render_doctor(report, verbose: bool = False) -> None:
    """doctor's report as text: facts, the kernel scan (one line per kernel and verdict,
    or per config with ``verbose``), then one verdict per bug."""
    for g in report.gpus:
        out(f"GPU: {g.name} (compute capability {g.compute_capability})")
    if not report.gpus:
        out(f"GPU: {report.gpu_note}")
    t = report.toolchain
    where = f" ({t.ptxas_source}: {t.ptxas})" if t.ptxas else ""
    fixed = f"; fixed from {report.fixed_from}" if report.fixed_from else ""
    located = f" ({t.location})" if t.location else ""
    out(
        f"Triton {t.triton or 'not installed'}{located}; "
        f"ptxas for sm_90: {t.ptxas_version or 'unknown'}{where}{fixed}"
    )
    if report.tree is None:
        out(f"vLLM: {report.tree_error}")
    else:
        _render_tree(report)
        if report.runner is not None:
            for text in runner_lines(report.runner, report.patches):
                for line in wrap("", text, 4):
                    out(line)
    for c in report.tuned_configs:
        out(f"tuned config {c.file}: {c.problem}")
    for pyc in report.stale_bytecode:
        out(f"stale bytecode: {pyc}")
    for c in report.old_caches:
        out(f"{c.name} {c.path}: {counted(c.entries, 'entry', 'entries')} older than the patch")
    if report.kernels is not None:
        render_kernels(report.kernels, verbose)
    out("")
    for v in report.verdicts:
        out(f"[{v.status}] {v.bug}")
        out(
            f"    {v.reason}"
            + (f"; fix: {v.fix}" if v.fix and v.status in ("exposed", "unknown") else "")
        )


def _render_tree(report) -> None:
    tree, theirs = report.tree, report.tree_triton
    out(f"vLLM {tree.version} at {tree.root}")
    if theirs is not None and theirs.version:
        ptxas = f", ptxas {theirs.ptxas_version}" if theirs.ptxas_version else ""
        out(f"Triton next to vLLM: {theirs.version} ({theirs.location}{ptxas})")
    elif theirs is not None:
        out(f"Triton next to vLLM: none (no triton-*.dist-info in {tree.root})")
    width = max((len(a.patch.id) for a in report.patches), default=0)
    for a in report.patches:
        out(f"  {a.patch.id:<{width}}  {a.state}")


def render_kernels(scan, verbose: bool = False) -> None:
    """The scan: a header, then per kernel one line per verdict (``verbose``: per config)."""
    if scan.error:
        out(f"kernel scan: {scan.error}")
        return
    t = scan.toolchain
    gpus = ", ".join(name.replace("NVIDIA ", "") for name in scan.gpus)
    out(
        f"kernel scan (sm_90; Triton {t.triton}, ptxas {t.ptxas_version}, {scan.disassembler}; "
        f"{counted(len(scan.cases), 'config')} of {counted(len(scan.by_kernel()), 'kernel')} "
        f"from {counted(scan.calls, 'call')} "
        f"on {gpus}; {'remembered, ' if scan.remembered else ''}{scan.seconds} s):"
    )
    for kernel, cases in scan.by_kernel().items():
        lines = [_case_line(c) for c in cases] if verbose else _kernel_lines(kernel, cases)
        for line in lines:
            out(f"  {line}")


def _kernel_lines(kernel: str, cases: list) -> list[str]:
    """One line per verdict of a kernel: what runs here, what does not, errors, approximations."""
    runs = [c for c in cases if c.called and c.verdict != "error"]
    idle = [c for c in cases if not c.called and c.verdict != "error"]
    errors = [c for c in cases if c.verdict == "error"]
    lines = []
    hazards = [c for c in runs if c.verdict == "hazard"]
    if hazards:
        lines.append(
            f"{kernel}: hazard in {len(hazards)} of {counted(len(runs), 'config')} this "
            "install runs "
            f"(first: {_first_hazard(hazards[0])})"
        )
    elif runs:
        lines.append(
            f"{kernel}: no overwrite in the {counted(len(runs), 'config')} this install runs"
        )
    if idle:
        idle_hazards = [c for c in idle if c.verdict == "hazard"]
        found = f"hazard in {len(idle_hazards)} of" if idle_hazards else "no overwrite in"
        lines.append(
            f"{kernel}: {found} {counted(len(idle), 'config')} not run here "
            f"({idle[0].why_not_called})"
        )
    if errors:
        lines.append(
            f"{kernel}: error in {counted(len(errors), 'config')} (first: {errors[0].error})"
        )
    approximate = [c for c in cases if c.approximate]
    if approximate:
        lines.append(
            f"{kernel}: {counted(len(approximate), 'config')} approximate "
            f"({approximate[0].approximate})"
        )
    return lines


def _first_hazard(case) -> str:
    hazard = case.hazards[0]
    where = sass.address(hazard.address)
    return f"{case.shape()}, {case.calls[0]}: {hazard.instruction} at {where}"


def _case_line(case) -> str:
    runs = "runs here" if case.called else f"not run: {case.why_not_called}"
    first = case.hazards[0] if case.hazards else None
    detail = case.error or (
        f"{counted(len(case.hazards), 'overwrite')}, first {first.instruction} "
        f"at {sass.address(first.address)}"
        if first
        else ""
    )
    approximate = f"; approximate: {case.approximate}" if case.approximate else ""
    return (
        f"[{case.verdict}] {case.label()}; {runs}" + (f"; {detail}" if detail else "") + approximate
    )


def doctor_json(report) -> dict:
    triton = _fields(report.toolchain) | {"fixed_from": report.fixed_from}
    triton["version"] = triton.pop("triton")
    theirs = report.tree_triton
    return {
        "gpus": [_fields(g) for g in report.gpus],
        "gpu_note": report.gpu_note,
        "triton": triton,
        "triton_next_to_vllm": _fields(theirs) if theirs else None,
        "vllm": report.tree.describe() if report.tree else {"error": report.tree_error},
        "patches": [_doctor_patch_json(a) for a in report.patches],
        "tuned_configs": [_fields(f) for f in report.tuned_configs],
        "stale_bytecode": report.stale_bytecode,
        "old_caches": [_fields(c) for c in report.old_caches],
        "kernels": scan_json(report.kernels) if report.kernels else {},
        "verdicts": [_fields(v) | {"status": str(v.status)} for v in report.verdicts],
        "runner": runner_json(report.runner, report.patches) if report.runner else None,
    }


def _doctor_patch_json(a: Assessment) -> dict:
    return {
        "id": a.patch.id,
        "state": str(a.state),
        "variant": a.variant.name if a.variant else None,
        "files": list(a.files),
    }


def scan_json(scan) -> dict:
    """The kernel scan's JSON (doctor --json's ``kernels``)."""
    nested = ("cases", "models", "toolchain")
    data = {k: v for k, v in _fields(scan).items() if k not in nested}
    data["toolchain"] = _fields(scan.toolchain) if scan.toolchain else None
    data["models"] = [_fields(m) for m in scan.models]
    data["cases"] = [_case_json(c) for c in scan.cases]
    return data


def _case_json(case) -> dict:
    hazards = [hazard_json(h) for h in case.hazards]
    return _fields(case) | {"hazards": hazards, "label": case.label()}


def hazard_json(hazard: sass.Hazard) -> dict:
    """A hazard as doctor's JSON and cuobjdump name its parts: addresses in hex, registers R<n>."""
    return {
        "address": sass.address(hazard.address),
        "instruction": hazard.instruction,
        "registers": [f"R{r}" for r in hazard.registers],
        "wgmma": sass.address(hazard.wgmma_address),
    }


# ----- probe report -----


def render_probe_report(report) -> None:
    """Per affected request: where it first went bad, the verdict, where to look.

    Request ids (a client's X-Request-Id), adapter and module names come from the
    log: :func:`out` escapes their control characters, as every line's.
    """
    say = out
    records, steps = counted(report.records, "record"), counted(report.steps, "step")
    say(f"nan-probe log {report.path}: {records} over {steps}")
    for q in report.quarantines:
        say(f"  quarantined at load: {q.named()}: {q.cause()}; check it: {q.command()}")
    if report.quarantines_not_listed:
        say(f"  and {counted(report.quarantines_not_listed, 'more quarantine')}")
    if not report.findings:
        say("no request had a NaN or Inf in any probed layer or projection")
    for f in report.findings:
        adapter = f" (adapter {f.adapter})" if f.adapter else ""
        where = f"step {f.step}, layer {f.layer}, {f.module}"
        if f.tensor:  # its adapter's quarantine, not the first bad projection, is the cause
            say(f"  request {f.request}{adapter}: bad from step {f.step}, its adapter quarantined")
        else:
            say(f"  request {f.request}{adapter}: first bad at {where}")
        say(f"      {f.verdict}; look at {f.look_at}")
        if not f.tensor:
            say(f"      bad in layer {f.layer}: {', '.join(f.bad_modules)}")
    if report.padding_only:
        padding = counted(report.padding_only, "record")
        say(f"{padding} had bad rows in CUDA-graph padding only (no request)")
    say(f"probe report: {counted(len(report.findings), 'affected request')}")


def probe_json(report) -> dict:
    return {
        "ok": True,
        "command": "probe report",
        "file": report.path,
        "records": report.records,
        "steps": report.steps,
        "headers": report.headers,
        "padding_only": report.padding_only,
        "affected_requests": [_fields(f) for f in report.findings],
        "quarantines": [_fields(q) | {"command": q.command()} for q in report.quarantines],
        "quarantines_not_listed": report.quarantines_not_listed,
        "warnings": report.warnings,
    }


def render_probe_warnings(report) -> None:
    """A cut last line the report skipped: on stderr, in text and --json alike."""
    for warning in report.warnings:
        warn(f"warning: {warning}")


# ----- adapter check -----


def render_adapter_check(report) -> None:
    """One line per finding (kind, file, tensor, what), the notes, the checks skipped, one
    summary line.

    Every line holds what the user's files say (tensor names, config values, a
    model's architecture, paths): :func:`out` escapes each on its way out, as it does
    every command's lines.
    """
    for line in adapter_check_lines(report):
        out(line)


def adapter_check_lines(report) -> list[str]:
    """The text report, unescaped (:func:`render_adapter_check` escapes every line)."""
    lines = []
    for f in report.findings:
        where = f"{f.file}: {f.tensor}" if f.tensor else f.file
        lines.append(f"{f.kind}: {where}: {f.message}")
    lines += [f"note: {note}" for note in report.notes]
    lines += [f"skipped: {skipped}" for skipped in report.skipped]
    release = f", vLLM {report.vllm_version}" if report.vllm_version else ""
    scanned = f"{counted(report.tensors, 'tensor')}, {report.bytes_scanned / 1e6:.1f} MB scanned"
    verdict = "clean" if report.ok else counted(len(report.findings), "finding")
    lines.append(f"adapter check {report.adapter}{release}: {verdict} ({scanned})")
    return lines


def adapter_check_json(report) -> dict:
    return {
        "ok": report.ok,
        "exit_code": exits.OK if report.ok else exits.FAILURE,
        "adapter": report.adapter,
        "model": report.model,
        "target": report.target,
        "vllm_version": report.vllm_version,
        "tensors": report.tensors,
        "bytes_scanned": report.bytes_scanned,
        "findings": [_fields(f) | {"kind": str(f.kind)} for f in report.findings],
        "skipped": report.skipped,
        "notes": report.notes,
    }
