"""The torch path's GEMV route (matmul-add-lora-linear), run by Triton's interpreter on the CPU.

Decode-sized add_lora_linear calls run two Triton kernels that read only each
row's own adapter. Here they run under TRITON_INTERPRET=1 on CPU tensors, in
the module the catalogue creates (imported as it is), against the GEMM route
of the same module and a float64 reference computed token by token from the
adapters' own weights; the layout, the slot weights and the quarantine are the
path's own (adopt_layer, SlotMasks, set_lora's check). The kernels' machine
code (no wgmma) is read by the kernel scan (tests/test_kernelscan.py).

Triton takes its interpreter only if TRITON_INTERPRET is set when it is first
imported (its own library functions are built then), so the checks
(``check_*`` below) run in one child Python that starts with it set; each test
here asserts one check's outcome, with the child's traceback if it failed.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import random
import subprocess
import sys
import types
import weakref

import pytest

from tests.conftest import assert_close_to, created_source, module_from_source, same_bits

torch = pytest.importorskip("torch", reason="the torch LoRA path needs torch (the test extra)")

PATCH = "matmul-add-lora-linear"
MODULE = "vllm/lora/punica_wrapper/patchkit_lora_matmul.py"
NO_TRITON = "no Triton here (pip install triton 'numpy<2.3' runs it in Triton's interpreter)"


def import_module(name: str, directory, interpret: bool, gemv: str | None = None):
    """The catalogue's module, imported fresh; its kernels are the interpreter's if asked,
    PATCHKIT_LORA_GEMV set to ``gemv`` (None: unset, the default, the route on).

    Triton picks interpreter or compiler when a kernel is defined (at import).
    The ops' dispatch table (_IMPL, one per process) is put back afterwards, so
    other tests' modules keep serving the ops they registered.
    """
    impl = sys.modules.get("patchkit_lora_matmul_impl")
    saved = dict(vars(impl)) if impl is not None else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1" if interpret else "0")
        if gemv is None:
            mp.delenv("PATCHKIT_LORA_GEMV", raising=False)
        else:
            mp.setenv("PATCHKIT_LORA_GEMV", gemv)
        module = module_from_source(name, created_source(PATCH, MODULE), directory)
    if saved is not None:
        vars(impl).clear()
        vars(impl).update(saved)
    return module


CHILD = """
import json, sys, traceback
from tests import test_lora_gemv as t
from pathlib import Path
m = t.import_module("patchkit_lora_matmul_gemv", Path(sys.argv[1]), interpret=True)
assert all(type(k).__name__ == "InterpretedFunction" for k in m._gemv_kernels())
found = {}
for name in sys.argv[2:]:
    check, _, case = name.partition("[")
    args = [next(c for c in t.CASES if f"seed{c[0]}]" == case)] if case else []
    try:
        getattr(t, check)(m, *args)
        found[name] = "ok"
    except Exception:
        found[name] = traceback.format_exc()[-4000:]
