"""Host time of one add_lora_linear call of the torch LoRA path, per route.

Prefill steps too large for vLLM's CUDA graphs run eagerly: each LoRA call's
Python and dispatch work is paid on the host every step, and a profile of
MoE 16 x r64 prefill on the H200 found the default set's GPU idle more than
unpatched vLLM's (docs/evidence.md, 2026-12-02i). This measures that host
work alone: the op is called the way vLLM's compiled graph calls it
(torch.ops.patchkit_lora.add_lora_linear) with tiny tensors, so that the
kernels' own time is negligible, and each case reports microseconds per call
(median of --repeats runs of --calls calls; each run's in runs_us) and the aten ops
one call issues (torch.profiler). Loads `patchkit_lora_matmul.py` from patches/.

  route   tokens  what the call takes
  gemm    16      the GEMM route over every slot (16 slots, 15 in use)
  narrow  16      the GEMM route on the batch's 2 slots (ActiveSlots)
  split   12      one slice only: the split shrink
  gemv    4       the Triton GEMVs (CUDA only)

  python scripts/bench_lora_host.py [--device cpu|cuda] [--module FILE] [--json FILE]
        [--gemv-without-launches] [--plan-key]

--gemv-without-launches (CPU): the GEMV route too, its two kernels' launches replaced
by nothing, so that the route's own Python work is timed apart from the launches.

--plan-key: instead of the op, the check each call makes of its layer's plan (the
key `_pointers` of the call's A and B, made and compared with the plan's, 1-4
slices; route `plan-key`): what a module's key adds to every call, apart from the
rest of its host work.

--module measures another copy of the module (an earlier commit's, from `git
show REV:patches/matmul-add-lora-linear/files/vllm/lora/punica_wrapper/
patchkit_lora_matmul.py`), one module a process: each registers the same ops.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODULE = ROOT / "patches/matmul-add-lora-linear/files/vllm/lora/punica_wrapper"
MODULE = MODULE / "patchkit_lora_matmul.py"
SLOTS, RANK, HIDDEN = 16, 4, 32
SLICES = (1, 2, 3, 4)
# route: (tokens, slots in use); 16 tokens is above the GEMV bound and small enough
# that the CPU's own matmuls cost little next to the host work measured
ROUTES = {"gemm": (16, 15), "narrow": (16, 2), "split": (12, 15), "gemv": (4, 4)}
SPLIT_K_MAX_TOKENS = 12  # so that one-slice calls of 16 tokens take the GEMM route


def load_module(path: Path = MODULE):
    spec = importlib.util.spec_from_file_location("patchkit_lora_matmul", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def op_arguments(m, device, slices, tokens, used) -> tuple:
    """The op's arguments as the wrapper passes them, weights laid out as adopt does."""
    gen = torch.Generator(device=device).manual_seed(0)
    widths = [16 * (s + 1) for s in range(slices)]
    a = [torch.randn(SLOTS, 1, RANK, HIDDEN, device=device, generator=gen) for _ in widths]
    b = [torch.randn(SLOTS, 1, w, RANK, device=device, generator=gen) for w in widths]
    for t in b:
        m._make_b_rank_major(t)
    if slices > 1:
        m._share_a_storage(a)
    mapping = torch.arange(tokens, device=device) % used
    lora_ids = torch.arange(SLOTS + 1, device=device) - 1
    weights, no_lora = m._batch_weights(mapping, lora_ids, SLOTS, torch.float32)
    reduce_weights = weights.reshape(-1, 1, 1).expand(-1, 1, 8).contiguous()
    active = m.ActiveSlots(SLOTS, device)
    active_ids = torch.full((SLOTS + 1,), -1, dtype=torch.int32, device=device)
    active_ids[:used] = torch.arange(used, dtype=torch.int32)
    active.build(active_ids, tokens)
    x = torch.randn(tokens, HIDDEN, device=device, generator=gen)
    y = torch.zeros(tokens, sum(widths), device=device)
    flag = torch.tensor(False)
    return (y, x, a, b, weights, reduce_weights, no_lora, flag, 1.0, True, active.index,
            active.state_cpu)  # fmt: skip


