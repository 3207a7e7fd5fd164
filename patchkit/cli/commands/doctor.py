"""doctor: what stands between this machine and sound LoRA numbers, and the kernel scan.

Its report: facts, the kernel scan (one line per kernel and verdict, or per config with
``-v``), then one verdict per bug; its JSON the same, as data.
"""

from __future__ import annotations

import click

from patchkit.cli import runner
from patchkit.cli.options import json_option, noted_catalogue, target_options
from patchkit.cli.outcome import user_errors
from patchkit.cli.render import (
    counted,
    emit_json,
    field_values,
    message,
    messages,
    out,
    wrap,
)
from patchkit.cli.words import say
from patchkit.doctor import sass
from patchkit.errors import PatchkitError
from patchkit.patching.assess import Assessment
from patchkit.vllmtree.tree import locate


@click.command("doctor")
@target_options
@click.option(
    "--kernels",
    is_flag=True,
    help="Also compile every LoRA Triton kernel vLLM launches for sm_90 (no GPU needed) and "
    "scan their SASS for the wgmma register race. Needs torch and Triton.",
)
@click.option(
    "--model",
    metavar="DIR",
    type=click.Path(exists=True, file_okay=False),
    help="With --kernels: call the kernels with this model's shapes (its config.json: "
    "hidden size, experts, top-k, dtype) instead of Qwen3.5-27B and Qwen3.5-35B-A3B.",
)
@click.option(
    "--adapter",
    "adapters",
    metavar="DIR",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    help="With --kernels: a LoRA adapter directory whose adapter_config.json ranks to scan "
    "(repeatable; default ranks 16 and 64).",
)
@click.option("-v", "--verbose", is_flag=True, help="With --kernels: one line per config.")
@json_option
@user_errors
def doctor_command(
    target: str | None,
    vllm_version: str | None,
    kernels: bool,
    model: str | None,
    adapters: tuple[str, ...],
    verbose: bool,
    as_json: bool,
) -> None:
    """Report GPU, Triton/ptxas, vLLM patch states, tuned configs and stale caches.

    Needs no GPU and imports no vLLM. Ends with a verdict per known bug.
    """
    from pathlib import Path

    from patchkit.doctor import doctor

    if (model or adapters) and not kernels:
        raise click.UsageError("--model and --adapter go with --kernels")
    try:
        tree, tree_error = locate(target, vllm_version), None
    except PatchkitError as exc:
        if target is not None:  # a --target that is wrong fails as in every other command
            raise
        tree, tree_error = None, exc.reason
    request = None
    if kernels:
        request = doctor.ScanRequest(
            Path(model) if model else None, tuple(Path(a) for a in adapters)
        )
    result = doctor.run(tree, tree_error, noted_catalogue(), kernels=request)
    if as_json:
        emit_json("doctor", doctor_json(result))
    else:
        render_doctor(result, verbose)


# ----- the report -----


def render_doctor(report, verbose: bool = False) -> None:
    """doctor's report as text: facts, the kernel scan (one line per kernel and verdict,
    or per config with ``verbose``), then one verdict per bug."""
    for g in report.gpus:
        out(f"GPU: {g.name} (compute capability {g.compute_capability})")
    if not report.gpus:
        out(f"GPU: {say(report.gpu_note)}")
    t = report.toolchain
    where = f" ({t.ptxas_source}: {t.ptxas})" if t.ptxas else ""
    fixed = f"; fixed from {report.fixed_from}" if report.fixed_from else ""
    located = f" ({t.location})" if t.location else ""
    out(
        f"Triton {t.triton or 'not installed'}{located}; "
        f"ptxas for sm_90: {t.ptxas_version or 'unknown'}{where}{fixed}"
    )
    if report.tree is None:
        out(f"vLLM: {say(report.tree_error)}")
    else:
        _render_tree(report)
        if report.runner is not None:
            for text in runner.lines(report.runner, report.patches):
                for line in wrap("", text, 4):
                    out(line)
    for c in report.tuned_configs:
        out(f"tuned config {c.file}: {say(c.problem)}")
    for pyc in report.stale_bytecode:
        out(f"stale bytecode: {say(pyc)}")
    for c in report.old_caches:
        out(f"{c.name} {c.path}: {counted(c.entries, 'entry', 'entries')} older than the patch")
    if report.kernels is not None:
        render_kernels(report.kernels, verbose)
    out("")
    for v in report.verdicts:
        out(f"[{v.status}] {v.bug}")
        fix = say(v.fix) if v.fix else ""
        out(
            f"    {say(v.reason)}"
            + (f"; fix: {fix}" if fix and v.status in ("exposed", "unknown") else "")
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
    triton = field_values(report.toolchain) | {"fixed_from": report.fixed_from}
    triton["version"] = triton.pop("triton")
    theirs = report.tree_triton
    return {
        "ok": True,
        "gpus": [field_values(g) for g in report.gpus],
        "gpu_note": message(report.gpu_note),
        "triton": triton,
        "triton_next_to_vllm": field_values(theirs) if theirs else None,
        "vllm": (report.tree.describe() if report.tree else {"error": message(report.tree_error)}),
        "patches": [_doctor_patch_json(a) for a in report.patches],
        "tuned_configs": [
            {"file": f.file, "problem": message(f.problem)} for f in report.tuned_configs
        ],
        "stale_bytecode": [say(pyc) for pyc in report.stale_bytecode],
        "stale_bytecode_reasons": messages(report.stale_bytecode),
        "old_caches": [field_values(c) for c in report.old_caches],
        "kernels": scan_json(report.kernels) if report.kernels else {},
        "verdicts": [_verdict_json(v) for v in report.verdicts],
        "runner": runner.as_json(report.runner, report.patches) if report.runner else None,
    }


def _verdict_json(verdict) -> dict:
    """A bug's verdict: its status word, why and its fix as messages (no fix: null)."""
    return {
        "bug": verdict.bug,
        "status": str(verdict.status),
        "reason": message(verdict.reason),
        "fix": message(verdict.fix),
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
    data = {k: v for k, v in field_values(scan).items() if k not in nested}
    data["toolchain"] = field_values(scan.toolchain) if scan.toolchain else None
    data["models"] = [field_values(m) for m in scan.models]
    data["cases"] = [_case_json(c) for c in scan.cases]
    return data


def _case_json(case) -> dict:
    hazards = [hazard_json(h) for h in case.hazards]
    return field_values(case) | {"hazards": hazards, "label": case.label()}


def hazard_json(hazard: sass.Hazard) -> dict:
    """A hazard as doctor's JSON and cuobjdump name its parts: addresses in hex, registers R<n>."""
    return {
        "address": sass.address(hazard.address),
        "instruction": hazard.instruction,
        "registers": [f"R{r}" for r in hazard.registers],
        "wgmma": sass.address(hazard.wgmma_address),
    }