print(json.dumps(found))
"""


def check_names() -> list[str]:
    names = [n for n in globals() if n.startswith("check_") and n not in ("check_case",
             "check_names")]  # fmt: skip
    return names + [f"check_case[seed{c[0]}]" for c in CASES]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, str]:
    """Every check, run once in a child Python under Triton's interpreter."""
    pytest.importorskip("triton", reason=NO_TRITON)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    directory = tmp_path_factory.mktemp("gemv")
    done = subprocess.run([sys.executable, "-c", CHILD, str(directory), *check_names()],
                          capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def passed(interpreted: dict, name: str) -> None:
    assert interpreted[name] == "ok", interpreted[name]


class Layer:
    """One LoRA layer laid out by the path (adopt_layer), with slot weights for a batch."""

    def __init__(self, m, widths, slots, rank, hidden, dtype=torch.bfloat16, seed=0):
        self.m, self.widths, self.dtype = m, tuple(widths), dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.a = tuple(torch.zeros(slots, 1, rank, hidden, dtype=dtype) for _ in widths)
        self.b = tuple(torch.zeros(slots, 1, w, rank, dtype=dtype) for w in widths)
        self.meta = types.SimpleNamespace(
            token_lora_mapping=torch.full((64,), -1, dtype=torch.int32),
            active_lora_ids=torch.empty(slots + 1, dtype=torch.int32),
            no_lora_flag_cpu=torch.tensor([False]),
        )
        self.masks = m.SlotMasks(self.meta)
        self.layer = types.SimpleNamespace(
            lora_a_stacked=self.a, lora_b_stacked=self.b, set_lora=self._write,
            reset_lora=self._clear,
        )  # fmt: skip
        m.adopt_layer(self.layer, self.masks)
        self.adapters: dict[int, tuple] = {}

    def _write(self, slot, a, b):
        for s, (a_s, b_s) in enumerate(zip(a, b, strict=True)):
            self.a[s][slot, 0].zero_()
            self.b[s][slot, 0].zero_()
            self.a[s][slot, 0, : a_s.size(0)] = a_s
            self.b[s][slot, 0, :, : b_s.size(1)] = b_s

    def _clear(self, slot):
        for t in (*self.a, *self.b):
            t[slot].zero_()

    def load(self, slot, rank=None, poison=None):
        """A random adapter (rank <= the layer's, zero-padded as vLLM pads) in `slot`,
        through the path's own set_lora check; `poison` puts a NaN or inf in it."""
        rank = rank or self.a[0].size(2)
        hidden = self.a[0].size(3)
        a = [(torch.randn(rank, hidden, generator=self.gen) / 10).to(self.dtype) for _ in self.b]
        b = [(torch.randn(w, rank, generator=self.gen) / 10).to(self.dtype) for w in self.widths]
        if poison is not None:
            (a if poison[0] == "a" else b)[poison[1]][1, 2] = poison[2]
        else:
            self.adapters[slot] = (a, b)
        self.layer.set_lora(slot, a, b)

    def map(self, rows):
        """vLLM's mapping for a batch (slot per row, -1 for none), then the slot weights."""
        self.rows = list(rows)
        self.meta.token_lora_mapping[: len(rows)] = torch.tensor(rows, dtype=torch.int32)
        self.meta.no_lora_flag_cpu[0] = all(r < 0 for r in rows)
        self.masks.update(len(rows))

    def call(self, y, x, scale=1.0, add_inputs=True, flag=None):
        """What add_lora_linear runs: the module's _linear with this batch's buffers."""
        flag = self.meta.no_lora_flag_cpu if flag is None else flag
        self.m._linear(y, x, list(self.a), list(self.b), self.masks.weights[self.dtype],
                       self.masks.reduce_weights[self.dtype], self.masks.no_lora, flag,
                       scale, add_inputs)  # fmt: skip
        return y

    def reference(self, x, scale):
        """The LoRA delta in float64, row by row, from the adapters' own weights (0 for
        rows without a slot, an empty slot, or a quarantined one)."""
        delta = torch.zeros(x.size(0), sum(self.widths), dtype=torch.float64)
        for t, slot in enumerate(self.rows):
            if slot not in self.adapters:
                continue
            a, b = self.adapters[slot]
            offset = 0
            for a_s, b_s in zip(a, b, strict=True):
                shrunk = x[t].double() @ a_s.double().T * scale
                delta[t, offset : offset + b_s.size(0)] = shrunk @ b_s.double().T
                offset += b_s.size(0)
        return delta


def gemm_route(layer, y, x, scale, add_inputs):
    """The same call on the GEMM route (the path as it was before the GEMV route)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layer.m, "GEMV_MAX_TOKENS", 0)
        return layer.call(y, x, scale, add_inputs)


def check(layer, x, y, scale=1.0, bad=()):
    """Both add_inputs settings: the GEMV route taken, rows without a slot bit-identical,
    rows of a bad adapter NaN, the others as the float64 reference and the GEMM route."""
    m, gemv_linear = layer.m, layer.m.gemv_linear
    weights = layer.masks.weights[layer.dtype]
    assert m._gemv_device(x) and m._gemv_fits(y, x, list(layer.a), list(layer.b), weights)
    rows = torch.tensor(layer.rows)
    none = rows < 0
    bad_rows = torch.tensor([r in bad for r in layer.rows])
    good = ~none & ~bad_rows
    delta = layer.reference(x, scale)
    for add_inputs in (True, False):
        taken = []

        def spy(*args, taken=taken):
            taken.append(gemv_linear(*args))
            return taken[-1]

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(m, "gemv_linear", spy)
            out = layer.call(y.clone(), x, scale, add_inputs)
        assert taken == [True], add_inputs  # _linear took the GEMV route
        gemm = gemm_route(layer, y.clone(), x, scale, add_inputs)
        expected = delta + (y.double() if add_inputs else 0)
        assert same_bits(out[none], y[none]), add_inputs
        assert torch.isnan(out[bad_rows]).all(), add_inputs
        assert torch.isnan(gemm[bad_rows]).all(), add_inputs
        if good.any():
            assert torch.isfinite(out[good]).all()
            assert_close_to(out[good], expected[good], layer.dtype)
            assert_close_to(out[good], gemm[good].double(), layer.dtype)


# (seed, rows, slice widths, slots, rank, hidden): every slice count (1-4, Qwen3.5's
# in_proj_qkvz has 4), 1/2/8/16 slots, ranks 8 (half a shrink block), 16, 64 and 128,
# hidden sizes and slice widths that are no multiple of a block, rows without a slot.
CASES = [
    (1, [0], (40,), 1, 8, 96),
    (2, [1, -1], (72, 24), 2, 16, 200),
    (3, [3, -1, 0, -1, 3, -1, -1, 6], (136, 40, 24), 8, 64, 130),
    (4, [9, -1, 15, 2], (24,), 16, 128, 96),
    (5, [2], (48, 16, 16), 16, 128, 70),
    (6, [0, 1], (24,), 2, 16, 2100),  # 17 hidden blocks: 2 per part, the last parts empty
    (7, [5, 1, -1, 5, 0, 7], (32, 32, 48, 48), 8, 32, 144),
]


def check_case(gemv, case):
    seed, rows, widths, slots, rank, hidden = case
    layer = Layer(gemv, widths, slots, rank, hidden, seed=seed)
    rnd = random.Random(seed)
    for slot in sorted({r for r in rows if r >= 0}):
        layer.load(slot, rank=rnd.choice([r for r in (8, 16, 64, 128) if r <= rank]))
    layer.map(rows)
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(len(rows), hidden, generator=gen).to(torch.bfloat16)
    y = torch.randn(len(rows), sum(widths), generator=gen).to(torch.bfloat16)
    check(layer, x, y, scale=0.5 if seed % 2 else 1.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}")
def test_the_gemv_route_matches_the_reference_and_the_gemm_route(interpreted, case):
    """Rows of an adapter as the float64 reference and the GEMM route, scale applied,
    every slice at its offset; rows without a slot bit-identical; adding and writing."""
    passed(interpreted, f"check_case[seed{case[0]}]")


def check_every_token_count_up_to_the_bound(gemv):
    """1..GEMV_MAX_TOKENS rows on 8 slots, each batch a mix of adapters and rows
    without one; one more row than the bound takes the GEMM route."""
    layer = Layer(gemv, (40,), 8, 8, 24, seed=7)
    for slot in range(8):
        layer.load(slot)
    rnd = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for tokens in range(1, gemv.GEMV_MAX_TOKENS + 1):
        layer.map([rnd.choice([-1, *range(8)]) for _ in range(tokens)])
        x = torch.randn(tokens, 24, generator=gen).to(torch.bfloat16)
        y = torch.randn(tokens, 40, generator=gen).to(torch.bfloat16)
        check(layer, x, y)
    over = gemv.GEMV_MAX_TOKENS + 1
    layer.map([0] * over)
    x, y = torch.zeros(over, 24, dtype=torch.bfloat16), torch.zeros(over, 40, dtype=torch.bfloat16)
    assert not gemv._gemv_fits(y, x, list(layer.a), list(layer.b), layer.masks.weights[x.dtype])


def check_more_rows_than_slots_take_the_gemm_route(gemv):
    """The GEMV reads one adapter per row, the GEMM route every slot once: rows > slots
    go to the GEMMs (a shape, never the mapping's values)."""
    layer = Layer(gemv, (40,), 2, 8, 24)
    fits = []
    for tokens in (1, 2, 3):
        layer.map([0] * tokens)
        x, y = torch.zeros(tokens, 24, dtype=torch.bfloat16), torch.zeros(tokens, 40)
        fits.append(gemv._gemv_fits(y, x, list(layer.a), list(layer.b),
                                    layer.masks.weights[x.dtype]))  # fmt: skip
    assert fits == [True, True, False]


def check_a_quarantined_adapter_and_an_empty_slot(gemv):
    """NaN in one adapter's A, inf in another's B: their rows come out NaN (all
    columns, every slice), the other rows as without them; a row on an empty slot
    gets a zero delta; rows without a slot are untouched."""
    layer = Layer(gemv, (40, 24), 8, 16, 100, seed=11)
    for slot in (0, 2, 5):
        layer.load(slot)
    layer.load(3, poison=("a", 1, float("nan")))
    layer.load(6, poison=("b", 0, float("inf")))
    assert torch.isnan(layer.masks.health[[3, 6]]).all()  # marked bad by set_lora's check
    layer.map([3, 0, -1, 6, 2, 7, 5, 3])  # slot 7 is empty
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(8, 100, generator=gen).to(torch.bfloat16)
    y = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    check(layer, x, y, bad=(3, 6))
    out = layer.call(y.clone(), x)
    assert same_bits(out[5], y[5])  # empty slot: x @ 0 @ 0 added, bit for bit
    layer.load(3)  # loaded again, good: the mark is gone
    layer.map([3, 0, -1, 6, 2, 7, 5, 3])
    check(layer, x, y, bad=(6,))


def check_every_slice_count_with_a_bad_adapter_and_an_empty_slot(gemv):
    """1-4 slices, 8 rows on 8 slots: adapters of mixed ranks, an empty slot, rows
    without one and a non-finite adapter (NaN or inf, in A or B, in a different slice
    each time): its rows NaN in every slice, every other row as the reference."""
    poisons = [("a", 0, float("nan")), ("b", 1, float("inf")), ("a", 2, float("-inf")),
               ("b", 3, float("nan"))]  # fmt: skip
    for slices in (1, 2, 3, 4):
        widths = (40, 24, 56, 16)[:slices]
        layer = Layer(gemv, widths, 8, 32, 80, seed=20 + slices)
        for slot, rank in ((0, 8), (2, 32), (5, 16)):
            layer.load(slot, rank=rank)
        kind, where, value = poisons[slices - 1]
        layer.load(3, poison=(kind, min(where, slices - 1), value))
        layer.map([3, 0, -1, 7, 2, 5, 3, -1])  # slot 7 is empty
        gen = torch.Generator().manual_seed(20 + slices)
        x = torch.randn(8, 80, generator=gen).to(torch.bfloat16)
        y = torch.randn(8, sum(widths), generator=gen).to(torch.bfloat16)
        check(layer, x, y, scale=0.5, bad=(3,))
        assert same_bits(layer.call(y.clone(), x)[3], y[3])  # the empty slot adds 0


def check_a_batch_without_lora_replayed_through_a_captured_call(gemv):
    """A CUDA graph captured with LoRA runs the kernels again for a batch without
    LoRA (vLLM leaves its mapping stale and raises only the CPU flag): the rows read
    the cleared slot weights, not the stale mapping, and stay as they were."""
    layer = Layer(gemv, (40, 24), 4, 16, 64, seed=12)
    for slot in range(4):
        layer.load(slot)
    layer.map([0, 1, 2, 3])
    layer.meta.no_lora_flag_cpu[0] = True  # the next batch has no LoRA
    layer.masks.update(4)
    assert (layer.meta.token_lora_mapping[:4] >= 0).all()  # stale, as vLLM leaves it
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    y = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    for add_inputs in (True, False):
        out = layer.call(y.clone(), x, add_inputs=add_inputs, flag=torch.tensor([False]))
        assert same_bits(out, y)


def check_other_dtypes_are_cast_as_the_gemm_route_casts_them(gemv):
    """fp16 weights; a float32 input is read in the weights' dtype (as the GEMM route
    casts it) and a float32 output is added to in float32."""
    layer = Layer(gemv, (40, 24), 2, 16, 72, dtype=torch.float16, seed=13)
    layer.load(0)
    layer.load(1)
    layer.map([1, 0])
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 72, generator=gen)
    y = torch.randn(2, 64, generator=gen).to(torch.float16)
    check(layer, x.to(torch.float16), y)
    assert same_bits(layer.call(y.clone(), x), layer.call(y.clone(), x.to(torch.float16)))
    y32 = torch.randn(2, 64, generator=gen)
    out = layer.call(y32.clone(), x)
    expected = y32.double() + layer.reference(x.to(torch.float16), 1.0)
    assert_close_to(out, expected, torch.float16)


def test_every_token_count_up_to_the_bound(interpreted):
    """1..GEMV_MAX_TOKENS rows, mixes of adapters and rows without one; one more takes the GEMMs."""
    passed(interpreted, "check_every_token_count_up_to_the_bound")


def test_more_rows_than_slots_take_the_gemm_route(interpreted):
    """Rows > slots go to the GEMMs, by shape."""
    passed(interpreted, "check_more_rows_than_slots_take_the_gemm_route")


def test_a_quarantined_adapter_and_an_empty_slot(interpreted):
    """A bad adapter's rows NaN, the others as without it; an empty slot adds 0."""
    passed(interpreted, "check_a_quarantined_adapter_and_an_empty_slot")


def test_every_slice_count_with_a_bad_adapter_and_an_empty_slot(interpreted):
    """1-4 slices: a non-finite adapter's rows NaN, an empty slot adds 0, the rest as
    the reference."""
    passed(interpreted, "check_every_slice_count_with_a_bad_adapter_and_an_empty_slot")


def test_every_check_is_asserted_by_a_test():
    """A check the child runs but no test reads would pass unseen."""
    source = open(__file__).read()
    for name in check_names():
        if not name.startswith("check_case["):
            assert f'passed(interpreted, "{name}")' in source, name


def test_a_batch_without_lora_replayed_through_a_captured_call(interpreted):
    """The cleared slot weights, not vLLM's stale mapping, decide."""
    passed(interpreted, "check_a_batch_without_lora_replayed_through_a_captured_call")


def test_other_dtypes_are_cast_as_the_gemm_route_casts_them(interpreted):
    """fp16 weights, float32 input and output."""
    passed(interpreted, "check_other_dtypes_are_cast_as_the_gemm_route_casts_them")


def test_the_kernels_have_no_dot():
    """tl.dot is what lowers to wgmma on sm_90 (the register-A race); the GEMV kernels
    reduce with tl.sum. Read from the module's source, every @triton.jit function."""
    tree = ast.parse(created_source(PATCH, MODULE))
    jitted = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any("triton.jit" in ast.unparse(d) for d in node.decorator_list)
    ]
    assert {f.name for f in jitted} == {"_gemv_shrink_kernel", "_gemv_expand_kernel", "_row_slot"}
    for function in jitted:
        names = {n.attr for n in ast.walk(function) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}
        assert not {"dot", "dot_scaled"} & names, function.name
        assert "sum" in names


