"""vLLM's own host code, run from the tree without vLLM: the stand-ins it runs against.

The kernel scan must compile the kernels vLLM would launch, with the
arguments and configs vLLM's Python picks; a copy of that logic in patchkit
would drift with every release. So the tree's modules are executed from
their source files, with real torch (tensors on the ``meta`` device: shapes,
strides and dtypes without memory) and real Triton, while every ``vllm.*``
import outside the modules named in :data:`REAL` is answered by a stand-in:

- *modelled* stand-ins say what a CUDA machine of compute capability 9.0
  says (``current_platform``, ``torch.cuda``, shared memory, SM count) or
  do what is harmless here (a logger that drops messages, custom-op
  registration, collectives of one rank, ``moe_lora_align_block_size``
  whose output only feeds shapes). ``os.environ`` as vLLM's code sees it
  is the scan's settings, so the tree's own ``envs.py`` reads them;
- anything else is a :class:`Dummy`. It answers every use, and records
  each use made while a call is evaluated, so a case whose host code leaned
  on something the scan does not model is labelled approximate, naming it,
  instead of passing for vLLM's own answer.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import re
import sys
import types
import warnings
from collections import namedtuple
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Modules executed from the tree's own source; every other vllm.* import is a stand-in.
REAL = (
    "vllm.envs",
    "vllm.lora.ops.triton_ops",
    "vllm.lora.punica_wrapper",  # punica_gpu, its base, and a patch's module beside them
    "vllm.lora.layers.utils",
    "vllm.model_executor.layers.fused_moe.fused_moe",
    "vllm.model_executor.layers.fused_moe.config",
    "vllm.utils.math_utils",
)
BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"
PREFIX = "patchkit_vllm."  # the sandbox's modules are named "patchkit_vllm.vllm...."
ALIGNMENT = 256  # the CUDA caching allocator's: every tensor the scan makes starts there


@dataclass(frozen=True)
class Gpu:
    """The facts of one Hopper GPU that vLLM's host code asks for."""

    name: str  # torch.cuda.get_device_name(): tuned-config file names use it
    sms: int  # multiprocessor count: some launchers size their grid by it
    shared_memory: int = 232448  # max dynamic shared memory per block on sm_90 (227 KiB)

    @property
    def short(self) -> str:
        return self.name.replace("NVIDIA ", "").split(" ")[0]


# The Hopper GPUs of compute capability 9.0 that the scan evaluates vLLM's choices for.
GPUS = (Gpu("NVIDIA H100 80GB HBM3", 132), Gpu("NVIDIA H200", 132), Gpu("NVIDIA H20", 78))


def gpu_named(name: str) -> Gpu:
    """A GPU nvidia-smi reports, with the facts of the listed model it is."""
    for gpu in GPUS:
        if gpu.short in name.split():
            return Gpu(name, gpu.sms, gpu.shared_memory)
    return Gpu(name, GPUS[0].sms)


@dataclass
class Uses:
    """What one evaluation touched: unmodelled stand-ins and files it read."""

    dummies: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


