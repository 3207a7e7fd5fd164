"""The torch LoRA path through vLLM's real PunicaWrapperGPU, on CPU, in every patched release.

The add_lora_linear a layer calls (replaced by the patch), the
calls that keep vLLM's own methods (add_shrink/add_expand, i.e. _mcp_apply;
add_lora_embedding; add_lora_logits), the once-per-batch slot masks, the
weight layout kept in step with vLLM's real set_lora/reset_lora, NaN
containment and the step aside under VLLM_BATCH_INVARIANT. References are
float64, token by token, from the adapters' own weights.
"""

from __future__ import annotations

import logging
import random

import pytest
from packaging.version import Version

from tests.conftest import CATALOGUE, RELEASES, TORCH_PATH_FAMILIES, assert_close_to, same_bits
from tests.punica_harness import (
    FAMILIES,
    HIDDEN,
    PATCH,
    RANK,
    SLOTS,
    Layer,
    adapter,
    compiled_call,
    installed,
    load_wrapper_module,
    make_wrapper,
    reference,
    setup,
    update,
)

torch = pytest.importorskip("torch", reason="the torch LoRA path needs torch (the test extra)")

from patchkit.catalogue.model import Variant  # noqa: E402

PATCHED = [
    v for v in RELEASES if isinstance(CATALOGUE.get(PATCH).expected_for(Version(v)), Variant)
]


@pytest.fixture
def wrapper_module(request, tmp_path, monkeypatch):
    version = request.param
    with installed(version, tmp_path, monkeypatch):
        module = load_wrapper_module(version, tmp_path)
        yield version, module


def assert_close(result, expected):
    """bf16 results against a float64 reference (the weights here are bf16)."""
    assert_close_to(result, expected, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("wrapper_module", PATCHED, indirect=True)
def test_add_lora_linear_through_the_real_wrapper(wrapper_module):
    version, punica_gpu = wrapper_module
    for widths in ((80,), (64, 32, 48)):
        wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths)
        before = y.clone()
        wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, widths)
        rows = torch.tensor(slots) >= 0
        expected = before.double() + reference(x, slots, adapters, widths)
        assert_close(y[rows], expected[rows])
        assert same_bits(y[~rows], before[~rows])


@pytest.mark.parametrize("wrapper_module", ["0.17.0", "0.22.0", "0.26.0", "0.32.0"], indirect=True)
def test_one_slice_at_every_token_count_either_side_of_the_split(wrapper_module):
    """One slice: the split shrink up to SPLIT_K_MAX_TOKENS (8 parts to 64 tokens, 4
    beyond), the single GEMM above; the same results either way."""
    version, punica_gpu = wrapper_module
    ops = punica_gpu.torch_lora_shrink.__globals__
    for tokens in (1, 2, 64, 65, 256, 257, 300):
        wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, (80,), tokens=tokens,
                                                      seed=tokens)  # fmt: skip
        masks = wrapper.patchkit_token_masks
        split = ops["_splits"](x, list(layer.lora_a_stacked), masks.reduce_weights[x.dtype])
        assert split == (tokens <= ops["SPLIT_K_MAX_TOKENS"]), tokens
        before = y.clone()
        wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 0.5, (80,))
        rows = torch.tensor(slots) >= 0
        expected = before.double() + reference(x, slots, adapters, (80,), 0.5)
        assert_close(y[rows], expected[rows])
        assert same_bits(y[~rows], before[~rows])


@pytest.mark.parametrize("wrapper_module", ["0.17.0", "0.26.0"], indirect=True)
def test_a_layer_attached_after_a_batch_was_mapped_gets_that_batchs_weights(wrapper_module):
    """The slot weights of a dtype are kept from the first layer of that dtype on; one
    attached after update_metadata (as verify's kernel check and the benchmark do)
    finds them filled for the batch already mapped."""
    version, punica_gpu = wrapper_module
    wrapper = make_wrapper(punica_gpu, SLOTS)
    slots = [-1, 0, 1, 0, 1, -1, 0]
    update(wrapper, punica_gpu, slots, SLOTS)
    layer = Layer(version, (80,), SLOTS, RANK, HIDDEN)
    layer.set_mapping(wrapper)
    adapters = {slot: adapter(slot, (80,), RANK) for slot in (0, 1)}
    for slot, weights in adapters.items():
        layer.load(slot, *weights)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(len(slots), HIDDEN, generator=gen).to(torch.bfloat16)
    y = torch.zeros(len(slots), 80, dtype=torch.bfloat16)
    wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, (80,))
    rows = torch.tensor(slots) >= 0
    assert_close(y[rows], reference(x, slots, adapters, (80,))[rows])