def test_without_the_interpreter_cpu_calls_take_the_gemm_route(tmp_path):
    """Compiled (not interpreted) kernels never see a CPU tensor: the GEMMs run."""
    pytest.importorskip("triton", reason=NO_TRITON)
    m = import_module("patchkit_lora_matmul_compiled", tmp_path, interpret=False)
    assert m._gemv_kernels() is not None
    assert not m._gemv_device(torch.zeros(1, 8))


def test_the_gemv_route_is_on_unless_set_to_0(tmp_path):
    """The serving benchmark judged the route against unpatched vLLM, so decode-sized
    calls take it by default (and with the old opt-in value 1); PATCHKIT_LORA_GEMV=0
    is the way back: gemv_linear declines, whatever the shapes."""
    slots, rank, hidden, width = 4, 8, 64, 32
    a_all = torch.zeros(1, slots, 1, rank, hidden)
    b = [torch.zeros(slots, 1, rank, width).transpose(2, 3)]
    y, x = torch.zeros(1, width), torch.zeros(1, hidden)
    weights = torch.zeros(8, slots)
    fits = {}
    for value in (None, "1", " 0 ", "0"):
        m = import_module(f"patchkit_lora_matmul_gemv_{len(fits)}", tmp_path, False, value)
        fits[value] = (m.GEMV_ENABLED, m._gemv_fits(y, x, [a_all[0]], b, weights))
    assert fits == {None: (True, True), "1": (True, True), " 0 ": (False, False),
                    "0": (False, False)}  # fmt: skip


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the storages ops create inside the block: the peak live, and those still
    alive at the end (each freed when its last tensor dies)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = torch.utils._pytree.tree_leaves
        seen = {a.untyped_storage().data_ptr() for a in leaves((args, kwargs or {}))
                if isinstance(a, torch.Tensor)}  # fmt: skip
        out = func(*args, **(kwargs or {}))
        for tensor in (o for o in leaves(out) if isinstance(o, torch.Tensor)):
            key = tensor.untyped_storage().data_ptr()
            if key not in seen and key not in self.live:
                self.live[key] = tensor.untyped_storage().nbytes()
                self.peak = max(self.peak, sum(self.live.values()))
                weakref.finalize(tensor.untyped_storage(), self.live.pop, key, 0)
        return out


