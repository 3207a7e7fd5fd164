"""verify: prove on a GPU that the installed vLLM's LoRA path gives sound numbers."""

from __future__ import annotations

import os
import sys

import click

from patchkit.cli import exits, render
from patchkit.cli.options import json_option, noted_catalogue
from patchkit.cli.outcome import user_errors
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
    result = runner.run(noted_catalogue(), request, render.warn)
    render.emit_json(render.verify_json(result)) if as_json else render.render_verify(result)
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
