# SPDX-License-Identifier: Apache-2.0
"""Torch matmuls and dot-free Triton GEMVs in place of vLLM's punica LoRA kernels.

Added to this vLLM tree by patchkit, patch `matmul-add-lora-linear`; `patchkit
revert` removes it. Why: on sm_90 the Triton expand kernel can produce NaN
(ptxas reuses registers under an asynchronous wgmma, triton-lang/triton#9433;
vLLM issue #48590), and Qwen3.5/3.6 then answers "!!!!!!".

With PATCHKIT_LORA_BACKEND=torch (the default; read once, when punica_gpu.py
is imported) punica_gpu.py installs this path:

* `add_lora_linear`, the call of every LoRA linear layer, runs as one GEMM
  for all slices and slots (x @ A.T, A of every slice and slot stacked),
  one `mul_` by each token's slot weights (1 for its own slot, 0 for the
  others), and one `addmm_` per output slice into y (B of every slot stacked
  along the rank). A one-slice call of at most SPLIT_K_MAX_TOKENS tokens
  instead splits the shrink over the hidden size (a batched GEMM, so that
  more of the GPU reads A) and reduces the parts with a second batched GEMM
  whose left operand is the slot weights: reduce and mask in one kernel,
  three in all, where cuBLAS alone takes four there (its split-K GEMM has
  its own reduce kernel). There is no host sync, so CUDA graphs capture it,
  and it is a custom op, opaque to torch.compile, like vLLM's.
* A prefill-sized call (at least ACTIVE_MIN_TOKENS tokens, outside a CUDA
  graph capture) whose batch uses at most half of the slots, and that skips at
  least ACTIVE_MIN_WORK multiply-adds that way, runs the same GEMMs on those
  slots only: their A and B rows taken out once a call (`index_select`), the
  slot weights' columns too, so the FLOPs are those of the slots in use, not
  of max_loras. Which slots: vLLM's own active_lora_ids, read on the host
  once a batch in update_metadata (ActiveSlots; PATCHKIT_LORA_ACTIVE_ONLY=0
  turns it off).
* A decode-sized call, at most min(GEMV_MAX_TOKENS, max_loras) tokens on a
  CUDA device, runs two Triton GEMV kernels instead (the default; see
  GEMV_ENABLED for why, and PATCHKIT_LORA_GEMV=0 turns it off), which read only each
  row's own slot (found in the batch's slot weights, as the GEMMs mask):
  one shrink for all slices, split over the hidden size into fp32 parts,
  and one expand per slice that sums the parts, multiplies by the row's
  slot weight and scale, and adds into (or writes) y. No tl.dot, so no
  wgmma and none of sm_90's register-A hazard; no atomics, so the result
  is deterministic. Every route is chosen by shapes only.
* Every other call that reached the Triton kernels (add_shrink/add_expand,
  hence `_mcp_apply`; add_lora_embedding; add_lora_logits;
  apply_lora_full_linear) goes through `torch_lora_shrink` /
  `torch_lora_expand`, which take the Triton ops' arguments.

What runs once per batch, not once per layer: each token's slot weights
(`SlotMasks`), rebuilt in `update_metadata` from vLLM's own kernel metadata
into fixed buffers that the captured graphs read.

What runs once per model, not once per call: each LoRA layer's stacked
weights are moved, when the layer is attached to this wrapper
(`set_mapping`), into the layout the matmuls read: B of shape (slots, 1,
out, rank) is stored rank-major, so that all slots form one (slots * rank,
out) matrix, and the A tensors of a layer's slices share one storage, one
(slices * slots * rank, in) matrix. vLLM keeps its tensors (same objects,
shapes and values; only their strides change), so its set_lora/reset_lora
write straight into this layout: nothing is copied again and no memory is
added. The matrices the calls read of that layout (A of all slices, each
slice's B) are made on a layer's first call and kept with it (LayerPlan):
prefill steps too large for vLLM's CUDA graphs run every call's host work,
and the ops are registered as vLLM registers its own, not through
torch.library.custom_op, for the same reason.

NaN: a token's row never takes another slot's numbers. The GEMMs read every
slot and the slot weights multiply, so every loaded weight must be finite:
after each set_lora the new slot is checked once, and a non-finite value in
its A or B is replaced by 0 there and the slot marked bad. A bad slot's
weight is NaN instead of 1, so rows of that adapter come out NaN (as with
the Triton kernels) and every other row is as without it; the GEMV route
multiplies each row by the same weight. Loading the slot again, or removing
the adapter, clears the mark. The quarantine is said once per load, naming
the adapter (the worker's add_adapter tells this module which request it
loads) and its first non-finite tensor in layer order; with nan-probe on, a
record goes to the probe log too, for `patchkit probe report`. (On the
GEMM route a row whose own input is not finite gets NaN in its LoRA delta
even without an adapter; its layer output is not finite anyway. The GEMV
route leaves rows without a slot as they are.)

PATCHKIT_LORA_BACKEND=triton keeps the Triton kernels, to compare without
reverting. VLLM_BATCH_INVARIANT=1 does too (with one log line): vLLM's
batch-invariant mode overrides aten::mm and its own LoRA shrink, not this
path.

Cost per add_lora_linear call, T tokens, S slices, L slots (max_loras), r
rank, H in, N = sum of slice widths. GEMMs: FLOPs 2*T*L*r*(S*H + N), L times
the Triton kernels' (which skip other slots), and every slot's weights read; a
temporary of T*S*L*r elements (SPLIT_K_MAX_SPLIT times that for a split
shrink). Narrowed to the batch's n slots (n <= L/2): L replaced by n in both,
plus copies of those slots' A and B rows (n/L of the layer's). GEMV (T <=
min(GEMV_MAX_TOKENS, L)): each row reads its own adapter's S*r*H + r*N weights
(rows of one adapter share them through L2), FLOPs 2*T*r*(S*H + N) on the CUDA
cores, 1 + S launches, a temporary of T*GEMV_SPLIT_K*S*r float32 (192 KiB at 8
tokens, 3 slices of rank 128); on an H200 a decode step's LoRA modules took
0.40-1.02 of the GEMM route's time there (GEMV_MAX_TOKENS says where). Per
batch and model dtype: slot weights of max_num_batched_tokens * L elements,
and of SPLIT_K_MAX_TOKENS * L * SPLIT_K_MAX_SPLIT elements for the split
reduce.
"""

import contextlib
import logging
import os
import re
import shlex
import sys
import types
import typing

import torch

try:  # vLLM's CUDA installs have Triton; a CPU-only test environment may not
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

logger = logging.getLogger(__name__)

BACKEND_ENV = "PATCHKIT_LORA_BACKEND"
BACKENDS = ("torch", "triton")
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def requested_backend() -> str:
    """The LoRA op backend the operator asked for: 'torch' unless set."""
    value = os.environ.get(BACKEND_ENV, "").strip().lower() or "torch"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def batch_invariant() -> bool:
    """Whether vLLM's batch-invariant mode is asked for (any value but empty or 0)."""
    return os.environ.get(BATCH_INVARIANT_ENV, "").strip() not in ("", "0")


def backend_from_env() -> str:
    """The backend this process uses: the Triton kernels under batch invariance."""
    backend = requested_backend()
    return "triton" if backend == "torch" and batch_invariant() else backend


LORA_BACKEND = backend_from_env()
if LORA_BACKEND != requested_backend():
    logger.warning(
        "patchkit: %s is set, so LoRA runs on vLLM's Triton kernels, which keep its "
        "batch-invariant guarantee; the torch path (matmul-add-lora-linear) is off.",
        BATCH_INVARIANT_ENV,
    )


def _key_the_compile_cache() -> None:
    """Give each backend its own entry in vLLM's torch.compile cache.

    vLLM keys compiled graphs by envs.compile_factors(), which walks every
    variable in vllm.envs.environment_variables. Without this, a graph
    compiled with one backend's ops is loaded again under the other ("Directly
    load the compiled graph(s) ... from the cache"), so the switch would not
    take effect until the cache is deleted. Registering the variable there
    needs no edit to envs.py, and this module is imported (with punica_gpu)
    before vLLM compiles the model.
    """
    try:
        from vllm import envs
    except ImportError:  # used on its own (tests, benchmarks)
        return
    envs.environment_variables.setdefault(BACKEND_ENV, backend_from_env)


_key_the_compile_cache()


# ----- once per batch: which slot each token uses -----


SPLIT_K_MAX_TOKENS = 256  # one-slice calls up to this many tokens split the shrink
SPLIT_K_MAX_SPLIT = 8


def split_k_parts(num_tokens: int) -> int:
    """How many parts the shrink of a one-slice call is split into (shape only).

    Measured on an H200 (docs/evidence.md): 8 parts are fastest up to
    64 tokens, 4 up to 256; beyond, cuBLAS's own GEMM is as fast.
    """
    return SPLIT_K_MAX_SPLIT if num_tokens <= 64 else 4


