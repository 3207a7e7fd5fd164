"""The torch path's grouped route (PATCHKIT_LORA_GROUPED=1) through vLLM's real wrapper, on CPU.

Prefill-sized add_lora_linear calls sort the batch's tokens by slot once (in
update_metadata) and run one torch._grouped_mm per slot and slice, so each token
meets only its own adapter. On the CPU torch runs _grouped_mm by its reference
loop, so these tests check what the route computes and when it is taken, against
a float64 reference token by token from the adapters' own weights and against
the GEMM route; its speed is for the GPU host (scripts/research/prefill-lora/).
GROUPED_MIN_TOKENS is lowered here so that small batches take the route.
"""

from __future__ import annotations

import logging
import random

import pytest

from tests.conftest import assert_close_to, same_bits
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
def grouped(request, tmp_path, monkeypatch):
    """(version, punica_gpu, the path module's globals) with the grouped route on."""
    version = request.param
    monkeypatch.setenv("PATCHKIT_LORA_GROUPED", "1")
    with installed(version, tmp_path, monkeypatch):
        punica_gpu = load_wrapper_module(version, tmp_path)
        ops = punica_gpu.torch_lora_shrink.__globals__
        monkeypatch.setitem(ops, "GROUPED_MIN_TOKENS", MIN_TOKENS)
        yield version, punica_gpu, ops


def taken(ops, monkeypatch) -> list[bool]:
    """What grouped_linear answered for each add_lora_linear call from now on."""
    answers: list[bool] = []
    real = ops["grouped_linear"]

    def spy(*args):
        answers.append(real(*args))
        return answers[-1]

    monkeypatch.setitem(ops, "grouped_linear", spy)
    return answers


def call(wrapper, layer, x, y, widths, scale=1.0, **kwargs):
    out = y.clone()
    wrapper.add_lora_linear(out, x, layer.lora_a_stacked, layer.lora_b_stacked, scale, widths,
                            **kwargs)  # fmt: skip
    return out


def gemm_route(ops, monkeypatch, wrapper, layer, x, y, widths, scale=1.0):
    """The same call with the grouped route off: what the default set computes."""
    with monkeypatch.context() as mp:
        mp.setitem(ops, "GROUPED_ENABLED", False)
        return call(wrapper, layer, x, y, widths, scale)


@pytest.mark.parametrize("grouped", FAMILIES, indirect=True)
def test_every_slice_count_matches_the_reference_and_the_gemm_route(grouped, monkeypatch):
    """1-4 slices (Qwen3.5's in_proj_qkvz has 4), adapters of ranks 4-16 zero-padded
    as vLLM pads them, an empty slot, rows without a slot: the grouped route is
    taken, LoRA rows as the float64 reference and the GEMM route, the others bit
    for bit, the scale applied."""
    version, punica_gpu, ops = grouped
    answers = taken(ops, monkeypatch)
    for widths in ((80,), (64, 32), (64, 32, 48), (64, 32, 48, 16)):
        wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths, loaded=(0, 1, 3),
                                                      tokens=40, seed=len(widths))  # fmt: skip
        slots[5] = 2  # slot 2 is empty
        update(wrapper, punica_gpu, slots, SLOTS)
        out = call(wrapper, layer, x, y, widths, scale=0.5)
        assert answers[-1] is True, widths
        rows = torch.tensor([s in adapters for s in slots])
        loaded = [s if s in adapters else -1 for s in slots]
        expected = y.double() + reference(x, loaded, adapters, widths, 0.5)
        assert_close_to(out[rows], expected[rows], torch.bfloat16)
        gemm = gemm_route(ops, monkeypatch, wrapper, layer, x, y, widths, 0.5)
        assert_close_to(out[rows], gemm[rows].double(), torch.bfloat16)
        assert same_bits(out[~rows], y[~rows])  # no slot, or the empty one


@pytest.mark.parametrize("grouped", FAMILIES, indirect=True)
def test_a_bad_adapter_reaches_only_its_own_rows(grouped, monkeypatch, caplog):
    """inf in one slot's B, NaN in another's A, loaded through vLLM's set_lora and the
    path's check: their rows come out NaN in every slice, every other row as the
    reference (rows without a slot bit for bit), on the grouped route too."""
    version, punica_gpu, ops = grouped
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
    rnd = random.Random(5)
    slots = [rnd.choice([-1, 0, 1, 2, 3]) for _ in range(24)]
    update(wrapper, punica_gpu, slots, SLOTS)
    out = call(wrapper, layer, x, y, widths)
    assert answers == [True]
    expected = y.double() + reference(x, slots, adapters, widths)
    good = [t for t, s in enumerate(slots) if s in (0, 2)]
    assert_close_to(out[good], expected[good], torch.bfloat16)
    none = [t for t, s in enumerate(slots) if s == -1]
    assert same_bits(out[none], y[none])
    for bad in (1, 3):
        assert torch.isnan(out[[t for t, s in enumerate(slots) if s == bad]]).all()


@pytest.mark.parametrize("grouped", ["0.26.0"], indirect=True)
def test_a_row_whose_slot_is_out_of_range_keeps_its_values(grouped, monkeypatch):
    """A mapping value past the slots (no vLLM batch should hold one) gives its row no
    slot weight on the GEMM route; on the grouped route the row still joins a group,
    so that nothing unwritten by _grouped_mm is added into y: its row is unchanged."""
    version, punica_gpu, ops = grouped
    answers = taken(ops, monkeypatch)
    widths = (64, 32)
    wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths, tokens=24)
    wrapper.token_mapping_meta.token_lora_mapping[3] = SLOTS + 5
    wrapper.patchkit_token_masks.update(24)
    out = call(wrapper, layer, x, y, widths)
    assert answers == [True]
    assert same_bits(out[3], y[3])
    slots = [s if t != 3 else -1 for t, s in enumerate(slots)]
    rows = torch.tensor(slots) >= 0
    expected = y.double() + reference(x, slots, adapters, widths)
    assert_close_to(out[rows], expected[rows], torch.bfloat16)


