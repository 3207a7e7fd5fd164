"""The merged reference written (W + scale * B @ A per planned tensor), and its rounding control.

``write_merged(plan, dest_dir)`` writes a checkpoint vLLM serves without
LoRA: the shards holding changed tensors are rewritten byte for byte except
those tensors' data, computed in float32 row blocks and cast back to the
stored dtype; the other shards are hard-linked (or symlinked), never
copied, so the plan's byte count is exact. Written beside dest_dir and
renamed into place, so dest_dir is complete or absent. With a seed the
same merge is rounded stochastically instead of to nearest: the rounding
control of ``verify --model``, whose distance from the reference measures
the reference's own bf16 precision. torch is imported inside functions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from patchkit.adapters.safetensorsfile import SafetensorsFile, TensorInfo, tensor_bytes, torch_dtype
from patchkit.codes import Code
from patchkit.errors import OsFailure, PatchkitError
from patchkit.verify.adapterfiles import AdapterTensors, FactorCache
from patchkit.verify.checkpoint import INDEX_NAME
from patchkit.verify.mergeplan import (
    MergePlan,
    NotEnoughSpace,
    Piece,
    WorkdirUnusable,
    human_bytes,
    plan_merge,
)

# Elements of one row block of a weight while it is merged (64 MiB in float32).
_CHUNK_ELEMENTS = 1 << 24
# Adapter factors (float32) kept between checkpoint tensors.
_CACHE_BYTES = 2 << 30


def round_stochastically(block, generator):
    """``block`` (float32) in bf16, each value rounded down or up (in magnitude) at random.

    Up with the probability of the dropped bits' share of one bf16 step, so each
    value is right on average, with an error uncorrelated with rounding to
    nearest. Two merged references rounded these two ways are equally valid
    bf16 versions of the same float32 weights, so how far apart they serve is
    the precision of the merged reference itself (``verify --model``'s rounding
    control). bf16 whatever the checkpoint's dtype, because vLLM serves the
    references in bf16 (``verify/serving.py``): a float32 or float16 checkpoint
    is rounded there once more, at load, to nearest. The usual bit trick
    (random low 16 bits added, then cut off), about 3x faster than choosing
    between neighbours; NaN and inf are rounded to nearest.
    """
    import torch

    block = block.contiguous()
    noise = torch.randint(0, 1 << 16, block.shape, generator=generator, dtype=torch.int32)
    bits = (block.view(torch.int32) + noise) & -(1 << 16)
    rounded = bits.view(torch.float32).to(torch.bfloat16)
    return rounded.where(block.isfinite(), block.to(torch.bfloat16))


def _merge_tensor(
    src: SafetensorsFile, info: TensorInfo, pieces: list[Piece], cache, out, generator=None
) -> None:
    """Write one merged tensor: row blocks in float32, W + scale * left @ right, cast back
    (to nearest, or stochastically with a ``generator``)."""
    import torch

    cols = info.shape[-1]
    rows = info.numel // cols
    dtype = torch_dtype(info.dtype)
    step = max(1, _CHUNK_ELEMENTS // cols)
    pieces = sorted(pieces, key=lambda p: p.row0)
    for c0 in range(0, rows, step):
        c1 = min(rows, c0 + step)
        block = src.read_rows(info.name, c0, c1 - c0).to(torch.float32)
        for piece in pieces:
            o0, o1 = max(c0, piece.row0), min(c1, piece.row0 + piece.nrows)
            if o0 >= o1:
                continue
            left, right = piece.lora.factors(cache, piece.expert)
            s0 = piece.sub0 + o0 - piece.row0
            delta = left[s0 : s0 + o1 - o0] @ right
            block[o0 - c0 : o1 - c0] += delta.mul_(piece.lora.scale)
        if generator is None:
            rounded = block.to(dtype)
        else:  # bf16 values, stored in the checkpoint's dtype
            rounded = round_stochastically(block, generator).to(dtype)
        out.write(tensor_bytes(rounded))


class Cancelled(Exception):
    """write_merged was told to stop (its run is ending); what it wrote is removed."""


def _stop_if(cancel, dest: Path) -> None:
    """Cancelled when ``cancel`` (a threading.Event, or None) is set."""
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"writing {dest.name} stopped")


def _rewrite_shard(
    src: SafetensorsFile,
    dest: Path,
    pieces: dict[str, list[Piece]],
    cache,
    generator=None,
    cancel=None,
) -> None:
    """The shard again, byte for byte, except the merged tensors' data; ``cancel`` (a
    threading.Event) is looked at before each tensor."""
    chunk = 1 << 24
    with open(dest, "wb") as out:
        out.write(src.header_bytes)
        pos = src.data_start
        for info in sorted(src.tensors.values(), key=lambda i: i.begin):
            _stop_if(cancel, dest)
            if info.begin > pos:  # bytes between tensors, kept as they are
                out.write(src.read_bytes(pos, info.begin - pos))
            if info.name in pieces:
                _merge_tensor(src, info, pieces[info.name], cache, out, generator)
            else:
                for start in range(info.begin, info.end, chunk):
                    out.write(src.read_bytes(start, min(chunk, info.end - start)))
            pos = max(pos, info.end)
        if src.size > pos:
            out.write(src.read_bytes(pos, src.size - pos))


class ChangedSincePlanned(PatchkitError):
    """A shard of the base model changed between the merge's plan and its writing:
    ``path``. Nothing was written."""

    code = Code.CHANGED_WHILE_RUNNING


def _link(source: Path, dest: Path) -> str:
    real = source.resolve()
    try:
        os.link(real, dest)
        return "hardlink"
    except OSError:
        pass
    try:
        os.symlink(real, dest)
        return "symlink"
    except OSError as exc:
        raise OsFailure(
            exc,
            "linking",
            path=real,
            line=f"cannot hard-link or symlink {real} into {dest.parent} ({exc.strerror}); "
            "the merge does not copy unchanged shards",
        ) from exc


def write_merged(
    plan: MergePlan,
    dest_dir: Path | str,
    progress: Callable[[str], None] | None = None,
    stochastic_seed: int | None = None,
    cancel=None,
) -> dict[str, str]:
    """Write the merged checkpoint to dest_dir (which must not exist, or be empty).

    Written next to it first and renamed into place at the end, so dest_dir
    is either complete or absent. Returns {shard: "merged"|"hardlink"|"symlink"}.
    With ``stochastic_seed`` the merged tensors are rounded stochastically
    (``round_stochastically``, reproducible from the seed) instead of to nearest.
    ``cancel`` (a threading.Event, set when the run ends early) stops it before the next
    tensor; the staging directory goes and dest_dir is left as it was.
    """
    dest = Path(dest_dir).absolute()
    _stop_if(cancel, dest)  # a run that has ended gets nothing made, its workdir included
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise WorkdirUnusable(
            f"{dest} exists and is not empty; give write_merged a new directory", path=dest
        )
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(parent).free
    except OSError as exc:
        raise OsFailure(exc, "preparing") from exc
    if free < plan.bytes_needed:
        raise NotEnoughSpace(
            f"the merged checkpoint needs {human_bytes(plan.bytes_needed)} at {parent}, "
            f"{human_bytes(free)} is free; give --workdir a larger disk",
            path=parent,
            needed=plan.bytes_needed,
            free=free,
        )
    for name, (size, mtime) in plan.sources.items():
        st = (plan.model_dir / name).stat()
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise ChangedSincePlanned(
                f"{plan.model_dir / name} changed since the merge was planned",
                path=plan.model_dir / name,
            )
    done: dict[str, str] = {}
    adapter = AdapterTensors(plan.adapter_dir)
    cache = FactorCache(adapter, _CACHE_BYTES)
    generator = _generator(stochastic_seed)
    work = None
    try:
        # A fresh staging directory of our own (mkdtemp), never one found by its name:
        # a directory of that name in the user's --keep DIR is theirs, not a leftover.
        work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=parent))
        for name in plan.copy:
            shutil.copyfile(plan.model_dir / name, work / name)
        if plan.index_text is not None:
            (work / INDEX_NAME).write_text(plan.index_text)
        for name in plan.link:
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            done[name] = _link(plan.model_dir / name, work / name)
        for name in plan.rewrite:
            if progress:
                progress(f"merging {name}")
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            with SafetensorsFile(plan.model_dir / name) as src:
                mine = {k: v for k, v in plan.pieces.items() if k in src.tensors}
                _rewrite_shard(src, work / name, mine, cache, generator, cancel)
            done[name] = "merged"
        if dest.exists():
            dest.rmdir()
        os.rename(work, dest)
    except OSError as exc:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        raise OsFailure(exc, "writing the merged checkpoint to") from exc
    except BaseException:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        adapter.close()
    return done


def _generator(seed: int | None):
    """A CPU generator for stochastic rounding, or None (round to nearest)."""
    if seed is None:
        return None
    import torch

    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def merged_checkpoint(
    model_dir: Path | str,
    adapter_dir: Path | str,
    workdir: Path | str,
    progress: Callable[[str], None] | None = None,
) -> Iterator[tuple[Path, MergePlan]]:
    """Plan, tell, write a merged checkpoint under workdir, and remove it afterwards."""
    plan = plan_merge(model_dir, adapter_dir)
    if progress:
        for line in plan.describe():
            progress(line)
    dest = Path(workdir) / f"merged-{Path(adapter_dir).name}-{os.getpid()}"
    write_merged(plan, dest, progress)
    try:
        yield dest, plan
    finally:
        shutil.rmtree(dest, ignore_errors=True)
