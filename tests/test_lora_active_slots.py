"""The torch path's GEMMs narrowed to the batch's own slots, through vLLM's real wrapper, on CPU.

A prefill-sized add_lora_linear call whose batch uses at most half of the slots
runs the GEMMs of those slots only (ActiveSlots, built in update_metadata from
vLLM's own active_lora_ids). These tests check what it computes and when it is
taken, against a float64 reference token by token from the adapters' own
weights and against the GEMM route over every slot; its speed is for the GPU
host (prefill-lora/ in docs/evidence/research-prototypes.tar.xz). ACTIVE_MIN_TOKENS
and ACTIVE_MIN_WORK are lowered here so that small batches take it (but for the
test of the work rule), and SPLIT_K_MAX_TOKENS below it, as it is in the module
(256 against 512), so that one-slice calls reach the GEMM route too.
"""

from __future__ import annotations

import contextlib
import logging
import random

import pytest

from tests.conftest import TORCH_PATH_FAMILIES, assert_close_to, same_bits
from tests.punica_harness import (
    FAMILIES,
    HIDDEN,
    RANK,
    SLOTS,
    Layer,
    adapter,
    compiled_call,
    installed,
    load_wrapper_module,
    reference,
    setup,
    update,
)

torch = pytest.importorskip("torch", reason="the torch LoRA path needs torch (the test extra)")

MIN_TOKENS = 16


@pytest.fixture
def narrowed(request, tmp_path, monkeypatch):
    """(version, punica_gpu, the path module's globals), ACTIVE_MIN_TOKENS lowered."""
    version = request.param
    with installed(version, tmp_path, monkeypatch):
        punica_gpu = load_wrapper_module(version, tmp_path)
        ops = punica_gpu.torch_lora_shrink.__globals__
        monkeypatch.setitem(ops, "ACTIVE_MIN_TOKENS", MIN_TOKENS)
        monkeypatch.setitem(ops, "ACTIVE_MIN_WORK", 0)
        monkeypatch.setitem(ops, "SPLIT_K_MAX_TOKENS", MIN_TOKENS - 1)
        yield version, punica_gpu, ops


def taken(ops, monkeypatch) -> list[list[int] | None]:
    """The slots each add_lora_linear call's GEMMs were narrowed to (None: every slot)."""
    answers: list[list[int] | None] = []
    real = ops["active_slots"]

    def spy(*args):
        index = real(*args)
        answers.append(None if index is None else index.tolist())
        return index

    monkeypatch.setitem(ops, "active_slots", spy)
    return answers


def batch(tokens: int, used: tuple[int, ...], seed: int) -> list[int]:
    """A batch's slot per token: rows of the slots in `used` and rows without one."""
    mix = random.Random(seed)
    slots = [mix.choice([-1, *used]) for _ in range(tokens)]
    slots[: len(used)] = used  # every slot of `used` has a row
    return slots


def call(wrapper, layer, x, y, widths, scale=1.0, **kwargs):
    out = y.clone()
    wrapper.add_lora_linear(out, x, layer.lora_a_stacked, layer.lora_b_stacked, scale, widths,
                            **kwargs)  # fmt: skip
    return out


def every_slot(ops, monkeypatch, wrapper, layer, x, y, widths, scale=1.0, **kwargs):
    """The same call on the GEMM route over every slot (narrowing off)."""
    with monkeypatch.context() as mp:
        mp.setitem(ops, "active_slots", lambda *args: None)
        return call(wrapper, layer, x, y, widths, scale, **kwargs)


def check(out, y, x, slots, adapters, widths, scale=1.0, add_inputs=True):
    """LoRA rows as the float64 reference; rows without an adapter bit for bit y
    (adding) or as they were (writing keeps them too)."""
    rows = torch.tensor([s in adapters for s in slots])
    loaded = [s if s in adapters else -1 for s in slots]
    start = y.double() if add_inputs else torch.zeros_like(y, dtype=torch.float64)
    expected = start + reference(x, loaded, adapters, widths, scale)
    assert_close_to(out[rows], expected[rows], torch.bfloat16)
    assert same_bits(out[~rows], y[~rows])


