"""GPU proof and cost of the nan-probe patch.

Run on the test H200 with vLLM 0.26.0 patched with the default set and
`patchkit apply --only nan-probe`:

    python3 scripts/proofs/nan_probe_gpu.py OUTDIR [--budget SECONDS]

It builds the e2e tiny Qwen3.5 hybrid (patchkit.verify.e2e: 3 Gated DeltaNet
layers + 1 attention layer), two healthy rank-64 adapters and `poisoned`, a
copy of healthy-b with an inf in the lora_B of layer 1's mlp.down_proj. Then,
in parallel, one child per configuration, each with its own VLLM_CACHE_ROOT
and PATCHKIT_PROBE_LOG:

- proof-{triton,torch}-{eager,cudagraph}: the LoRA backend
  (PATCHKIT_LORA_BACKEND) and enforce_eager on/off. Phase "healthy": one batch
  of base, healthy-a and healthy-b; phase "poisoned": one batch of healthy-a,
  poisoned and base. The child writes result.json (requests, tokens, the
  probe's step count after each phase) and `patchkit probe report --json`.
- bench: two engines with CUDA graphs on the torch LoRA path, probe on
  (PATCHKIT_PROBE_LOG set) and probe off (unset: nothing is wrapped), measured
  in interleaved rounds once the proof children are done: decode (32
  requests, 64-token prompts, 128 new tokens) and prefill (16 requests of
  2000 tokens, 1 new token), tokens per second.

Then it checks: with Triton, the report names layer 1 and mlp.down_proj and
only `poisoned` requests; with the torch path, only `poisoned` rows are bad
(the quarantine), the log holds the quarantine's record and the report names
layer 1, mlp.down_proj and lora_B from it; the healthy phase has zero
records; and prints the throughput ratios. summary.json holds it all.

    python3 scripts/proofs/nan_probe_gpu.py OUTDIR --model moe35b [--budget SECONDS]

serves the Qwen3.5-MoE at 35B-A3B widths instead (scripts/bench_serving.py's
moe35b: 8 layers, 256 routed experts top 8, a shared expert; built on the GPU
into OUTDIR/work, reused by a later run), a rank-16 adapter `healthy` on
attention, GDN, the shared expert and the routed experts, and `poison-shared`,
a copy with inf in three values of layer 1's mlp.shared_expert.down_proj
lora_B; one configuration, the default torch path under CUDA graphs
(`torch-cudagraph`), no bench. Its checks: the healthy phase writes no record,
only `poison-shared` requests are bad, the engine log has the quarantine's line
naming the adapter, layer 1 and the tensor, the probe log has its record, and
`patchkit probe report` names layer 1, mlp.shared_expert.down_proj and lora_B
(not layer 0's first projection) and `patchkit adapter check`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from patchkit.verify.toolkit import RANK, TARGET_MODULES, qwen35_config  # noqa: E402

POISON_LAYER = 1
POISON_MODULE = "mlp.down_proj"
MOE_POISON_MODULE = "mlp.shared_expert.down_proj"
MOE_RANK = 16
MOE_ENGINE_ARGS = dict(
    max_lora_rank=MOE_RANK, max_loras=2, gpu_memory_utilization=0.2,
    kv_cache_memory_bytes=2 << 30, max_model_len=2048, max_num_seqs=8,
    max_num_batched_tokens=2048, enable_prefix_caching=False,
    compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
)  # fmt: skip
PROOFS = [(b, m) for b in ("triton", "torch") for m in ("eager", "cudagraph")]
ENGINE_ARGS = dict(
    enable_lora=True, max_lora_rank=RANK, max_loras=3, skip_tokenizer_init=True,
    language_model_only=True, gpu_memory_utilization=0.12, max_model_len=4096,
    max_num_seqs=32, max_num_batched_tokens=4096, dtype="bfloat16", seed=0,
    attention_backend="TRITON_ATTN", gdn_prefill_backend="triton",
)  # fmt: skip


def build(work: Path, seed: int = 0) -> dict:
    """The tiny model, healthy-a, healthy-b and poisoned (inf in one lora_B)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(qwen35_config()).to(torch.bfloat16)
    model.save_pretrained(work / "model")
    peft_model = get_peft_model(
        model,
        LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGET_MODULES, init_lora_weights=False),
    )
    adapters = {}
    for name in ("healthy-a", "healthy-b"):
        with torch.no_grad():
            for pname, param in peft_model.named_parameters():
                if "lora_A" in pname or "lora_B" in pname:
                    scale = 0.3 if "lora_B" in pname else 1.0
                    param.normal_(0.0, param.shape[-1] ** -0.5 * scale)
        adapters[name] = str(work / name)
        peft_model.save_pretrained(adapters[name])
    adapters["poisoned"] = str(work / "poisoned")
    tensor = poison(Path(adapters["healthy-b"]), Path(adapters["poisoned"]), POISON_MODULE, 1)
    return {"model": str(work / "model"), "adapters": adapters, "poisoned_tensor": tensor,
            "poisoned": "poisoned", "poison": {"layer": POISON_LAYER, "module": POISON_MODULE,
            "tensor": "lora_B"}}  # fmt: skip


