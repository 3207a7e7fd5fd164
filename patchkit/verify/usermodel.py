"""`patchkit verify --model DIR --lora NAME=DIR`: the user's own model and adapters under vLLM.

vLLM serves the model with every adapter (LoRA on, eager and CUDA-graph
mode), and, as the reference, each adapter merged into a copy of the base
weights (patchkit.verify.mergewrite: W + scale * B @ A, experts included) served
without LoRA. No transformers forward is needed, so a model that only fits
on its serving GPUs can be checked there. Prompts: 600, 3000 and the
largest that fits (at most 16k tokens, below --max-model-len), token ids
drawn from the model's plain vocabulary.

This module reads the options and runs the whole: the engines are
patchkit.verify.engines, the references patchkit.verify.references, the checks
patchkit.verify.modelchecks and the rule that decides (bounds and verdicts)
patchkit.verify.rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from patchkit import signals
from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError, UsageProblem
from patchkit.fs.files import read_user_json
from patchkit.verify import adaptercontrols, serving
from patchkit.verify.checks import INCONCLUSIVE, Check
from patchkit.verify.engines import ENGINE_TIMEOUT, PEFT_ENTRY, Served, jobs
from patchkit.verify.mergeplan import WorkdirUnusable
from patchkit.verify.modelchecks import compare
from patchkit.verify.references import (
    Reference,
    merged_reference,
    peft_or_merged,
    plan_references,
    reference_base,
    rounding_floors,
    run_peft_reference,
)
from patchkit.verify.refwriter import ReferenceWriter
from patchkit.verify.rule import ModelResult, adapter_verdict, decisive, extent

PROMPT_LENGTHS = (600, 3000)
LONGEST = 16384
# Qwen tokenizers' plain BPE tokens lie below their special tokens (151643+ in
# Qwen2/3, 248044+ in Qwen3.5); prompts use ids below this.
PLAIN_VOCAB = 150000
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def parse_lora(value: str) -> tuple[str, Path]:
    """NAME=DIR of one --lora, or one line (exit 2).

    adapter_config.json is looked at through the directory's descriptor, as every
    later read of it is (a link out of the adapter, a FIFO: refused, never followed).
    """
    from patchkit.adapters.directory import Directory

    name, sep, path = value.partition("=")
    # fullmatch: NAME's "$" also matches before a trailing newline ("one\n" passed)
    if not sep or not NAME.fullmatch(name) or not path:
        raise UsageProblem(
            f"--lora {value!r}: expected NAME=DIR (NAME of letters, digits, '.', '_', '-')"
        )
    directory = Path(path)
    try:
        with Directory(directory) as folder:
            if not folder.has("adapter_config.json"):
                raise UsageProblem(f"--lora {name}: {directory} holds no adapter_config.json")
            folder.open("adapter_config.json").close()
    except UsageProblem:
        raise
    except PatchkitError as exc:
        raise UsageProblem(f"--lora {name}: {exc}", option="--lora", cause=exc) from None
    return name, directory


def read_config(model_dir: Path) -> dict:
    """The model's text config (a multimodal model's text_config), or one line (exit 2)."""
    path = model_dir / "config.json"
    try:
        config = read_user_json(path)  # a FIFO named config.json hung read_text()
    except OSError as exc:
        raise UsageProblem(
            f"--model {model_dir}: no readable config.json there ({exc.strerror})"
        ) from None
    except ValueError as exc:
        raise UsageProblem(f"--model {model_dir}: config.json is unusable ({exc})") from None
    text = config.get("text_config") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(text or {}, dict):
        raise UsageProblem(f"--model {model_dir}: config.json is not a model config (an object)")
    merged = {**config, **(text or {})}
    for key in ("vocab_size", "max_position_embeddings"):
        value = merged.get(key)
        # a string, a float or a negative number here raised ValueError/OverflowError
        if value is not None and (type(value) is not int or value < 1):
            raise UsageProblem(
                f"--model {model_dir}: config.json: {key} is {value!r}, not a positive integer"
            )
    return merged


def max_model_len(config: dict, asked: int | None) -> int:
    """--max-model-len, or 16k plus the generated tokens, within the model's positions.

    ``asked`` is the option as given: 0 is a length (refused), not "not given"."""
    positions = config.get("max_position_embeddings") or LONGEST + serving.GENERATED
    length = asked if asked is not None else min(LONGEST + serving.GENERATED, positions)
    check_max_model_len(length)
    return length


def check_max_model_len(length: int) -> None:
    """A length the checks can run in: room for the shortest prompt and its answer."""
    shortest = PROMPT_LENGTHS[0] + serving.GENERATED
    if length < shortest:
        raise UsageProblem(f"--max-model-len {length}: the checks need at least {shortest} tokens")


def prompt_lengths(length: int) -> list[int]:
    """600, 3000 and the largest prompt that fits (at most 16k), without repeats."""
    longest = min(LONGEST, length - serving.GENERATED)
    return sorted({n for n in PROMPT_LENGTHS if n <= longest} | {longest})


def make_prompts(config: dict, lengths: list[int], seed: int) -> dict[str, list[int]]:
    """Token-id prompts from the plain vocabulary, none of the config's special ids."""
    top = min(config.get("vocab_size") or PLAIN_VOCAB, PLAIN_VOCAB)
    special = {v for k, v in config.items() if k.endswith("token_id") and isinstance(v, int)}
    # Drawing and skipping special ids never ended when the vocabulary held no
    # plain id (vocab_size 2 with a pad id 1): refused first. The draw itself is
    # unchanged, so a seed gives the prompts it gave before.
    if all(token in special for token in range(1, top)):
        raise UsageProblem(
            f"config.json: vocab_size {top} leaves no plain token id to build prompts from"
        )
    rnd = random.Random(seed)
    out = {}
    for n in lengths:
        ids: list[int] = []
        while len(ids) < n:
            token = rnd.randrange(1, top)
            if token not in special:
                ids.append(token)
        out[f"p{n}"] = ids
    return out


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def judge(
    served: dict,
    adapters: list[str],
    controls: dict[str, list],
    references: dict[str, Reference],
    prefix: str = "",
    admission: list[Check] | None = None,
) -> ModelResult:
    """Checks and a verdict per adapter, each adapter against ``references[adapter]``;
    ``admission`` (admission_checks: what `adapter check` found) comes first."""
    found = (admission or []) + compare(served, adapters, prefix, controls, references)
    verdicts = [adapter_verdict(a, found, references[a], controls.get(a, [])) for a in adapters]
    return ModelResult(found, verdicts)


