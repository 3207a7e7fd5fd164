"""adapter check: a LoRA adapter judged on CPU before any server loads it."""

from __future__ import annotations

import sys

import click

from patchkit.cli import exits, render
from patchkit.cli.options import check_target, json_option
from patchkit.cli.outcome import user_errors


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
        render.emit_json(render.adapter_check_json(report))
    else:
        render.render_adapter_check(report)
    sys.exit(exits.OK if report.ok else exits.FAILURE)