@pytest.mark.parametrize("wrapper_module", ["0.26.0", "0.32.0"], indirect=True)
def test_dual_stream_writes_lora_rows_and_leaves_the_others(wrapper_module):
    """add_inputs=False (0.20+ dual stream): LoRA rows get the delta alone."""
    version, punica_gpu = wrapper_module
    widths = (64, 32)
    wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths)
    before = y.clone()
    wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 0.5, widths,
                            add_inputs=False)  # fmt: skip
    rows = torch.tensor(slots) >= 0
    assert_close(y[rows], reference(x, slots, adapters, widths, 0.5)[rows])
    assert same_bits(y[~rows], before[~rows])


@pytest.mark.parametrize("wrapper_module", FAMILIES, indirect=True)
def test_weights_are_laid_out_once_in_vllms_own_tensors(wrapper_module):
    """set_mapping moves B rank-major and the slices' A into one storage: no copy per
    call, no memory added, and vLLM's real set_lora/reset_lora write into that layout."""
    version, punica_gpu = wrapper_module
    ops = punica_gpu.torch_lora_shrink.__globals__
    widths = (64, 32, 48)
    wrapper, layer, adapters, *_ = setup(version, punica_gpu, widths)
    a_all = ops["stacked_a"](list(layer.lora_a_stacked))
    assert a_all.data_ptr() == layer.lora_a_stacked[0].data_ptr()
    assert layer.lora_a_stacked[0].untyped_storage().nbytes() == sum(
        a.numel() * a.element_size() for a in layer.lora_a_stacked)  # fmt: skip
    for s, b in enumerate(layer.lora_b_stacked):
        assert b.shape == (SLOTS, 1, widths[s], RANK)
        assert b.untyped_storage().nbytes() == b.numel() * b.element_size()
        view = ops["stacked_b"](b)
        assert view.data_ptr() == b.data_ptr()
        for slot, (_, b_adapter) in adapters.items():
            rank = b_adapter[s].size(1)
            assert torch.equal(view[slot * RANK : slot * RANK + rank], b_adapter[s].T)
    layer.reset_lora(2)
    assert ops["stacked_b"](layer.lora_b_stacked[0])[2 * RANK : 3 * RANK].count_nonzero() == 0
    assert not ops["_FALLBACKS"]


# (widths, slots, rank, adopted under inference_mode): the shapes where an in-place
# transposition could go wrong (width == rank, one slot, a width or rank of 1, odd sizes)
B_LAYOUTS = [
    ((64, 32, 48), SLOTS, RANK, False),
    ((16,), 1, 16, False),
    ((16, 16, 16), 1, 16, False),
    ((16, 16), 3, 16, True),
    ((1, 40), 2, 8, False),
    ((24,), 5, 1, False),
    ((7, 5, 3), 4, 9, True),
]