@pytest.mark.parametrize("narrowed", FAMILIES, indirect=True)
def test_every_slice_count_matches_the_reference_and_every_slot(narrowed, monkeypatch):
    """1-4 slices (Qwen3.5's in_proj_qkvz has 4), adapters of ranks 4-16 zero-padded
    as vLLM pads them, rows without a slot; a batch on one slot and on two (one of
    them empty), of the 4: narrowed to those slots, in order, LoRA rows as the
    float64 reference and as the GEMM route over every slot, the others bit for
    bit, the scale applied."""
    version, punica_gpu, ops = narrowed
    answers = taken(ops, monkeypatch)
    for widths in ((80,), (64, 32), (64, 32, 48), (64, 32, 48, 16)):
        for used in ((3,), (2, 1)):  # slot 2 is empty
            wrapper, layer, adapters, _, x, y = setup(
                version, punica_gpu, widths, loaded=(0, 1, 3), tokens=40, seed=len(widths)
            )
            slots = batch(40, used, seed=len(used))
            update(wrapper, punica_gpu, slots, SLOTS)
            out = call(wrapper, layer, x, y, widths, scale=0.5)
            assert answers[-1] == sorted(used), (widths, used)
            check(out, y, x, slots, adapters, widths, 0.5)
            full = every_slot(ops, monkeypatch, wrapper, layer, x, y, widths, 0.5)
            rows = torch.tensor([s in adapters for s in slots])
            assert_close_to(out[rows], full[rows].double(), torch.bfloat16)


@pytest.mark.parametrize("narrowed", ["0.26.0", "0.32.0"], indirect=True)
def test_a_dual_stream_write_is_narrowed_too_and_keeps_other_rows(narrowed, monkeypatch):
    """add_inputs False (vLLM's dual stream writes into a zeroed output): the LoRA rows
    are the delta alone, rows without a slot keep what they held."""
    version, punica_gpu, ops = narrowed
    if "add_inputs" not in punica_gpu.PunicaWrapperGPU.add_lora_linear.__code__.co_varnames:
        pytest.skip("this family always adds")
    answers = taken(ops, monkeypatch)
    widths = (64, 32, 48)
    wrapper, layer, adapters, _, x, y = setup(version, punica_gpu, widths, tokens=30)
    slots = batch(30, (0, 3), seed=4)
    update(wrapper, punica_gpu, slots, SLOTS)
    out = call(wrapper, layer, x, y, widths, add_inputs=False)
    assert answers == [[0, 3]]
    check(out, y, x, slots, adapters, widths, add_inputs=False)


@pytest.mark.parametrize("narrowed", FAMILIES, indirect=True)
def test_a_bad_adapter_reaches_only_its_own_rows(narrowed, monkeypatch, caplog):
    """inf in one slot's B, NaN in another's A, loaded through vLLM's set_lora and the
    path's check: a narrowed batch's rows of the bad slot come out NaN in every slice,
    the good slot's as the reference, rows without a slot bit for bit; a batch of the
    other bad slot alone the same."""
    version, punica_gpu, ops = narrowed
    answers = taken(ops, monkeypatch)
    widths = (64, 32)
    wrapper, layer, adapters, _, x, y = setup(version, punica_gpu, widths, loaded=(0, 1, 2, 3),
                                              tokens=24)  # fmt: skip
    bad_b, bad_a = adapter(91, widths, 8), adapter(92, widths, 8)
    bad_b[1][-1][3, 2] = float("inf")
    bad_a[0][0][1, 5] = float("nan")
    with caplog.at_level(logging.WARNING):
        layer.load(1, *bad_b)
        layer.load(3, *bad_a)
    for used, bad in (((0, 1), 1), ((3,), 3)):
        slots = batch(24, used, seed=bad)
        update(wrapper, punica_gpu, slots, SLOTS)
        out = call(wrapper, layer, x, y, widths)
        assert answers[-1] == list(used)
        assert torch.isnan(out[[t for t, s in enumerate(slots) if s == bad]]).all()
        good = [t for t, s in enumerate(slots) if s not in (-1, bad)]
        if good:
            expected = y.double() + reference(x, slots, adapters, widths)
            assert_close_to(out[good], expected[good], torch.bfloat16)
        none = [t for t, s in enumerate(slots) if s == -1]
        assert same_bits(out[none], y[none])


