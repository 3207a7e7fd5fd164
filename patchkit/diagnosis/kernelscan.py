"""`patchkit doctor --kernels`: compile this install's LoRA kernels for sm_90 and read the SASS.

On most GPUs the NaN of vLLM #48590 never fires, so a run cannot prove a
fix. The machine code can: the race is a pattern that ptxas < 13.3 emits
(see :mod:`patchkit.diagnosis.sass`). This module compiles vLLM's own
``_lora_expand_kernel`` and ``_lora_shrink_kernel``, taken from the tree
being examined (patchkit carries no copy of vLLM's code), with the
installed Triton for ``GPUTarget("cuda", 90, 32)``. That needs no GPU and
no CUDA driver: Triton's ptxas and cuobjdump are in its wheel.

The configs are the ones this install would run on compute capability 9.0:
the tree's own ``get_lora_op_configs`` and the host code of the op that
adjusts it (0.33's ``NUM_STAGES = 1``) are evaluated with a stand-in
platform that reports 9.0, so a patched tree shows its patched config; and
every config in ``VLLM_TUNED_CONFIG_FOLDER``. The kernel arguments are
specialised as Triton's JIT would on a real call (16-divisible pointers,
sizes and strides; strides of 1 as constants), because the pipelined loop
that carries the race only appears with those hints.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.diagnosis import sass
from patchkit.engine.fsutil import read_json_file, write_cache_file
from patchkit.target.tree import VllmTree

OPS_DIR = "vllm/lora/ops/triton_ops"
HIDDEN, RANK = 5120, 64  # Qwen3.5-27B's hidden size; a common rank (config lookups only)
BATCHES = (16, 4096)  # a decode and a prefill batch: some defaults depend on it
LOOKUP = "get_lora_op_configs"  # the config the tree's own lookup returns on 9.0
PATHS = {
    # name: (add_inputs, USE_GDC), the ways vLLM's call sites reach lora_expand:
    # add_lora_linear/logits/embedding add into the output; the dual-stream LoRA
    # path (VLLM_LORA_ENABLE_DUAL_STREAM) writes it, with PDL unless
    # VLLM_LORA_DISABLE_PDL.
    "add": (True, False),
    "dual-stream": (False, True),
    "dual-stream-no-pdl": (False, False),
}


def path_runs(path: str) -> tuple[bool, str]:
    """Whether vLLM reaches lora_expand by ``path`` in this environment, and why not."""
    dual = os.environ.get("VLLM_LORA_ENABLE_DUAL_STREAM", "0").strip() not in ("", "0")
    no_pdl = os.environ.get("VLLM_LORA_DISABLE_PDL", "0").strip() not in ("", "0")
    if path == "dual-stream" and not (dual and not no_pdl):
        return False, "dual-stream LoRA with PDL is off (VLLM_LORA_ENABLE_DUAL_STREAM)"
    if path == "dual-stream-no-pdl" and not (dual and no_pdl):
        return False, "dual-stream LoRA without PDL is off (VLLM_LORA_DISABLE_PDL)"
    return True, ""


class ScanUnavailable(Exception):
    """Triton (or its disassembler) is missing: the scan cannot run here."""


@dataclass
class Case:
    """One kernel compile: op, slices, dtypes, path and the config it runs with."""

    op: str  # expand | shrink
    slices: int
    input_dtype: str  # fp32 | bf16 | fp16
    model_dtype: str  # bf16 | fp16
    path: str  # add | dual-stream (expand); "" for shrink
    config: dict
    source: str  # LOOKUP, or "tuned: <file>"
    called: bool = True
    why_not_called: str = ""
    verdict: str = ""  # hazard | clean | no-register-operand | error
    hgmma: int = 0
    register_a: int = 0
    hazards: list[dict] = field(default_factory=list)
    error: str = ""

    def label(self) -> str:
        c = self.config
        path = f", {self.path}" if self.path else ""
        if not c:  # a config vLLM could not compute
            return (
                f"{self.op} {self.slices} slice(s), {self.input_dtype} input{path} ({self.source})"
            )
        return (
            f"{self.op} {self.slices} slice(s), {self.input_dtype} input, {self.model_dtype} "
            f"weights{path}: block {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}, "
            f"{c['num_stages']} stage(s), {c['num_warps']} warps ({self.source})"
        )

    def to_json(self) -> dict:
        data = {k: v for k, v in self.__dict__.items()}
        data["label"] = self.label()
        return data


@dataclass
class ScanReport:
    triton: str = ""
    ptxas: str = ""
    ptxas_version: str = ""
    disassembler: str = ""
    seconds: float = 0.0
    cases: list[Case] = field(default_factory=list)
    error: str = ""

    def to_json(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k != "cases"}
        data["cases"] = [c.to_json() for c in self.cases]
        return data


# ----- the stand-in vLLM that the tree's config code is evaluated against -----


class _Anything:
    """Answers any attribute, call or index with itself; false, empty, equal to nothing."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self

    def __getitem__(self, key):
        return self

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __mro_entries__(self, bases):
        return (object,)


