"""Kernel signatures and specialisation, exactly as Triton's JIT binds a launch.

The race only appears in the machine code Triton emits for the arguments
of a real call: which pointers, sizes and strides are divisible by 16,
which integers are 1 (and become constants), which are ``do_not_specialize``.
Instead of a table of kernel parameters (which breaks on the next new
parameter), vLLM's launcher runs (see :mod:`patchkit.doctor.standins`)
and Triton's own JIT binds its ``kernel[grid](...)`` call: a stand-in
driver reports an sm_90 GPU, and Triton's ``jit_cache_hook`` receives the
complete *specialisation data* (signature, constants, attributes, options)
just before Triton would compile, and stops it there. The same data later
compiles the kernel through Triton's public ``JITFunction.preload``
(:mod:`patchkit.doctor.kernelbuild`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

TARGET = ("cuda", 90, 32)  # compute capability 9.0, warp size 32
# Constexprs shown in a case's config; the rest stay in --json.
SHOWN = ("BLOCK", "NUM_STAGES", "SPLIT_K", "GROUP_SIZE_M", "NPID", "EVEN_K", "CAST_TYPE")


@dataclass(frozen=True)
class Launch:
    """One kernel launch as Triton's JIT bound it: everything a compile depends on."""

    kernel: str  # the @triton.jit function's name
    module: str  # the vLLM module it lives in
    data: str = field(repr=False)  # Triton's specialisation data (JSON)
    jit: object = field(compare=False, repr=False, default=None)  # the JITFunction

    @functools.cached_property
    def key(self) -> str:
        """Identifies the compile: same key, same machine code (for one Triton and ptxas)."""
        decoded = json.loads(self.data)
        decoded.pop("key", None)  # Triton's in-memory cache key repeats the rest
        return hashlib.sha256(json.dumps(decoded, sort_keys=True).encode()).hexdigest()

    def constants(self) -> dict:
        """The constexpr arguments, by parameter name (specialised ints included)."""
        decoded = json.loads(self.data)
        names = getattr(self.jit, "arg_names", None) or list(decoded["signature"])
        found = {}
        for path, value in zip(decoded["constant_keys"], decoded["constant_vals"], strict=True):
            name = names[path[0]] if path and path[0] < len(names) else str(path)
            found[name] = value
        return found

    def options(self) -> dict:
        return json.loads(self.data)["options"]

    def signature(self) -> dict:
        return json.loads(self.data)["signature"]

    def divisible(self) -> list[str]:
        """The arguments Triton assumes 16-divisible (``tt.divisibility``)."""
        decoded = json.loads(self.data)
        names = getattr(self.jit, "arg_names", None) or list(decoded["signature"])
        found = []
        for path, attrs in zip(decoded["attrs_keys"], decoded["attrs_vals"], strict=True):
            if any(a and a[0] == "tt.divisibility" for a in attrs) and path:
                found.append(names[path[0]])
        return found

    def config(self) -> dict:
        """Block sizes, stages and warps: what a person compares between configs."""
        shown = {
            k: v
            for k, v in self.constants().items()
            if k.upper().startswith(SHOWN) and v is not None
        }
        options = self.options()
        for name in ("num_warps", "num_stages", "num_ctas"):
            shown[name] = options.get(name)
        if options.get("launch_pdl"):
            shown["launch_pdl"] = True
        return shown


class _Driver:
    """A driver for an sm_90 GPU that is not there: Triton binds, nothing launches."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(*TARGET)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("meta")

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def sm90() -> Iterator[None]:
    """Triton's active driver is the stand-in sm_90 one inside the block."""
    from triton.runtime.driver import driver

    previous = getattr(driver, "_active", None)  # None: Triton picks one when next asked
    driver.set_active(_Driver())
    try:
        yield
    finally:
        driver.set_active(previous)


@contextlib.contextmanager
def capturing(before: Callable[[], tuple] = tuple) -> Iterator[list[tuple[Launch, tuple]]]:
    """Collect the launches bound inside the block, none of them compiled or run.

    Each comes with what ``before()`` says at that moment (the stand-ins
    vLLM's code had used so far: only those can have shaped the launch).
    Needs the stand-in driver (:func:`sm90`) around it.
    """
    from triton import knobs

    launches: list[tuple[Launch, tuple]] = []

    def hook(*, fn, compile, **_ignored) -> bool:
        launch = Launch(fn.name, str(fn.module), compile["specialization_data"], fn.jit_function)
        launches.append((launch, before()))
        return True  # handled: Triton neither compiles nor launches

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield launches
    finally:
        knobs.runtime.jit_cache_hook = previous
