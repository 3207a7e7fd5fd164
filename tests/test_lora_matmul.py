"""The torch LoRA path of matmul-add-lora-linear, run on the CPU.

The code under test is the module the patch creates, taken from the patched
tree of a real release (not a copy kept here), and the punica_gpu.py the
patch edits, for every release the patch applies to. References are computed
in float64 from the same weights, token by token.
"""

from __future__ import annotations

import ast
import random

import pytest
from packaging.version import Version

from patchkit.catalogue.model import Variant
from tests.conftest import (
    CATALOGUE,
    RELEASES,
    TORCH_PATH_FAMILIES,
    assert_close_to,
    module_from_source,
    patched_text,
    release_tree,
    same_bits,
)

torch = pytest.importorskip("torch", reason="the torch LoRA path needs torch (the test extra)")

PATCH = "matmul-add-lora-linear"
MODULE = "vllm/lora/punica_wrapper/patchkit_lora_matmul.py"
WRAPPER = "vllm/lora/punica_wrapper/punica_gpu.py"
PATCHED_RELEASES = [
    v for v in RELEASES if isinstance(CATALOGUE.get(PATCH).expected_for(Version(v)), Variant)
]


def meta(mapping: torch.Tensor, max_loras: int) -> tuple:
    """The kernel metadata after token_lora_mapping, as vLLM's LoRAKernelMeta builds it.

    The torch path reads only the active LoRA ids (sorted, -1 padded to
    max_loras + 1); the other entries serve the Triton launch.
    """
    active = torch.unique(mapping)
    lora_ids = torch.full((max_loras + 1,), -1, dtype=active.dtype)
    lora_ids[: active.numel()] = active
    cpu_flag = torch.tensor([bool((mapping == -1).all())])
    return (None, None, None, lora_ids, cpu_flag, torch.tensor([max_loras + 1]))


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    text = patched_text("0.26.0", PATCH, MODULE)
    return module_from_source("patchkit_lora_matmul", text, tmp_path_factory.mktemp("mod"))


class Case:
    """Random LoRA weights for max_loras slots, slices of different widths and a mapping."""

    def __init__(self, seed, tokens, max_loras, adapters, widths, max_rank, dtype):
        gen = torch.Generator().manual_seed(seed)
        rnd = random.Random(seed)
        self.hidden, self.widths, self.dtype = 96, widths, dtype
        self.x = torch.randn(tokens, self.hidden, generator=gen).to(dtype)
        # Loaded adapters sit in random slots with random ranks <= max_rank;
        # rows and columns beyond an adapter's rank are zero, as vLLM pads them.
        self.slots = rnd.sample(range(max_loras), adapters)
        self.rank = {
            slot: rnd.choice([r for r in (8, 16, 32, 64, 128) if r <= max_rank])
            for slot in self.slots
        }
        self.a = [torch.zeros(max_loras, 1, max_rank, self.hidden, dtype=dtype) for _ in widths]
        self.b = [torch.zeros(max_loras, 1, w, max_rank, dtype=dtype) for w in widths]
        for a, b, w in zip(self.a, self.b, widths, strict=True):
            for slot, rank in self.rank.items():
                a[slot, 0, :rank] = (torch.randn(rank, self.hidden, generator=gen) / 10).to(dtype)
                b[slot, 0, :, :rank] = (torch.randn(w, rank, generator=gen) / 10).to(dtype)
        choices = [-1, *self.slots]
        self.mapping = torch.tensor([rnd.choice(choices) for _ in range(tokens)])
        self.mapping[0] = -1  # always at least one row without LoRA
        self.y = torch.randn(tokens, sum(widths), generator=gen).to(dtype)

    def meta(self) -> tuple:
        return meta(self.mapping, self.a[0].size(0))

    def reference(self, scale: float) -> torch.Tensor:
        """The LoRA delta, float64, token by token: scale * x @ A[slot].T @ B[slot].T."""
        delta = torch.zeros(self.y.shape, dtype=torch.float64)
        for t, slot in enumerate(self.mapping.tolist()):
            if slot < 0:
                continue
            offset = 0
            for a, b, w in zip(self.a, self.b, self.widths, strict=True):
                shrunk = self.x[t].double() @ a[slot, 0].double().T * scale
                delta[t, offset : offset + w] = shrunk @ b[slot, 0].double().T
                offset += w
        return delta