class NoLaunch:
    """A kernel whose launch does nothing: a compiled kernel allocates no torch memory."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("widths", [(40,), (40, 24, 24, 16)], ids=["1 slice", "4 slices"])
def test_the_gemv_route_keeps_nothing_and_allocates_only_its_parts(tmp_path, widths):
    """Memory: one call on the GEMV route allocates one tensor, the fp32 parts (tokens x
    GEMV_SPLIT_K x slices x rank), and nothing outlives the call; the GEMM route's
    temporary at the same call, for comparison, is tokens x slices x slots x rank in
    the model dtype (8 times that for a split one-slice call, plus its reduce)."""
    pytest.importorskip("triton", reason=NO_TRITON)
    m = import_module("patchkit_lora_matmul_memory", tmp_path, interpret=False)
    m._gemv_shrink_kernel = m._gemv_expand_kernel = NoLaunch()
    slots, rank, hidden, tokens = 16, 32, 64, 8
    layer = Layer(m, widths, slots, rank, hidden)
    layer.map(list(range(tokens)))
    x, y = torch.randn(tokens, hidden).bfloat16(), torch.randn(tokens, sum(widths)).bfloat16()
    layer.call(y.clone(), x)  # the layer's first call lays out its LayerPlan (no new storage)
    found = {}
    for route, gemv_tokens in (("gemv", m.GEMV_MAX_TOKENS), ("gemm", 0)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(m, "_gemv_device", lambda x: True)
            mp.setattr(m, "GEMV_MAX_TOKENS", gemv_tokens)
            taken: list[bool] = []

            def spy(*args, taken=taken, gemv_linear=m.gemv_linear):
                taken.append(gemv_linear(*args))
                return taken[-1]

            mp.setattr(m, "gemv_linear", spy)
            out = y.clone()
            with LiveBytes() as mode:
                layer.call(out, x)
            gc.collect()
        assert taken == [route == "gemv"]
        found[route] = (mode.peak, sum(mode.live.values()))
    parts = tokens * m.GEMV_SPLIT_K * len(widths) * rank * 4
    shrunk = tokens * len(widths) * slots * rank * 2
    assert found["gemv"] == (parts, 0)
    if len(widths) > 1:
        assert found["gemm"] == (shrunk, 0) and parts == 2 * shrunk  # at 16 slots
    else:
        assert found["gemm"][0] > parts and found["gemm"][1] == 0