def choose_references(
    served: dict, adapters: list[str], controls: dict, asked: str | None, prefix: str = ""
) -> tuple[dict[str, Reference], list[str]]:
    """The reference of each adapter, and the adapters that need the PEFT reference.

    ``asked`` is --reference (merged, peft) or None: then the merged reference
    judges an adapter where it decides (its rounding control small, as on the
    dense shapes, and every control rejected), and the PEFT reference where it
    does not, said with why.
    """
    if asked == "peft":
        why = Reason.of(Code.VERIFY_REFERENCE_ASKED, reference="peft")
        return {a: Reference("peft", None, {}, why) for a in adapters}, list(adapters)
    run = Served.from_json(served, adapters, prefix)
    forced = Reason.of(Code.VERIFY_REFERENCE_ASKED, reference="merged")
    merged = {a: merged_reference(run, a, forced if asked else None) for a in adapters}
    if asked == "merged":
        return merged, []
    first = judge(served, adapters, controls, merged, prefix)
    need = [v.adapter for v in first.adapters if v.verdict == INCONCLUSIVE]
    chosen = {
        v.adapter: dataclasses.replace(merged[v.adapter], why=merged_why(run, v))
        for v in first.adapters
    }
    return chosen, need


def merged_why(run: Served, verdict) -> Reason:
    """Why the merged reference judges an adapter: its rounding is small, or, its worst
    token coarse or its rounding unknown, it decided all the same (within its bound with
    every control rejected by the mean, or by a check that needs no precision); or why
    it was set aside (its own verdict's reason); or that it did not run, where the
    verdict came from vLLM's own checks (an engine that did not start), never "it
    decided"."""
    if verdict.verdict == INCONCLUSIVE:
        return Reason.of(Code.VERIFY_MERGED_UNDECIDED, verdict=verdict.why)
    merged = merged_reference(run, verdict.adapter, None)
    if merged.runs is None:  # a verdict without it (vLLM did not start): it decided nothing
        return Reason.of(Code.VERIFY_MERGED_NOT_RUN, missing=merged.missing)
    floors = rounding_floors(run, verdict.adapter)
    mean, worst = extent(floors) if floors else (None, None)
    small = Code.VERIFY_ROUNDING_SMALL if decisive(floors) else Code.VERIFY_MERGED_DECIDED
    return Reason.of(small, mean=mean, max=worst)


REFERENCE_CHOICES = ("merged", "peft")


def prepare(
    model_dir: Path,
    loras: list[tuple[str, Path]],
    tp: int,
    asked_len: int | None,
    seed: int,
    reference: str | None = None,
) -> dict:
    """What is decided before any GPU work: config, prompt lengths, prompts (exit 2 if bad)."""
    names = [n for n, _ in loras]
    if len(set(names)) != len(names):
        raise UsageProblem(f"--lora: a NAME given twice ({', '.join(names)})")
    if reference is not None and reference not in REFERENCE_CHOICES:
        raise UsageProblem(f"--reference {reference!r}: one of {', '.join(REFERENCE_CHOICES)}")
    config = read_config(model_dir)
    length = max_model_len(config, asked_len)
    return {
        "config": config,
        "adapters": dict(loras),
        "tensor_parallel_size": tp,
        "max_model_len": length,
        "prompts": make_prompts(config, prompt_lengths(length), seed),
        "seed": seed,
        "reference": reference,
    }