@pytest.mark.parametrize("narrowed", TORCH_PATH_FAMILIES, indirect=True)
def test_every_slot_where_narrowing_does_not_pay_or_is_off(narrowed, monkeypatch):
    """Fewer tokens than ACTIVE_MIN_TOKENS, more than half of the slots in use, x of
    another token count than the batch mapped, or PATCHKIT_LORA_ACTIVE_ONLY=0 (the
    module's ACTIVE_ONLY): every slot's GEMMs, the same results."""
    version, punica_gpu, ops = narrowed
    answers = taken(ops, monkeypatch)
    widths = (64, 32)
    wrapper, layer, adapters, _, x, y = setup(version, punica_gpu, widths, tokens=40)
    cases = (
        (MIN_TOKENS - 1, (0, 3), None),
        (MIN_TOKENS, (0, 3), [0, 3]),
        (40, (0, 2, 3), None),  # 3 of 4 slots
    )
    for tokens, used, expect in cases:
        slots = batch(tokens, used, seed=tokens)
        update(wrapper, punica_gpu, slots, SLOTS)
        out = call(wrapper, layer, x[:tokens], y[:tokens], widths)
        assert answers[-1] == expect, (tokens, used)
        check(out, y[:tokens], x[:tokens], slots, adapters, widths)
    slots = batch(40, (3,), seed=9)
    update(wrapper, punica_gpu, slots, SLOTS)
    call(wrapper, layer, x[:39], y[:39], widths)  # padded or cut: not the batch mapped
    assert answers[-1] is None
    monkeypatch.setitem(ops, "ACTIVE_ONLY", False)
    update(wrapper, punica_gpu, slots, SLOTS)
    out = call(wrapper, layer, x, y, widths)
    assert answers[-1] is None
    check(out, y, x, slots, adapters, widths)


@pytest.mark.parametrize("narrowed", ["0.26.0", "0.32.0"], indirect=True)
def test_a_call_is_narrowed_only_where_it_skips_enough_work(narrowed, monkeypatch):
    """ACTIVE_MIN_WORK: a call skipping fewer multiply-adds (tokens x idle slots x rank
    x (slices x hidden + widths)) keeps every slot; one skipping as many is narrowed.
    Layers of one batch are judged each by its own shapes."""
    version, punica_gpu, ops = narrowed
    answers = taken(ops, monkeypatch)
    widths = (64, 32, 48)
    wrapper, layer, adapters, _, x, y = setup(version, punica_gpu, widths, tokens=40)
    slots = batch(40, (0, 3), seed=8)
    update(wrapper, punica_gpu, slots, SLOTS)
    work = 40 * (SLOTS - 2) * RANK * (3 * HIDDEN + sum(widths))
    assert ops["skipped_work"](40, SLOTS - 2, layer.lora_a_stacked, layer.lora_b_stacked) == work
    for threshold, expect in ((work + 1, None), (work, [0, 3])):
        monkeypatch.setitem(ops, "ACTIVE_MIN_WORK", threshold)
        check(call(wrapper, layer, x, y, widths), y, x, slots, adapters, widths)
        assert answers[-1] == expect, threshold
    one = Layer(version, (64,), SLOTS, RANK, HIDDEN)  # a narrower layer of the same batch
    one.set_mapping(wrapper)
    one.load(0, [adapters[0][0][0]], [adapters[0][1][0]])
    call(wrapper, one, x, y[:, :64], (64,))
    assert answers[-1] is None