@pytest.mark.parametrize("widths,slots,rank,inference", B_LAYOUTS)
@pytest.mark.parametrize("wrapper_module", FAMILIES, indirect=True)
def test_b_is_laid_out_rank_major_in_the_storage_vllm_allocated(
    wrapper_module, widths, slots, rank, inference
):
    """B is re-laid in place, a slot at a time, not copied into a new storage: vLLM
    creates the LoRA layers under a 20 MiB split limit, where a freed B of 20 MiB or
    more went whole to the next request of that size (0.36 GiB on a 32-layer dense
    model). Each B keeps its storage and address, holds the same values, rank-major,
    and the adapters loaded afterwards are served exactly (a helper's review shapes)."""
    version, punica_gpu = wrapper_module
    ops = punica_gpu.torch_lora_shrink.__globals__
    wrapper = make_wrapper(punica_gpu, slots, max_tokens=512)
    layer = Layer(version, widths, slots, rank, HIDDEN)
    gen = torch.Generator().manual_seed(7)
    for b in layer.lora_b_stacked:  # values in every slot: the re-layout must carry them
        b.copy_(torch.randn(b.shape, generator=gen))
    before = [
        (b.data_ptr(), b.untyped_storage().data_ptr(), b.clone()) for b in layer.lora_b_stacked
    ]
    wrapper.patchkit_token_masks.use_dtype(torch.bfloat16)  # its buffers made outside the mode
    with torch.inference_mode(inference):
        layer.set_mapping(wrapper)
    for b, (address, storage, values) in zip(layer.lora_b_stacked, before, strict=True):
        assert (b.data_ptr(), b.untyped_storage().data_ptr()) == (address, storage)
        assert ops["_b_is_rank_major"](b)
        assert torch.equal(b, values)
    adapters = {slot: adapter(slot, widths, rank) for slot in range(slots)}
    for slot, weights in adapters.items():
        layer.load(slot, *weights)
    rnd = random.Random(0)
    for tokens in (3, 40, 300):
        token_slots = [rnd.choice([-1, *range(slots)]) for _ in range(tokens)]
        update(wrapper, punica_gpu, token_slots, slots)
        x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
        y = torch.randn(tokens, sum(widths), generator=gen).to(torch.bfloat16)
        out = y.clone()
        wrapper.add_lora_linear(out, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, widths)
        rows = torch.tensor(token_slots) >= 0
        expected = y.double() + reference(x, token_slots, adapters, widths)
        assert_close_to(out[rows], expected[rows], torch.bfloat16)
        assert same_bits(out[~rows], y[~rows])
    assert not ops["_FALLBACKS"]


def direct_children(prof, op_name: str) -> list[str]:
    """aten ops called directly inside each call of op_name, in order."""
    return [
        child.name
        for event in prof.events()
        if event.name == op_name
        for child in event.cpu_children
    ]


VIEWS = {
    "aten::view",
    "aten::as_strided",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::slice",
    "aten::select",
    "aten::unsqueeze",
    "aten::expand",
    "aten::reshape",
    "aten::alias",
    "aten::item",
    "aten::resolve_conj",
    "aten::resolve_neg",
}  # fmt: skip  (item: the no-LoRA flag; resolve_*: tolist of ActiveSlots' state; CPU tensors)


CALL_KERNELS = [
    # (slices, tokens): the ops of one add_lora_linear call
    ((64, 32, 48), 23, ["aten::mm", "aten::mul_", "aten::addmm_", "aten::addmm_", "aten::addmm_"]),
    ((64,), 23, ["aten::bmm", "aten::bmm", "aten::addmm_"]),  # split shrink, masked reduce
    ((64,), 300, ["aten::mm", "aten::mul_", "aten::addmm_"]),
]


def profiled_call(wrapper, layer, x, y, widths) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, widths)
    return direct_children(prof, "patchkit_lora::add_lora_linear")


@pytest.mark.parametrize("wrapper_module", FAMILIES, indirect=True)
def test_one_call_is_a_gemm_the_slot_weights_and_one_addmm_per_slice(wrapper_module):
    """The batch-only work (slot weights) ran in update_metadata, the layer's matrices
    were laid out by its first call (a tensor on the weights' storage per matrix:
    empty and set_); a later call does neither, and few views: a slice of y and of
    the shrunk rows per slice, the batch's rows of the weights and no-LoRA flags, the
    GEMM's transpose and shapes (the route rebuilt every view each call: 36 for 4
    slices, docs/evidence.md, 2026-12-02i; the no-LoRA flag and ActiveSlots' state
    are read as well)."""
    version, punica_gpu = wrapper_module
    for widths, tokens, expected in CALL_KERNELS:
        wrapper, layer, _, _, x, y = setup(version, punica_gpu, widths, tokens=tokens)
        first = profiled_call(wrapper, layer, x, y, widths)
        laid_out = ["aten::empty", "aten::set_"] * (1 + len(widths))
        assert [n for n in first if n not in VIEWS][: len(laid_out)] == laid_out
        assert [n for n in first if n not in VIEWS][len(laid_out) :] == expected
        later = profiled_call(wrapper, layer, x, y, widths)
        assert [n for n in later if n not in VIEWS] == expected, (widths, tokens)
        assert sum(n in VIEWS for n in later) <= 9 + 2 * len(widths), later