class _Platform(_Anything):
    """current_platform of a CUDA machine with compute capability 9.0."""

    def __init__(self, gpu_name: str):
        self.gpu_name = gpu_name

    def is_cuda(self):
        return True

    def is_cuda_alike(self):
        return True

    def is_rocm(self):
        return False

    def is_device_capability(self, capability):
        return capability in (90, (9, 0))

    def has_device_capability(self, capability):
        wanted = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return wanted <= 90

    def get_device_capability(self, device_id=0):
        from collections import namedtuple

        capability = namedtuple("DeviceCapability", "major minor")(9, 0)
        return capability

    def get_device_name(self, device_id=0):
        return self.gpu_name


class _Envs(_Anything):
    """vllm.envs: the variables that decide LoRA configs, read from the environment."""

    def __getattr__(self, name):
        if name == "VLLM_TUNED_CONFIG_FOLDER":
            return os.environ.get(name) or None
        if name in ("VLLM_BATCH_INVARIANT", "VLLM_LORA_ENABLE_DUAL_STREAM"):
            return os.environ.get(name, "0").strip() not in ("", "0")
        return None


class _Torch(_Anything):
    float32, float16, bfloat16 = "fp32", "fp16", "bf16"

    def __init__(self, gpu_name: str):
        self.cuda = _Platform(gpu_name)


def _next_power_of_2(n: int) -> int:
    return 1 if n < 1 else 1 << (n - 1).bit_length()


def _stand_ins(gpu_name: str) -> dict:
    platform, envs = _Platform(gpu_name), _Envs()
    return {
        "envs": envs,
        "current_platform": platform,
        "next_power_of_2": _next_power_of_2,
        "vllm_is_batch_invariant": lambda: envs.VLLM_BATCH_INVARIANT,
        "init_logger": lambda name: _Anything(),
    }


def _evaluate(source: str, filename: str, gpu_name: str, extra: dict | None = None) -> dict:
    """Run module source with vLLM and torch replaced by stand-ins; its namespace."""
    names = _stand_ins(gpu_name)
    torch = _Torch(gpu_name)

    def fake_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "torch" or name.startswith("torch."):
            return torch
        if name == "vllm" or name.startswith("vllm."):
            module = _Anything()
            for wanted in fromlist or ():
                object.__setattr__(module, wanted, names.get(wanted, _Anything()))
            return module
        return builtins.__import__(name, globals, locals, fromlist, level)

    namespace = {
        "__builtins__": {**builtins.__dict__, "__import__": fake_import},
        "__name__": "patchkit_vllm_config",
        **(extra or {}),
    }
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - the tree's own code
    return namespace


def _config_function(tree: VllmTree, gpu_name: str):
    path = tree.path(f"{OPS_DIR}/utils.py")
    namespace = _evaluate(path.read_text(encoding="utf-8"), str(path), gpu_name)
    return namespace["get_lora_op_configs"]


def _host_overrides(tree: VllmTree, op: str) -> list[ast.stmt]:
    """The statements of ``_lora_<op>`` between its config lookup and its launch grid."""
    path = tree.path(f"{OPS_DIR}/lora_{op}_op.py")
    module = ast.parse(path.read_text(encoding="utf-8"))
    function = next(
        n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == f"_lora_{op}"
    )
    body, keep, started = function.body, [], False
    for statement in body:
        targets = [t.id for t in getattr(statement, "targets", []) if isinstance(t, ast.Name)]
        if "kernel_config" in targets:
            started = True
            continue
        if not started:
            continue
        if "grid" in targets:
            break
        keep.append(statement)
    return keep