@pytest.mark.parametrize("narrowed", ["0.26.0", "0.32.0"], indirect=True)
def test_the_host_read_is_one_vllm_allows_and_none_inside_a_capture(narrowed, monkeypatch):
    """vLLM 0.28+ raises on a GPU wait outside gpu_sync_allowed when its sync check is
    on: the read of active_lora_ids is inside it (once a batch, and only for a batch of
    ACTIVE_MIN_TOKENS or more, where a call of the widest layer adopted could skip
    ACTIVE_MIN_WORK). Inside a CUDA graph capture nothing is read and no call
    is narrowed, whatever the state says: the graph replays for other batches."""
    version, punica_gpu, ops = narrowed
    answers = taken(ops, monkeypatch)
    entered = []

    @contextlib.contextmanager
    def allowed():
        entered.append(True)
        yield

    monkeypatch.setitem(ops, "_sync_allowed", allowed)
    widths = (64, 32)
    wrapper, layer, adapters, _, x, y = setup(version, punica_gpu, widths, tokens=40)
    state = wrapper.patchkit_token_masks.active.state_cpu
    entered.clear()
    update(wrapper, punica_gpu, batch(40, (3,), seed=1), SLOTS)
    assert entered == [True] and state.tolist() == [1, 40]
    update(wrapper, punica_gpu, batch(MIN_TOKENS - 1, (3,), seed=2), SLOTS)
    assert entered == [True]  # too few tokens: not read
    call(wrapper, layer, x, y, widths)  # the calls record the widest layer's work
    widest = RANK * (2 * HIDDEN + sum(widths))  # a token, a slot
    assert ops["_WIDEST"][wrapper.patchkit_token_masks.active.index.data_ptr()] == widest
    monkeypatch.setitem(ops, "ACTIVE_MIN_WORK", 40 * (SLOTS - 1) * widest + 1)
    update(wrapper, punica_gpu, batch(40, (3,), seed=1), SLOTS)
    assert entered == [True] and state.tolist() == [0, 0]  # no call could skip enough
    monkeypatch.setitem(ops, "ACTIVE_MIN_WORK", 0)
    slots = batch(40, (3,), seed=3)
    update(wrapper, punica_gpu, slots, SLOTS)
    monkeypatch.setitem(ops, "_capturing", lambda t: True)
    check(call(wrapper, layer, x, y, widths), y, x, slots, adapters, widths)
    assert answers[-1] is None
    entered.clear()
    update(wrapper, punica_gpu, slots, SLOTS)
    assert entered == [] and state.tolist() == [0, 0]


@pytest.mark.parametrize("narrowed", ["0.26.0"], indirect=True)
def test_the_bound_of_a_batch_is_the_widest_layer_that_called(narrowed, monkeypatch):
    """SlotMasks.may_narrow bounds a batch by the widest layer that has called
    add_lora_linear: a narrower layer calling after it does not lower the bound, and a
    layer attached but never calling (as lm_head, whose LoRA runs in add_lora_logits)
    does not raise it."""
    version, punica_gpu, ops = narrowed
    wide_widths, narrow_widths = (64, 32, 48), (16,)
    wrapper, wide, adapters, _, x, y = setup(version, punica_gpu, wide_widths, tokens=40)
    narrow = Layer(version, narrow_widths, SLOTS, RANK, HIDDEN)
    narrow.set_mapping(wrapper)
    never = Layer(version, (4096,), SLOTS, RANK, HIDDEN)  # attached, never called
    never.set_mapping(wrapper)
    update(wrapper, punica_gpu, batch(40, (0,), seed=4), SLOTS)
    call(wrapper, wide, x, y, wide_widths)
    call(wrapper, narrow, x, y[:, :16], narrow_widths)
    widest = RANK * (3 * HIDDEN + sum(wide_widths))
    assert ops["_WIDEST"][wrapper.patchkit_token_masks.active.index.data_ptr()] == widest
    masks = wrapper.patchkit_token_masks
    monkeypatch.setitem(ops, "ACTIVE_MIN_WORK", 40 * (SLOTS - 1) * widest)
    assert masks.may_narrow(40) and not masks.may_narrow(39)


@pytest.mark.parametrize("narrowed", ["0.26.0"], indirect=True)
def test_a_batch_after_a_narrowed_one_is_not_narrowed_by_it(narrowed, monkeypatch):
    """The slots are the batch's own: after a narrowed batch, a smaller batch, one on
    other slots, or one without LoRA is mapped afresh (a batch without LoRA runs no
    LoRA at all and changes nothing)."""
    version, punica_gpu, ops = narrowed
    answers = taken(ops, monkeypatch)
    widths = (64, 32)
    wrapper, layer, adapters, _, x, y = setup(version, punica_gpu, widths, tokens=40)
    state = wrapper.patchkit_token_masks.active.state_cpu
    update(wrapper, punica_gpu, batch(40, (0,), seed=1), SLOTS)
    assert state.tolist() == [1, 40]
    slots = batch(8, (0,), seed=2)
    update(wrapper, punica_gpu, slots, SLOTS)
    assert state.tolist() == [0, 0]
    check(call(wrapper, layer, x[:8], y[:8], widths), y[:8], x[:8], slots, adapters, widths)
    assert answers[-1] is None
    slots = batch(40, (3,), seed=3)
    update(wrapper, punica_gpu, slots, SLOTS)
    check(call(wrapper, layer, x, y, widths), y, x, slots, adapters, widths)
    assert answers[-1] == [3]
    update(wrapper, punica_gpu, [-1] * 40, SLOTS)
    assert state.tolist() == [0, 0]
    assert same_bits(call(wrapper, layer, x, y, widths), y)


