"""vLLM's real PunicaWrapperGPU and LoRA layer methods, loaded on a CPU without vLLM installed.

The code under test comes from a release's tree, pristine or as the
catalogue's variant leaves it: punica_wrapper/{punica_gpu, punica_base,
utils}.py and patchkit's module are imported as files; LoRAKernelMeta
(ops/triton_ops/lora_kernel_metadata.py) is imported whole;
LoRAMapping, get_captured_lora_counts, round_up and async_tensor_h2d are
compiled from their real definitions (their files import vLLM's heavy
modules). Only names the code under test imports but never reaches on this
path are stand-ins, each said below: the Triton ops (they raise, so a test
fails if the torch path ever falls through to them), `_custom_ops`,
`triton`, numpy's ndarray type and the GPU-sync debug context.

A LoRA layer is an object carrying vLLM's stacked weight shapes, whose
`set_mapping`, `set_lora` and `reset_lora` are the release's real methods
(base.py, base_linear.py, column_parallel_linear.py).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import random
import sys
import textwrap
import types
from pathlib import Path

import torch

from tests.conftest import patched_text, release_tree

PATCH = "matmul-add-lora-linear"
WRAPPER_FILES = ("punica_gpu.py", "punica_base.py", "utils.py")
MODULE = "patchkit_lora_matmul.py"


def definitions(
    path: Path, names: tuple[str, ...], namespace: dict, source: str | None = None
) -> dict:
    """Compile the named top-level definitions of a real source file into namespace
    (``source``: the file's text as a patch leaves it, instead of what is on disk)."""
    source = path.read_text() if source is None else source
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            code = "\n".join(lines[start - 1 : node.end_lineno])
            exec(compile(code, f"{path}:{node.name}", "exec"), namespace)
    missing = [n for n in names if n not in namespace]
    assert not missing, f"{path} has no {missing}"
    return namespace


def methods(
    source: str, origin: str, cls: str, names: tuple[str, ...], namespace: dict | None = None
) -> dict:
    """The named methods of a class in a real source text, as plain functions.

    Their globals are ``namespace`` (torch added), for names the methods reach.
    """
    lines = source.splitlines()
    node = next(
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls
    )
    namespace = {"torch": torch, **(namespace or {})}
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name in names:
            code = textwrap.dedent("\n".join(lines[item.lineno - 1 : item.end_lineno]))
            exec(compile(code, f"{origin}:{cls}.{item.name}", "exec"), namespace)
    return {n: namespace[n] for n in names if n in namespace}


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def _triton_op(name: str):
    def reached(*args, **kwargs):
        raise AssertionError(f"the Triton op {name} was reached on the torch path")

    return reached


def _modules(tree: Path, directory: Path, register) -> dict[str, types.ModuleType]:
    """sys.modules entries for the vLLM names the wrapper imports.

    Modules holding dataclasses are registered before their code runs, as
    dataclasses look their module up.
    """
    vllm = tree / "vllm"
    pkg = {name: _module(name, __path__=[]) for name in (
        "vllm", "vllm.lora", "vllm.lora.ops", "vllm.utils")}  # fmt: skip
    pkg["vllm.lora.punica_wrapper"] = _module(
        "vllm.lora.punica_wrapper", __path__=[str(directory / "punica_wrapper")]
    )
    meta = register(_module("vllm.lora.ops.triton_ops.lora_kernel_metadata"))
    exec(
        compile(
            (vllm / "lora/ops/triton_ops/lora_kernel_metadata.py").read_text(),
            str(vllm / "lora/ops/triton_ops/lora_kernel_metadata.py"),
            "exec",
        ),
        meta.__dict__,
    )
    layers = register(_module("vllm.lora.layers"))
    definitions(
        vllm / "lora/layers/utils.py",
        ("LoRAMapping",),
        _namespace_for(vllm / "lora/layers/utils.py", layers.__dict__),
    )
    return {
        **pkg,
        "vllm.lora.ops.triton_ops": _module(
            "vllm.lora.ops.triton_ops",
            LoRAKernelMeta=meta.LoRAKernelMeta,
            lora_shrink=_triton_op("lora_shrink"),
            lora_expand=_triton_op("lora_expand"),
            fused_moe_lora=_triton_op("fused_moe_lora"),
        ),
        "vllm.lora.utils": _module(
            "vllm.lora.utils",
            **definitions(vllm / "lora/utils.py", ("get_captured_lora_counts",), {}),
        ),
        "vllm.triton_utils": _module("vllm.triton_utils", HAS_TRITON=True, triton=None),
        "vllm.utils.math_utils": _module(
            "vllm.utils.math_utils", **definitions(vllm / "utils/math_utils.py", ("round_up",), {})
        ),
        "vllm.utils.torch_utils": _module(
            "vllm.utils.torch_utils",
            **definitions(
                vllm / "utils/torch_utils.py",
                ("async_tensor_h2d",),
                {
                    "torch": torch,
                    "PIN_MEMORY": False,
                    "is_pin_memory_available": lambda: False,
                    "np": types.SimpleNamespace(ndarray=type("ndarray", (), {})),
                },
            ),
        ),
        # A debug facility: inert unless vLLM's sync check mode is switched on.
        "vllm.utils.gpu_sync_debug": _module(
            "vllm.utils.gpu_sync_debug", gpu_sync_allowed=contextlib.nullcontext
        ),
        "vllm._custom_ops": _module("vllm._custom_ops"),  # MoE only
    }


def _namespace_for(path: Path, namespace: dict) -> dict:
    """What LoRAMapping's definition needs: dataclass, and its Enum type if any."""
    from dataclasses import dataclass
    from enum import Enum

    namespace.update(dataclass=dataclass, Enum=Enum, torch=torch)
    if "class LoRAMappingType" in path.read_text():
        definitions(path, ("LoRAMappingType",), namespace)
    return namespace


def load_wrapper_module(version: str, directory: Path, patched: bool = True):
    """Import a release's punica_gpu.py (patched or pristine) under its vLLM module name.

    Call inside `installed(...)`, which puts the vLLM names in sys.modules.
    """
    directory = directory / "punica_wrapper"
    directory.mkdir(parents=True, exist_ok=True)
    tree = release_tree(version)
    for name in WRAPPER_FILES:
        relpath = f"vllm/lora/punica_wrapper/{name}"
        text = (tree / relpath).read_text()
        if patched and name == "punica_gpu.py":
            text = patched_text(version, PATCH, relpath)
        (directory / name).write_text(text)
    if patched:
        relpath = f"vllm/lora/punica_wrapper/{MODULE}"
        (directory / MODULE).write_text(patched_text(version, PATCH, relpath))
    return importlib.import_module("vllm.lora.punica_wrapper.punica_gpu")


@contextlib.contextmanager
def installed(version: str, directory: Path, monkeypatch):
    """The vLLM module names, for the duration of a test; the wrapper modules are fresh."""
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm."):
            monkeypatch.delitem(sys.modules, name)

    def register(module):
        monkeypatch.setitem(sys.modules, module.__name__, module)
        return module

    for module in _modules(release_tree(version), directory, register).values():
        register(module)
    yield


def make_wrapper(punica_gpu, max_loras: int, max_tokens: int = 256):
    config = types.SimpleNamespace(max_loras=max_loras, specialize_active_lora=False,
                                   max_lora_rank=128)  # fmt: skip
    return punica_gpu.PunicaWrapperGPU(max_tokens, 8, "cpu", lora_config=config)


def update(wrapper, punica_gpu, slots: list[int], max_loras: int, prefill: bool = True):
    """vLLM's update_metadata for one batch: token t uses slot slots[t] (-1: none).

    Adapter ids are slot + 1, as lora_index_to_id holds them.
    """
    mapping_cls = sys.modules["vllm.lora.layers"].LoRAMapping
    ids = tuple(s + 1 if s >= 0 else 0 for s in slots)
    index_to_id = [j + 1 for j in range(max_loras)]
    wrapper.update_metadata(mapping_cls(ids, ids, is_prefill=prefill), index_to_id, max_loras, 1000)


class Layer:
    """A LoRA linear layer: vLLM's stacked shapes, the release's real methods."""

    METHODS = {
        False: [("vllm/lora/layers/base_linear.py", "BaseLinearLayerWithLoRA",
                 ("reset_lora", "set_lora"))],
        True: [("vllm/lora/layers/base_linear.py", "BaseLinearLayerWithLoRA", ("reset_lora",)),
               ("vllm/lora/layers/column_parallel_linear.py", "MergedColumnParallelLinearWithLoRA",
                ("set_lora", "expand_packed_lora"))],
    }  # fmt: skip

    def __init__(self, version: str, widths: tuple[int, ...], max_loras: int, rank: int,
                 hidden: int, dtype=torch.bfloat16, patched: bool = True):  # fmt: skip
        tree = release_tree(version)
        base = "vllm/lora/layers/base.py"
        base_text = patched_text(version, PATCH, base) if patched else (tree / base).read_text()
        self.n_slices, self.tp_size, self.output_sizes = len(widths), 1, list(widths)
        self.output_slices = tuple(widths)
        self.lora_a_stacked = tuple(
            torch.zeros(max_loras, 1, rank, hidden, dtype=dtype) for _ in widths)  # fmt: skip
        self.lora_b_stacked = tuple(
            torch.zeros(max_loras, 1, w, rank, dtype=dtype) for w in widths)  # fmt: skip
        found = methods(base_text, base, "BaseLayerWithLoRA", ("set_mapping",))
        for relpath, cls, names in self.METHODS[len(widths) > 1]:
            found |= methods((tree / relpath).read_text(), relpath, cls, names)
        for name, function in found.items():
            setattr(self, name, function.__get__(self))

    def load(self, slot: int, a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
        """What LoRAModelManager does to activate an adapter in a slot."""
        if self.n_slices == 1:
            self.set_lora(slot, a[0], b[0])
        else:
            self.set_lora(slot, a, b)


# ----- what the torch path's tests through the real wrapper share -----

FAMILIES = ["0.17.0", "0.19.1", "0.20.0", "0.22.0", "0.26.0", "0.30.0", "0.31.0", "0.32.0"]
HIDDEN, RANK, SLOTS = 96, 16, 4


def adapter(seed: int, widths, rank: int):
    """One adapter's per-slice A (rank, hidden) and B (width, rank), as vLLM passes them."""
    gen = torch.Generator().manual_seed(seed)
    a = [(torch.randn(rank, HIDDEN, generator=gen) / 10).to(torch.bfloat16) for _ in widths]
    b = [(torch.randn(w, rank, generator=gen) / 10).to(torch.bfloat16) for w in widths]
    return a, b


def reference(x, slots, adapters, widths, scale=1.0):
    """float64 delta, token by token: scale * x_t @ A[slot].T @ B[slot].T."""
    delta = torch.zeros(x.size(0), sum(widths), dtype=torch.float64)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        a, b = adapters[slot]
        offset = 0
        for a_s, b_s, w in zip(a, b, widths, strict=True):
            delta[t, offset : offset + w] = (
                x[t].double() @ a_s.double().T * scale
            ) @ b_s.double().T
            offset += w
    return delta


def setup(version, punica_gpu, widths=(64, 32, 48), loaded=(0, 2, 3), tokens=23, seed=0):
    """A wrapper, a layer attached to it (set_mapping), adapters loaded, a batch mapped."""
    wrapper = make_wrapper(punica_gpu, SLOTS, max_tokens=max(256, tokens))
    layer = Layer(version, widths, SLOTS, RANK, HIDDEN)
    layer.set_mapping(wrapper)
    rnd = random.Random(seed)
    adapters = {}
    for slot in loaded:
        rank = rnd.choice([4, 8, RANK])
        adapters[slot] = adapter(seed * 10 + slot, widths, rank)
        layer.load(slot, *adapters[slot])
    slots = [rnd.choice([-1, *loaded]) for _ in range(tokens)]
    slots[0] = -1 if tokens > 1 else loaded[0]  # a row without LoRA, unless it is alone
    update(wrapper, punica_gpu, slots, SLOTS)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    y = torch.randn(tokens, sum(widths), generator=gen).to(torch.bfloat16)
    return wrapper, layer, adapters, slots, x, y


def compiled_call(wrapper, layer, widths):
    """The layer's add_lora_linear as a function (x, y) -> y, eager and under
    torch.compile (fullgraph, a dynamic token count, as vLLM compiles the model)."""
    torch._dynamo.reset()

    def forward(x, y):
        wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, widths)
        return y

    return forward, torch.compile(forward, fullgraph=True, dynamic=True)