class SlotMasks:
    """Per-token slot weights for one LoRAKernelMeta, rebuilt once per batch.

    `weights[dtype][t, j]` is 1 when token t uses slot j (NaN when that slot
    holds a bad adapter) and 0 otherwise; `reduce_weights[dtype]` holds the
    same values repeated SPLIT_K_MAX_SPLIT times per (token, slot), the left
    operand of the split shrink's reduce; `no_lora[t]` is True when token t
    uses no slot. Fixed buffers of the metadata's size, in each dtype the
    LoRA layers use (registered when a layer is attached, before any
    forward), so CUDA graphs captured once read each batch's values. A few
    small kernels per batch, none per layer.
    """

    def __init__(self, meta):
        mapping = meta.token_lora_mapping
        rows, num_slots = mapping.size(0), meta.active_lora_ids.size(0) - 1
        self.meta = meta
        self.slots = torch.arange(num_slots, dtype=mapping.dtype, device=mapping.device)
        self.no_lora = torch.ones(rows, 1, dtype=torch.bool, device=mapping.device)
        self.health = torch.ones(num_slots, device=mapping.device)  # 1, or NaN: a bad adapter
        self.bad_in: dict[int, set] = {}  # slot -> the layers that found it bad
        self.weights: dict[torch.dtype, torch.Tensor] = {}
        self.reduce_weights: dict[torch.dtype, torch.Tensor] = {}
        self.num_tokens = 0  # of the last update
        self.written = 0  # rows [0, written) may hold a LoRA batch's values; the rest hold none
        self.active = ActiveSlots(num_slots, mapping.device)

    def use_dtype(self, dtype: torch.dtype) -> None:
        """Keep weights in `dtype` too (a LoRA layer's weight dtype), from now on."""
        if dtype in self.weights:
            return
        rows, num_slots, device = self.no_lora.size(0), self.slots.size(0), self.slots.device
        self.weights[dtype] = torch.zeros(rows, num_slots, dtype=dtype, device=device)
        self.reduce_weights[dtype] = torch.zeros(
            self.reduce_rows(rows), 1, SPLIT_K_MAX_SPLIT, dtype=dtype, device=device
        )
        if self.num_tokens:  # a batch is mapped already: fill the new buffers for it
            self.update(self.num_tokens)

    def reduce_rows(self, num_tokens: int) -> int:
        """Rows of reduce_weights for the first `num_tokens` tokens (a row per token and slot)."""
        return min(num_tokens, SPLIT_K_MAX_TOKENS) * self.slots.size(0)

    def mark(self, slot: int, layer, bad: bool) -> None:
        """Record what `layer` found in `slot` after set_lora/reset_lora (load time only).

        A fill on the device, not `health[slot] = value`: that copies a host scalar into
        a one-element CUDA tensor, a blocking copy that waits for every copy queued
        before it, and vLLM's set_lora calls reset_lora before it queues its own, so
        each layer of a load waited for the layer before (184 such syncs a reload in
        the profile of docs/evidence.md, 2026-12-02, MoE 2 x r128 on 16 layers).
        """
        found = self.bad_in.setdefault(slot, set())
        if bad:
            found.add(id(layer))
        else:
            found.discard(id(layer))
        self.health[slot].fill_(float("nan") if found else 1.0)

    def update(self, num_tokens: int) -> None:
        """After vLLM's prepare_tensors for this batch's first `num_tokens` tokens.

        For a batch without LoRA vLLM leaves token_lora_mapping as the
        previous batch wrote it (it only raises the CPU flag), so the weights
        are zeroed instead of read from it: every row a LoRA batch wrote,
        once, so that a run of batches without LoRA (base traffic on a LoRA
        server) launches nothing here, as on vLLM's Triton path.
        """
        self.num_tokens = num_tokens
        self.active.forget()
        if self.meta.no_lora_flag_cpu.item():
            self._clear(self.written)
            self.written = 0
            return
        self.written = max(self.written, num_tokens)
        no_lora = self.no_lora[:num_tokens]
        reduce_rows = self.reduce_rows(num_tokens)
        mapping = self.meta.token_lora_mapping[:num_tokens]
        own = mapping.unsqueeze(1) == self.slots
        torch.any(own, dim=1, keepdim=True, out=no_lora)
        no_lora.logical_not_()
        weights = torch.where(own, self.health, 0.0)
        for dtype, buffer in self.weights.items():
            buffer[:num_tokens].copy_(weights)
            repeated = weights.view(-1, 1, 1)[:reduce_rows].expand(-1, 1, SPLIT_K_MAX_SPLIT)
            self.reduce_weights[dtype][:reduce_rows].copy_(repeated)
        if self.may_narrow(num_tokens):
            self.active.build(self.meta.active_lora_ids, num_tokens)

    def may_narrow(self, num_tokens: int) -> bool:
        """Whether a call of this batch could skip ACTIVE_MIN_WORK (at most every slot
        but one idle, on the widest layer that has called add_lora_linear so far:
        vLLM's profiling run calls every one before serving; without it the first
        large batch does, unnarrowed): if not, the host read is not worth doing
        (8 x r16 and 2 x r128 never reach it at 8,192 tokens on these models; one
        slot never does)."""
        idle = self.slots.size(0) - 1
        widest = _WIDEST.get(self.active.index.data_ptr(), 0)
        return (
            ACTIVE_ONLY
            and num_tokens >= ACTIVE_MIN_TOKENS
            and num_tokens * idle * widest >= ACTIVE_MIN_WORK
        )

    def _clear(self, rows: int) -> None:
        """Rows [0, rows) to the no-LoRA state: no_lora True, every weight 0."""
        if not rows:
            return
        self.no_lora[:rows].fill_(True)
        reduce_rows = self.reduce_rows(rows)
        for dtype, weights in self.weights.items():
            weights[:rows].zero_()
            self.reduce_weights[dtype][:reduce_rows].zero_()


_MASKS: dict[int, SlotMasks] = {}  # by the data_ptr of the metadata's mapping buffer


def masks_for(meta) -> SlotMasks:
    """The SlotMasks of a LoRAKernelMeta; the ops find them by its mapping buffer."""
    key = meta.token_lora_mapping.data_ptr()
    masks = _MASKS.get(key)
    if masks is None or masks.meta is not meta:
        masks = _MASKS[key] = SlotMasks(meta)
    return masks


def _batch_weights(mapping, lora_ids, num_slots, dtype):
    """(slot weights, no_lora) rows for this call: this batch's buffers, or built here."""
    num_tokens = mapping.size(0)
    masks = _MASKS.get(mapping.data_ptr())
    if masks is not None and masks.slots.size(0) == num_slots and dtype in masks.weights:
        return masks.weights[dtype][:num_tokens], masks.no_lora[:num_tokens]
    # Not a wrapper's metadata (the ops used on their own): build them now.
    slots = torch.arange(num_slots, device=mapping.device)
    active = (lora_ids.unsqueeze(1) == slots).any(dim=0)
    own = (mapping.unsqueeze(1) == slots) & active
    return own.to(dtype), ~own.any(dim=1, keepdim=True)


# ----- prefill-sized calls: the GEMMs of the batch's own slots -----

# On unless PATCHKIT_LORA_ACTIVE_ONLY=0 (read once, at import). Why: the GEMM route
# computes every slot's rank for every token, max_loras times the Triton kernels'
# FLOPs; with 16 slots of rank 64 that cost 0.67 ms more a MoE layer at 8,192 tokens
# than 8 x r16 did (docs/evidence.md, 2026-12-02h). A prefill step holds few requests
# (the benchmark's 8,192-token steps: two prompts of 4,096, two slots of 16), so the
# GEMMs of the slots in use are a fraction of the work. Where it pays, measured per
# call on an H200 (docs/evidence.md, 2026-12-02i): at 8,192 tokens with 16 slots of
# rank 64, 0.39-0.92 of the every-slot call's time on 6 of the 7 LoRA shapes of the
# dense 27B and the 35B-A3B (out_proj lost); at 256-1,024 tokens, or with 8 x r16
# or 2 x r128, it mostly lost (up to 2.9 times), its 2 + S index_selects and host work
# costing more than the FLOPs it skips. So a call is narrowed only where it skips at
# least ACTIVE_MIN_WORK multiply-adds: the 20 of 224 measured calls that skip 6e10 or
# more all won (0.39-0.76), every call that lost skips 4.8e10 or fewer, and 2 that won
# by more than 20 % skip fewer (0.75 and 0.76: left to the every-slot route). A
# grouped GEMM per slot, the other way to skip idle slots, was slower than the GEMM
# route at every shape (2026-12-02h).
ACTIVE_ENV = "PATCHKIT_LORA_ACTIVE_ONLY"
ACTIVE_ONLY = os.environ.get(ACTIVE_ENV, "").strip() != "0"
ACTIVE_MIN_WORK = 6 * 10**10  # multiply-adds a call skips: tokens x idle slots x rank x (S*H + N)
# Batches of fewer tokens are not read at all: decode (CUDA graphs replay the route
# they captured) and small prefills, which skip less than ACTIVE_MIN_WORK anyway up
# to 16 slots of rank 128 on these models' widest layer.
ACTIVE_MIN_TOKENS = 512