def build_moe(work: Path) -> dict:
    """The 35B-A3B-wide MoE (bench_serving.py's moe35b), `healthy` and `poison-shared`
    (rank 16, attention, GDN, shared and routed experts); a finished build is reused."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_serving

    healthy, poisoned = work / "healthy", work / "poison-shared"
    if not (work / "built.json").exists():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        bench_serving.build(work, model="moe35b", adapters=1, rank=MOE_RANK)
        (work / "adapter-0").rename(healthy)
        tensor = poison(healthy, poisoned, MOE_POISON_MODULE, 3)
        (work / "built.json").write_text(json.dumps({"poisoned_tensor": tensor}))
    tensor = json.loads((work / "built.json").read_text())["poisoned_tensor"]
    return {
        "model": str(work / "model"), "adapters": {"healthy": str(healthy),
        "poison-shared": str(poisoned)}, "poisoned_tensor": tensor, "poisoned": "poison-shared",
        "poison": {"layer": POISON_LAYER, "module": MOE_POISON_MODULE, "tensor": "lora_B"},
        "engine_args": MOE_ENGINE_ARGS,
        "phases": [["healthy", ["base", "healthy"]],
                   ["poisoned", ["healthy", "poison-shared", "base"]]],
        "prompt": 64, "new": 8,
    }  # fmt: skip


def poison(source: Path, dest: Path, module: str, count: int) -> str:
    """Copy an adapter; write inf into lora_B[:count, 0] of layer POISON_LAYER's module."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    path = dest / "adapter_model.safetensors"
    tensors = load_file(str(path))
    wanted = f"layers.{POISON_LAYER}.{module}.lora_B"
    name = next(n for n in sorted(tensors) if wanted in n)
    tensors[name][:count, 0] = float("inf")
    save_file(tensors, str(path), metadata={"format": "pt"})
    return name


# ----- the children -----


RUNNERS = {"v1": "0", "v2": "1"}  # VLLM_USE_V2_MODEL_RUNNER for each (0.19.0-0.33.0)


def child_env(
    out: Path, backend: str, probe: bool, in_process: bool = True, runner: str = ""
) -> dict:
    """A configuration's environment; in_process keeps the engine in the child (the
    proof reads the probe's step count), the bench's two engines need their own.
    ``runner`` ("v1", "v2") forces vLLM's model runner; "" leaves vLLM's default."""
    env = dict(os.environ)
    if runner:
        env["VLLM_USE_V2_MODEL_RUNNER"] = RUNNERS[runner]
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    env["VLLM_CACHE_ROOT"] = str(out / "vllm-cache")
    env["PATCHKIT_LORA_BACKEND"] = backend
    env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    env["VLLM_USE_DEEP_GEMM"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PATCHKIT_PROBE_LOG", None)
    if probe:
        env["PATCHKIT_PROBE_LOG"] = str(out / "probe.jsonl")
    return env


def start(role: str, out: Path, built: Path, env: dict, *extra: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "child.log").open("w")
    command = [sys.executable, __file__, "--child", role, str(out), str(built), *extra]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out)


def engine(built: dict, eager: bool):
    from vllm import LLM

    args = {**ENGINE_ARGS, **built.get("engine_args", {})}
    return LLM(model=built["model"], enforce_eager=eager, **args)


