"""patchkit nan-probe: where does the first NaN / Inf appear, per request, in a served model.

Added to vLLM by `patchkit apply --only nan-probe`; off unless PATCHKIT_PROBE_LOG
names a file (then nothing is wrapped and nothing runs: the patch costs nothing).

Why it is built this way: vLLM serves under torch.compile and CUDA graphs, where
Python forward hooks and prints do not run on replay. So each probed module gets
one registered custom op (``patchkit::probe_record``) in its forward, traced by
Dynamo like any op and captured into the graphs; it writes, into one preallocated
device buffer, each token row's largest absolute value (NaN and Inf propagate,
so the host tells a NaN row from an Inf row from a finite one). The host reads
that buffer once per real step (a non-blocking copy into pinned memory, read
back a step later, so async scheduling keeps running) and writes JSON lines.

Probed: each decoder layer's output (hidden state and residual), the first
layer's input, and each LoRA-wrapped linear projection inside a decoder layer.
Only steps of real requests are read: the V1 runner calls ``after_forward`` from
``_model_forward``, which its profile, warm-up and capture runs (``_dummy_run``)
never call; Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``) calls it
from ``execute_model`` after the model ran, only when ``dummy_run`` is False (its
capture runs go through the CUDA-graph manager, never ``execute_model``). What
the two runners hold differently (the batch's request ids, ``query_start_loc``,
adapters) is read in one place, :func:`batch_meta`. ``PATCHKIT_PROBE_STATS=1``
adds exact NaN / Inf counts, mean and std per module (more kernels per module)
and logs every module every step.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import os
import re
import stat
import sys
import time
from collections import deque
from dataclasses import dataclass

import torch

LOG_ENV = "PATCHKIT_PROBE_LOG"
STATS_ENV = "PATCHKIT_PROBE_STATS"
STAT_COLUMNS = 5  # nan, inf, finite values, their sum, the sum of their squares
RING = 4  # steps in flight between the device and the host
MAX_ADAPTER_NAME = 200  # vLLM's lora_name has no limit; every record of a request repeats it
MAX_ADAPTER_PATH = 4096  # PATH_MAX: no directory the server loaded from is longer
LAYER_PATH = re.compile(r"^(.*?(?:^|\.)layers\.(\d+))(?:\.(.+))?$")


@torch.library.custom_op("patchkit::probe_record", mutates_args=("rows", "stats"))
def probe_record(
    xs: list[torch.Tensor], rows: torch.Tensor, stats: torch.Tensor, slot: int, with_stats: bool
) -> None:
    """Write each token row's max |x| over ``xs`` into ``rows[slot]`` (no host sync).

    NaN and Inf propagate (a row with a NaN reads NaN, else one with an Inf
    reads Inf). On a GPU one Triton kernel per call (``row_absmax``); with
    ``with_stats`` also exact NaN / Inf counts and the finite sum and sum of
    squares into ``stats[slot]``. Only tensors with one row per token of the
    first (and some values) count for the rows: any other argument of a
    probed forward is not per token, and neither path may read past it.
    """
    flats = [_rows_of(x)[: rows.shape[1]] for x in xs]
    target = rows[slot, : flats[0].shape[0]]
    token_rows = [f for f in flats if f.shape == (target.shape[0], f.shape[1]) and f.shape[1]]
    if token_rows:
        row_absmax(token_rows, target)
    else:
        target.zero_()
    if with_stats:
        stats[slot].copy_(sum(_exact_stats(flat) for flat in flats))


@probe_record.register_fake
def _probe_record_fake(xs, rows, stats, slot, with_stats) -> None:
    """Shapes only: Dynamo and the compile passes trace the op without running it."""
    return None


# "triton": one kernel per probed point on a GPU; "torch": the reference, two to
# five ATen kernels per point (a cast to float32, a reduction, a maximum). The
# module switches itself to "torch" if the Triton kernel cannot be built or
# launched; scripts/bench_probe_gpu.py sets it to compare the two.
ROW_KERNEL = "triton"


def row_absmax(flats: list[torch.Tensor], target: torch.Tensor) -> None:
    """``target[r]`` = the largest |value| of row r over ``flats`` (NaN > Inf > finite).

    Why a kernel of its own: the probe runs at every decoder layer and LoRA
    projection of every step, where a decode step is a few milliseconds; ATen's
    norm casts the bf16 rows to a float32 copy and reduces it, and a layer's
    hidden state and residual need a maximum on top: about 120 small kernels a
    step for an 8-layer model, most of the probe's cost (docs/evidence.md).
    A kernel that fails is caught where it can be: vLLM's profile and warm-up
    runs call the op at every shape eagerly before any CUDA graph is captured,
    so each kernel variant is built (and would fail) outside a capture.
    """
    global ROW_KERNEL
    if ROW_KERNEL == "triton" and target.is_cuda and target.numel():
        try:
            _triton_row_absmax(flats, target)
            return
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not stop the server
            ROW_KERNEL = "torch"
            reason = (str(exc).strip().splitlines() or [""])[0][:200]
            print(
                f"patchkit nan-probe: the Triton row kernel failed ({type(exc).__name__}: "
                f"{reason}); the probe goes on with torch's reductions (slower)",
                file=sys.stderr,
                flush=True,
            )
    _torch_row_absmax(flats, target)


def _torch_row_absmax(flats: list[torch.Tensor], target: torch.Tensor) -> None:
    torch.linalg.vector_norm(flats[0], ord=float("inf"), dim=-1, dtype=torch.float32, out=target)
    for flat in flats[1:]:
        norm = torch.linalg.vector_norm(flat, ord=float("inf"), dim=-1, dtype=torch.float32)
        torch.maximum(target, norm, out=target)


def _triton_row_absmax(flats: list[torch.Tensor], target: torch.Tensor) -> None:
    """One launch per pair of tensors (a layer's hidden state and residual), one
    program per token row, reading the rows in their own dtype."""
    if triton is None:
        raise RuntimeError("Triton is not importable")
    flats = [f if f.stride(-1) == 1 else f.contiguous() for f in flats]
    block = min(triton.next_power_of_2(max(16, *(f.shape[1] for f in flats))), 4096)
    for start in range(0, len(flats), 2):
        a, b = flats[start], flats[min(start + 1, len(flats) - 1)]
        _row_absmax_kernel[(target.shape[0],)](
            a, a.stride(0), a.shape[1], b, b.stride(0), b.shape[1], target,
            HAS_B=start + 1 < len(flats), ACCUMULATE=start > 0, BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip


try:  # Triton comes with vLLM on a GPU; a CPU-only torch goes without it
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _scan_rows(ptr, stride, width, row, top, nan, BLOCK: tl.constexpr):
        """Fold one tensor's row into the running |max| and NaN flag."""
        cols = tl.arange(0, BLOCK)
        for start in range(0, width, BLOCK):
            at = start + cols
            x = tl.load(ptr + row * stride + at, mask=at < width, other=0.0).to(tl.float32)
            is_nan = x != x
            nan = tl.maximum(nan, is_nan.to(tl.int32))
            top = tl.maximum(top, tl.where(is_nan, 0.0, tl.abs(x)))
        return top, nan

    @triton.jit
    def _row_absmax_kernel(
        a, a_stride, a_width, b, b_stride, b_width, out,
        HAS_B: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        top = tl.zeros([BLOCK], dtype=tl.float32)
        nan = tl.zeros([BLOCK], dtype=tl.int32)
        top, nan = _scan_rows(a, a_stride, a_width, row, top, nan, BLOCK)
        if HAS_B:
            top, nan = _scan_rows(b, b_stride, b_width, row, top, nan, BLOCK)
        # tl.max drops NaN on the GPU, so NaN is flagged apart and written last
        result = tl.where(tl.max(nan, axis=0) > 0, float("nan"), tl.max(top, axis=0))
        if ACCUMULATE:
            before = tl.load(out + row)
            bad = (before != before) | (result != result)
            result = tl.where(bad, float("nan"), tl.maximum(result, before))
        tl.store(out + row, result)


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """The tensor as (token rows, values): vLLM's hidden states are (tokens, hidden)."""
    return x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(1, -1)


def _exact_stats(flat: torch.Tensor) -> torch.Tensor:
    """(nan count, inf count, finite count, finite sum, finite sum of squares), float64."""
    nan = torch.isnan(flat)
    inf = torch.isinf(flat)
    bad = nan | inf
    finite = torch.where(bad, 0, flat).double()
    counts = torch.stack([nan.sum(), inf.sum(), (~bad).sum()]).double()
    return torch.cat([counts, torch.stack([finite.sum(), (finite * finite).sum()])])


@dataclass(frozen=True)
class Slot:
    """One probed point: the first layer's input, a decoder layer's output, or a LoRA
    projection (``order``: its place among the layer's projections, registration order)."""

    index: int
    layer: int
    module: str
    kind: str  # "input", "output" or "lora"
    order: int = -1

    def header(self) -> dict:
        return {"layer": self.layer, "module": self.module, "kind": self.kind, "order": self.order}


@dataclass
class Pending:
    """One real step whose rows are on their way to pinned host memory."""

    step: int
    meta: dict
    rows: torch.Tensor
    stats: torch.Tensor
    event: object
    tokens: int


class Probe:
    """The device buffers, the slots, and the host side that turns a step into JSON lines."""

    def __init__(self, log_path: str, with_stats: bool, max_tokens: int, device, slots):
        self.log_path, self.with_stats, self.slots = log_path, with_stats, slots
        self.rows = torch.zeros(len(slots), max_tokens, dtype=torch.float32, device=device)
        self.stats = torch.zeros(len(slots), STAT_COLUMNS, dtype=torch.float64, device=device)
        pin = device.type == "cuda"
        self.host_rows = [_host(self.rows.numel(), torch.float32, pin) for _ in range(RING)]
        self.host_stats = [_host(self.stats.numel(), torch.float64, pin) for _ in range(RING)]
        self.pending: deque[Pending] = deque()
        self.step = 0
        self.rank = _rank()
        self.log_failed = False

    # ----- device side, once per real step -----

    def after_forward(self, meta: dict) -> None:
        """Queue this step's buffers for the host (non-blocking), then reset them."""
        if len(self.pending) == RING:
            self._finish(self.pending.popleft(), wait=True)
        index = self.step % RING
        tokens = min(int(meta["tokens"]), self.rows.shape[1])
        host_rows = self.host_rows[index][: len(self.slots) * tokens].view(len(self.slots), tokens)
        host_rows.copy_(self.rows[:, :tokens].contiguous(), non_blocking=True)
        host_stats = self.host_stats[index].view(self.stats.shape)
        if self.with_stats:
            host_stats.copy_(self.stats, non_blocking=True)
        event = None
        if self.rows.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.reset()
        self.pending.append(Pending(self.step, meta, host_rows, host_stats, event, tokens))
        self.step += 1
        self.poll()

    def reset(self) -> None:
        """Zero the device buffers (stream-ordered after the copy that reads them);
        the statistics only where the op writes them."""
        self.rows.zero_()
        if self.with_stats:
            self.stats.zero_()

    def poll(self) -> None:
        """Write the lines of every step the device has finished."""
        while self.pending and (self.pending[0].event is None or self.pending[0].event.query()):
            self._finish(self.pending.popleft(), wait=False)

    def flush(self) -> None:
        """Wait for every step in flight and write its lines (at exit, or by a test)."""
        while self.pending:
            self._finish(self.pending.popleft(), wait=True)

    # ----- host side -----

    def _finish(self, pending: Pending, wait: bool) -> None:
        if wait and pending.event is not None:
            pending.event.synchronize()
        lines = step_lines(self, pending)
        if lines and not self.log_failed:
            try:
                write_lines(self.log_path, lines)
            except (OSError, ValueError) as exc:
                # runs inside vLLM's forward step: say it once, keep serving
                self.log_failed = True
                _warn(self.log_path, exc, "no more probe lines are written (the server goes on)")


def _host(numel: int, dtype, pin: bool) -> torch.Tensor:
    """A flat host buffer; pinned on CUDA so the device-to-host copy does not block."""
    return torch.zeros(numel, dtype=dtype, pin_memory=pin)


def step_lines(probe: Probe, pending: Pending) -> list[dict]:
    """The JSON records of one step: the modules with a non-finite row (all, with stats).

    This runs in vLLM's step loop after every step, where a decode step of a
    small model takes a few milliseconds: the healthy step (no stats asked) is
    decided by one reduction over all slots, and only the slots holding a
    non-finite row are looked at one by one (a loop of small tensor calls over
    every slot cost about 10 us a slot, a quarter of decode throughput).
    """
    rows = pending.rows[:, : pending.tokens]
    if probe.with_stats:
        looked_at = probe.slots
    else:
        bad_slots = (~torch.isfinite(rows)).any(dim=1)
        if not bool(bad_slots.any()):
            return []
        looked_at = [probe.slots[i] for i in bad_slots.nonzero().flatten().tolist()]
    bounds = pending.meta["query_start_loc"]
    lines = []
    for slot in looked_at:
        values = rows[slot.index]
        nan_rows = torch.isnan(values)
        inf_rows = torch.isinf(values)
        bad = nan_rows | inf_rows
        record = _record(probe, pending, slot, nan_rows, inf_rows, values[~bad])
        record["bad_requests"] = _requests_of(bad, bounds, pending.meta["req_ids"])
        lines.append(record)
    return lines


def _record(probe: Probe, pending: Pending, slot: Slot, nan_rows, inf_rows, finite) -> dict:
    record = {
        "step": pending.step,
        "rank": probe.rank,
        **slot.header(),
        "nan_rows": int(nan_rows.sum()),
        "inf_rows": int(inf_rows.sum()),
        "absmax": float(finite.max()) if finite.numel() else None,
        "tokens": pending.tokens,
        "requests": pending.meta["req_ids"],
        "adapters": pending.meta["adapters"],
        "time": pending.meta["time"],
    }
    if probe.with_stats:
        record.update(_moments(pending.stats[slot.index].tolist()))
    return record


def _moments(column: list[float]) -> dict:
    """Exact counts, mean and std of the finite values from the op's five columns."""
    nan, inf, count, total, squares = column
    mean = total / count if count else None
    std = max(squares / count - mean * mean, 0.0) ** 0.5 if count else None
    return {"nan": int(nan), "inf": int(inf), "mean": mean, "std": std}


def _requests_of(bad, bounds: list[int], req_ids: list[str]) -> list[str]:
    """The requests whose token rows (query_start_loc ranges) hold a bad row."""
    return [
        req_id
        for req_id, start, end in zip(req_ids, bounds, bounds[1:], strict=False)
        if end > start and bool(bad[start:end].any())
    ]


def write_lines(path: str, records: list[dict]) -> None:
    """Append the records as JSON lines, one write (O_APPEND: ranks do not interleave).

    The file is opened by :func:`open_log` each time (never through a link,
    never another user's file). Raises OSError.
    """
    data = "".join(json.dumps(r, allow_nan=False) + "\n" for r in records).encode()
    fd = open_log(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


# ----- opening the log: a root server must not write where another user points it -----

# Created 0600: the lines carry request ids (a client's X-Request-Id) and adapter
# names, for the server's user (and root) to read with `patchkit probe report`.
LOG_MODE = 0o600
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LogRefused(OSError):
    """A log path the probe will not write through (its strerror says why)."""


def open_log(path: str) -> int:
    """A descriptor appending to the log at ``path``, reached without following a link.

    Why: vLLM often runs as root, and PATCHKIT_PROBE_LOG may name a file in a
    directory other users write to. A plain open() follows a link planted
    there (into a root-owned file, or a dangling one creating any file). So
    the path is walked one directory descriptor at a time from / (or the
    working directory), each component opened with O_NOFOLLOW|O_DIRECTORY:
    a link anywhere is refused, and a component swapped for a link after it
    was opened changes nothing (the walk holds the directory, not its name).
    The log's directory must be one other users cannot change (see
    :func:`_check_directory`); the file must be a regular file with one link,
    owned by this process's effective user; a new one is made with O_EXCL.
    Raises OSError: LogRefused for such a refusal.
    """
    *folders, name = path.split("/")
    if name in ("", ".", ".."):
        raise LogRefused(errno.EISDIR, "names a directory, not a file")
    directory = os.open("/" if path.startswith("/") else ".", _DIRECTORY)
    try:
        for folder in folders:
            if folder not in ("", "."):
                inner = _open_directory(directory, folder)
                os.close(directory)
                directory = inner
        _check_directory(os.fstat(directory))
        return _open_file(directory, name)
    finally:
        os.close(directory)


def _open_directory(directory: int, folder: str) -> int:
    try:
        return os.open(folder, _DIRECTORY, dir_fd=directory)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        what = "a symbolic link" if _is_link(directory, folder) else "not a directory"
        raise LogRefused(
            exc.errno, f"{folder!r} is {what} (the log is never reached through a link)"
        ) from None


def _is_link(directory: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _check_directory(found: os.stat_result) -> None:
    """The log's directory must be one no other user can rename a file into.

    Owned by this user or root, and: not writable by group or others, or sticky
    (/tmp: others may create files there, but not rename or remove ours, and
    O_EXCL|O_NOFOLLOW makes a name they planted first fail, never followed).
    A group-writable one is refused too (a member could rename another file of
    the server's user onto the log's name); POSIX ACLs show in the group bits.
    """
    owner_ok = found.st_uid in (os.geteuid(), 0)
    shared = found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if owner_ok and (not shared or found.st_mode & stat.S_ISVTX):
        return
    whose = f"owned by uid {found.st_uid}" if not owner_ok else "writable by other users"
    raise LogRefused(
        errno.EPERM,
        f"its directory is {whose} (mode {stat.S_IMODE(found.st_mode):o}, not sticky): "
        "use a directory only the server's user or root can write to",
    )


def _open_file(directory: int, name: str) -> int:
    """Open the existing log (checked by type before it is opened: no FIFO or device
    is ever opened), or create it with O_EXCL; a name that appears in between is
    looked at again, once."""
    for _ in range(2):
        try:
            found = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            found = None
        if found is not None:
            _check_file(found)
            return _checked(os.open(name, _APPEND, dir_fd=directory), found)
        try:
            fd = os.open(name, _APPEND | os.O_CREAT | os.O_EXCL, LOG_MODE, dir_fd=directory)
        except FileExistsError:
            continue
        return _checked(fd, None)
    raise LogRefused(errno.EEXIST, "appeared and changed while it was being created")


def _checked(fd: int, expected: os.stat_result | None) -> int:
    """``fd`` if it is the file looked at (same inode) and a fit one, else closed and refused."""
    try:
        found = os.fstat(fd)
        if expected is not None and (found.st_dev, found.st_ino) != (
            expected.st_dev,
            expected.st_ino,
        ):
            raise LogRefused(errno.EAGAIN, "was replaced while it was being opened")
        _check_file(found)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_file(found: os.stat_result) -> None:
    """A regular file with one link, owned by this process's effective user."""
    if stat.S_ISLNK(found.st_mode):
        raise LogRefused(errno.ELOOP, "is a symbolic link (the log is never written through one)")
    if not stat.S_ISREG(found.st_mode):
        raise LogRefused(errno.EINVAL, "not a regular file")
    if found.st_nlink != 1:
        raise LogRefused(errno.EMLINK, f"has {found.st_nlink} hard links (one expected)")
    if found.st_uid != os.geteuid():
        raise LogRefused(
            errno.EPERM,
            f"owned by uid {found.st_uid}, not by the server's user (uid {os.geteuid()})",
        )


def _warn(path: str, exc: BaseException, what: str) -> None:
    """One line on stderr: the probe must never take the server down with it.

    The path comes from the environment and an unexpected error's text from
    anywhere: a newline or an escape sequence in them is written escaped, so
    the line stays one line.
    """
    reason = getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"
    line = f"{path}: {reason}; {what}"
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in line)
    print(f"patchkit nan-probe: {shown}", file=sys.stderr, flush=True)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ----- wrapping the model's modules -----

_PROBED_CLASSES: dict[tuple[type, bool], type] = {}


def probed_class(cls: type, records_input: bool) -> type:
    """A subclass of ``cls`` whose forward records its output (and input) with the op.

    A subclass, not a forward hook: Dynamo traces it like the original forward,
    and the op lands in the compiled graph and in the CUDA graphs.
    """
    key = (cls, records_input)
    if key not in _PROBED_CLASSES:

        class Probed(cls):
            def forward(self, *args, **kwargs):
                if records_input:
                    record(self, self._patchkit_probe_in, _tensors((*args, *kwargs.values())))
                out = super().forward(*args, **kwargs)
                record(self, self._patchkit_probe_out, _output_tensors(out, self._patchkit_kind))
                return out

        Probed.__name__, Probed.__qualname__ = cls.__name__, cls.__qualname__
        _PROBED_CLASSES[key] = Probed
    return _PROBED_CLASSES[key]


def record(module, slot: int, tensors: list) -> None:
    """One op call writing ``slot`` of the probe's buffers (the module's own attributes)."""
    if tensors:
        torch.ops.patchkit.probe_record(
            tensors,
            module._patchkit_probe_rows,
            module._patchkit_probe_stats,
            slot,
            module._patchkit_probe_with_stats,
        )


def _tensors(values) -> list:
    """The floating-point tensors among a forward's arguments (hidden state, residual)."""
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _output_tensors(out, kind: str) -> list:
    """A layer's (hidden, residual); a linear layer's output without its bias."""
    if isinstance(out, torch.Tensor):
        return _tensors([out])
    if isinstance(out, tuple) and out:
        return _tensors(out if kind == "layer" else out[:1])
    return []


def probe_targets(model) -> list[tuple[int, str, str, object]]:
    """(layer, module path inside the layer, kind, module) of every point to probe.

    Decoder layers are the children of a ModuleList named ``layers``; LoRA
    projections are the LoRA linear wrappers inside them, in registration order.
    """
    targets = []
    for layer, inner, module in _layer_modules(model):
        if inner is None:
            targets.append((layer, "", "layer", module))
        elif _has_base(module, "BaseLinearLayerWithLoRA"):
            targets.append((layer, inner, "lora", module))
    return targets


def unprobed_lora(model) -> list[dict]:
    """The LoRA wrappers inside decoder layers that the probe does not watch.

    MoE expert LoRA (FusedMoEWithLoRA) runs inside vLLM's fused MoE kernels,
    whose output is not one tensor per LoRA path; it is not probed. The
    header names these modules so that `patchkit probe report` can say, for a
    layer whose output went bad with every probed projection fine, that the
    experts' LoRA is a suspect too, not only the layer's own compute.
    """
    return [
        {"layer": layer, "module": inner, "class": type(module).__name__}
        for layer, inner, module in _layer_modules(model)
        if inner is not None
        and _has_base(module, "BaseLayerWithLoRA")
        and not _has_base(module, "BaseLinearLayerWithLoRA")
    ]


def _layer_modules(model):
    """(layer, path inside the layer or None for the layer itself, module) of every
    module under a decoder layer, in registration order."""
    for name, module in model.named_modules():
        match = LAYER_PATH.match(name)
        if match is not None:
            yield int(match.group(2)), match.group(3), module


def _has_base(module, class_name: str) -> bool:
    """By name, not by import: the module must load without vLLM's LoRA layers."""
    return any(c.__name__ == class_name for c in type(module).__mro__)


def install_on(
    model, log_path: str, with_stats: bool, max_tokens: int, device, runner: str = "v1"
) -> Probe:
    """Wrap the model's decoder layers and LoRA projections; allocate the buffers."""
    targets = probe_targets(model)
    first_layer = min((t[0] for t in targets if t[2] == "layer"), default=None)
    slots, plan = [], []
    order: dict[int, int] = {}
    for layer, inner, kind, module in targets:
        input_slot = -1
        if kind == "layer" and layer == first_layer:
            input_slot = len(slots)
            slots.append(Slot(input_slot, layer, "input", "input"))
        if kind == "lora":
            order[layer] = order.get(layer, -1) + 1
            slot = Slot(len(slots), layer, inner, "lora", order[layer])
        else:
            slot = Slot(len(slots), layer, "output", "output")
        slots.append(slot)
        plan.append((module, kind, input_slot, slot.index))
    probe = Probe(log_path, with_stats, max_tokens, device, slots)
    # before wrapping: a log it cannot write wraps nothing
    write_lines(log_path, [_header(probe, unprobed_lora(model), runner)])
    for module, kind, input_slot, out_slot in plan:
        _wrap(module, probe, kind, input_slot, out_slot)
    return probe


def _wrap(module, probe: Probe, kind: str, input_slot: int, out_slot: int) -> None:
    module._patchkit_kind = kind
    module._patchkit_probe_in = input_slot
    module._patchkit_probe_out = out_slot
    module._patchkit_probe_with_stats = probe.with_stats
    module.register_buffer("_patchkit_probe_rows", probe.rows, persistent=False)
    module.register_buffer("_patchkit_probe_stats", probe.stats, persistent=False)
    module.__class__ = probed_class(type(module), input_slot >= 0)


def _header(probe: Probe, unprobed: list[dict], runner: str) -> dict:
    return {
        "probe": "nan-probe",
        "format": 1,
        "runner": runner,  # the model runner whose hooks feed this log: "v1" or "v2"
        "rank": probe.rank,
        "stats": probe.with_stats,
        "time": time.time(),
        "slots": [s.header() for s in probe.slots],
        "unprobed_lora": unprobed,
    }


# ----- the runners' calls (the patch's hunks) -----

_PROBE: Probe | None = None
# The runner whose load_model reached install() in this process ("v1" or "v2"),
# whether or not the probe is on; check_wired() tells a runner without hooks by it.
_WIRED: str | None = None
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
# V2's warm-ups (vllm/v1/worker/gpu/warmup.py, vllm/model_executor/warmup/) run
# execute_model on made-up requests, not as a dummy run: "_warmup_0_",
# "_v2_mixed_warmup_decode_", "_context_warmup_0_", "_sparse_mla_v2_warmup_...". A
# step of only such requests is not read (V1's warm-up never reaches its hook).
# tests/test_nan_probe_v2.py reads the real ids of each release.
V2_WARMUP_ID = re.compile(r"^_[a-z0-9_]*warmup")


def install(runner, kind: str = "v1") -> None:
    """From the runner's load_model, after LoRA wrapped the layers, before compile.

    ``kind`` names the runner whose hook calls it: "v1" (GPUModelRunner of
    vllm/v1/worker/gpu_model_runner.py) or "v2" (Model Runner V2); the log's
    header records it.
    """
    global _PROBE, _WIRED
    _WIRED = kind
    log_path = os.environ.get(LOG_ENV, "")
    if not log_path:
        return
    with_stats = os.environ.get(STATS_ENV, "").strip() not in ("", "0")
    if getattr(getattr(runner, "parallel_config", None), "enable_dbo", False):
        # micro-batches write their rows from row 0 each: no row could be attributed
        _warn(log_path, ValueError("dual batch overlap (--enable-dbo) is on"),
              "the probe is off (it cannot attribute a micro-batched step's rows)")  # fmt: skip
        return
    device = next(runner.model.parameters()).device
    try:
        _PROBE = install_on(runner.model, log_path, with_stats, runner.max_num_tokens, device, kind)
    except Exception as exc:  # noqa: BLE001 - vLLM must load, probed or not
        # a link, another user's file, a directory, a FIFO, a missing folder, a full
        # disk (OSError), or anything unexpected: vLLM still loads, unprobed
        _warn(log_path, exc, f"the probe is off (set {LOG_ENV} to a file it can append to)")
        return
    atexit.register(_PROBE.flush)


def check_wired(runner) -> None:
    """From the worker's load_model, once the runner vLLM picked has loaded the model.

    Why: the hooks live in the runner files; where vLLM picks a runner this
    tree's probe has no hooks in (a V1-only probe while Model Runner V2 serves,
    VLLM_USE_V2_MODEL_RUNNER=1 on a release whose V2 the probe does not hook),
    the probe would log nothing and look like a healthy model. One line says so.
    """
    if not os.environ.get(LOG_ENV, "") or _WIRED is not None:
        return
    cls = type(runner)
    name = f"{cls.__module__}.{cls.__qualname__}"
    which = "Model Runner V2" if cls.__module__ == V2_RUNNER_MODULE else "a runner"
    print(
        f"patchkit nan-probe: vLLM picked {which} ({name}), which has no probe hooks in "
        f"this tree; nothing is probed (`patchkit status` names the runner and the variable "
        f"that picks the other one)",
        file=sys.stderr,
        flush=True,
    )


def after_forward(runner, batch=None) -> None:
    """After the model ran a step of real requests (never a dummy, profile or capture run).

    V1 calls it from GPUModelRunner._model_forward (``batch`` None: the runner's
    own input_batch and query_start_loc); V2 from execute_model with the step's
    InputBatch. A diagnostic must not fail the request it watches: an
    unexpected error in the host-side reading (a runner attribute renamed in a
    later vLLM, say) turns the probe off with one line on stderr and the step
    goes on.
    """
    global _PROBE
    if _PROBE is None:
        return
    try:
        if batch is not None and _is_warmup(batch):
            _PROBE.reset()
            return
        _PROBE.after_forward(batch_meta(runner, batch))
    except Exception as exc:  # noqa: BLE001 - anything: the server keeps serving
        path, _PROBE = _PROBE.log_path, None
        _warn(path, exc, f"the probe is off from here ({type(exc).__name__} reading a step)")


def _is_warmup(batch) -> bool:
    req_ids = list(batch.req_ids[: batch.num_reqs])
    return bool(req_ids) and all(V2_WARMUP_ID.match(str(r)) for r in req_ids)


def batch_meta(runner, batch=None) -> dict:
    """The step's requests, their token ranges and adapters, as the runner has them now.

    The one place where the two runners differ. V1 (``batch`` None): the
    persistent ``runner.input_batch`` (req_ids, request_lora_mapping,
    lora_id_to_lora_request) and ``runner.query_start_loc.np``. V2: the step's
    InputBatch (req_ids in the step's order, ``query_start_loc_np``; padded
    requests after ``num_reqs`` are not read) and ``runner.lora_state.lora_requests``
    (request id to its LoRARequest).
    """
    if batch is None:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        bounds = [int(b) for b in runner.query_start_loc.np[: num_reqs + 1]]
        mapping = getattr(batch, "request_lora_mapping", None)
        known = getattr(batch, "lora_id_to_lora_request", {})
        loras = [known.get(int(mapping[i])) if mapping is not None else None
                 for i in range(len(req_ids))]  # fmt: skip
    else:
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        bounds = [int(b) for b in batch.query_start_loc_np[: num_reqs + 1]]
        requests = getattr(getattr(runner, "lora_state", None), "lora_requests", None) or {}
        loras = [requests.get(req_id) for req_id in req_ids]
    adapters = {
        req_id: bounded(lora.lora_name, MAX_ADAPTER_NAME)
        for req_id, lora in zip(req_ids, loras, strict=True)
        if lora is not None
    }
    return {
        "req_ids": req_ids,
        "query_start_loc": bounds,
        "tokens": bounds[-1] if bounds else 0,
        "adapters": adapters,
        "time": time.time(),
    }


QUARANTINE_KEYS = ("adapter", "adapter_id", "adapter_path", "slot", "layer", "module", "tensor",
                   "nan", "inf")  # fmt: skip


def note_quarantine(event: dict) -> None:
    """One record for an adapter the torch LoRA path quarantined at load (its hook).

    Why: that path zeroes a non-finite weight and makes the adapter's rows NaN
    from its first LoRA projection on, so the rows alone would point at layer
    0; this record says which adapter and which tensor (layer, module, lora_A
    or lora_B, NaN and inf counts) for `patchkit probe report`. Written with
    the probe's own writer (``write_lines``: never through a link, never
    another user's file), only while the probe is on; a write that fails turns
    the probe's writing off with one line, as a step's lines would.
    """
    probe = _PROBE
    if probe is None or probe.log_failed:
        return
    record = {"event": "quarantine", "rank": probe.rank, "time": time.time()}
    record.update({key: event.get(key) for key in QUARANTINE_KEYS})
    record["adapter"] = bounded(record["adapter"], MAX_ADAPTER_NAME)
    record["adapter_path"] = bounded(record["adapter_path"], MAX_ADAPTER_PATH)
    try:
        write_lines(probe.log_path, [record])
    except (OSError, ValueError) as exc:
        probe.log_failed = True
        _warn(probe.log_path, exc, "no more probe lines are written (the server goes on)")


def bounded(text, limit: int):
    """``text`` cut to at most ``limit`` characters, the cut marked with its length and
    a hash of the whole (two long names sharing their start stay two).

    Why: a tenant names its adapter (and its path, loading it at runtime) with no
    limit in vLLM; a record must stay a line `patchkit probe report` reads and a
    report line a person reads. patchkit.probe.report.bounded makes the same cut
    (a name cut here and the same name in full match there); a cut text is not
    cut again. Anything but a string (None: no name) is left as it is.
    """
    if not isinstance(text, str) or len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    mark = f"...[{len(text)} chars, sha256 {digest}]"
    return text[: limit - len(mark)] + mark


def flush() -> None:
    """Write every step still in flight (tests and scripts; atexit does it too)."""
    if _PROBE is not None:
        _PROBE.flush()
