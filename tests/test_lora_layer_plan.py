"""A layer's LayerPlan: the stacked matrices its add_lora_linear calls read, laid out on
its first call and kept on its first A tensor, through vLLM's real wrapper and
set_lora, on CPU.

What it must keep: every call reads the adapters in the slots as they are now (a
set_lora after the plan was made, a tensor moved to new storage, a layout that
needs a copy), it allocates nothing (the matrices are the weights' own storage),
it dies with the layer, and compiled calls reuse it. References are float64,
token by token, from the adapters' own weights.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.conftest import assert_close_to, same_bits
from tests.punica_harness import (
    FAMILIES,
    SLOTS,
    adapter,
    compiled_call,
    installed,
    load_wrapper_module,
    reference,
    setup,
    update,
)

torch = pytest.importorskip("torch", reason="the torch LoRA path needs torch (the test extra)")

WIDTHS = ((80,), (64, 32, 48))


@pytest.fixture
def wrapper_module(request, tmp_path, monkeypatch):
    version = request.param
    with installed(version, tmp_path, monkeypatch):
        punica_gpu = load_wrapper_module(version, tmp_path)
        yield version, punica_gpu, punica_gpu.torch_lora_shrink.__globals__


def call(wrapper, layer, x, y, widths, scale=1.0):
    out = y.clone()
    wrapper.add_lora_linear(out, x, layer.lora_a_stacked, layer.lora_b_stacked, scale, widths)
    return out


def assert_result(out, y, x, slots, adapters, widths, scale=1.0):
    rows = torch.tensor(slots) >= 0
    expected = y.double() + reference(x, slots, adapters, widths, scale)
    assert_close_to(out[rows], expected[rows], torch.bfloat16)
    assert same_bits(out[~rows], y[~rows])


def tokens_for(widths) -> int:
    """A GEMM-route call (a one-slice call of few tokens takes the split shrink)."""
    return 300 if len(widths) == 1 else 23


@pytest.mark.parametrize("wrapper_module", FAMILIES, indirect=True)
def test_an_adapter_loaded_after_the_first_call_is_read_by_the_next(wrapper_module):
    """vLLM's set_lora writes into the weights; the plan's matrices are that storage."""
    version, punica_gpu, ops = wrapper_module
    for widths in WIDTHS:
        tokens = tokens_for(widths)
        wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths, tokens=tokens)
        assert_result(call(wrapper, layer, x, y, widths), y, x, slots, adapters, widths)
        plan = layer.lora_a_stacked[0].__dict__[ops["PLAN_ATTR"]]
        adapters[1] = adapter(101, widths, 8)  # a new slot, and another adapter in slot 2
        adapters[2] = adapter(102, widths, 16)
        layer.load(1, *adapters[1])
        layer.load(2, *adapters[2])
        slots = [(t % 5) - 1 for t in range(tokens)]  # -1, 0, 1, 2, 3, ...
        update(wrapper, punica_gpu, slots, SLOTS)
        adapters[3] = adapters.get(3)
        assert_result(call(wrapper, layer, x, y, widths), y, x, slots, adapters, widths)
        assert layer.lora_a_stacked[0].__dict__[ops["PLAN_ATTR"]] is plan  # the same plan


@pytest.mark.parametrize("wrapper_module", ["0.17.0", "0.26.0", "0.32.0"], indirect=True)
def test_the_plan_allocates_nothing_and_dies_with_the_layer(wrapper_module):
    """Its matrices are tensors on the weights' storage, not copies and not views (a view
    would hold the A tensor the plan hangs on: a cycle through C++ that gc cannot
    break, keeping the layer's weights alive for the process)."""
    version, punica_gpu, ops = wrapper_module
    widths = (64, 32, 48)
    wrapper, layer, _, _, x, y = setup(version, punica_gpu, widths)
    call(wrapper, layer, x, y, widths)
    plan = layer.lora_a_stacked[0].__dict__[ops["PLAN_ATTR"]]
    weights = [*layer.lora_a_stacked, *layer.lora_b_stacked]
    storages = {w.untyped_storage().data_ptr() for w in weights}
    for matrix in (plan.a, *plan.b):
        assert matrix.untyped_storage().data_ptr() in storages
        assert not matrix._is_view()
    assert plan.a.data_ptr() == layer.lora_a_stacked[0].data_ptr()
    for matrix, b in zip(plan.b, layer.lora_b_stacked, strict=True):
        assert matrix.data_ptr() == b.data_ptr()
    alive = weakref.ref(layer.lora_a_stacked[0])
    del plan, weights, matrix, b, layer
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("wrapper_module", ["0.17.0", "0.26.0", "0.32.0"], indirect=True)
def test_weights_moved_to_new_storage_get_a_new_plan(wrapper_module):
    """A tensor set_ to other storage (the weights replaced in place, not written) is seen
    on the next call, for A and for B."""
    version, punica_gpu, ops = wrapper_module
    for widths in WIDTHS:
        tokens = tokens_for(widths)
        wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths, tokens=tokens)
        call(wrapper, layer, x, y, widths)
        for stacked in (layer.lora_b_stacked[-1], layer.lora_a_stacked[0]):
            plan = layer.lora_a_stacked[0].__dict__[ops["PLAN_ATTR"]]
            moved = stacked.clone(memory_format=torch.preserve_format)
            moved.copy_(stacked)
            if stacked is layer.lora_a_stacked[0] and len(widths) > 1:
                moved = torch.cat([a.reshape(-1) for a in layer.lora_a_stacked])
                for s, a in enumerate(layer.lora_a_stacked):
                    a.set_(moved.untyped_storage(), s * a.numel(), a.shape, a.stride())
            else:
                stacked.set_(moved.untyped_storage(), 0, stacked.shape, stacked.stride())
            for a, b in zip(layer.lora_a_stacked, layer.lora_b_stacked, strict=True):
                a.mul_(2)  # the old storage keeps the old values: a stale plan reads those
                b.mul_(2)
            for slot, (a, b) in list(adapters.items()):
                adapters[slot] = ([t * 2 for t in a], [t * 2 for t in b])
            assert_result(call(wrapper, layer, x, y, widths), y, x, slots, adapters, widths)
            assert layer.lora_a_stacked[0].__dict__[ops["PLAN_ATTR"]] is not plan


