"""verify: prove on a GPU that the installed vLLM's LoRA path gives sound numbers."""

from __future__ import annotations

import dataclasses
import os
import sys

import click

from patchkit.cli import exits
from patchkit.cli.adapter_words import finding_words
from patchkit.cli.options import json_option, noted_catalogue
from patchkit.cli.outcome import user_errors
from patchkit.cli.render import counted, emit_json, message, out, warn
from patchkit.cli.verify_words import say
from patchkit.codes import Reason
from patchkit.verify import checks


@click.command("verify")
@click.option(
    "--e2e",
    is_flag=True,
    help="Also serve a tiny Qwen3.5 and a Qwen3.5-MoE with LoRA in vLLM (~5 min).",
)
@click.option(
    "--model",
    metavar="DIR",
    help="Also serve this model with each --lora adapter, and controls of each (half "
    "strength, experts dropped), and judge them against a reference (--reference).",
)
@click.option(
    "--lora",
    "loras",
    multiple=True,
    metavar="NAME=DIR",
    help="With --model: a PEFT LoRA adapter to check (repeatable).",
)
@click.option(
    "--reference",
    type=click.Choice(["merged", "peft"]),
    help="With --model: judge LoRA against the adapter merged into a bf16 copy of the "
    "weights (served by vLLM without LoRA), or against transformers + PEFT in float32. "
    "Default: merged where its own bf16 rounding decides, PEFT where it does not.",
)
@click.option(
    "--tensor-parallel-size",
    type=int,
    default=1,
    show_default=True,
    metavar="N",
    help="Serve every engine of --e2e and --model on N GPUs (at most the GPUs visible).",
)
@click.option(
    "--max-model-len",
    type=int,
    metavar="L",
    help="With --model: vLLM's max_model_len; the longest prompt is L - 16, at most 16384 "
    "(default: 16400, or the model's max_position_embeddings when smaller).",
)
@click.option(
    "--workdir",
    metavar="DIR",
    help="Work in this new or empty directory (created if missing): the merged references, "
    "the controls and vLLM's logs; emptied afterwards (default: the system temp dir).",
)
@click.option(
    "--seed",
    metavar="N",
    type=int,
    envvar="PATCHKIT_VERIFY_SEED",
    help="Seed for the random inputs (default: a fresh one each run).",
)
@click.option(
    "--keep",
    metavar="DIR",
    help="Work in this new or empty directory and keep it: the e2e models, the merged "
    "references, the served results and vLLM's logs.",
)
@json_option
@user_errors
def verify_command(
    e2e, model, loras, reference, tensor_parallel_size, max_model_len, workdir, seed, keep, as_json
) -> None:
    """Prove on this GPU that the installed vLLM's LoRA path gives sound numbers.

    Needs an NVIDIA GPU, torch and the vLLM that this Python imports. The
    verdict is PASSED (exit 0), FAILED (exit 1: a failed check, or an adapter
    that failed) or INCONCLUSIVE (exit 4: an adapter the reference could not
    decide; the report says why and what decides instead).
    """
    from patchkit.verify import runner

    request = verify_request(
        e2e, model, loras, tensor_parallel_size, max_model_len, workdir, seed, keep, reference
    )
    if as_json:  # vLLM logs to stdout by default; keep stdout for the JSON
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    result = runner.run(noted_catalogue(), request, progress)
    emit_json("verify", verify_json(result)) if as_json else render_verify(result)
    sys.exit(VERDICT_EXITS[result.verdict])


# verify's verdicts (patchkit.verify.checks) as exit statuses
VERDICT_EXITS = {
    checks.PASSED: exits.OK,
    checks.FAILED: exits.FAILURE,
    checks.INCONCLUSIVE: exits.INCONCLUSIVE,
}


