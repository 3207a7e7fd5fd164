"""adapter check: a LoRA adapter judged on CPU before any server loads it."""

from __future__ import annotations

import sys

import click

from patchkit.cli import exits
from patchkit.cli.adapter_words import finding_words
from patchkit.cli.options import check_target, json_option
from patchkit.cli.outcome import user_errors
from patchkit.cli.render import counted, emit_json, field_values, message, messages, out


@click.group("adapter", cls=click.Group)
def adapter() -> None:
    """Inspect LoRA adapters without a GPU (no vLLM, no torch)."""


@adapter.command("check")
@click.argument("adapter_dir", metavar="DIR", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--model",
    metavar="DIR",
    type=click.Path(exists=True, file_okay=False),
    help="The base model's directory: factors are checked against its config.json.",
)
@click.option(
    "--target",
    metavar="TREE",
    type=click.Path(file_okay=False),
    callback=check_target,
    help="A vLLM tree: what that release would refuse or ignore (patches applied or not).",
)
@click.option(
    "--max-lora-rank",
    "max_rank",
    metavar="N",
    type=click.IntRange(min=1),
    help="The server's --max-lora-rank: a higher rank is a finding.",
)
@json_option
@user_errors
def adapter_check(
    adapter_dir: str, model: str | None, target: str | None, max_rank: int | None, as_json: bool
) -> None:
    """One line per problem, naming the file and the tensor: NaN/Inf, shapes that do not
    fit the model, ranks, targets the model lacks, adapter_config.json, and with --target
    what that vLLM release refuses.

    Reads only. Exit 0 when clean, 1 with findings, 2 on a usage error.
    """
    from patchkit.adapters.check import check
    from patchkit.vllmtree.tree import locate

    tree = locate(target) if target is not None else None
    report = check(adapter_dir, model, tree, max_rank)
    if as_json:
        emit_json("adapter check", adapter_check_json(report))
    else:
        render_adapter_check(report)
    sys.exit(exits.OK if report.ok else exits.FAILURE)


# ----- the report -----


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
        lines.append(f"{f.kind}: {where}: {finding_words(f.message)}")
    lines += [f"note: {finding_words(note)}" for note in report.notes]
    lines += [f"skipped: {finding_words(skipped)}" for skipped in report.skipped]
    lines += target_lines(report)
    release = f", vLLM {report.vllm_version}" if report.vllm_version else ""
    scanned = f"{counted(report.tensors, 'tensor')}, {report.bytes_scanned / 1e6:.1f} MB scanned"
    verdict = "clean" if report.ok else counted(len(report.findings), "finding")
    lines.append(f"adapter check {report.adapter}{release}: {verdict} ({scanned})")
    return lines


def target_lines(report) -> list[str]:
    """One line per target name (layers collapsed): whether the --target release wraps it."""
    from patchkit.adapters.reach import grouped
    from patchkit.cli.adapter_target_words import reach_words

    lines = []
    for name, where, outcome, reason in grouped(report.targets):
        why = reach_words(reason)
        lines.append(
            f"on vLLM {report.vllm_version}: {name}{f' ({where})' if where else ''}: {outcome}"
            + (f" ({why})" if why and outcome == "wrapped" else f": {why}" if why else "")
        )
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
        "findings": [_finding_json(f) for f in report.findings],
        "skipped": messages(report.skipped),
        "notes": messages(report.notes),
        "targets": [_target_json(row) for row in report.targets],
    }


def _target_json(row: dict) -> dict:
    """A target as JSON: ``why`` in words as before (the message's), and its reason as a
    message."""
    reason = message(row["why"])
    return {**row, "why": reason["message"], "reason": reason}


def _finding_json(finding) -> dict:
    """A finding as a message: its reason's code (``adapter-nonfinite-values``), its words
    as the text line ends and its facts, then where (file, tensor) and its kind."""
    where = {k: v for k, v in field_values(finding).items() if k != "message"}
    return message(finding.message) | where | {"kind": str(finding.kind)}