def with_memory(setup: dict, model_dir: Path, gpu: tuple[int, int]) -> tuple[dict, int]:
    """Add each engine's memory to setup; return how many engines run side by side."""
    total, free = gpu
    kv = 2 * serving.GIB
    vocab = setup["config"].get("vocab_size") or PLAIN_VOCAB
    fraction = serving.engine_memory(
        weight_bytes(model_dir), vocab, setup["tensor_parallel_size"], kv, total
    )
    setup = {**setup, "gpu_memory_utilization": fraction, "kv_cache_bytes": kv}
    return setup, serving.side_by_side(fraction, 0.9 * free / total)


def run_model(
    model_dir: Path,
    setup: dict,
    workdir: Path | None,
    keep: Path | None,
    gpu: tuple[int, int],
    say: Callable[[str], None],
) -> ModelResult:
    """Build the controls, write the merged references (unless `--reference peft`),
    serve everything, add the PEFT reference where it decides, judge; clean up unless keep."""
    adapters = setup["adapters"]
    asked = setup.get("reference")
    plans = {}
    if asked != "peft":
        plans = setup.get("plans") or plan_references(
            model_dir, adapters, reference_base(keep, workdir), say
        )
    work, made = _workdir(keep, workdir)
    writer = None
    try:
        routed = serving.experts_in(setup["config"])  # read_config's, checked
        controls = {
            name: adaptercontrols.build(name, path, work)
            + adaptercontrols.engine_controls(name, path, routed)
            for name, path in adapters.items()
        }
        say(f"controls: {describe_controls(controls)}")
        if plans:  # written while the first engines run (refwriter)
            writer = ReferenceWriter(plans, work, say, setup["seed"])
        setup, at_once = with_memory(setup, model_dir, gpu)
        references = writer.paths if writer else {}
        engines = jobs(model_dir, adapters, references, setup, controls=controls)
        say(
            f"serving {model_dir}: {len(engines)} engines, {at_once} at a time, "
            f"prompts {', '.join(p[1:] for p in setup['prompts'])} tokens"
        )
        ready = writer.ready if writer else None
        served = serving.serve_all(engines, work, ENGINE_TIMEOUT, at_once, ready)
        chosen, need = choose_references(served, list(adapters), controls, asked)
        if need:
            say(f"PEFT reference (transformers + PEFT, float32) for {', '.join(need)}")
            served[PEFT_ENTRY] = run_peft_reference(
                model_dir, {n: adapters[n] for n in need}, setup["prompts"], work
            )
            run = Served.from_json(served, list(adapters), merged=bool(references))
            for name in need:
                chosen[name] = peft_or_merged(run, name, chosen[name])
        (work / "served.json").write_text(json.dumps(served))
        return judge(served, list(adapters), controls, chosen, admission=setup.get("admission"))
    finally:
        with signals.deferred():  # a second Ctrl-C cut it short: the run's files stayed
            _clean_up(writer, work, workdir if made else None, keep)


def _clean_up(writer: ReferenceWriter | None, work: Path, made: Path | None, keep) -> None:
    """Stop the references' writing, then remove this run's directory (unless --keep)
    and --workdir where this run created it and nothing else is there."""
    if writer is not None:
        writer.close()  # before the workdir goes: nothing writes into it after
    if keep is None:
        shutil.rmtree(work, ignore_errors=True)  # this run's own directory
        if made is not None:  # --workdir was created by this run: removed if empty
            with contextlib.suppress(OSError):
                made.rmdir()


def describe_controls(controls: dict[str, list]) -> str:
    """'a0: 50 % strength, experts ignored, adapter ignored; b: ...' for the log."""
    return "; ".join(
        f"{name}: {', '.join(c.what for c in group)}" for name, group in controls.items()
    )


def _workdir(keep: Path | None, workdir: Path | None) -> tuple[Path, bool]:
    """Where this run writes: --keep itself, or a new directory of its own under --workdir
    (or the system's temporary directory), which it alone removes afterwards; and whether
    this run created --workdir (then it goes too, if nothing else is left in it)."""
    if keep is not None:
        _claim(keep)
        return keep, False
    made = workdir is not None and _claim(workdir)
    return Path(tempfile.mkdtemp(prefix="patchkit-verify-", dir=workdir)), made


def _claim(path: Path) -> bool:
    """Check again, right before the first write, that ``path`` is a new or an empty real
    directory (the option's check ran minutes earlier, before the GPU checks): created
    here, or there, empty and no link. True when created here. Something put there
    since, a link above all, is refused rather than written through."""
    try:
        path.mkdir(parents=True)
        return True
    except FileExistsError:
        pass
    except OSError as exc:
        raise WorkdirUnusable(
            f"{path}: cannot create it ({exc.strerror})", path=path, error=exc.strerror
        ) from None
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
        empty = is_dir and not any(path.iterdir())
    except OSError as exc:
        raise WorkdirUnusable(
            f"{path}: cannot read it ({exc.strerror})", path=path, error=exc.strerror
        ) from None
    if not empty:
        what = "a link or not a directory" if not is_dir else "not empty"
        raise WorkdirUnusable(
            f"{path}: {what} by the time verify was to write there (it was new or empty "
            "when verify started); nothing was written; give a new directory",
            path=path,
        )
    return False