try:  # vLLM 0.25+ has it; from 0.28 a step may wait for the GPU only where it says so
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed as _sync_allowed
except ImportError:  # earlier releases, or this module used on its own
    _sync_allowed = contextlib.nullcontext


class ActiveSlots:
    """The slots this batch's tokens use, for the GEMM route of calls outside CUDA
    graphs: built in SlotMasks.update, once a batch of ACTIVE_MIN_TOKENS or more.

    `index[:n]` holds the n slots in use, ascending; `state_cpu` holds (n, the
    batch's tokens), or (0, 0) when this batch has none: a batch with LoRA on more
    than half of the slots (narrowing would copy more than it saves), one in which
    no call could skip ACTIVE_MIN_WORK (SlotMasks.may_narrow), no LoRA, or this off.
    A CPU tensor the op reads at run time, as vLLM's no_lora_flag_cpu, never a
    Python int that torch.compile would bake into its graph.
    """

    def __init__(self, num_slots: int, device):
        self.index = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.state_cpu = torch.zeros(2, dtype=torch.int64)
        self.built = False  # state_cpu holds a batch's slots

    def forget(self) -> None:
        """No slots known for the batch being mapped (until build says otherwise); once
        after a built batch, so that base traffic touches nothing here."""
        if self.built:
            self.state_cpu.zero_()
            self.built = False

    def build(self, active_lora_ids: torch.Tensor, num_tokens: int) -> None:
        """From vLLM's active_lora_ids (the batch's distinct slots, -1 for none, -1
        padded), which its prepare_tensors has just written: one read on the host
        (it waits for those copies; prepare_tensors itself waits for the GPU twice, for
        its no-LoRA flag and torch.unique; about 0.15 ms of host time on the H200),
        inside vLLM's gpu_sync_allowed, then the slots sorted on the device."""
        if _capturing(active_lora_ids):
            return
        num_slots = self.index.size(0)
        with _sync_allowed():
            count = sum(1 for slot in active_lora_ids.tolist() if slot >= 0)
        if not count or 2 * count > num_slots:
            return
        ids = active_lora_ids.to(torch.int64)
        keyed = torch.where(ids < 0, num_slots, ids)  # the slots first, ascending
        self.index[:count].copy_(torch.sort(keyed).values[:count])
        self.state_cpu[0], self.state_cpu[1] = count, num_tokens
        self.built = True


def _capturing(t: torch.Tensor) -> bool:
    """Inside a CUDA graph capture on t's device (whose replays meet other batches)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def skipped_work(tokens: int, idle: int, lora_a: list, lora_b: list) -> int:
    """Multiply-adds a call skips by leaving out `idle` slots: their shrink and expand."""
    rank, hidden = lora_a[0].size(-2), lora_a[0].size(-1)
    widths = sum(b.size(-2) for b in lora_b)
    return tokens * idle * rank * (len(lora_a) * hidden + widths)


# The most multiply-adds a token and slot of any layer that has called add_lora_linear,
# by the data_ptr of its wrapper's ActiveSlots.index: what SlotMasks.may_narrow bounds
# a batch's calls by. Recorded by the calls themselves, so that layers vLLM adopts but
# runs elsewhere (lm_head's add_lora_logits, the merged layers' add_shrink/add_expand
# of 0.20-0.24) do not count.
_WIDEST: dict[int, int] = {}


def active_slots(x, active, plan) -> torch.Tensor | None:
    """The slots a call's GEMMs are narrowed to (index, on x's device), or None for
    every slot: not built for exactly these tokens, skipping less than
    ACTIVE_MIN_WORK, or inside a CUDA graph capture. `plan`: the layer's LayerPlan."""
    if active is None:
        return None
    index, state_cpu = active
    key = index.data_ptr()
    if plan.work > _WIDEST.get(key, 0):
        _WIDEST[key] = plan.work
    count, tokens = state_cpu.tolist()
    if not count or tokens != x.size(0):
        return None
    if tokens * (plan.slots - count) * plan.work < ACTIVE_MIN_WORK:
        return None
    if _capturing(x):
        return None
    return index[:count]


# ----- once per model: the layout the matmuls read -----


def _as_list(stacked) -> list:
    if isinstance(stacked, torch.Tensor):
        return [stacked]
    return list(stacked) if isinstance(stacked, (list, tuple)) else []


def _slot_shaped(tensors: list) -> bool:
    """vLLM's (slots, 1, a, b) stacking, one tensor per slice."""
    return bool(tensors) and all(
        isinstance(t, torch.Tensor) and t.dim() == 4 and t.size(1) == 1 for t in tensors
    )


def _b_is_rank_major(b: torch.Tensor) -> bool:
    """B (slots, 1, width, rank) stored as (slots, rank, width). A dimension of size 1
    (one slot: vLLM's default max_loras) has no stride to check: torch's reshape
    renumbers it."""
    slots, _, width, rank = b.shape
    return (
        (rank == 1 or b.stride(3) == width)
        and (width == 1 or b.stride(2) == 1)
        and (slots == 1 or b.stride(0) == rank * width)
    )


def _make_b_rank_major(b: torch.Tensor) -> None:
    """Store B (slots, 1, width, rank) as (slots, rank, width); same tensor, new strides.

    In place, a slot at a time, where B is contiguous (as vLLM makes it): B keeps the
    block vLLM allocated, and the only temporary is one slot's. A new storage for the
    whole B freed the old one, and vLLM creates the LoRA layers under a 20 MiB split
    limit (gpu_worker.load_model), where the allocator hands a freed block of 20 MiB or
    more whole to a later, smaller request of 20 MiB or more: on the dense 27B-wide
    model at 16 x r64 each layer's freed gate_up B (34 MiB) went whole to its A join
    (20 MiB), 0.36 GiB allocated for nothing over 32 layers (docs/evidence.md, 2026-12-03).
    """
    if _b_is_rank_major(b):
        return
    slots, _, width, rank = b.shape
    if b.is_contiguous():
        flat = b.view(slots, width * rank)
        for slot in range(slots):  # reshape copies the transposed slot before copy_ writes
            flat[slot].copy_(flat[slot].view(width, rank).t().reshape(-1))
        b.set_(b.untyped_storage(), b.storage_offset(), b.shape,
               (rank * width, rank * width, 1, width))  # fmt: skip
        return
    moved = b.reshape(slots, width, rank).transpose(1, 2).contiguous()
    b.set_(moved.untyped_storage(), 0, b.shape, (rank * width, rank * width, 1, width))


def _a_shared(a_list: list) -> bool:
    first = a_list[0]
    step = first.numel()
    return all(
        a.is_contiguous()
        and a.shape == first.shape
        and a.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and a.storage_offset() == first.storage_offset() + s * step
        for s, a in enumerate(a_list)
    )


def _share_a_storage(a_list: list) -> None:
    """Put the A tensors of a layer's slices one after another in one storage."""
    if _a_shared(a_list):
        return
    first = a_list[0]
    joined = torch.cat([a.reshape(-1) for a in a_list])
    for s, a in enumerate(a_list):
        a.set_(joined.untyped_storage(), s * first.numel(), first.shape, first.stride())


_FALLBACKS: set[str] = set()


def _fallback(what: str) -> None:
    if what not in _FALLBACKS:
        _FALLBACKS.add(what)
        logger.warning("patchkit LoRA torch path: %s; copied on every call", what)


def stacked_a(a_list: list) -> torch.Tensor:
    """A of all slices and slots as one (slices * slots * rank, in) matrix."""
    first = a_list[0]
    rows = len(a_list) * first.size(0) * first.size(-2)
    if _a_shared(a_list):
        return first.as_strided((rows, first.size(-1)), (first.size(-1), 1))
    _fallback("LoRA A weights outside the shared layout")
    return torch.cat([a.reshape(-1, a.size(-1)) for a in a_list])


def stacked_b(b: torch.Tensor) -> torch.Tensor:
    """B of all slots as one (slots * rank, out) matrix; (slots, [1,] out, rank) in."""
    b = b.reshape(b.size(0), 1, b.size(-2), b.size(-1))
    slots, _, width, rank = b.shape
    if _b_is_rank_major(b):
        return b.as_strided((slots * rank, width), (width, 1))
    _fallback("LoRA B weights not rank-major")
    return b.reshape(slots, width, rank).transpose(1, 2).reshape(slots * rank, width)