@pytest.mark.parametrize("wrapper_module", ["0.17.0", "0.26.0"], indirect=True)
def test_a_layout_that_needs_a_copy_is_copied_on_every_call(wrapper_module):
    """A outside the shared storage and B not rank-major (set_ after the layer was
    adopted): the plan keeps no copy, so a set_lora after the first call is read."""
    version, punica_gpu, ops = wrapper_module
    widths = (64, 32)
    wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths)
    first = layer.lora_a_stacked[1]
    alone = first.clone()
    first.set_(alone.untyped_storage(), 0, alone.shape, alone.stride())
    b = layer.lora_b_stacked[0]
    row_major = b.contiguous()  # (slots, 1, width, rank) in its natural order
    b.set_(row_major.untyped_storage(), 0, b.shape, row_major.stride())
    assert not ops["_b_is_rank_major"](b)
    assert_result(call(wrapper, layer, x, y, widths), y, x, slots, adapters, widths)
    plan = layer.lora_a_stacked[0].__dict__[ops["PLAN_ATTR"]]
    assert plan.a is None and plan.b is None
    adapters[2] = adapter(202, widths, 8)
    layer.load(2, *adapters[2])
    assert_result(call(wrapper, layer, x, y, widths), y, x, slots, adapters, widths)


@pytest.mark.parametrize("wrapper_module", ["0.26.0", "0.32.0"], indirect=True)
def test_compiled_calls_reuse_the_plan(wrapper_module, monkeypatch):
    """torch.compile passes the layer's own tensors into the op: one plan for every call."""
    version, punica_gpu, ops = wrapper_module
    widths = (64, 32, 48)
    made = []
    real = ops["LayerPlan"]

    class Counted(real):
        __slots__ = ()

        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)

    monkeypatch.setitem(ops, "LayerPlan", Counted)
    wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths)
    eager, compiled = compiled_call(wrapper, layer, widths)
    for _ in range(3):
        out = compiled(x, y.clone())
        assert_result(out, y, x, slots, adapters, widths)
    assert made == [1]