def lora(built: dict, name: str):
    """The adapter's request: ids 1, 2, ... in the order built lists them."""
    from vllm.lora.request import LoRARequest

    number = list(built["adapters"]).index(name) + 1
    return LoRARequest(name, number, built["adapters"][name])


def prompt(n: int, salt: int) -> dict:
    return {"prompt_token_ids": [(i * 7919 + salt * 104729) % 4000 + 1 for i in range(n)]}


def generate(llm, built: dict, names: list[str], length: int, new: int) -> list[dict]:
    """One batch: each name is 'base' or an adapter; greedy; the tokens that came back."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0)
    prompts = [prompt(length, i) for i in range(len(names))]
    loras = [None if n == "base" else lora(built, n) for n in names]
    results = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return [
        {"name": n, "request_id": r.request_id, "tokens": list(r.outputs[0].token_ids)}
        for n, r in zip(names, results, strict=True)
    ]


def proof_child(out: Path, built: dict, mode: str) -> None:
    """Healthy batch, then a batch with the poisoned adapter; the probe's steps after each."""
    from vllm.v1.worker import patchkit_nan_probe as probe_module

    started = time.monotonic()
    llm = engine(built, eager=(mode == "eager"))
    result = {"engine_seconds": time.monotonic() - started, "phases": {}}
    phases = built.get("phases") or (("healthy", ["base", "healthy-a", "healthy-b"]),
                                     ("poisoned", ["healthy-a", "poisoned", "base"]))  # fmt: skip
    for phase, names in phases:
        requests = generate(llm, built, names, built.get("prompt", 600), built.get("new", 16))
        probe_module.flush()
        result["phases"][phase] = {"requests": requests, "probe_steps": probe_module._PROBE.step}
    (out / "result.json").write_text(json.dumps(result, indent=1))


def bench_child(out: Path, built: dict, ready: Path, deadline: float) -> None:
    """Probe on and off, CUDA graphs, torch LoRA path: interleaved rounds until the deadline."""
    engines = {}
    for name in ("off", "on"):
        env = child_env(
            out / name, "torch", probe=(name == "on"), in_process=False,
            runner=built.get("runner", ""),
        )  # fmt: skip
        (out / name).mkdir(parents=True, exist_ok=True)
        os.environ.clear()
        os.environ.update(env)
        engines[name] = engine(built, eager=False)
    while not ready.exists() and time.time() < deadline - 120:
        time.sleep(2)
    rounds = []
    loras = ["healthy-a", "healthy-b", "base", "base"]
    while time.time() < deadline - 30 and len(rounds) < 12:
        row = {}
        for name in ("off", "on") if len(rounds) % 2 == 0 else ("on", "off"):
            llm = engines[name]
            row[f"decode_{name}"] = timed(llm, built, [loras[i % 4] for i in range(32)], 64, 128)
            row[f"prefill_{name}"] = timed(llm, built, [loras[i % 4] for i in range(16)], 2000, 1)
        rounds.append(row)
        (out / "bench.json").write_text(json.dumps({"rounds": rounds}, indent=1))


def timed(llm, built: dict, names: list[str], length: int, new: int) -> float:
    """Tokens per second of one batch (prompt tokens for prefill, new tokens for decode)."""
    started = time.perf_counter()
    generate(llm, built, names, length, new)
    seconds = time.perf_counter() - started
    return len(names) * (new if new > 1 else length) / seconds


# ----- the parent -----


