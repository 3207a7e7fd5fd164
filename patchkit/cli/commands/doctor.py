"""doctor: what stands between this machine and sound LoRA numbers, and the kernel scan."""

from __future__ import annotations

import click

from patchkit.cli import render
from patchkit.cli.options import json_option, noted_catalogue, target_options
from patchkit.cli.outcome import user_errors
from patchkit.errors import PatchkitError
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
        tree, tree_error = locate(target, vllm_version), ""
    except PatchkitError as exc:
        if target is not None:  # a --target that is wrong fails as in every other command
            raise
        tree, tree_error = None, str(exc)
    request = None
    if kernels:
        request = doctor.ScanRequest(
            Path(model) if model else None, tuple(Path(a) for a in adapters)
        )
    result = doctor.run(tree, tree_error, noted_catalogue(), kernels=request)
    if as_json:
        render.emit_json(render.doctor_json(result))
    else:
        render.render_doctor(result, verbose)