class NoLaunch:
    """A Triton kernel whose launch does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def without_gemv_launches(m) -> None:
    """The module's GEMV route taken on the CPU, its kernels launching nothing."""
    m._gemv_shrink_kernel = m._gemv_expand_kernel = NoLaunch()
    m._gemv_device = lambda x: True
    if m.triton is None:  # a CPU install without Triton: the route only checks it is there
        m.triton = object()


def per_call_us(call, device, calls: int, repeats: int) -> list[float]:
    """µs a call in each of `repeats` runs of `calls` calls, after a warm-up run. All of
    them, not only their median: a row that differs between two modules in every run
    is the code's, one whose runs spread as far is the host's (2026-12-02l's GEMM row)."""
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        for _ in range(calls):
            call()
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return runs[1:]


def aten_ops(call) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def sha256(path: Path) -> str:
    """The measured module's digest: which code ran, where the checkout's commit is not
    known (a copy of the tree on another host may carry a stale or no .git)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--module", type=Path, default=MODULE)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--gemv-without-launches", action="store_true")
    parser.add_argument("--plan-key", action="store_true")
    args = parser.parse_args()
    if args.gemv_without_launches and args.device != "cpu":
        parser.error("--gemv-without-launches is for the CPU: on CUDA the launches are real")
    m = load_module(args.module)
    if args.gemv_without_launches:
        without_gemv_launches(m)
    m.ACTIVE_MIN_WORK = 0  # tiny shapes: narrow wherever the batch allows
    m.SPLIT_K_MAX_TOKENS = SPLIT_K_MAX_TOKENS
    op = torch.ops.patchkit_lora.add_lora_linear.default
    info = dict(commit=commit(), module=str(args.module), module_sha256=sha256(args.module),
                host=platform.node(), device=args.device,
                gemv_without_launches=args.gemv_without_launches,
                torch=torch.__version__, python=platform.python_version())  # fmt: skip
    print(json.dumps(info), flush=True)
    rows = plan_key_rows(m, args) if args.plan_key else op_rows(m, args, op)
    if args.json:
        args.json.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    return 0


def measure(call, device, route, slices, tokens, calls, repeats) -> dict:
    """One printed row: µs a call (every counted run, and their median), aten ops a call."""
    with torch.no_grad():
        runs = per_call_us(call, device, calls, repeats)
        ops = aten_ops(call)
    row = dict(route=route, slices=slices, tokens=tokens, us=round(statistics.median(runs), 1),
               aten_ops=ops, runs_us=[round(r, 1) for r in runs])  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def plan_key_rows(m, args) -> list[dict]:
    """Each slice count's plan check alone: the call's key made and compared with the
    plan's, as LayerPlan.matches does."""
    rows = []
    for slices in SLICES:
        _, _, a, b, *_ = op_arguments(m, args.device, slices, *ROUTES["gemm"])
        kept = m._pointers(a, b)
        rows.append(measure(lambda a=a, b=b, kept=kept: kept == m._pointers(a, b), args.device,
                            "plan-key", slices, 0, args.calls, args.repeats))  # fmt: skip
    return rows


def op_rows(m, args, op) -> list[dict]:
    """Each route's call through the op, as vLLM's compiled graph makes it."""
    rows = []
    for route, (tokens, used) in ROUTES.items():
        if route == "gemv" and args.device != "cuda" and not args.gemv_without_launches:
            continue
        for slices in SLICES if route != "split" else (1,):
            arguments = op_arguments(m, args.device, slices, tokens, used)

            def call(arguments=arguments):
                op(*arguments)

            rows.append(measure(call, args.device, route, slices, tokens, args.calls,
                                args.repeats))  # fmt: skip
    return rows


if __name__ == "__main__":
    sys.exit(main())