def report_of(out: Path) -> dict:
    """`patchkit probe report --json` on the child's log (the CLI users run)."""
    done = subprocess.run(
        [sys.executable, "-m", "patchkit", "probe", "report", str(out / "probe.jsonl"), "--json"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    text = subprocess.run(
        [sys.executable, "-m", "patchkit", "probe", "report", str(out / "probe.jsonl")],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    (out / "report.txt").write_text(text.stdout + text.stderr)
    return json.loads(done.stdout) if done.stdout.strip() else {"error": done.stderr}


def check_proof(out: Path, backend: str) -> dict:
    """What the proof asks of one configuration, from its result, log and report."""
    result = json.loads((out / "result.json").read_text())
    report = report_of(out)
    healthy_steps = result["phases"]["healthy"]["probe_steps"]
    records = [json.loads(x) for x in (out / "probe.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if "step" in r]
    healthy_bad = [r for r in steps if r["step"] < healthy_steps]
    findings = report.get("affected_requests", [])
    adapters = sorted({f["adapter"] or "base" for f in findings})
    built = json.loads((out.parent / "built.json").read_text())
    poisoned = built.get("poisoned", "poisoned")
    bad = built.get("poison", {"layer": POISON_LAYER, "module": POISON_MODULE, "tensor": "lora_B"})
    checks = {
        "healthy_phase_zero_records": not healthy_bad,
        "only_poisoned_requests_bad": adapters == [poisoned],
    }
    if built.get("runner"):  # the log's header names the runner its hooks are in
        header = next((r for r in records if "probe" in r), {})
        checks["log_header_names_the_runner"] = header.get("runner") == built["runner"]
    if backend == "triton":
        checks["report_names_layer_and_projection"] = bool(findings) and all(
            f["layer"] == bad["layer"] and f["module"] == bad["module"] for f in findings
        )
    else:
        checks.update(quarantine_checks(out, records, findings, poisoned, bad))
    return {"checks": checks, "findings": findings, "engine_seconds": result["engine_seconds"],
            "records": len(steps), "poisoned_tokens": _tokens(result, poisoned),
            "quarantines": report.get("quarantines", []),
            "quarantine_lines": quarantine_lines(out)}  # fmt: skip


def quarantine_lines(out: Path) -> list[str]:
    """The torch path's quarantine lines in the engine's log, as vLLM printed them."""
    log = (out / "child.log").read_text(errors="replace").splitlines()
    return [x for x in log if "patchkit LoRA torch path" in x][:4]


def quarantine_checks(out: Path, records: list, findings: list, poisoned: str, bad: dict) -> dict:
    """The torch path's quarantine, named: its engine log line, its probe record, and
    the report naming the tensor from it (not layer 0's first projection)."""
    want = (bad["layer"], bad["module"], bad["tensor"])
    events = [r for r in records if r.get("event") == "quarantine"]
    line = f"adapter '{poisoned}' (id "
    named = f"layer {bad['layer']} {bad['module']} {bad['tensor']} has non-finite values"
    return {
        "engine_log_names_adapter_and_tensor": any(
            line in x and named in x for x in quarantine_lines(out)
        ),
        "probe_log_has_quarantine_record": [
            (e["adapter"], e["layer"], e["module"], e["tensor"]) for e in events
        ]
        == [(poisoned, *want)],
        "report_names_layer_and_tensor": bool(findings)
        and all(
            (f["layer"], f["module"], f.get("tensor")) == want
            and (f.get("command") or "").startswith("patchkit adapter check ")
            for f in findings
        ),
    }


def _tokens(result: dict, name: str) -> list[int]:
    return next(r["tokens"] for r in result["phases"]["poisoned"]["requests"] if r["name"] == name)


def bench_summary(out: Path) -> dict:
    path = out / "bench.json"
    if not path.exists():
        return {"error": "no bench rounds"}
    rounds = json.loads(path.read_text())["rounds"]
    summary = {"rounds": len(rounds)}
    for kind in ("decode", "prefill"):
        ratios = sorted(r[f"{kind}_on"] / r[f"{kind}_off"] for r in rounds)
        summary[kind] = {
            "median_on_over_off": ratios[len(ratios) // 2] if ratios else None,
            "ratios": ratios,
            "median_tok_s_off": _median([r[f"{kind}_off"] for r in rounds]),
            "median_tok_s_on": _median([r[f"{kind}_on"] for r in rounds]),
        }
    return summary


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def wait(child: subprocess.Popen, until: float) -> None:
    """Wait for a child until the wall-clock time ``until``; kill it then (its log stays)."""
    try:
        child.wait(timeout=max(1, until - time.time()))
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def parent(out: Path, budget: float, proofs: list[str], serial: bool, with_bench: bool,
           model: str = "tiny", runner: str = "") -> int:  # fmt: skip
    """Build, then run the proof children and the bench; ``serial`` runs one engine
    start at a time (vLLM's memory profiling fails when another process on the GPU
    frees memory meanwhile, seen on the H200 with six engines starting at once)."""
    deadline = time.time() + budget
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    built = build_moe(out / "work") if model == "moe35b" else build(out / "work")
    built["build_seconds"] = time.monotonic() - started
    built["runner"] = runner
    built_file = out / "built.json"
    built_file.write_text(json.dumps(built, indent=1))
    ready = out / "proofs-done"
    children = {}
    for name in proofs:
        backend, mode = name.split("-")
        env = child_env(out / f"proof-{name}", backend, True, runner=runner)
        children[name] = start("proof", out / f"proof-{name}", built_file, env, mode)
        if serial:
            wait(children[name], deadline - 60)
    if not serial:
        for child in children.values():
            wait(child, deadline - 60)
    ready.write_text("go")
    if not with_bench:
        return judge(out)
    bench = start("bench", out / "bench", built_file,
                  child_env(out / "bench", "torch", False, in_process=False, runner=runner),
                  str(ready), str(deadline))  # fmt: skip
    wait(bench, deadline)
    return judge(out)


def judge(out: Path) -> int:
    """Check every configuration and summarise the bench into summary.json."""
    built = json.loads((out / "built.json").read_text())
    summary = {"built": built, "proofs": {}}
    for backend, mode in PROOFS:
        name = f"proof-{backend}-{mode}"
        if not (out / name).exists():
            continue
        try:
            summary["proofs"][name] = check_proof(out / name, backend)
        except (OSError, ValueError, KeyError, StopIteration) as exc:
            summary["proofs"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    summary["bench"] = bench_summary(out / "bench")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    for name, proof in summary["proofs"].items():  # the lines that prove it, last
        passed = proof.get("checks") and all(proof["checks"].values())
        print(f"{name}: {'PASS' if passed else 'FAIL'} {proof.get('checks', proof)}")
        for line in proof.get("quarantine_lines", [])[:1]:
            print(f"  engine log: {line.strip()}")
        for finding in proof.get("findings", [])[:2]:
            print(f"  report: request {finding['request']} ({finding['adapter']}): "
                  f"layer {finding['layer']} {finding['module']} {finding.get('tensor')}: "
                  f"{finding['verdict']}")  # fmt: skip
    ok = all(all(p.get("checks", {"x": False}).values()) for p in summary["proofs"].values())
    return 0 if ok else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        role, out, built_file = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
        built = json.loads(built_file.read_text())
        if role == "proof":
            proof_child(out, built, sys.argv[5])
        else:
            bench_child(out, built, Path(sys.argv[5]), float(sys.argv[6]))
        return 0
    parser = argparse.ArgumentParser(description="GPU proof and cost of the nan-probe patch")
    parser.add_argument("out", type=Path)
    parser.add_argument("--budget", type=float, default=500.0, help="seconds for everything")
    parser.add_argument(
        "--check", action="store_true", help="only judge an OUT a run left (on any machine)"
    )
    parser.add_argument(
        "--proofs", default=",".join(f"{b}-{m}" for b, m in PROOFS),
        help="comma-separated BACKEND-MODE configurations (default: all four)",
    )  # fmt: skip
    parser.add_argument("--serial", action="store_true", help="start one engine at a time")
    parser.add_argument(
        "--no-bench", action="store_true",
        help="the proofs only (scripts/bench_serving.py measures the cost)",
    )  # fmt: skip
    parser.add_argument(
        "--model", choices=("tiny", "moe35b"), default="tiny",
        help="moe35b: the 35B-A3B-wide MoE, shared-expert poison, torch-cudagraph only",
    )  # fmt: skip
    parser.add_argument(
        "--runner", choices=("v1", "v2"), default="",
        help="force vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER, 0.19.0-0.33.0); the "
        "probe log's header must name it",
    )  # fmt: skip
    args = parser.parse_args()
    if args.check:
        return judge(args.out)
    if args.model == "moe35b":
        return parent(
            args.out, args.budget, ["torch-cudagraph"], True, False, "moe35b", args.runner
        )
    return parent(
        args.out, args.budget, args.proofs.split(","), args.serial, not args.no_bench,
        runner=args.runner,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
