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
import subprocess
import sys
import weakref

import pytest

from tests.conftest import REPO, TORCH_PATH_FAMILIES, assert_close_to, same_bits
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


@pytest.mark.parametrize("wrapper_module", TORCH_PATH_FAMILIES, indirect=True)
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


@pytest.mark.parametrize("wrapper_module", TORCH_PATH_FAMILIES, indirect=True)
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


@pytest.mark.parametrize("wrapper_module", TORCH_PATH_FAMILIES, indirect=True)
def test_strides_changed_in_place_get_a_new_plan(wrapper_module):
    """A tensor re-strided in place keeps its address (`as_strided_`): the plan checks
    shape and strides too, not the address alone, so the call reads the new layout."""
    version, punica_gpu, ops = wrapper_module
    widths = (64, 32, 48)
    wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths)
    call(wrapper, layer, x, y, widths)
    plan = layer.lora_a_stacked[0].__dict__[ops["PLAN_ATTR"]]
    b = layer.lora_b_stacked[1]
    row_major = b.contiguous()  # the same values, in (slots, 1, width, rank) order
    address = b.data_ptr()
    b.as_strided_(b.shape, row_major.stride())
    b.copy_(row_major)
    assert b.data_ptr() == address and not ops["_b_is_rank_major"](b)
    assert_result(call(wrapper, layer, x, y, widths), y, x, slots, adapters, widths)
    assert layer.lora_a_stacked[0].__dict__[ops["PLAN_ATTR"]] is not plan


@pytest.mark.parametrize("wrapper_module", ["0.26.0", "0.32.0"], indirect=True)
def test_a_plan_made_under_inference_mode_serves_a_call_with_autograd(wrapper_module):
    """vLLM's forwards run under inference_mode; the plan made there is of normal tensors,
    so a later call with an input that needs gradients (a test, a user's own code) works
    as it did before the plan."""
    version, punica_gpu, ops = wrapper_module
    for widths in WIDTHS:
        tokens = tokens_for(widths)
        wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths, tokens=tokens)
        with torch.inference_mode():
            call(wrapper, layer, x, y, widths)
        plan = layer.lora_a_stacked[0].__dict__[ops["PLAN_ATTR"]]
        assert not any(m.is_inference() for m in (plan.a, *plan.b))
        out = call(wrapper, layer, x.clone().requires_grad_(), y, widths)
        assert_result(out.detach(), y, x, slots, adapters, widths)


OPS = {"lora_shrink": "output_tensor", "lora_expand": "output_tensor", "add_lora_linear": "y"}


@pytest.mark.parametrize("wrapper_module", ["0.26.0"], indirect=True)
def test_the_ops_are_registered_for_cpu_cuda_and_fake_and_write_only_their_output(
    wrapper_module,
):
    """The registration itself: a kernel for CPU and CUDA and a fake (Meta: torch.compile
    traces with it), and in the schema one written argument, the output, as vLLM's
    lora_shrink/lora_expand declare theirs (torch.compile keeps the write)."""
    for name, written in OPS.items():
        qualified = f"patchkit_lora::{name}"
        for key in ("CPU", "CUDA", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key), (name, key)
        schema = getattr(torch.ops.patchkit_lora, name).default._schema
        writes = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert writes == [written], (name, writes)
        assert not schema.returns


REIMPORT = """
import sys
from pathlib import Path
import torch
from tests.conftest import created_source, module_from_source
module = "vllm/lora/punica_wrapper/patchkit_lora_matmul.py"
source = created_source("matmul-add-lora-linear", module)
first = module_from_source("first_copy", source, Path(sys.argv[1]))
del sys.modules["patchkit_lora_matmul_impl"]  # the ops' table gone, the ops still registered
second = module_from_source("second_copy", source, Path(sys.argv[1]))
flag, y = torch.tensor(True), torch.zeros(2, 4)
torch.ops.patchkit_lora.add_lora_linear(y, torch.ones(2, 4), [torch.ones(1, 1, 2, 4)],
    [torch.ones(1, 1, 4, 2)], torch.ones(2, 1), torch.ones(2, 1, 8), torch.ones(2, 1,
    dtype=torch.bool), flag, 1.0, True)
print("ok", y.abs().sum().item())
"""


def test_a_second_import_after_the_ops_table_is_gone_reuses_the_registered_ops(tmp_path):
    """The ops are registered once a process; a module imported again when the table
    that holds the Library is gone (a reloaded worker's sys.modules) finds them in
    torch.ops instead of defining them twice, which torch refuses."""
    done = subprocess.run([sys.executable, "-c", REIMPORT, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "0.0"]  # the no-LoRA flag: y untouched