@pytest.mark.parametrize("wrapper_module", FAMILIES, indirect=True)
def test_a_batch_without_lora_runs_nothing_and_changes_nothing(wrapper_module):
    version, punica_gpu = wrapper_module
    widths = (64, 32)
    wrapper, layer, _, slots, x, y = setup(version, punica_gpu, widths)
    update(wrapper, punica_gpu, [-1] * len(slots), SLOTS)
    before = y.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, widths)
    assert direct_children(prof, "patchkit_lora::add_lora_linear") == ["aten::item"]  # the flag
    assert same_bits(y, before)


WRITES = {  # what updating the slot masks launches
    "aten::fill_",
    "aten::zero_",
    "aten::copy_",
    "aten::where",
    "aten::eq",
    "aten::any",
    "aten::logical_not_",
}


def mask_writes(masks, num_tokens: int) -> list[str]:
    """The writing ops of one SlotMasks.update (what update_metadata adds per batch)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        masks.update(num_tokens)
    return [e.name for e in prof.events() if e.name in WRITES]


@pytest.mark.parametrize("wrapper_module", ["0.17.0", "0.22.0", "0.26.0", "0.32.0"], indirect=True)
def test_base_traffic_launches_nothing_per_batch(wrapper_module):
    """A batch without LoRA clears the rows the last LoRA batches wrote, once; the
    batches without LoRA after it launch nothing, as vLLM's Triton path does not.
    Rows a larger LoRA batch wrote earlier are cleared too (a padded graph reads them)."""
    version, punica_gpu = wrapper_module
    wrapper, layer, _, slots, x, y = setup(version, punica_gpu, (64, 32), tokens=40)
    masks = wrapper.patchkit_token_masks
    update(wrapper, punica_gpu, [0, 2, -1], SLOTS)  # a smaller LoRA batch after 40 tokens
    wrapper.token_mapping_meta.no_lora_flag_cpu.fill_(True)  # the next batch has no LoRA
    assert mask_writes(masks, 5)  # clears what the LoRA batches wrote
    rows = masks.no_lora.size(0)
    assert masks.no_lora.all() and all(not w.any() for w in masks.weights.values())
    assert all(not w.any() for w in masks.reduce_weights.values())
    for tokens in (5, 40, rows):
        assert mask_writes(masks, tokens) == []
    update(wrapper, punica_gpu, [-1, 1], SLOTS)  # LoRA again: written, then cleared once
    assert masks.weights[x.dtype][1, 1] == 1 and not masks.no_lora[1]
    update(wrapper, punica_gpu, [-1] * 3, SLOTS)
    assert masks.no_lora.all() and not masks.weights[x.dtype].any()
    before = y.clone()
    wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, (64, 32))
    assert same_bits(y, before)


@pytest.mark.parametrize("wrapper_module", TORCH_PATH_FAMILIES, indirect=True)
def test_a_graph_captured_with_lora_replayed_for_a_batch_without(wrapper_module):
    """With cudagraph_specialize_lora off, vLLM replays the graph captured with LoRA
    for a batch without: the kernels run on the stale token_lora_mapping that vLLM
    leaves, and the masks (filled, not read from it) keep y unchanged."""
    version, punica_gpu = wrapper_module
    ops = punica_gpu.torch_lora_shrink.__globals__
    widths = (64, 32)
    wrapper, layer, _, slots, x, y = setup(version, punica_gpu, widths)
    update(wrapper, punica_gpu, [-1] * len(slots), SLOTS)
    stale = wrapper.token_mapping_meta.token_lora_mapping[: len(slots)]
    assert (stale >= 0).any()  # vLLM did not rewrite it
    before = y.clone()
    masks = wrapper.patchkit_token_masks
    for widths_used in (widths, widths[:1]):  # the split one-slice call too
        ops["_linear"](y, x, list(layer.lora_a_stacked[: len(widths_used)]),
                       list(layer.lora_b_stacked[: len(widths_used)]), masks.weights[x.dtype],
                       masks.reduce_weights[x.dtype], masks.no_lora, torch.tensor([False]), 1.0,
                       True)  # fmt: skip
        assert same_bits(y, before)


def with_lora(call, wrapper, layer, x, y, widths):
    """y plus the layer's LoRA: add_lora_linear, or add_shrink then add_expand (_mcp_apply)."""
    out = y.clone()
    if call == "linear":
        wrapper.add_lora_linear(out, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, widths)
    else:
        buffer = torch.empty(len(widths), x.size(0), RANK)
        wrapper.add_shrink(buffer, x, layer.lora_a_stacked, 1.0)
        wrapper.add_expand(out, buffer, layer.lora_b_stacked, widths, add_inputs=True)
    return out