class AdoptedLayer:
    """A LoRA layer whose stacked weights this path has laid out and checks."""

    def __init__(self, layer, masks: SlotMasks):
        self.a = _as_list(getattr(layer, "lora_a_stacked", None))
        self.b = _as_list(getattr(layer, "lora_b_stacked", None))
        self.masks = masks
        self.layer_key = id(layer)  # how an AdapterLoad finds the layer's module name
        if len(self.a) > 1 and _slot_shaped(self.a):  # its one new storage before any
            _share_a_storage(self.a)  # old one is freed (_make_b_rank_major says why)
        for b in self.b:
            _make_b_rank_major(b)
        set_lora, reset_lora = layer.set_lora, layer.reset_lora

        def set_lora_then_check(index, *args, **kwargs):
            try:  # checked even when it raises: vLLM writes A before it finds B too wide
                return set_lora(index, *args, **kwargs)
            finally:
                self.quarantine_non_finite(index)

        def reset_lora_then_clear(index, *args, **kwargs):
            result = reset_lora(index, *args, **kwargs)
            self.masks.mark(index, self, bad=False)
            return result

        layer.set_lora, layer.reset_lora = set_lora_then_check, reset_lora_then_clear

    def slot(self, index: int) -> list:
        """Slot `index`'s A and B of every slice (views: a write reaches the slot)."""
        return [w[index] for w in self.a + self.b]

    @torch.no_grad()
    def quarantine_non_finite(self, index: int) -> None:
        """Keep a non-finite weight of slot `index` out of every other slot's rows.

        The GEMMs multiply every slot's weights by the slot weights of each
        row, and 0 * inf is NaN, so a non-finite A or B value would reach all
        rows. It is replaced by 0, and the slot is marked bad in the batch
        weights (NaN instead of 1), so that the rows of this adapter still
        come out NaN. Once per set_lora, never per call: the check runs on
        the device here, and its answer is read on the host by `settle`,
        right away or, inside vLLM's activate_adapter, once for all its
        layers when it returns (`defer_checks_of`).
        """
        finite = torch.stack([torch.isfinite(w).all() for w in self.slot(index)]).all()
        if _DEFERRED is not None:
            _DEFERRED.append((self, index, finite))
            return
        self.settle(index, bool(finite))

    @torch.no_grad()  # as the check: settle_checks calls it outside quarantine_non_finite
    def settle(self, index: int, finite: bool) -> None:
        """Mark slot `index` as the check found it; a bad one is counted tensor by tensor
        (load time only), zeroed and named by `quarantined`."""
        self.masks.mark(index, self, not finite)
        if finite:
            return
        found = first_non_finite(self.a, self.b, index)
        for w in self.slot(index):
            w.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        quarantined(index, self.layer_key, found)


# ----- once per activate_adapter: one host read of every layer's check -----

# Inside a wrapped activate_adapter: (layer, slot, the check's device answer) of each
# set_lora, in the order vLLM set the layers; None outside.
_DEFERRED: list | None = None


def defer_checks_of(manager) -> None:
    """Wrap `manager.activate_adapter` (once) so that the checks of the slot it fills are
    read on the host in one sync when it returns, not in one sync per LoRA layer.

    Why: vLLM copies each module's A and B into the slot with non_blocking copies from
    pinned memory, the routed experts' factors too, and a host read waits for every copy
    queued before it; read layer by layer, the host waited for the copies layer by layer
    instead of queueing the next layer's meanwhile: the suspect, not yet measured apart,
    of an adapter reload (remove_lora and add_lora) taking 0.51 s on this path against
    0.43 s on vLLM's kernels with 8 MoE adapters of rank 16 at 28 layers
    (docs/evidence.md, 2026-12-02). Nothing else
    changes: activate_adapter returns only after every layer is settled, so no forward
    can read a slot before its bad values are zeroed, and the first bad tensor in layer
    order is still the one named. An exception inside settles what was set."""
    activate = getattr(manager, "activate_adapter", None)
    if activate is None or getattr(activate, "patchkit_defers_checks", False):
        return

    def activate_adapter(*args, **kwargs):
        global _DEFERRED
        if _DEFERRED is not None:  # called from inside another: that one settles
            return activate(*args, **kwargs)
        _DEFERRED = []
        try:
            return activate(*args, **kwargs)
        finally:
            checks, _DEFERRED = _DEFERRED, None
            settle_checks(checks)

    activate_adapter.patchkit_defers_checks = True
    manager.activate_adapter = activate_adapter


def settle_checks(checks: list) -> None:
    """Each deferred check settled in order, its answers read in one host sync.

    Every layer is settled even when one raises (naming it, or writing the probe's
    record): its slot was written already, so a layer left unsettled would keep its
    non-finite values in a slot vLLM counts as active. The first error is raised after.
    """
    if not checks:
        return
    finite = torch.stack([answer for _, _, answer in checks]).tolist()
    error = None
    for (layer, index, _), ok in zip(checks, finite, strict=True):
        try:
            layer.settle(index, ok)
        except Exception as exc:  # noqa: BLE001 (raised below, once every slot is safe)
            error = error or exc
    if error is not None:
        raise error


def first_non_finite(a_list: list, b_list: list, index: int) -> dict:
    """The first of slot `index`'s tensors holding NaN or inf, slice by slice, A before B.

    {"slice", "slices", "tensor" ("lora_A" or "lora_B"), "nan", "inf"}: the
    counts of that tensor in this slot (this rank's shard). Load time only.
    """
    for s, (a, b) in enumerate(zip(a_list, b_list, strict=False)):
        for tensor, w in (("lora_A", a[index]), ("lora_B", b[index])):
            nan, inf = int(torch.isnan(w).sum()), int(torch.isinf(w).sum())
            if nan or inf:
                return {"slice": s, "slices": len(a_list), "tensor": tensor, "nan": nan,
                        "inf": inf}  # fmt: skip
    return {"slice": 0, "slices": len(a_list), "tensor": "lora_A", "nan": 0, "inf": 0}


# ----- once per adapter load: which adapter, which tensor -----

LAYER_PATH = re.compile(r"^(?:.*?\.)?layers\.(\d+)\.(.+)$")
CHECK_COMMAND = "patchkit adapter check"

# The add_adapter running now: (vLLM's LoRAModelManager, the LoRARequest), set by the
# patch's hook at the top of the worker's add_adapter; vLLM calls that once per active
# adapter per step, so the hook only keeps the pair, and wraps the manager's
# activate_adapter the first time (defer_checks_of): no device call.
_LOAD: tuple | None = None
_REPORTED: tuple | None = None  # the load whose quarantine was already said


def begin_adapter_load(manager, request) -> None:
    """From the worker's add_adapter (the patch's hunk in worker_manager.py)."""
    global _LOAD
    _LOAD = (manager, request)
    defer_checks_of(manager)


class AdapterLoad:
    """Which adapter an add_adapter loads into which slot, and where its layers are.

    vLLM's activate_adapter puts the adapter's id in lora_index_to_id[slot]
    before it sets the slot's modules, one by one in the model's order (layer
    by layer), so the first set_lora that finds a non-finite weight holds the
    first bad tensor in layer order: that one is named, once per load.
    """

    def __init__(self, manager, request, index: int):
        self.manager, self.slot = manager, index
        self.adapter_id = getattr(request, "lora_int_id", None)
        self.name = getattr(request, "lora_name", None)
        self.path = getattr(request, "lora_path", None)

    def holds(self) -> bool:
        """Whether the slot being set is this request's (not a pin or another path)."""
        slots = getattr(self.manager, "lora_index_to_id", None) or []
        return self.slot < len(slots) and slots[self.slot] == self.adapter_id

    def where(self, layer_key: int, found: dict) -> dict:
        """The bad tensor's place: layer index and module inside it, as the adapter's
        files name it (a packed module's slice by its own name where vLLM says it)."""
        modules = getattr(self.manager, "modules", {}) or {}
        full = next((name for name, m in modules.items() if id(m) == layer_key), "")
        match = LAYER_PATH.match(full)
        layer, module = (int(match.group(1)), match.group(2)) if match else (None, full)
        if module and found["slices"] > 1:
            parent, _, last = module.rpartition(".")
            names = (getattr(self.manager, "packed_modules_mapping", None) or {}).get(last, [])
            if len(names) == found["slices"]:
                module = f"{parent}.{names[found['slice']]}" if parent else names[found["slice"]]
            else:
                module = f"{module} (slice {found['slice']} of {found['slices']})"
        return {"layer": layer, "module": module or "a LoRA layer"}