@pytest.mark.parametrize("narrowed", ["0.26.0"], indirect=True)
def test_compiled_once_it_reads_each_batchs_slots_at_run_time(narrowed, monkeypatch):
    """torch.compile (fullgraph, a dynamic token count, as vLLM compiles the model)
    keeps the op opaque: batches of different sizes and slots through one graph give
    the eager results, narrowed as eager is, so nothing of the first batch is baked in."""
    version, punica_gpu, ops = narrowed
    answers = taken(ops, monkeypatch)
    widths = (64, 32)
    wrapper, layer, adapters, _, x, y = setup(version, punica_gpu, widths, tokens=48)
    forward, compiled = compiled_call(wrapper, layer, widths)
    for tokens, used in ((48, (0,)), (33, (2, 3)), (40, (0, 2, 3))):
        slots = batch(tokens, used, seed=tokens)
        update(wrapper, punica_gpu, slots, SLOTS)
        graph = compiled(x[:tokens], y[:tokens].clone())
        eager = forward(x[:tokens], y[:tokens].clone())
        assert same_bits(graph, eager), tokens
        assert answers[-2] == answers[-1] == (sorted(used) if len(used) <= 2 else None)
        check(graph, y[:tokens], x[:tokens], slots, adapters, widths)


@pytest.mark.parametrize("narrowed", ["0.26.0"], indirect=True)
def test_the_op_called_without_the_slots_runs_every_slot(narrowed, monkeypatch):
    """A graph compiled before the op had its active_* inputs calls it without them
    (their defaults are None): every slot's GEMMs, the same results."""
    version, punica_gpu, ops = narrowed
    answers = taken(ops, monkeypatch)
    widths = (64, 32)
    wrapper, layer, adapters, _, x, y = setup(version, punica_gpu, widths, tokens=40)
    slots = batch(40, (2,), seed=5)
    update(wrapper, punica_gpu, slots, SLOTS)
    masks, out = wrapper.patchkit_token_masks, y.clone()
    ops["_LINEAR_OP"](out, x, list(layer.lora_a_stacked), list(layer.lora_b_stacked),
                      masks.weights[torch.bfloat16], masks.reduce_weights[torch.bfloat16],
                      masks.no_lora, wrapper.token_mapping_meta.no_lora_flag_cpu, 1.0,
                      True)  # fmt: skip
    assert answers == [None]
    check(out, y, x, slots, adapters, widths)


@pytest.mark.parametrize("narrowed", ["0.26.0"], indirect=True)
def test_the_layers_of_another_dtype_are_narrowed_too(narrowed, monkeypatch):
    """float16 LoRA layers beside bf16 ones read their own slot weights, narrowed."""
    version, punica_gpu, ops = narrowed
    answers = taken(ops, monkeypatch)
    widths = (64, 32)
    wrapper, _, adapters, _, x, y = setup(version, punica_gpu, widths, tokens=30)
    half = Layer(version, widths, SLOTS, RANK, HIDDEN, dtype=torch.float16)
    half.set_mapping(wrapper)
    for slot, weights in adapters.items():
        half.load(slot, *weights)
    slots = batch(30, (2,), seed=6)
    update(wrapper, punica_gpu, slots, SLOTS)
    out = call(wrapper, half, x.half(), y.half(), widths)
    assert answers == [[2]]
    rows = torch.tensor([s in adapters for s in slots])
    expected = y.double() + reference(x, slots, adapters, widths)
    assert_close_to(out[rows], expected[rows], torch.float16)
    assert same_bits(out[~rows], y.half()[~rows])