class _Locals(dict):
    """exec() locals where an unknown name is a stand-in instead of a NameError."""

    def __missing__(self, key):
        if hasattr(builtins, key):
            raise KeyError(key)
        return _Anything()


class _Tensor:
    def __init__(self, dtype: str):
        self.dtype = dtype


def effective_config(
    tree: VllmTree, op: str, kernel_config: dict, slices: int, input_dtype: str,
    model_dtype: str, add_inputs: bool, gpu_name: str,
) -> dict:  # fmt: skip
    """The kernel config after the op's own host code adjusted it (e.g. NUM_STAGES = 1)."""
    scope = _Locals(
        kernel_config=kernel_config,
        inputs=_Tensor(input_dtype),
        lora_b_weights=[_Tensor(model_dtype)] * slices,
        lora_a_weights=[_Tensor(model_dtype)] * slices,
        K=RANK if op == "expand" else HIDDEN,
        N=HIDDEN if op == "expand" else RANK,
        MAX_N=HIDDEN,
        add_inputs=add_inputs,
        ADD_INPUTS=add_inputs,
        CAST_TYPE=False,
        NUM_SLICES=slices,
        partials=None,
        torch=_Torch(gpu_name),
        **_stand_ins(gpu_name),
    )
    module = ast.Module(body=_host_overrides(tree, op), type_ignores=[])
    code = compile(module, str(tree.path(f"{OPS_DIR}/lora_{op}_op.py")), "exec")
    try:
        exec(code, {"__builtins__": builtins.__dict__}, scope)  # noqa: S102
    except Exception:  # host code this stand-in cannot follow: the config as looked up
        config = _launch_config(op, kernel_config)
        config["CAST_TYPE"] = input_dtype != model_dtype
        return config
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_WARPS", "NUM_CTAS", "NUM_STAGES", "EVEN_K",
             "CAST_TYPE", "SPLIT_K", "GROUP_SIZE_M")  # fmt: skip
    found = {n: dict.get(scope, n) for n in names if n in scope}
    config = {k: v for k, v in found.items() if k not in ("NUM_WARPS", "NUM_CTAS", "NUM_STAGES")}
    config["num_warps"] = found.get("NUM_WARPS", kernel_config.get("num_warps", 4))
    config["num_stages"] = found.get("NUM_STAGES", kernel_config.get("num_stages", 2))
    config["num_ctas"] = found.get("NUM_CTAS", kernel_config.get("num_ctas", 1))
    return config


def _lookup(config_function, op: str, batch: int, slices: int, add_inputs: bool) -> dict:
    wanted = dict(
        op_type=op, max_loras=4, batch=batch, hidden_size=HIDDEN, rank=RANK,
        num_slices=slices, add_inputs=add_inputs,
    )  # fmt: skip
    accepted = inspect.signature(config_function).parameters
    return dict(config_function(**{k: v for k, v in wanted.items() if k in accepted}))


# ----- the cases to compile -----


def default_cases(tree: VllmTree, gpu_name: str) -> list[Case]:
    """The default configs for 1-3 slices, bf16 and fp16, as this tree computes them on 9.0."""
    config_function = _config_function(tree, gpu_name)
    envs_text = tree.path("vllm/envs.py").read_text(encoding="utf-8")
    paths = ["add"]
    if "VLLM_LORA_ENABLE_DUAL_STREAM" in envs_text:
        paths.append("dual-stream")
        if "VLLM_LORA_DISABLE_PDL" in envs_text:
            paths.append("dual-stream-no-pdl")
    cases: dict[str, Case] = {}
    for slices in (1, 2, 3):
        for model in ("bf16", "fp16"):
            for path in paths:
                for input_dtype in ("fp32", model):
                    for batch in BATCHES:
                        case = _default_case(
                            tree, config_function, "expand", batch, slices, input_dtype, model,
                            path, gpu_name,
                        )  # fmt: skip
                        cases.setdefault(_key(case), case)
            for batch in BATCHES:
                case = _default_case(
                    tree, config_function, "shrink", batch, slices, model, model, "", gpu_name
                )
                cases.setdefault(_key(case), case)
    return list(cases.values())