def quarantined(index: int, layer_key: int, found: dict) -> None:
    """Say which adapter was quarantined and why: one log line per load (its first bad
    tensor in layer order) and, with nan-probe on, one record in the probe's log."""
    global _REPORTED
    load = AdapterLoad(*_LOAD, index) if _LOAD is not None else None
    if load is None or not load.holds():  # a set_lora outside add_adapter: the slot only
        logger.warning(
            "patchkit LoRA torch path: the adapter in slot %d has non-finite weights (%s); "
            "its requests get NaN, other requests are not affected",
            index,
            _counts(found),
        )
        return
    if _REPORTED is _LOAD:
        return
    _REPORTED = _LOAD
    event = quarantine_event(load, layer_key, found)
    logger.warning("%s", quarantine_line(event))
    _to_probe_log(event)


def quarantine_event(load: AdapterLoad, layer_key: int, found: dict) -> dict:
    """The facts of one quarantine, as the probe log records them."""
    return {
        "adapter": load.name,
        "adapter_id": load.adapter_id,
        "adapter_path": load.path,
        "slot": load.slot,
        **load.where(layer_key, found),
        "tensor": found["tensor"],
        "nan": found["nan"],
        "inf": found["inf"],
    }


def quarantine_line(event: dict) -> str:
    """The log line: the adapter by name and id, the tensor, what happens, what next.
    Names and paths come from API clients: repr() keeps a newline in one out of the log."""
    adapter = f"adapter {event['adapter']!r}" if event["adapter"] is not None else "adapter"
    layer = f"layer {event['layer']} " if event["layer"] is not None else ""
    directory = shell_word(event["adapter_path"])
    return (
        f"patchkit LoRA torch path: {adapter} (id {event['adapter_id']}): {layer}"
        f"{event['module']} {event['tensor']} has non-finite values ({_counts(event)}); "
        "its requests get NaN, other requests are not affected; "
        f"check it with `{CHECK_COMMAND} {directory}`"
    )


def shell_word(path: str | None) -> str:
    """The adapter's path as one word a shell takes as written (shlex.quote: `;`, `$()`
    and `|` in a tenant's lora_path stay text when the line is pasted), or DIR where
    the path holds characters a log or a terminal would not show as they are."""
    if path and path.isascii() and path.isprintable():
        return shlex.quote(path)
    return "DIR"


def _counts(found: dict) -> str:
    parts = [f"{found[k]} {k}" for k in ("nan", "inf") if found[k]]
    return ", ".join(parts) or "non-finite"


def _to_probe_log(event: dict) -> None:
    """A quarantine record in nan-probe's log, through the probe's own writer (when
    that patch is applied and PATCHKIT_PROBE_LOG is set; else nothing)."""
    try:
        from vllm.v1.worker import patchkit_nan_probe
    except ImportError:
        return
    note = getattr(patchkit_nan_probe, "note_quarantine", None)
    if note is not None:
        note(event)


def adopt_layer(layer, masks: SlotMasks) -> None:
    """Called by BaseLayerWithLoRA.set_mapping for each LoRA layer, before any forward.

    MoE layers are left alone: their LoRA runs in the fused MoE kernel.
    """
    stacked = _as_list(getattr(layer, "lora_a_stacked", None))
    if stacked and isinstance(stacked[0], torch.Tensor):
        masks.use_dtype(stacked[0].dtype)
    if hasattr(layer, "w13_lora_a_stacked") or hasattr(layer, "w2_lora_a_stacked"):
        return
    if not _slot_shaped(_as_list(getattr(layer, "lora_b_stacked", None))):
        return
    AdoptedLayer(layer, masks)  # kept alive by the set_lora it wraps


# ----- the ops -----


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _a_matrix(lora_a: list) -> torch.Tensor:
    """A of every slice and slot as one matrix; (slots, [1,] rank, in) per slice in."""
    return stacked_a([w.reshape(w.size(0), 1, w.size(-2), w.size(-1)) for w in lora_a])


PLAN_ATTR = "_patchkit_lora_plan"


class LayerPlan:
    """What a layer's add_lora_linear calls read of its weights, worked out on its first
    call and kept on its first A tensor: the stacked A matrix, each slice's B matrix,
    the shapes and layout checks, the work a token and slot costs.

    Why: prefill steps too large for vLLM's CUDA graphs run every LoRA call eagerly,
    and rebuilding these views on each call was most of the GEMM route's host work
    (36 of a 4-slice call's 42 aten ops were views and metadata; docs/evidence.md,
    2026-12-02i); scripts/bench_lora_host.py measures the host time a call.

    The matrices are tensors of their own on the weights' storage (`set_`, not
    views: a view would hold the A tensor it hangs on, a cycle through C++ that
    would outlive the layer), so vLLM's set_lora writes reach them as before. A
    layout that needs a copy (A outside the shared storage, B not rank-major) is
    not kept: that copy is made on every call, as the weights change. `current`
    checks on each call that the tensors still have the storage, shape and
    strides the plan was made for (vLLM only writes into them, but a tensor
    changed in place, `set_`, `resize_` or `as_strided_`, gets a new plan).
    """

    __slots__ = ("pointers", "slots", "rank", "hidden", "widths", "work", "a", "b")

    def __init__(self, lora_a: list, lora_b: list):
        a = [w.reshape(w.size(0), 1, w.size(-2), w.size(-1)) for w in lora_a]
        b = [w.reshape(w.size(0), 1, w.size(-2), w.size(-1)) for w in lora_b]
        self.pointers = _pointers(lora_a, lora_b)
        self.slots, _, self.rank, self.hidden = a[0].shape
        self.widths = tuple(w.size(2) for w in b)
        self.work = skipped_work(1, 1, lora_a, lora_b)  # a token and slot
        self.a = _own_tensor(stacked_a(a)) if _a_shared(a) else None
        fits = all(w.size(0) == self.slots and w.size(3) == self.rank for w in b)
        rank_major = fits and all(_b_is_rank_major(w) for w in b)
        self.b = tuple(_own_tensor(stacked_b(w)) for w in b) if rank_major else None

    def current(self, lora_a: list, lora_b: list) -> bool:
        """Whether the call's tensors still have the storage, shapes and strides this
        plan reads them by."""
        return self.pointers == _pointers(lora_a, lora_b)

    def a_matrix(self, lora_a: list) -> torch.Tensor:
        return self.a if self.a is not None else _a_matrix(lora_a)

    def b_matrix(self, lora_b: list, s: int) -> torch.Tensor:
        return self.b[s] if self.b is not None else stacked_b(lora_b[s])


def _pointers(lora_a: list, lora_b: list) -> tuple:
    """What a plan is made from: each tensor's address, shape and strides."""
    return (len(lora_a), *((w.data_ptr(), w.shape, w.stride()) for w in (*lora_a, *lora_b)))


def _own_tensor(view: torch.Tensor) -> torch.Tensor:
    """A tensor on `view`'s storage, offset and strides that is not a view of its base.
    A normal tensor even when made under inference_mode (vLLM's forward), so that a
    later call with autograd on can use it as it uses the weights."""
    with torch.inference_mode(False):
        own = torch.empty(0, dtype=view.dtype, device=view.device)
        return own.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def layer_plan(lora_a: list, lora_b: list) -> LayerPlan:
    """The layer's LayerPlan, kept on its first A tensor; made again when a tensor's
    storage, shape or strides changed. (A tensor object new on every call would get a
    new plan every call: the same results, only not faster.)"""
    held = lora_a[0].__dict__
    plan = held.get(PLAN_ATTR)
    if plan is None or not plan.current(lora_a, lora_b):
        plan = held[PLAN_ATTR] = LayerPlan(lora_a, lora_b)
    return plan


def _weighted_shrink(x, lora_a, weights, slots=None, a=None) -> torch.Tensor:
    """(tokens, slices, slots * rank): x @ A.T of every slice and slot, one GEMM, times
    each token's slot weights (0 where the token does not use the slot). `slots`
    (an index, or None for all): only those slots, in that order. `a`: the stacked A
    matrix, when the caller holds it."""
    num_tokens, slices = x.size(0), len(lora_a)
    num_slots, rank = lora_a[0].size(0), lora_a[0].size(-2)
    a, weights = (_a_matrix(lora_a) if a is None else a), weights[:num_tokens]
    if slots is not None:
        a = a.view(slices, num_slots, -1).index_select(1, slots).view(-1, a.size(1))
        weights, num_slots = weights.index_select(1, slots), slots.size(0)
    shrunk = torch.mm(_cast(x, a.dtype), a.t()).view(num_tokens, slices, num_slots, rank)
    shrunk.mul_(weights.view(num_tokens, 1, num_slots, 1))
    return shrunk.view(num_tokens, slices, num_slots * rank)