@pytest.mark.parametrize("wrapper_module", FAMILIES, indirect=True)
def test_a_bad_adapter_reaches_only_its_own_rows(wrapper_module, caplog):
    """inf in one slot's B, NaN in another's A: the other rows are as without them
    (rows without LoRA bit for bit), the bad adapters' rows are NaN, in every way a
    layer's LoRA is computed; loading a good adapter into the slot again, or removing
    the bad one, clears it."""
    version, punica_gpu = wrapper_module
    slots = [-1, 0, 1, 2, 3, -1, 2, 1, 0, 3, -1]
    for widths in ((64, 32), (64,)):  # one slice: the split shrink
        caplog.clear()
        wrapper, layer, adapters, _, x, y = setup(version, punica_gpu, widths, loaded=(0, 1, 2, 3))
        bad_b = adapter(91, widths, 8)
        bad_b[1][-1][3, 2] = float("inf")
        bad_a = adapter(92, widths, 8)
        bad_a[0][0][1, 5] = float("nan")
        with caplog.at_level(logging.WARNING):
            layer.load(1, *bad_b)
            layer.load(3, *bad_a)
        for slot in (1, 3):
            assert f"slot {slot} has non-finite weights" in caplog.text
        update(wrapper, punica_gpu, slots, SLOTS)
        x, y = x[: len(slots)], y[: len(slots)]
        expected = y.double() + reference(x, slots, adapters, widths)
        for call in ("linear", "shrink+expand"):
            out = with_lora(call, wrapper, layer, x, y, widths)
            good = [t for t, s in enumerate(slots) if s in (0, 2)]
            assert_close(out[good], expected[good])
            none = [t for t, s in enumerate(slots) if s == -1]
            assert same_bits(out[none], y[none])
            for bad in (1, 3):
                assert not torch.isfinite(out[[t for t, s in enumerate(slots) if s == bad]]).all()
        layer.load(1, *adapters[1])
        layer.reset_lora(3)
        update(wrapper, punica_gpu, slots, SLOTS)
        out = with_lora("linear", wrapper, layer, x, y, widths)
        assert torch.isfinite(out).all()
        rows = [t for t, s in enumerate(slots) if s == 1]
        assert_close(out[rows], expected[rows])
        three = [t for t, s in enumerate(slots) if s == 3]
        assert same_bits(out[three], y[three])  # an empty slot: no delta


@pytest.mark.parametrize("wrapper_module", FAMILIES, indirect=True)
def test_shrink_then_expand_as_mcp_apply_uses_the_batch_masks(wrapper_module):
    """_mcp_apply's add_shrink -> add_expand (vLLM's own methods) on the rebound ops:
    the same result, and no per-layer mask work (no comparison ops inside)."""
    version, punica_gpu = wrapper_module
    widths = (64, 32, 48)
    wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths)
    before = y.clone()
    buffer = torch.empty(len(widths), x.size(0), RANK)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wrapper.add_shrink(buffer, x, layer.lora_a_stacked, 1.0)
        wrapper.add_expand(y, buffer, layer.lora_b_stacked, widths, add_inputs=True)
    rows = torch.tensor(slots) >= 0
    assert_close(y[rows], (before.double() + reference(x, slots, adapters, widths))[rows])
    assert same_bits(y[~rows], before[~rows])
    inside = direct_children(prof, "patchkit_lora::lora_shrink")
    inside += direct_children(prof, "patchkit_lora::lora_expand")
    assert not {"aten::eq", "aten::ne", "aten::arange", "aten::any"} & set(inside)