def _default_case(
    tree, config_function, op, batch, slices, input_dtype, model, path, gpu_name
) -> Case:
    """One case as the tree's config code decides it; an error case if that code raises."""
    add_inputs = PATHS[path][0] if path else False
    try:
        kernel_config = _lookup(config_function, op, batch, slices, add_inputs)
    except Exception as exc:  # e.g. KeyError from a tuned file without this num_slices
        case = Case(op, slices, input_dtype, model, path, {}, LOOKUP)
        case.verdict = "error"
        case.error = (
            f"vLLM's get_lora_op_configs raises {type(exc).__name__} {exc} for {slices} "
            f"slice(s), batch {batch}: vLLM would fail the same way"
        )
        return case
    config = effective_config(
        tree, op, kernel_config, slices, input_dtype, model, add_inputs, gpu_name
    )
    return Case(op, slices, input_dtype, model, path, config, LOOKUP)


def tuned_cases(folder: str | None) -> list[Case]:
    """Every expand/shrink config in VLLM_TUNED_CONFIG_FOLDER (fp32 input, bf16 weights)."""
    if not folder or not Path(folder).is_dir():
        return []
    cases: dict[str, Case] = {}
    for path in sorted(Path(folder).glob("*.json")):
        name = path.stem.upper()
        op = "expand" if "_EXPAND" in name else "shrink" if "_SHRINK" in name else None
        if op is None or "MOE" in name:
            continue
        add_inputs = not name.endswith("_FALSE")
        try:
            data = read_json_file(path)
        except (OSError, ValueError):
            continue  # doctor's tuned-config check reports unreadable files
        path_name = ("add" if add_inputs else "dual-stream") if op == "expand" else ""
        input_dtype = "fp32" if op == "expand" else "bf16"
        for _, num_slices, leaf in config_leaves(data):
            slices = int(num_slices) if str(num_slices).isdigit() else 1
            case = Case(op, slices, input_dtype, "bf16", path_name, {}, f"tuned: {path.name}")
            try:
                case.config = _launch_config(op, leaf)
            except (KeyError, TypeError, ZeroDivisionError) as exc:
                case.verdict = "error"
                case.error = f"tuned config {leaf} is incomplete ({exc!r}): vLLM fails on it too"
            cases.setdefault(_key(case), case)
    return list(cases.values())


def _launch_config(op: str, leaf: dict) -> dict:
    """A vLLM config dict (a tuned leaf, or a looked-up default) as the launch reads it.

    No release passes ``max_nreg`` to the launch, so neither does the scan.
    """
    config = {
        "BLOCK_M": leaf["block_m"], "BLOCK_N": leaf["block_n"], "BLOCK_K": leaf["block_k"],
        "num_warps": leaf.get("num_warps", 4), "num_stages": leaf.get("num_stages", 2),
        "num_ctas": leaf.get("num_ctas", 1),
        "EVEN_K": (RANK if op == "expand" else HIDDEN) % leaf["block_k"] == 0,
    }  # fmt: skip
    if op == "shrink":
        config["SPLIT_K"] = leaf.get("split_k", 1)
        config["GROUP_SIZE_M"] = leaf.get("group_size_m", 8)
    else:
        config["CAST_TYPE"] = True
    return config


def config_leaves(data):
    """(max_loras, num_slices, leaf) of vLLM's config_data[max_loras][num_slices][m][k][n]."""
    for max_loras, by_slices in data.items() if isinstance(data, dict) else ():
        for num_slices, subtree in by_slices.items() if isinstance(by_slices, dict) else ():
            for leaf in leaf_configs(subtree):
                yield max_loras, num_slices, leaf


def leaf_configs(node) -> list[dict]:
    """The kernel configs (dicts with a block_n) anywhere below ``node``."""
    if isinstance(node, dict) and "block_n" in node:
        return [node]
    if isinstance(node, dict):
        return [leaf for child in node.values() for leaf in leaf_configs(child)]
    return []


def _key(case: Case) -> str:
    return json.dumps(
        [case.op, case.slices, case.input_dtype, case.model_dtype, case.path, case.config],
        sort_keys=True,
        default=str,
    )


# ----- compiling and disassembling -----