class Dummy:
    """Any vLLM name the scan does not model: answers every use, and records it."""

    def __init__(self, name: str, sandbox: Sandbox | None = None):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_sandbox", sandbox)

    def _used(self, how: str) -> None:
        if self._sandbox is not None:
            self._sandbox.used(f"{self._name}{how}")

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # introspection (functools, dataclasses) is not a use
        return Dummy(f"{self._name}.{name}", self._sandbox)

    def __call__(self, *args, **kwargs):
        self._used("()")
        if len(args) == 1 and not kwargs and isinstance(args[0], type | types.FunctionType):
            return args[0]  # a decorator leaves what it decorates as it is
        return Dummy(f"{self._name}()", self._sandbox)

    def __getitem__(self, key):
        self._used("[]")
        return Dummy(f"{self._name}[]", self._sandbox)

    def __iter__(self):
        self._used(" (iterated)")
        return iter(())

    def __bool__(self):
        self._used(" (as a condition)")
        return False

    def __mro_entries__(self, bases):
        return (type(f"StandIn_{self._name.rpartition('.')[2]}", (), {}),)  # one per base

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _Logger:
    """vLLM's logger: the scan keeps none of its messages."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


class Platform:
    """``current_platform`` of a CUDA machine with one Hopper GPU (compute capability 9.0)."""

    device_type = "cuda"
    device_name = "cuda"

    def __init__(self, sandbox: Sandbox):
        self._sandbox = sandbox

    @property
    def gpu(self) -> Gpu:
        return self._sandbox.gpu

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Dummy(f"current_platform.{name}", self._sandbox)

    def is_cuda(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        return _capability(capability) == 90

    def is_device_capability_family(self, capability, device_id: int = 0) -> bool:
        return _capability(capability) // 10 == 9

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        return _capability(capability) <= 90

    def get_device_capability(self, device_id: int = 0):
        return namedtuple("DeviceCapability", "major minor")(9, 0)

    def get_device_name(self, device_id: int = 0) -> str:
        return self.gpu.name

    def num_compute_units(self, device_id: int | None = 0) -> int:
        return self.gpu.sms


def _capability(value) -> int:
    """90 from 90, (9, 0) or DeviceCapability(9, 0)."""
    if isinstance(value, int):
        return value
    return value[0] * 10 + value[1]


class _Cuda:
    """``torch.cuda`` of the stand-in GPU (the CPU build of torch has none)."""

    def __init__(self, sandbox: Sandbox):
        self._sandbox = sandbox

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Dummy(f"torch.cuda.{name}", self._sandbox)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def get_device_name(self, device=None) -> str:
        return self._sandbox.gpu.name

    def get_device_capability(self, device=None) -> tuple[int, int]:
        return (9, 0)

    def get_device_properties(self, device=None):
        gpu = self._sandbox.gpu
        return types.SimpleNamespace(
            name=gpu.name,
            major=9,
            minor=0,
            multi_processor_count=gpu.sms,
            shared_memory_per_block_optin=gpu.shared_memory,
        )


class _Os(types.ModuleType):
    """The real os module, except the environment: vLLM's code reads the scan's settings."""

    def __init__(self, sandbox: Sandbox):
        super().__init__("os")
        self._sandbox = sandbox

    @property
    def environ(self) -> dict[str, str]:
        return self._sandbox.settings

    def getenv(self, key: str, default=None):
        return self._sandbox.settings.get(key, default)

    def __getattr__(self, name: str):
        return getattr(os, name)


class _Torch(types.ModuleType):
    """The real torch module, except ``torch.cuda``: that is the stand-in GPU."""

    def __init__(self, sandbox: Sandbox):
        super().__init__("torch")
        self.cuda = _Cuda(sandbox)

    def __getattr__(self, name: str):
        return getattr(_real_torch(), name)


@functools.lru_cache(maxsize=1)
def _real_torch():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU build without numpy warns on import
        import torch
    return torch


class Sandbox:
    """A tree's vLLM modules loaded against stand-ins; the GPU and settings can change.

    One sandbox serves every call of a scan (loading the modules is the slow
    part); :meth:`switch` changes the GPU and settings and clears vLLM's own
    ``lru_cache``s, which would otherwise keep the previous answers.
    """

    def __init__(self, root: Path, gpu: Gpu, settings: Mapping[str, str]):
        self.root = Path(root)
        self.gpu, self.settings = gpu, dict(settings)
        self.platform = Platform(self)
        self.modules: dict[str, types.ModuleType] = {}
        self.uses: Uses | None = None
        self.torch = _Torch(self)
        self.os = _Os(self)
        self.triton = _import("triton")
        self.tl = _import("triton.language")
        self._next_address = ALIGNMENT
        self._builtins = {**builtins.__dict__, "__import__": self._import, "open": self._open}

    # ----- what a case evaluation used -----

    def used(self, what: str) -> None:
        if self.uses is not None and what not in self.uses.dummies:
            self.uses.dummies.append(what)

    @contextlib.contextmanager
    def recording(self) -> Iterator[Uses]:
        """Record the stand-ins and files vLLM's code uses inside the block."""
        self.uses = Uses()
        try:
            yield self.uses
        finally:
            self.uses = None

    def _open(self, file, *args, **kwargs):
        if self.uses is not None:
            self.uses.files.append(str(file))
        return open(file, *args, **kwargs)

    def switch(self, gpu: Gpu, settings: Mapping[str, str]) -> None:
        """Evaluate the following calls on ``gpu`` under ``settings``."""
        self.gpu, self.settings = gpu, dict(settings)
        for module in self.modules.values():
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()

    # ----- tensors -----

    def tensor(self, shape, dtype, contiguous_strides=None):
        """A meta tensor at an address of its own, 256-aligned as CUDA's allocator gives.

        vLLM keys some caches by ``data_ptr()``; distinct addresses keep one
        call's weights from answering for another's.
        """
        torch = _real_torch()
        numel = 1
        for size in shape:
            numel *= size
        width = torch.empty((), dtype=dtype, device="meta").element_size()
        start = self._next_address
        self._next_address += -(-max(numel * width, 1) // ALIGNMENT) * ALIGNMENT
        arena = _arena()
        return arena[start : start + numel * width].view(dtype).view(*shape)

    # ----- modules -----

    def module(self, name: str):
        """The module ``name`` as vLLM's code would import it here."""
        if name in self.modules:
            return self.modules[name]
        found = self._stand_in(name)
        if found is None and any(name == r or name.startswith(r + ".") for r in REAL):
            found = self._load(name)
        if found is None:
            found = Dummy(name, self)
        self.modules[name] = found
        return found

    def _load(self, name: str):
        relpath = Path(*name.split("."))
        path = self.root / relpath.with_suffix(".py")
        package = self.root / relpath / "__init__.py"
        is_package = package.is_file()
        if is_package:
            path = package
        if not path.is_file():
            return None
        module = types.ModuleType(PREFIX + name)  # never the name of a real vllm module
        module.__file__ = str(path)
        module.__package__ = name if is_package else name.rpartition(".")[0]
        module.__builtins__ = self._builtins
        self.modules[name] = module  # a cycle back to it sees the half-built module
        sys.modules[module.__name__] = module  # dataclasses look their module up there
        code = compile(path.read_text(encoding="utf-8"), str(path), "exec")
        uses, self.uses = self.uses, None  # what a module does on import is not the call's
        try:
            exec(code, vars(module))  # noqa: S102 - the tree's own code, in a sandbox
        except Exception:
            del self.modules[name]
            raise
        finally:
            self.uses = uses
        return module

    def _import(self, name, globals=None, locals=None, fromlist=(), level=0):
        if level:
            package = (globals or {}).get("__package__") or ""
            base = package.rsplit(".", level - 1)[0] if level > 1 else package
            name = f"{base}.{name}" if name else base
        top = name.partition(".")[0]
        if name == "os":
            return self.os
        if top == "torch":
            return self.torch if not fromlist or name == "torch" else _import(name)
        if top != "vllm":
            return builtins.__import__(name, globals, locals, fromlist, 0)
        if not fromlist:
            return _Package("vllm", self)
        module = self.module(name)
        if isinstance(module, Dummy):  # `from vllm import envs`: the names may be modules
            module = _namespace(name)
        for wanted in fromlist:
            if not hasattr(module, wanted):
                setattr(module, wanted, self.module(f"{name}.{wanted}"))
        return module

    def _stand_in(self, name: str):
        """The modelled stand-in for a vLLM module, or None."""
        makers = {
            "vllm.platforms": lambda: _namespace(name, current_platform=self.platform),
            "vllm.logger": lambda: _namespace(name, init_logger=lambda *a, **k: _Logger()),
            "vllm.triton_utils": lambda: _namespace(
                name, triton=self.triton, tl=self.tl, HAS_TRITON=True
            ),
            "vllm.triton_utils.allocation": lambda: _namespace(
                name, set_triton_allocator=lambda *a, **k: None
            ),
            "vllm.utils.torch_utils": lambda: _namespace(
                name,
                direct_register_custom_op=lambda *a, **k: None,
                async_tensor_h2d=self._h2d,
            ),
            "vllm.utils.mem_utils": lambda: _namespace(
                name, get_max_shared_memory_bytes=lambda *a, **k: self.gpu.shared_memory
            ),
            "vllm.utils.platform_utils": lambda: _namespace(
                name, get_device_name_as_file_name=lambda *a: re.sub(r"[\s/]+", "_", self.gpu.name)
            ),
            "vllm.distributed": lambda: _namespace(
                name,
                tensor_model_parallel_all_reduce=lambda t: t,
                tensor_model_parallel_all_gather=lambda t, *a, **k: t,
            ),
            "vllm._custom_ops": lambda: _CustomOps(self),
            "vllm.model_executor.layers.fused_moe": lambda: _namespace(
                name, get_config=lambda: None
            ),
            "vllm.model_executor.layers.batch_invariant": lambda: _namespace(
                name, vllm_is_batch_invariant=lambda: _flag(self.settings.get(BATCH_INVARIANT))
            ),
        }
        make = makers.get(name)
        return make() if make else None

    def _h2d(self, data, dtype, target_device=None, pin_memory=False, **kwargs):
        return _real_torch().tensor(data, dtype=dtype, device="meta")


class _Package:
    """``vllm`` after ``import vllm.x.y``: attribute access walks to the modules."""

    def __init__(self, name: str, sandbox: Sandbox):
        self._name, self._sandbox = name, sandbox

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self._sandbox.module(f"{self._name}.{attr}")


class _CustomOps:
    """``vllm._custom_ops``: the MoE alignment op fills buffers whose shapes are all the scan
    needs; any other op is a dummy (and recorded)."""

    def __init__(self, sandbox: Sandbox):
        self._sandbox = sandbox

    def moe_lora_align_block_size(self, *args, **kwargs) -> None:
        return None

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Dummy(f"vllm._custom_ops.{name}", self._sandbox)


def _flag(value: str | None) -> bool:
    """An on/off environment variable as vLLM reads it: set, and not 0."""
    try:
        return bool(int(value or "0"))
    except ValueError:
        return False


def _namespace(name: str, **values) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(values)
    return module


@functools.lru_cache(maxsize=1)
def _arena():
    """1 TiB of meta memory: tensors are views into it, at the addresses the scan hands out."""
    return _real_torch().empty(1 << 40, dtype=_real_torch().uint8, device="meta")


def _import(name: str):
    __import__(name)
    return sys.modules[name]