def add_lora_linear(ops, case: Case, y: torch.Tensor, scale: float, add_inputs: bool):
    """What PunicaWrapperGPU.add_lora_linear does with the ops rebound to torch."""
    rank = case.b[0].size(-1)
    buffer = torch.empty(len(case.widths), case.x.size(0), rank, dtype=torch.float32)
    ops.torch_lora_shrink(case.x, case.a, buffer, case.mapping, *case.meta(), scale)
    ops.torch_lora_expand(
        buffer, case.b, y, case.mapping, *case.meta(), offset_start=0, add_inputs=add_inputs
    )
    return y


CASES = [
    # seed, tokens, max_loras, adapters, widths, max_rank
    (1, 33, 1, 1, (64,), 8),
    (2, 40, 4, 4, (64, 32, 48), 128),
    (3, 17, 4, 2, (80,), 64),
    (4, 64, 4, 3, (16, 16, 24, 40), 32),
    (5, 9, 2, 1, (32, 8), 16),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("params", CASES)
def test_add_lora_linear_matches_float64_reference(ops, params, add_inputs, dtype):
    case = Case(*params, dtype=dtype)
    scale = 0.5 if params[0] % 2 else 1.0
    y_in = case.y.clone()
    y = add_lora_linear(ops, case, case.y.clone(), scale, add_inputs)
    delta = case.reference(scale)
    lora_rows = case.mapping >= 0
    base = y_in.double() if add_inputs else 0
    assert_close_to(y[lora_rows], (base + delta)[lora_rows], dtype)
    # Rows without LoRA are left exactly as they were, bit for bit.
    assert same_bits(y[~lora_rows], y_in[~lora_rows])
    assert torch.isfinite(y).all()


@pytest.mark.slow
def test_no_adapter_in_the_batch_gives_exactly_no_change(ops):
    case = Case(7, 25, 4, 3, (64, 32), 64, torch.bfloat16)
    case.mapping[:] = -1
    for add_inputs in (True, False):
        y = add_lora_linear(ops, case, case.y.clone(), 1.0, add_inputs)
        assert same_bits(y, case.y)


def test_a_batch_without_lora_ignores_the_stale_mapping(ops):
    """vLLM leaves token_lora_mapping as the last LoRA batch wrote it when no token
    has a LoRA (it only resets the active ids and raises the CPU flag). Found by
    `patchkit verify` on an H200: base requests after LoRA requests got the old
    adapter. With the flag up the ops return at once, as the Triton ops do; a
    graph captured with LoRA runs them with the flag down (cudagraph_specialize_lora
    off), and the active ids alone must then keep every row unchanged."""
    case = Case(13, 30, 4, 3, (64, 32), 64, torch.bfloat16)
    stale = case.mapping.clone()
    case.mapping[:] = -1
    flag_up = case.meta()
    flag_down = (*flag_up[:4], torch.tensor([False]), *flag_up[5:])
    case.mapping = stale  # what the op is handed: stale slots, no active ids
    for meta in (flag_up, flag_down):
        for add_inputs in (True, False):
            y = case.y.clone()
            buffer = torch.zeros(2, 30, 64)
            ops.torch_lora_shrink(case.x, case.a, buffer, stale, *meta, 1.0)
            assert torch.count_nonzero(buffer) == 0
            buffer.fill_(1.0)  # whatever the buffer holds, no row takes it
            ops.torch_lora_expand(buffer, case.b, y, stale, *meta, add_inputs=add_inputs)
            assert same_bits(y, case.y)


def test_zero_weights_give_exactly_zero_delta(ops):
    case = Case(8, 25, 4, 3, (64, 32), 64, torch.bfloat16)
    for w in (*case.a, *case.b):
        w.zero_()
    y = add_lora_linear(ops, case, torch.zeros_like(case.y), 1.0, True)
    assert torch.count_nonzero(y) == 0
    y = add_lora_linear(ops, case, case.y.clone(), 1.0, True)
    assert torch.equal(y, case.y)


def test_shrink_output_is_written_not_added_and_offsets_are_honoured(ops):
    """Shrink overwrites its buffer (the Triton op zeroes it); expand starts at offset_start."""
    case = Case(9, 12, 2, 2, (16, 24), 16, torch.bfloat16)
    buffer = torch.full((2, 12, 16), float("nan"))
    ops.torch_lora_shrink(case.x, case.a, buffer, case.mapping, *case.meta(), 1.0)
    assert torch.isfinite(buffer).all()
    assert torch.count_nonzero(buffer[:, case.mapping < 0]) == 0
    wide = torch.randn(12, 8 + 40 + 5).to(torch.bfloat16)
    before = wide.clone()
    ops.torch_lora_expand(
        buffer, case.b, wide, case.mapping, *case.meta(), offset_start=8, add_inputs=True
    )
    assert same_bits(wide[:, :8], before[:, :8])
    assert same_bits(wide[:, 48:], before[:, 48:])
    expected = before[:, 8:48].double() + case.reference(1.0)
    assert_close_to(wide[:, 8:48], expected, torch.bfloat16)


def test_logits_style_float32_output_and_model_dtype_input(ops):
    """add_lora_logits may hand a float32 y; add_lora_embedding a model-dtype input."""
    case = Case(10, 20, 3, 2, (48,), 32, torch.bfloat16)
    y32 = case.y.float()
    buffer = torch.empty(1, 20, 32)
    ops.torch_lora_shrink(case.x, case.a, buffer, case.mapping, *case.meta(), 1.0)
    ops.torch_lora_expand(
        buffer.to(torch.bfloat16), case.b, y32, case.mapping, *case.meta(), add_inputs=True
    )
    rows = case.mapping >= 0
    assert_close_to(y32[rows], (case.y.double() + case.reference(1.0))[rows], torch.bfloat16)
    assert torch.equal(y32[~rows], case.y.float()[~rows])


def test_nan_in_a_row_without_lora_stays_in_that_row(ops):
    """A NaN input on a -1 row must not spread to other rows or slots.

    That row's own delta is NaN (its slot weights, 0, multiply a NaN); its layer
    output is NaN already, from the same input. Every other row is as without it.
    """
    case = Case(11, 10, 2, 2, (32,), 16, torch.bfloat16)
    clean = add_lora_linear(ops, case, case.y.clone(), 1.0, True)
    case.x[0] = float("nan")  # row 0 is a -1 row
    y = add_lora_linear(ops, case, case.y.clone(), 1.0, True)
    assert same_bits(y[1:], clean[1:])
    assert torch.isfinite(y[1:]).all()


@pytest.mark.slow
def test_runs_under_torch_compile_fullgraph_with_dynamic_token_count(ops):
    """No graph breaks (fullgraph) and the same numbers as eager, at two token counts."""
    torch._dynamo.reset()

    def lora_linear(x, a0, a1, b0, b1, mapping, lora_ids, y):
        kernel_meta = (None, None, None, lora_ids, torch.tensor([False]), None)
        buffer = torch.empty(2, x.size(0), a0.size(-2), dtype=torch.float32)
        ops.torch_lora_shrink(x, [a0, a1], buffer, mapping, *kernel_meta, 1.0)
        ops.torch_lora_expand(
            buffer, [b0, b1], y, mapping, *kernel_meta, offset_start=0, add_inputs=True
        )
        return y

    compiled = torch.compile(lora_linear, fullgraph=True, dynamic=True)
    for tokens in (7, 19):
        case = Case(12 + tokens, tokens, 4, 3, (32, 16), 32, torch.bfloat16)
        args = (case.x, *case.a, *case.b, case.mapping, case.meta()[3])
        eager = lora_linear(*args, case.y.clone())
        graph = compiled(*args, case.y.clone())
        assert_close_to(graph, eager.double(), torch.bfloat16)
        assert same_bits(graph[case.mapping < 0], case.y[case.mapping < 0])


def test_backend_switch_is_read_from_the_environment(monkeypatch, tmp_path):
    text = patched_text("0.26.0", PATCH, MODULE)
    for value, expected in (("", "torch"), ("torch", "torch"), (" Triton ", "triton")):
        monkeypatch.setenv("PATCHKIT_LORA_BACKEND", value)
        assert module_from_source(f"m{len(value)}", text, tmp_path).LORA_BACKEND == expected
    monkeypatch.setenv("PATCHKIT_LORA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="PATCHKIT_LORA_BACKEND='cuda'"):
        module_from_source("bad", text, tmp_path)


def module_level_rebinding(tree: ast.Module) -> dict[str, str]:
    """Names bound under the module-level `if LORA_BACKEND == "torch":`."""
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "LORA_BACKEND == 'torch'":
            return {
                s.targets[0].id: s.value.id
                for s in node.body
                if isinstance(s, ast.Assign) and isinstance(s.value, ast.Name)
            }
    return {}


@pytest.mark.parametrize("version", PATCHED_RELEASES)
def test_every_triton_lora_call_in_the_wrapper_goes_through_the_rebound_names(version):
    """The patched punica_gpu.py rebinds both ops after importing them, and every
    call to them in the file uses those module-level names (no attribute access
    such as torch.ops.vllm.lora_expand that would bypass the switch)."""
    tree = ast.parse(patched_text(version, PATCH, WRAPPER))
    assert module_level_rebinding(tree) == {
        "lora_shrink": "torch_lora_shrink",
        "lora_expand": "torch_lora_expand",
    }
    guards = [ast.unparse(n.test) for n in tree.body if isinstance(n, ast.If)]
    assert guards.index("HAS_TRITON") < guards.index("LORA_BACKEND == 'torch'")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    ops = ("lora_shrink", "lora_expand")
    direct = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id in ops]
    via_attribute = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr in ops]
    assert len(direct) >= 5 and via_attribute == []