def verify_request(e2e, model, loras, tp, max_model_len, workdir, seed, keep, reference=None):
    """verify's options checked together: each problem is one line, exit 2, nothing done."""
    from pathlib import Path

    from patchkit.errors import UsageProblem
    from patchkit.verify import runner
    from patchkit.verify.usermodel import check_max_model_len, parse_lora

    if loras and model is None:
        raise UsageProblem("--lora needs --model DIR (the base model the adapters belong to)")
    if model is not None and not loras:
        raise UsageProblem("--model needs at least one --lora NAME=DIR")
    if max_model_len is not None and model is None:
        raise UsageProblem("--max-model-len goes with --model")
    if max_model_len is not None:  # 0 is a length, refused here: never "not given"
        check_max_model_len(max_model_len)
    if seed is not None:
        runner.check_seed(seed)
    if reference is not None and model is None:
        raise UsageProblem("--reference goes with --model")
    if model is not None and not Path(model).is_dir():
        raise UsageProblem(f"--model {model}: not a directory")
    if workdir is not None and keep is not None:
        raise UsageProblem("--workdir and --keep: give one (--keep works in its directory)")
    if tp < 1:
        raise UsageProblem(f"--tensor-parallel-size {tp}: must be 1 or more")
    for option, path in (("--workdir", workdir), ("--keep", keep)):
        if path is not None:
            new_or_empty(option, Path(path))
    # The real paths, taken now: a link the user gave is followed once, here, and one
    # put in their place later is refused before the first write (usermodel._claim).
    keep, workdir = (Path(p).resolve() if p else None for p in (keep, workdir))
    return runner.Request(
        e2e=e2e,
        seed=seed,
        keep=keep,
        model=Path(model) if model else None,
        loras=[parse_lora(v) for v in loras],
        tensor_parallel_size=tp,
        max_model_len=max_model_len,
        workdir=workdir,
        reference=reference,
        finding_words=finding_words,
    )


def new_or_empty(option: str, path) -> None:
    """--workdir and --keep follow one rule: a new directory (created when verify runs) or
    an empty one. verify writes model/, adapter/, served.json, the references, vLLM's
    logs and caches there by fixed names, and empties --workdir afterwards: a folder
    that holds the user's own model, the vLLM tree or / would be overwritten or emptied."""
    from patchkit.errors import UsageProblem

    try:
        if path.exists() and not path.is_dir():
            raise UsageProblem(f"{option} {path}: not a directory")
        occupied = path.exists() and any(path.iterdir())
    except OSError as exc:
        raise UsageProblem(f"{option} {path}: cannot read it ({exc.strerror})") from None
    if occupied:
        raise UsageProblem(
            f"{option} {path}: not empty; give a new or empty directory (verify writes its "
            "models, references and logs there by fixed names)"
        )


# ----- the report -----


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
        out(
            "undecided: outside its bound, short of what the rule calls a failure of vLLM "
            "(each row says why); neither passed nor failed."
        )
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
    # "undecided" is longer than the column's 8: past it, one space before the detail
    result = max(8, *(len(_check_result(c)) + 1 for c in found))
    return [f"{title:<{width}}{'result':<{result}}detail"] + [
        f"{c.name:<{width}}{_check_result(c):<{result}}{c.detail}" for c in found
    ]


def adapter_verdict_lines(adapters) -> list[str]:
    """Per adapter: the verdict, the reference and why, what the run could tell apart."""
    lines = []
    for a in adapters:
        lines.append(f"adapter {a.adapter}: {a.verdict} against the {a.reference} reference")
        if a.reference_why is not None:
            lines.append(f"  reference: {a.reference} ({say(a.reference_why)})")
        lines.append(f"  why: {say(a.why)}")
        if a.decides_instead is not None:
            lines.append(f"  what decides instead: {say(a.decides_instead)}")
        if a.controls:
            lines.append(f"  would have caught: {', '.join(a.caught) or 'none of its controls'}")
        if a.nearest is not None:
            near = a.nearest
            lines.append(f"  the nearest it caught: {near.what} ({near.value:.2f}{a.unit})")
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


def progress(line: str | Reason) -> None:
    """verify's progress on stderr: a line, or a reason (its words made here)."""
    warn(say(line) if isinstance(line, Reason) else line)


def _adapter_json(verdict) -> dict:
    """An adapter's verdict: its fields, the reasons among them as messages."""
    return {
        **dataclasses.asdict(verdict),
        "reference_why": message(verdict.reference_why),
        "why": message(verdict.why),
        "decides_instead": message(verdict.decides_instead),
        "would_have_caught": verdict.caught,
        "could_not_tell_apart": verdict.missed,
        "nearest_caught": dataclasses.asdict(verdict.nearest) if verdict.nearest else None,
    }