@pytest.mark.parametrize("grouped", ["0.17.0", "0.26.0", "0.32.0"], indirect=True)
def test_the_route_is_taken_only_where_it_fits(grouped, monkeypatch):
    """Fewer tokens than GROUPED_MIN_TOKENS, a dual-stream write, float16 weights, or
    x of another token count than the batch sorted: the GEMM route, same results."""
    version, punica_gpu, ops = grouped
    answers = taken(ops, monkeypatch)
    widths = (64, 32)
    for tokens, expect in ((MIN_TOKENS - 1, False), (MIN_TOKENS, True)):
        wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths, tokens=tokens)
        out = call(wrapper, layer, x, y, widths)
        assert answers[-1] is expect, tokens
        rows = torch.tensor(slots) >= 0
        expected = y.double() + reference(x, slots, adapters, widths)
        assert_close_to(out[rows], expected[rows], torch.bfloat16)
    wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths, tokens=30)
    if "add_inputs" in punica_gpu.PunicaWrapperGPU.add_lora_linear.__code__.co_varnames:
        call(wrapper, layer, x, y, widths, add_inputs=False)
        assert answers[-1] is False  # the dual stream writes: the GEMM route keeps other rows
    call(wrapper, layer, x[:29], y[:29], widths)  # padded or cut: not the batch sorted
    assert answers[-1] is False
    half = Layer(version, widths, SLOTS, RANK, HIDDEN, dtype=torch.float16)
    half.set_mapping(wrapper)
    for slot, weights in adapters.items():
        half.load(slot, *weights)
    update(wrapper, punica_gpu, slots, SLOTS)
    out = call(wrapper, half, x.half(), y.half(), widths)
    assert answers[-1] is False
    rows = torch.tensor(slots) >= 0
    expected = y.double() + reference(x, slots, adapters, widths)
    assert_close_to(out[rows], expected[rows], torch.float16)


@pytest.mark.parametrize("grouped", ["0.26.0"], indirect=True)
def test_a_smaller_batch_or_one_without_lora_after_a_sorted_one(grouped, monkeypatch):
    """The order is the batch's own: after a sorted batch, a batch below the bound or
    without LoRA has none (rows_cpu 0), runs nothing of it and changes nothing."""
    version, punica_gpu, ops = grouped
    answers = taken(ops, monkeypatch)
    widths = (64, 32)
    wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths, tokens=40)
    masks = wrapper.patchkit_token_masks
    call(wrapper, layer, x, y, widths)
    assert answers == [True] and masks.grouped.rows_cpu.item() == 40
    update(wrapper, punica_gpu, slots[:8], SLOTS)
    assert masks.grouped.rows_cpu.item() == 0
    out = call(wrapper, layer, x[:8], y[:8], widths)
    assert answers[-1] is False
    rows = torch.tensor(slots[:8]) >= 0
    expected = y[:8].double() + reference(x[:8], slots[:8], adapters, widths)
    assert_close_to(out[rows], expected[rows], torch.bfloat16)
    update(wrapper, punica_gpu, [-1] * 40, SLOTS)
    assert masks.grouped.rows_cpu.item() == 0
    assert same_bits(call(wrapper, layer, x, y, widths), y)


@pytest.mark.parametrize("grouped", ["0.26.0"], indirect=True)
def test_compiled_once_it_reads_each_batchs_order_at_run_time(grouped, monkeypatch):
    """torch.compile (fullgraph, a dynamic token count, as vLLM compiles the model)
    keeps the op opaque: two batches of different sizes and mixes through one graph
    give the eager results, so nothing of the first batch is baked in."""
    version, punica_gpu, ops = grouped
    answers = taken(ops, monkeypatch)
    widths = (64, 32)
    wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths, tokens=48)
    forward, compiled = compiled_call(wrapper, layer, widths)
    for tokens, seed in ((48, 1), (33, 2)):
        mix = random.Random(seed)
        batch = [mix.choice([-1, *adapters]) for _ in range(tokens)]
        update(wrapper, punica_gpu, batch, SLOTS)
        graph = compiled(x[:tokens], y[:tokens].clone())
        eager = forward(x[:tokens], y[:tokens].clone())
        assert same_bits(graph, eager), tokens
        rows = torch.tensor(batch) >= 0
        expected = y[:tokens].double() + reference(x[:tokens], batch, adapters, widths)
        assert_close_to(graph[rows], expected[rows], torch.bfloat16)
    assert answers and all(answers)


@pytest.mark.parametrize("version", ["0.26.0"])
def test_off_unless_set_to_1_and_then_nothing_is_kept_for_it(version, tmp_path, monkeypatch):
    """Unset (the default) or any other value: no order buffers, the op gets none, and
    every call takes the routes it took before."""
    for value in (None, "0", "yes"):
        if value is None:
            monkeypatch.delenv("PATCHKIT_LORA_GROUPED", raising=False)
        else:
            monkeypatch.setenv("PATCHKIT_LORA_GROUPED", value)
        with installed(version, tmp_path / str(value), monkeypatch):
            punica_gpu = load_wrapper_module(version, tmp_path / str(value))
            ops = punica_gpu.torch_lora_shrink.__globals__
            assert ops["GROUPED_ENABLED"] is False, value
            answers = taken(ops, monkeypatch)
            wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, (64, 32), tokens=40)
            assert wrapper.patchkit_token_masks.grouped is None
            call(wrapper, layer, x, y, (64, 32))
            assert answers == [], value