def _kernels_module(tree: VllmTree, directory: Path):
    """The tree's @triton.jit functions, extracted from its sources into one module."""
    lines = ["import triton", "import triton.language as tl", ""]
    for name in ("kernel_utils.py", "lora_expand_op.py", "lora_shrink_op.py"):
        source = tree.path(f"{OPS_DIR}/{name}").read_text(encoding="utf-8").splitlines()
        for node in ast.parse("\n".join(source)).body:
            is_jit = isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d).startswith("triton.jit") for d in node.decorator_list
            )
            if is_jit:
                lines += source[node.decorator_list[0].lineno - 1 : node.end_lineno] + [""]
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    module_name = f"patchkit_lora_kernels_{digest}"  # stable: Triton's cache can be reused
    path = directory / f"{module_name}.py"
    path.write_text("\n".join(lines), encoding="utf-8")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # Triton's JIT looks its globals up there
    spec.loader.exec_module(module)
    return module


_TYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _signature(case: Case, params: list[inspect.Parameter]) -> tuple[dict, dict, list[str]]:
    """Triton signature, constexpr values and 16-divisible arguments for one case."""
    c = case.config
    single, same = case.slices == 1, case.slices != 3  # 3 slices: q/k/v of unequal width
    model = "*" + _TYPES[case.model_dtype]
    add_inputs, gdc = PATHS.get(case.path, (False, False))
    pointer = {
        "input_ptr": "*" + _TYPES[case.input_dtype],
        "lora_ptr": model if single else "*u64",
        "out_ptr": model if case.op == "expand" else "*fp32",
        "token_indices_sorted_by_lora_ids": "*i32", "num_tokens_per_lora": "*i32",
        "lora_token_start_loc": "*i32", "lora_ids": "*i32",
    }  # fmt: skip
    if case.op == "expand":
        pointer.update(
            slice_start_loc="i32" if single else "*u64",
            ls_d0_ptr="i32" if same else "*i64",
            ls_d1_ptr="i32" if same else "*i64",
            output_hs_ptr="i32" if same else "*i64",
        )
    ints = {"M", "N", "K", "input_d0_stride", "input_d1_stride", "lora_d0_stride"}
    ints |= {"lora_d1_stride", "output_d0_stride", "output_d1_stride", "output_split_stride"}
    ones = {"input_d2_stride", "output_d2_stride", "lora_d2_stride"}
    ones |= {"output_d1_stride"} if case.op == "expand" else {"input_d1_stride"}
    if same:
        ones.add("ls_d2_ptr")
    else:
        pointer["ls_d2_ptr"] = "*i64"
    values = {
        "BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"], "BLOCK_K": c["BLOCK_K"],
        "EVEN_K": c.get("EVEN_K", True), "ADD_INPUTS": add_inputs,
        "CAST_TYPE": c.get("CAST_TYPE", case.input_dtype != case.model_dtype),
        "SLICE_NUM": case.slices, "SAME_STRIDE": same, "USE_GDC": gdc, "launch_pdl": gdc,
        "SPLIT_K": c.get("SPLIT_K", 1), "GROUP_SIZE_M": c.get("GROUP_SIZE_M", 8),
    }  # fmt: skip
    signature, constants, divisible = {}, {}, []
    for param in params:
        name = param.name
        if name in ones:
            signature[name], constants[name] = "constexpr", 1
        elif name in pointer:
            signature[name] = pointer[name]
            divisible.append(name)
        elif name in ints:
            signature[name] = "i32"
            if name != "M":
                divisible.append(name)
        elif name == "scaling":
            signature[name] = "fp32"
        elif name in values:
            signature[name], constants[name] = "constexpr", values[name]
        elif param.default is not inspect.Parameter.empty:
            signature[name], constants[name] = "constexpr", param.default
        else:
            raise ValueError(f"kernel parameter {name!r} is unknown to the scan")
    return signature, constants, divisible