def _b_matrix(matrix: torch.Tensor, num_slots: int, slots=None) -> torch.Tensor:
    """A slice's B matrix (slots * rank, out), or its rows of `slots` only."""
    if slots is None:
        return matrix
    return matrix.view(num_slots, -1).index_select(0, slots).view(-1, matrix.size(1))


def _split_shrink(x, a, reduce_weights, num_slots) -> torch.Tensor:
    """(tokens, slots * rank): one slice's x @ A.T times the slot weights, the hidden
    size split into parts (one batched GEMM), the parts summed and weighted by a
    second batched GEMM: per (token, slot), (1 x parts) weights @ (parts x rank)."""
    num_tokens, hidden = x.shape
    rows = a.size(0)  # slots * rank
    rank, parts = rows // num_slots, split_k_parts(num_tokens)
    x_parts = x.view(num_tokens, parts, hidden // parts).transpose(0, 1)
    a_parts = a.view(rows, parts, hidden // parts).permute(1, 2, 0)
    partial = torch.bmm(x_parts, a_parts)  # (parts, tokens, slots * rank)
    by_slot = partial.as_strided(
        (num_tokens * num_slots, parts, rank), (rank, num_tokens * rows, 1)
    )
    weights = reduce_weights[: num_tokens * num_slots, :, :parts]
    return torch.bmm(weights, by_slot).view(num_tokens, rows)


def _splits(x, lora_a, reduce_weights, plan=None) -> bool:
    """Whether this call's shrink is split: one slice, few tokens, parts that divide."""
    num_tokens, hidden = x.shape
    if len(lora_a) != 1 or num_tokens > SPLIT_K_MAX_TOKENS:
        return False
    plan = plan or LayerPlan(lora_a, [])  # on its own (tests): the layer's plan untouched
    return (
        num_tokens <= reduce_weights.size(0) // plan.slots
        and hidden % split_k_parts(num_tokens) == 0
        and x.dtype == lora_a[0].dtype == reduce_weights.dtype
        and x.is_contiguous()
        and plan.a is not None
    )


# ----- few tokens: a Triton GEMV per row's own slot -----

# A call of at most min(GEMV_MAX_TOKENS, max_loras) tokens takes the GEMV kernels
# (on a CUDA device, Triton importable). The GEMV reads each row's own adapter, the
# GEMM route every slot once, so the GEMV wins while rows <= slots. Per decode step
# of the benchmark models' LoRA modules on an H200 (docs/evidence.md, the GEMV route: dense
# 27B and 35B-A3B widths, 2-16 slots of rank 16-128), with rows <= slots, the GEMV
# took 0.40-0.76 of the GEMM route's time at 1 token, 0.50-0.75 at 4 and 0.63-1.02
# at 8. Beyond (more rows than slots, or than 8) it lost: 1.14 at 16 tokens on 16
# dense slots, 1.32 at 8 tokens on 2. The bound depends on shapes only, so a CUDA
# graph captured for a batch size replays the route it was captured with.
GEMV_MAX_TOKENS = 8
# On unless PATCHKIT_LORA_GEMV=0 (read once, at import; "0" is the only value that
# turns it off, the way back to the GEMM route for every call). Why on: serving on
# the H200 side by side with unpatched vLLM (docs/evidence.md, "the GEMV route in
# serving"), decode with LoRA at batch 1 was 103.4 % of unpatched with 16 dense
# adapters of rank 64 (lower quartile 101.0 %) and 100.7 % with 8 MoE adapters of
# rank 16 (q1 97.2 %), batch 4 126.7 % and 101.3 %, where the GEMM route alone was at
# 97.5 % and 92.4 % at batch 1. Its checks passed on the H200 too (rows without a slot
# bit-identical, a bad adapter's rows NaN, CUDA graphs, verify --e2e), and the kernel
# scan reads every config it compiles with (no wgmma). Memory: no buffer of its own
# outlives a call. gemv_linear's fp32 parts (tokens x GEMV_SPLIT_K x slices x rank:
# 256 KiB at 8 tokens, 4 slices of rank 128) come from the allocator, or the CUDA
# graph's pool, for the call; at 16 slots that is twice the GEMM route's temporary
# for a call of several slices (128 KiB more at most) and under a quarter of it for
# a one-slice call, and far below the temporaries of the profile run and the larger
# graphs (the GEMM route), which set what vLLM reserves (docs/evidence.md).
GEMV_ENV = "PATCHKIT_LORA_GEMV"
GEMV_ENABLED = os.environ.get(GEMV_ENV, "").strip() != "0"
GEMV_SPLIT_K = 16  # shrink parts over the hidden size (fp32, summed by the expand)
GEMV_BLOCK_N = 16  # shrink: A rows (slices * rank) per program
GEMV_BLOCK_K = 128  # shrink: hidden columns per step
GEMV_BLOCK_W = 128  # expand: output columns per program
GEMV_MAX_BLOCK_R = 128  # expand: rank rows per step, the rank rounded up to a power of 2
GEMV_NUM_WARPS = 4  # both kernels
GEMV_BLOCK_L = 16  # both: slot weights read per step
# Every config the kernels compile with: these constants, BLOCK_R = gemv_block_r(rank)
# (16, 32, 64 or 128) and ADD_INPUTS (False for vLLM's dual stream); the kernel scan
# (doctor --kernels) compiles those its shapes reach. No tl.dot: nothing lowers to wgmma.


def _gemv_kernels():
    """The GEMV kernels (shrink, expand), or None without Triton.

    Defined when this module is imported: under TRITON_INTERPRET=1 they are
    Triton's interpreter's, which runs them on CPU tensors (the CPU tests).
    """
    return (_gemv_shrink_kernel, _gemv_expand_kernel) if triton is not None else None


if triton is not None:

    @triton.jit
    def _row_slot(w_ptr, t, stride_w, num_slots, BLOCK_L: tl.constexpr):
        """Row t's slot (the one whose weight is not 0; -1 for none) and its weight (1, or
        NaN for a bad adapter), from the batch's slot weights."""
        slot = tl.full((), -1, tl.int32)
        weight = tl.zeros((), tl.float32)
        for l0 in range(0, num_slots, BLOCK_L):
            lane = l0 + tl.arange(0, BLOCK_L)
            w = tl.load(w_ptr + t * stride_w + lane, mask=lane < num_slots, other=0.0)
            own = w.to(tl.float32) != 0.0  # unordered: NaN counts
            slot = tl.maximum(slot, tl.max(tl.where(own, lane, -1), axis=0))
            weight += tl.sum(tl.where(own, w.to(tl.float32), 0.0), axis=0)
        return slot, weight

    @triton.jit(do_not_specialize=["num_slots"])
    def _gemv_shrink_kernel(x_ptr, a_ptr, w_ptr, part_ptr, hidden, rows, rank, num_slots,
                            stride_x, stride_w, per_split, SPLIT_K: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_L: tl.constexpr):  # fmt: skip
        """part[t, split, n] = sum over the split's hidden columns k of
        A[slice(n), slot(t), rank(n), k] * x[t, k], n over slices * rank.

        A is the layer's (slices * slots * rank, hidden) matrix; x is read in
        A's dtype, as the GEMM route casts it. Rows without a slot write nothing.
        The slot lookup is the expand's (its weight is the expand's to apply).
        """
        t, nb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot, weight = _row_slot(w_ptr, t, stride_w, num_slots, BLOCK_L)
        if slot >= 0:
            n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            row = ((n // rank) * num_slots + slot) * rank + n % rank
            a_rows = a_ptr + row.to(tl.int64)[:, None] * hidden
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            start = split * per_split
            for k0 in range(0, per_split, BLOCK_K):
                k = start + k0 + tl.arange(0, BLOCK_K)
                k_in = k < hidden
                xv = tl.load(x_ptr + t * stride_x + k, mask=k_in, other=0.0)
                xv = xv.to(a_ptr.dtype.element_ty).to(tl.float32)
                a = tl.load(a_rows + k[None, :], mask=(n[:, None] < rows) & k_in[None, :],
                            other=0.0)  # fmt: skip
                acc += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
            tl.store(part_ptr + (t * SPLIT_K + split) * rows + n, acc, mask=n < rows)

    @triton.jit(do_not_specialize=["num_slots", "part_offset", "scale"])
    def _gemv_expand_kernel(part_ptr, b_ptr, y_ptr, w_ptr, rows, rank, width, num_slots,
                            part_offset, stride_y, stride_w, scale, SPLIT_K: tl.constexpr,
                            BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_L: tl.constexpr, ADD_INPUTS: tl.constexpr):  # fmt: skip
        """y[t, w] (+)= scale * weight(t) * sum_r B[slot(t) * rank + r, w] * h[t, r],
        h = the shrink's parts summed (this slice's rank columns, from part_offset).

        B is one slice's rank-major (slots * rank, width) matrix. Rows without
        a slot are not touched; with ADD_INPUTS False the others are written.
        """
        t, wb = tl.program_id(0), tl.program_id(1)
        slot, weight = _row_slot(w_ptr, t, stride_w, num_slots, BLOCK_L)
        if slot >= 0:
            cols = wb * BLOCK_W + tl.arange(0, BLOCK_W)
            c_in = cols < width
            acc = tl.zeros([BLOCK_W], dtype=tl.float32)
            parts = part_ptr + t * SPLIT_K * rows + part_offset
            for r0 in range(0, rank, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                r_in = r < rank
                h = tl.zeros([BLOCK_R], dtype=tl.float32)
                for split in range(SPLIT_K):
                    h += tl.load(parts + split * rows + r, mask=r_in, other=0.0)
                b_rows = b_ptr + (slot * rank + r).to(tl.int64)[:, None] * width
                b = tl.load(b_rows + cols[None, :], mask=r_in[:, None] & c_in[None, :], other=0.0)
                acc += tl.sum(b.to(tl.float32) * h[:, None], axis=0)
            delta = acc * (weight * scale)
            out = y_ptr + t * stride_y + cols
            if ADD_INPUTS:
                old = tl.load(out, mask=c_in, other=0.0)
                delta += old.to(tl.float32)
            tl.store(out, delta.to(y_ptr.dtype.element_ty), mask=c_in)


def _gemv_fits(y, x, lora_a, lora_b, weights, plan=None) -> bool:
    """Whether a call takes the GEMV kernels: at most min(GEMV_MAX_TOKENS, slots)
    tokens, A in the shared layout, B rank-major, unit column strides (shapes and
    strides only, never values). The token count first: a prefill call is out at once."""
    if not GEMV_ENABLED or x.dim() != 2 or not 0 < x.size(0) <= GEMV_MAX_TOKENS:
        return False
    plan = plan or layer_plan(lora_a, lora_b)
    return (
        x.size(0) <= plan.slots
        and x.stride(1) == 1
        and y.stride(1) == 1
        and plan.a is not None
        and plan.b is not None
        and plan.hidden == x.size(1)
        and y.size(1) >= sum(plan.widths)
        and weights.size(0) >= x.size(0)
        and weights.size(1) == plan.slots
        and weights.stride(1) == 1
    )


def gemv_linear(y, x, lora_a, lora_b, weights, scale, add_inputs, plan=None) -> bool:
    """add_lora_linear through the GEMV kernels; False (nothing done) when the call
    does not fit them or Triton cannot be imported.

    One shrink launch for all slices (split over the hidden size into fp32
    parts, a buffer of tokens x GEMV_SPLIT_K x slices*rank from the
    allocator, the CUDA graph's pool when captured), one expand launch per
    slice, which sums the parts: deterministic, no atomics. Each row reads
    only its own slot's A and B, found in the batch's slot weights (so a
    stale vLLM mapping is never read) and multiplied by its weight (NaN for
    a bad adapter).
    """
    plan = plan or layer_plan(lora_a, lora_b)
    if triton is None or not _gemv_fits(y, x, lora_a, lora_b, weights, plan):
        return False
    a = plan.a
    num_tokens, hidden = x.shape
    num_slots, rank = plan.slots, plan.rank
    rows = len(lora_a) * rank
    parts = torch.empty(num_tokens, GEMV_SPLIT_K, rows, dtype=torch.float32, device=x.device)
    blocks = -(-hidden // GEMV_BLOCK_K)
    per_split = -(-blocks // GEMV_SPLIT_K) * GEMV_BLOCK_K
    grid = (num_tokens, -(-rows // GEMV_BLOCK_N), GEMV_SPLIT_K)
    _gemv_shrink_kernel[grid](
        x, a, weights, parts, hidden, rows, rank, num_slots, x.stride(0), weights.stride(0),
        per_split, SPLIT_K=GEMV_SPLIT_K, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K,
        BLOCK_L=GEMV_BLOCK_L, num_warps=GEMV_NUM_WARPS,
    )  # fmt: skip
    block_r = gemv_block_r(rank)
    offset = 0
    for s, b in enumerate(plan.b):
        width = b.size(1)
        grid = (num_tokens, -(-width // GEMV_BLOCK_W))
        _gemv_expand_kernel[grid](
            parts, b, y[:, offset:], weights, rows, rank, width, num_slots, s * rank,
            y.stride(0), weights.stride(0), float(scale), SPLIT_K=GEMV_SPLIT_K,
            BLOCK_W=GEMV_BLOCK_W, BLOCK_R=block_r, BLOCK_L=GEMV_BLOCK_L,
            ADD_INPUTS=bool(add_inputs), num_warps=GEMV_NUM_WARPS,
        )  # fmt: skip
        offset += width
    return True


def gemv_block_r(rank: int) -> int:
    """The expand's rank rows per step: the rank rounded up to a power of 2, 16 to
    GEMV_MAX_BLOCK_R (a larger rank takes several steps). 16, 32, 64 or 128."""
    return min(max(16, 1 << (rank - 1).bit_length()), GEMV_MAX_BLOCK_R)


def _gemv_device(x) -> bool:
    """Whether the GEMV kernels run where x is: a CUDA device, or the CPU under
    Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests run them)."""
    if x.is_cuda:
        return True
    kernels = _gemv_kernels() if x.device.type == "cpu" else None
    return kernels is not None and type(kernels[0]).__name__ == "InterpretedFunction"


def _linear(y, x, lora_a, lora_b, weights, reduce_weights, no_lora, no_lora_flag, scale,
            add_inputs, active=None):  # fmt: skip
    """y[:, slice s] (+)= scale * (x @ A_s[slot].T) @ B_s[slot].T, per token; -1 rows untouched.

    `active`: the batch's ActiveSlots tensors (index, state_cpu), or None.
    """
    if no_lora_flag.item():  # a CPU tensor, as the Triton ops check it
        return
    plan = layer_plan(lora_a, lora_b)
    if _gemv_device(x) and gemv_linear(y, x, lora_a, lora_b, weights, scale, add_inputs, plan):
        return
    num_tokens = x.size(0)
    no_lora = no_lora[:num_tokens]
    if _splits(x, lora_a, reduce_weights, plan):
        h = _split_shrink(x, plan.a, reduce_weights, plan.slots)
        _add_expand(y, h, plan.b_matrix(lora_b, 0), 0, no_lora, scale, add_inputs)
        return
    slots = active_slots(x, active, plan)
    shrunk = _weighted_shrink(x, lora_a, weights, slots, plan.a_matrix(lora_a))
    offset = 0
    for s, width in enumerate(plan.widths):
        b = _b_matrix(plan.b_matrix(lora_b, s), plan.slots, slots)
        _add_expand(y, shrunk[:, s], b, offset, no_lora, scale, add_inputs)
        offset += width


def _add_expand(y, h, b, offset, no_lora, scale, add_inputs) -> None:
    """y[:, offset:offset+width] (+)= scale * h @ b; rows without LoRA keep their values.

    Those rows of h are 0 (and b is finite), so adding leaves them as they
    were; when writing (add_inputs False, vLLM's dual stream) they are kept
    explicitly.
    """
    out = y[:, offset : offset + b.size(1)]
    h = _cast(h, b.dtype)
    if add_inputs and out.dtype == b.dtype:
        out.addmm_(h, b, alpha=scale)  # one pass over out, like the Triton expand
        return
    delta = torch.mm(h, b)
    if scale != 1.0:
        delta.mul_(scale)
    if add_inputs:
        out.add_(delta)
    else:
        out.copy_(torch.where(no_lora, out, delta))


def _shrink(inputs, lora_a, output, mapping, lora_ids, no_lora_flag, scale) -> None:
    """output[s, t] = scale * inputs[t] @ A_s[slot(t)].T (float32 buffer, written)."""
    if no_lora_flag.item():
        return
    slices, num_tokens = len(lora_a), inputs.size(0)
    weights, _ = _batch_weights(mapping, lora_ids, lora_a[0].size(0), lora_a[0].dtype)
    shrunk = _weighted_shrink(inputs, lora_a, weights).view(
        num_tokens, slices, -1, lora_a[0].size(-2)
    )
    summed = shrunk.sum(dim=2, dtype=torch.float32)  # one slot per token: a pick, not a sum
    if scale != 1.0:
        summed.mul_(scale)
    output[:slices, :num_tokens].copy_(summed.transpose(0, 1))


def _expand(inputs, lora_b, output, mapping, lora_ids, no_lora_flag, offset, add_inputs):
    """output[t, slice s] (+)= inputs[s, t] @ B_s[slot(t)].T; rows without a slot untouched."""
    if no_lora_flag.item():
        return
    num_tokens = inputs.size(1)
    num_slots = lora_b[0].size(0)
    weights, no_lora = _batch_weights(mapping, lora_ids, num_slots, lora_b[0].dtype)
    for s, stacked in enumerate(lora_b):
        b = stacked_b(stacked)
        spread = inputs[s].to(b.dtype).unsqueeze(1) * weights.unsqueeze(2)
        _add_expand(output, spread.reshape(num_tokens, -1), b, offset, no_lora, 1.0, add_inputs)
        offset += b.size(1)


OPS_NAMESPACE = "patchkit_lora"
OPS_DEVICES = ("CPU", "CUDA")  # the dispatch keys the ops are registered for


def lora_shrink(
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    scaling: float,
) -> None:
    """The registered patchkit_lora::lora_shrink (through _IMPL: see _register_ops)."""
    _IMPL["shrink"](
        inputs, lora_a_weights, output_tensor, token_lora_mapping, lora_ids, no_lora_flag_cpu,
        scaling,
    )  # fmt: skip


def lora_expand(
    inputs: torch.Tensor,
    lora_b_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    offset_start: int,
    add_inputs: bool,
) -> None:
    """The registered patchkit_lora::lora_expand."""
    _IMPL["expand"](
        inputs, lora_b_weights, output_tensor, token_lora_mapping, lora_ids, no_lora_flag_cpu,
        offset_start, add_inputs,
    )  # fmt: skip


def add_lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    lora_b_weights: list[torch.Tensor],
    slot_weights: torch.Tensor,
    reduce_weights: torch.Tensor,
    no_lora: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    scale: float,
    add_inputs: bool,
    # typing.Optional: the spelling of torch's own table of schema types, which
    # infer_schema looks each annotation up in
    active_index: typing.Optional[torch.Tensor] = None,  # noqa: UP045
    active_state_cpu: typing.Optional[torch.Tensor] = None,  # noqa: UP045
) -> None:
    """The registered patchkit_lora::add_lora_linear."""
    active = None if active_index is None else (active_index, active_state_cpu)
    _IMPL["linear"](
        y, x, lora_a_weights, lora_b_weights, slot_weights, reduce_weights, no_lora,
        no_lora_flag_cpu, scale, add_inputs, active,
    )  # fmt: skip


def _no_output(*args) -> None:
    """The ops' fake (meta) implementation: they only write into their arguments."""


def _register_ops():
    """Register the ops once per process, opaque to torch.compile like vLLM's Triton ops.

    As ops that mutate their output (the same contract as vLLM's
    lora_shrink/lora_expand), torch.compile keeps each as one call and CUDA
    graphs capture the kernels inside; inductor never re-lowers them.
    Registered the way vLLM's direct_register_custom_op registers its own
    (a Library's define and impl, a fake for torch.compile), not with
    torch.library.custom_op, whose dispatch costs several times more host time
    a call (scripts/bench_lora_host.py; docs/evidence.md): every LoRA call of a
    prefill step too large for vLLM's CUDA graphs pays it. The registered
    functions call this module's through `_IMPL`, so a module imported again
    (tests, importlib.reload) serves the ops with its own functions and its
    own slot masks; the Library lives in _IMPL too, for the process (its
    registrations end with it).
    """
    _IMPL.update(shrink=_shrink, expand=_expand, linear=_linear)
    namespace = getattr(torch.ops, OPS_NAMESPACE)
    if "library" not in _IMPL and not hasattr(namespace, "add_lora_linear"):
        library = _IMPL["library"] = torch.library.Library(OPS_NAMESPACE, "FRAGMENT")
        for func, mutates in (
            (lora_shrink, ("output_tensor",)),
            (lora_expand, ("output_tensor",)),
            (add_lora_linear, ("y",)),
        ):
            name = func.__name__
            library.define(name + torch.library.infer_schema(func, mutates_args=mutates))
            for key in OPS_DEVICES:
                library.impl(name, func, key)
            torch.library.register_fake(f"{OPS_NAMESPACE}::{name}", _no_output, lib=library)
    return (
        namespace.lora_shrink.default,
        namespace.lora_expand.default,
        namespace.add_lora_linear.default,
    )


# One dict per process, shared by every import of this module (see _register_ops).
_IMPL: dict = sys.modules.setdefault(
    "patchkit_lora_matmul_impl", types.ModuleType("patchkit_lora_matmul_impl")
).__dict__
_SHRINK_OP, _EXPAND_OP, _LINEAR_OP = _register_ops()


def torch_lora_shrink(
    inputs: torch.Tensor,  # (tokens, hidden)
    lora_a_weights: list[torch.Tensor],  # each (max_loras, [1,] rank, hidden)
    output_tensor: torch.Tensor,  # (slices, tokens, rank), written, not added to
    token_lora_mapping: torch.Tensor,  # (tokens,), slot per token, -1 = none
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,  # (max_loras + 1,), this batch's active slots, -1 padded
    no_lora_flag_cpu: torch.Tensor,
    num_active_loras: torch.Tensor,
    scaling: float,
) -> None:
    """Drop-in for vLLM's lora_shrink (same positional arguments)."""
    _SHRINK_OP(
        inputs,
        list(lora_a_weights),
        output_tensor,
        token_lora_mapping,
        lora_ids,
        no_lora_flag_cpu,
        float(scaling),
    )


def torch_lora_expand(
    inputs: torch.Tensor,  # (slices, tokens, rank), float32 or the model dtype
    lora_b_weights: list[torch.Tensor],  # each (max_loras, [1,] out_slice, rank)
    output_tensor: torch.Tensor,  # (tokens, >= offset_start + sum(out_slice))
    token_lora_mapping: torch.Tensor,  # (tokens,), slot per token, -1 = none
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,  # (max_loras + 1,), this batch's active slots, -1 padded
    no_lora_flag_cpu: torch.Tensor,
    num_active_loras: torch.Tensor,
    offset_start: int = 0,
    add_inputs: bool = False,
) -> None:
    """Drop-in for vLLM's lora_expand (same positional and keyword arguments)."""
    _EXPAND_OP(
        inputs,
        list(lora_b_weights),
        output_tensor,
        token_lora_mapping,
        lora_ids,
        no_lora_flag_cpu,
        int(offset_start),
        bool(add_inputs),
    )


# ----- what punica_gpu.py installs -----


def install_torch_path(cls):
    """Class decorator of PunicaWrapperGPU: the torch path, when it is the backend.

    Adds `patchkit_adopt_layer` (called by BaseLayerWithLoRA.set_mapping),
    rebuilds the slot weights in `update_metadata`, and replaces
    `add_lora_linear`; its signature is the same in every release
    (VLLM-RELEASES.md), and `add_inputs` is read from kwargs as 0.20+ does
    (0.17-0.19 callers never pass it).
    """
    if LORA_BACKEND != "torch":
        return cls
    init, update_metadata = cls.__init__, cls.update_metadata

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # Only the per-token metadata: the per-prompt one (lm_head LoRA,
        # classifier heads) serves one call per batch, outside the graphs,
        # which builds its masks itself.
        self.patchkit_token_masks = masks_for(self.token_mapping_meta)

    def adopt_layer_of(self, layer):
        adopt_layer(layer, self.patchkit_token_masks)

    def update_metadata_and_masks(self, *args, **kwargs):
        update_metadata(self, *args, **kwargs)
        self.patchkit_token_masks.update(self.token_lora_indices.size(0))

    def add_lora_linear(
        self,
        y,
        x,
        lora_a_stacked,
        lora_b_stacked,
        scale,
        output_slices,
        *,
        buffer=None,
        **kwargs,
    ) -> None:
        """y[:, slices] += scale * x @ A[slot].T @ B[slot].T per token, as vLLM's."""
        assert len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices)
        assert buffer is None, "add_lora_linear makes its own buffer"
        add_inputs = kwargs.pop("add_inputs", True)
        masks, dtype = self.patchkit_token_masks, lora_a_stacked[0].dtype
        _LINEAR_OP(
            y.view(-1, y.shape[-1]),
            x.view(-1, x.shape[-1]),
            list(lora_a_stacked),
            list(lora_b_stacked),
            masks.weights[dtype],
            masks.reduce_weights[dtype],
            masks.no_lora,
            self.token_mapping_meta.no_lora_flag_cpu,
            float(scale),
            bool(add_inputs),
            masks.active.index,
            masks.active.state_cpu,
        )

    cls.__init__ = __init__
    cls.update_metadata = update_metadata_and_masks
    cls.add_lora_linear = add_lora_linear
    cls.patchkit_adopt_layer = adopt_layer_of
    return cls
