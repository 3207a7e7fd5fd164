"""The canary's output: its text report and its JSON document, both made here.

The command line prints what these return (patchkit.cli: every line
escaped on its way out); the canary owns its words. Model names, evidence
and answers come from the server: each per-model line is escaped and cut
to fields.LINE, and the API key is scrubbed from every line and document.
"""

from __future__ import annotations

import json

from patchkit.canary import fields
from patchkit.canary.metrics import COUNTER
from patchkit.canary.prompt import NEW_TOKENS
from patchkit.canary.report import ModelCheck, Report
from patchkit.canary.server import scrub

MODEL_NAME = 80  # characters of a model's name in the per-model lines
FORMAT = 1  # the JSON contract's format (a renamed or removed key bumps it)


def text(report: Report, api_key: str | None) -> list[str]:
    """The text report, each line scrubbed of the key, escaped and cut."""
    return [fields.one_line(scrub(line, api_key), fields.LINE) for line in lines(report)]


def document(report: Report, api_key: str | None, exit_code: int) -> str:
    """The JSON document, scrubbed of the key."""
    return scrub(json.dumps(as_json(report, exit_code), indent=2), api_key)


def lines(report: Report) -> list[str]:
    """The text report: a line per model, the counter, the verdict and the next steps
    (as they are: :func:`text` scrubs and escapes them)."""
    version = f"vLLM {report.version}" if report.version else "server"
    models = len(report.models)
    lines = [
        f"{version} at {report.url}: {models} model{'' if models == 1 else 's'}, "
        f"prompt ~{report.prompt_tokens}"
        f" tokens, {NEW_TOKENS} new, greedy ({report.seconds:.1f} s)"
    ]
    listed = report.models + report.parents
    name = {id(v): fields.one_line(v.model, MODEL_NAME) for v in listed}
    width = max(map(len, name.values()), default=0)
    for v in report.models:
        lines.append(f"  {label(v):<11} {name[id(v)]:<{width}}  {v.kind:<7}  {detail(v)}")
    for v in report.parents:  # asked only to compare an adapter named alone with it
        lines.append(
            f"  {label(v):<11} {name[id(v)]:<{width}}  {v.kind:<7}  asked to compare its "
            f"adapters with: {detail(v)}"
        )
    if report.recheck:
        r = report.recheck
        again = f"again after the bad adapter: {detail(r)}"
        recheck_name = fields.one_line(r.model, MODEL_NAME)
        lines.append(f"  {label(r):<11} {recheck_name:<{width}}  {again}")
    counter = report.counter
    if counter.get("present"):
        lines.append(f"{COUNTER}: {counter['before']:g} -> {counter['after']:g}")
    lines += [f"note: {note.message}" for note in report.notes]
    if report.ok:
        return lines + [f"OK: {report.summary()}"]
    lines.append(f"FAILED: {report.summary()}")
    steps = enumerate(report.next_steps(), start=1)
    return lines + [f"  {number}. {step.message}" for number, step in steps]


def label(v: ModelCheck) -> str:
    return {"ok": "ok", "bad": "BAD (NaN)"}.get(v.verdict, v.verdict.upper())


def detail(v: ModelCheck) -> str:
    facts = []
    if v.prompt_tokens is not None:
        facts.append(f"{v.prompt_tokens} prompt tokens")
    if v.completion_tokens is not None:
        facts.append(f"{v.completion_tokens} new")
    if v.verdict == "bad" and v.text is not None:
        facts.append(f"text {v.text[:24]!r}")
    facts.append(f"{v.seconds:.1f} s")
    return "; ".join([e.message for e in v.evidence] + [", ".join(facts)])


def as_json(report: Report, exit_code: int) -> dict:
    """The JSON contract's document (format 1): every message an object with its code."""
    error = report.error()
    return {
        "format": FORMAT,
        "command": "canary",
        "ok": report.ok,
        "exit_code": exit_code,
        "error": error.json() if error else None,
        "url": report.url,
        "vllm_version": report.version,
        "prompt_tokens": report.prompt_tokens,
        "new_tokens": NEW_TOKENS,
        "models": [verdict_json(v) for v in report.models],
        "recheck": verdict_json(report.recheck) if report.recheck else None,
        "parents": [verdict_json(v) for v in report.parents],
        "corrupted_requests": report.counter,
        "notes": [note.json() for note in report.notes],
        "skipped": len(report.skipped),  # the first few are named in notes
        "next_steps": [step.json() for step in report.next_steps()],
        "seconds": round(report.seconds, 2),
    }


def verdict_json(v: ModelCheck) -> dict:
    return {
        "kind": v.kind,
        "model": v.model,
        "parent": v.parent,
        "root": v.root,
        "verdict": v.verdict,
        "evidence": [e.json() for e in v.evidence],
        "http_status": v.http_status,
        "prompt_tokens": v.prompt_tokens,
        "completion_tokens": v.completion_tokens,
        "text": v.text,
        "token_ids": v.token_ids,
        "logprobs": v.logprobs,
        "effect": v.effect,
        "corrupted_delta": v.corrupted_delta,
        "seconds": v.seconds,
    }