def _compile(triton, kernel, case: Case) -> bytes:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(kernel.fn).parameters.values())
    signature, constants, divisible = _signature(case, params)
    names = [p.name for p in params]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    options = {k: case.config[k] for k in ("num_warps", "num_stages", "num_ctas")}
    source = ASTSource(kernel, signature, constants, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["cubin"]


def _disassembler(triton) -> list[str]:
    """cuobjdump (or nvdisasm) from Triton's wheel, else nvidia-cuda-nvdisasm's nvdisasm."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if (bin_dir / "cuobjdump").is_file():
        return [str(bin_dir / "cuobjdump"), "-sass"]
    if (bin_dir / "nvdisasm").is_file():
        return [str(bin_dir / "nvdisasm"), "-c"]
    spec = importlib.util.find_spec("nvidia")
    for location in spec.submodule_search_locations if spec else []:
        candidate = Path(location) / "cuda_nvdisasm" / "bin" / "nvdisasm"
        if candidate.is_file():
            return [str(candidate), "-c"]
    found = shutil.which("nvdisasm")
    if found:
        return [found, "-c"]
    raise ScanUnavailable(
        "no SASS disassembler: Triton's wheel has no cuobjdump/nvdisasm; "
        "`pip install nvidia-cuda-nvdisasm` provides one"
    )


def _ptxas(triton) -> str:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return os.environ.get("TRITON_PTXAS_PATH") or str(bundled)


def scan(tree: VllmTree, gpu_name: str = "NVIDIA H200", called=None, select=None) -> ScanReport:
    """Compile every case and read its SASS.

    ``called(case)`` returns (runs here?, why not) for each case; ``select(case)``
    limits the cases compiled (tests use it to stay quick).
    """
    from patchkit.diagnosis.doctor import ptxas_version

    report = ScanReport()
    started = time.monotonic()
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install
        report.error = f"Triton is not importable here ({type(exc).__name__}: {exc})"
        return report
    report.triton = triton.__version__
    report.ptxas = _ptxas(triton)
    report.ptxas_version = ptxas_version(report.ptxas) or "unknown"
    try:
        disassemble = _disassembler(triton)
    except ScanUnavailable as exc:
        report.error = str(exc)
        return report
    report.disassembler = Path(disassemble[0]).name
    cases = default_cases(tree, gpu_name) + tuned_cases(os.environ.get("VLLM_TUNED_CONFIG_FOLDER"))
    cases = [c for c in cases if select is None or select(c)]
    with tempfile.TemporaryDirectory(prefix="patchkit-kernels-") as tmp:
        module = _kernels_module(tree, Path(tmp))
        try:
            cubins = {}
            for n, case in enumerate(cases):  # Triton compiles one at a time (its cache helps)
                if called is not None:
                    case.called, case.why_not_called = called(case)
                cubins[n] = _compile_case(triton, module, case)
        finally:
            sys.modules.pop(module.__name__, None)
        # disassembling is the slow part (~0.4 s a kernel): in parallel, and cached
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            listings = pool.map(lambda n: _listing(cubins[n], disassemble, Path(tmp), n), cubins)
            for n, listing in zip(cubins, listings, strict=True):
                _read_findings(cases[n], listing)
    report.cases = cases
    report.seconds = round(time.monotonic() - started, 1)
    return report


def _compile_case(triton, module, case: Case) -> bytes | None:
    """The case's cubin; None (and the case marked ``error``) if it cannot be built."""
    if case.verdict == "error":
        return None  # its config could not be computed
    kernel = getattr(module, f"_lora_{case.op}_kernel", None)
    if kernel is None:
        case.verdict, case.error = "error", f"no _lora_{case.op}_kernel in this tree"
        return None
    try:
        return _compile(triton, kernel, case)
    except Exception as exc:  # a compile error is a finding to report, not a crash
        case.verdict = "error"
        case.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        return None


def _listing(cubin: bytes | None, disassemble: list[str], tmp: Path, n: int) -> str | None:
    """The SASS of a cubin, from patchkit's cache when the same cubin was read before."""
    if cubin is None:
        return None
    from patchkit.target.fetch import cache_root

    cached = cache_root() / "sass" / f"{hashlib.sha256(cubin).hexdigest()}.sass"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    path = tmp / f"kernel-{n}.cubin"
    path.write_bytes(cubin)
    listing = subprocess.run(
        [*disassemble, str(path)], capture_output=True, text=True, timeout=120
    ).stdout
    if "HGMMA" in listing or "EXIT" in listing:  # a real listing: keep it
        try:
            write_cache_file(cached, listing.encode("utf-8"))
        except OSError:
            pass  # a read-only cache only costs time
    return listing


def _read_findings(case: Case, listing: str | None) -> None:
    if listing is None:
        return
    if not listing.strip():
        case.verdict, case.error = "error", "the disassembler printed nothing"
        return
    findings = sass.scan(listing)
    case.verdict, case.hgmma = findings.verdict, findings.hgmma
    case.register_a = findings.register_a
    case.hazards = [h.to_json() for h in findings.hazards]