@pytest.mark.parametrize("wrapper_module", TORCH_PATH_FAMILIES, indirect=True)
def test_embedding_and_logits_through_the_real_wrapper(wrapper_module):
    version, punica_gpu = wrapper_module
    wrapper = make_wrapper(punica_gpu, SLOTS)
    slots = [-1, 0, 2, 2, -1, 3]
    update(wrapper, punica_gpu, slots, SLOTS)
    gen = torch.Generator().manual_seed(5)
    b = (torch.randn(SLOTS, 1, 40, RANK, generator=gen) / 10).to(torch.bfloat16)
    a = (torch.randn(SLOTS, 1, RANK, HIDDEN, generator=gen) / 10).to(torch.bfloat16)
    x = torch.randn(len(slots), RANK, generator=gen).to(torch.bfloat16)
    y = torch.randn(len(slots), 40, generator=gen).to(torch.bfloat16)
    out = y.clone()
    wrapper.add_lora_embedding(out, x, b, add_inputs=True)
    for t, s in enumerate(slots):
        expected = y[t].double() + (x[t].double() @ b[s, 0].double().T if s >= 0 else 0)
        assert_close(out[t : t + 1], expected.unsqueeze(0))
    hidden = torch.randn(len(slots), HIDDEN, generator=gen).to(torch.bfloat16)
    logits = torch.randn(len(slots), 40, generator=gen).float()
    out = logits.clone()
    wrapper.add_lora_logits(out, hidden, a, b, 1.0)
    for t, s in enumerate(slots):
        delta = hidden[t].double() @ a[s, 0].double().T @ b[s, 0].double().T if s >= 0 else 0
        assert_close(out[t : t + 1], (logits[t].double() + delta).unsqueeze(0))


@pytest.mark.slow
@pytest.mark.parametrize("wrapper_module", ["0.26.0"], indirect=True)
def test_the_wrapper_call_compiles_fullgraph_with_a_dynamic_token_count(wrapper_module):
    version, punica_gpu = wrapper_module
    widths = (64, 32)
    wrapper, layer, adapters, slots, x, y = setup(version, punica_gpu, widths, tokens=30)
    forward, compiled = compiled_call(wrapper, layer, widths)
    for tokens in (9, 30):
        eager = forward(x[:tokens], y[:tokens].clone())
        graph = compiled(x[:tokens], y[:tokens].clone())
        assert same_bits(graph, eager)


@pytest.mark.parametrize("version", TORCH_PATH_FAMILIES)
def test_batch_invariant_mode_keeps_vllms_triton_path(version, tmp_path, monkeypatch, caplog):
    """VLLM_BATCH_INVARIANT=1: one log line, the wrapper and the op names are vLLM's,
    and layers are not re-laid out."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with installed(version, tmp_path, monkeypatch), caplog.at_level(logging.WARNING):
        punica_gpu = load_wrapper_module(version, tmp_path)
        wrapper = make_wrapper(punica_gpu, SLOTS)
        layer = Layer(version, (64,), SLOTS, RANK, HIDDEN)
        layer.set_mapping(wrapper)
        update(wrapper, punica_gpu, [0, 1, -1], SLOTS)
        with pytest.raises(AssertionError, match="the Triton op lora_shrink was reached"):
            y, x = torch.zeros(3, 64), torch.zeros(3, HIDDEN)
            wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, (64,))
    assert punica_gpu.LORA_BACKEND == "triton"
    assert layer.lora_b_stacked[0].is_contiguous()
    assert [r.message.count("VLLM_BATCH_INVARIANT") for r in caplog.records] == [1]


@pytest.mark.parametrize("wrapper_module", ["0.17.0", "0.26.0"], indirect=True)
def test_one_slot_keeps_b_laid_out_without_a_copy_per_call(wrapper_module):
    """max_loras 1, vLLM's default: the slot dimension has size 1, so its stride is
    free and torch's reshape renumbers it; B still counts as rank-major, and calls
    read it in place (no copy per call, no fallback warning)."""
    version, punica_gpu = wrapper_module
    ops = punica_gpu.torch_lora_shrink.__globals__
    wrapper = make_wrapper(punica_gpu, 1)
    layer = Layer(version, (64,), 1, RANK, HIDDEN)
    layer.set_mapping(wrapper)
    a, b = adapter(1, (64,), RANK)
    layer.load(0, a, b)
    view = ops["stacked_b"](layer.lora_b_stacked[0])
    assert view.data_ptr() == layer.lora_b_stacked[0].data_ptr()
    assert torch.equal(view, b[0].T)
    slots = [0, -1, 0]
    update(wrapper, punica_gpu, slots, 1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, HIDDEN, generator=gen).to(torch.bfloat16)
    y = torch.zeros(3, 64, dtype=torch.bfloat16)
    wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, (64,))
    assert_close(y, reference(x, slots, {0: (a, b)}, (64,)))
    assert not ops["_FALLBACKS"]