# ----- the backend switch is part of vLLM's torch.compile cache key -----


@pytest.mark.parametrize("version", TORCH_PATH_FAMILIES)
def test_backend_switch_is_in_vllms_compile_cache_key(version, tmp_path, monkeypatch):
    """vLLM's real envs.compile_factors() gives each backend its own key, once the
    patched module is imported (as punica_gpu imports it before vLLM compiles)."""
    import hashlib
    import json
    import sys
    import types

    envs_source = (release_tree(version) / "vllm/envs.py").read_text()
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    config, utils = types.ModuleType("vllm.config"), types.ModuleType("vllm.config.utils")
    utils.normalize_value = lambda value: value  # vLLM's canonicalisation, not needed here
    envs = types.ModuleType("vllm.envs")
    vllm.envs, vllm.config, config.utils = envs, config, utils
    for name, module in {"vllm": vllm, "vllm.envs": envs, "vllm.config": config,
                         "vllm.config.utils": utils}.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    exec(compile(envs_source, f"vllm-{version}/vllm/envs.py", "exec"), envs.__dict__)

    def key() -> str:
        factors = envs.compile_factors()
        return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()

    monkeypatch.setenv("PATCHKIT_LORA_BACKEND", "torch")
    before = key()
    text = patched_text(version, PATCH, MODULE)
    module_from_source(f"patchkit_lora_matmul_key_{version.replace('.', '_')}", text, tmp_path)
    torch_key = key()
    assert envs.compile_factors()["PATCHKIT_LORA_BACKEND"] == "torch"
    monkeypatch.setenv("PATCHKIT_LORA_BACKEND", "triton")
    triton_key = key()
    assert len({before, torch_key, triton_key}) == 3
