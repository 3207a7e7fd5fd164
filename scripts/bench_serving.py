"""Serving throughput of vLLM under each patchkit configuration, side by side on one GPU (issue 10).

What it measures: a Qwen3.5-27B-width hybrid cut to 8 layers (6 Gated
DeltaNet + 2 attention, about 3.1 B parameters, random bf16 weights) with 4
random rank-64 adapters on every linear module, served by vllm.LLM with its
defaults (torch.compile, CUDA graphs), max_loras 4, max_num_seqs 64. Each
configuration gets its own engine, in its own process, on its own copy of the
vLLM tree (hard links; patchkit writes new files, so the copies never share a
patched file) and its own empty compile cache:

  unpatched            the release as installed
  only:<patch>         `patchkit apply --only <patch>`, for each patch this release needs
  default              `patchkit apply` (torch LoRA path)
  default+triton       the same tree, PATCHKIT_LORA_BACKEND=triton

All engines start together and stay up; the workloads then run one engine
at a time, configurations in a new order each round, so drift over time
falls on all of them alike. Round 0 warms up (adapter loads, Triton JIT; the
same batch shapes, 32 tokens out) and is not counted; the table gives the
median of the rounds after it, as many as fit the deadline, judged by the
time of the counted rounds.

Workloads (token-id prompts, greedy, ignore_eos; no prefix caching):
  decode_b64_lora / _base   64 prompts of 128 tokens, 256 tokens out each; output tok/s
                            (LoRA: the 4 adapters round-robin)
  decode_b1_lora / _base    1 prompt of 128 tokens, 256 out; output tok/s
  prefill_lora / _base      16 prompts of 4096 tokens, 1 out; prompt tok/s

Steps (the GPU host has no network; see ../shared/device):
  python scripts/bench_serving.py build DIR            model + adapters (transformers, peft)
  python scripts/bench_serving.py run DIR --site /opt/site [--rounds 3] [--deadline 480]
        [--json FILE] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from patchkit.e2e import TARGET_MODULES, qwen35_config  # noqa: E402

RANK, ADAPTERS, MAX_SEQS = 64, 4, 64
# Qwen3.5-27B widths, 8 layers (6 Gated DeltaNet + 2 attention).
WIDTHS = dict(
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    num_attention_heads=24,
    num_key_value_heads=4,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
)
WORKLOADS = {
    "decode_b64_lora": dict(n=64, prompt=128, out=256, lora=True),
    "decode_b64_base": dict(n=64, prompt=128, out=256, lora=False),
    "decode_b1_lora": dict(n=1, prompt=128, out=256, lora=True),
    "decode_b1_base": dict(n=1, prompt=128, out=256, lora=False),
    "prefill_lora": dict(n=16, prompt=4096, out=1, lora=True),
    "prefill_base": dict(n=16, prompt=4096, out=1, lora=False),
}
MARK = "PATCHKIT_BENCH "
WARMUP_OUT = 32  # round 0 loads the adapters at the counted rounds' batch shapes, briefly


# ----- build: the model and the adapters -----


def build(directory: Path) -> None:
    """Save the cut model (bf16) and 4 random rank-64 adapters, built on the GPU."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    config = qwen35_config(**WIDTHS)
    with torch.device("cuda"):
        model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(directory / "model")
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
    peft_model = get_peft_model(
        model,
        LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGET_MODULES, init_lora_weights=False),
    )
    for number in range(ADAPTERS):
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    param.normal_(0.0, param.shape[-1] ** -0.5 * (0.3 if "lora_B" in name else 1))
        peft_model.save_pretrained(directory / f"adapter-{number}")


# ----- sites: one vLLM tree per configuration -----


def patchkit(*args: str, target: Path) -> dict:
    command = [sys.executable, "-m", "patchkit.cli", *args, "--target", str(target), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"patchkit {' '.join(args)} on {target}: {done.stdout}{done.stderr}")
    return json.loads(done.stdout)


def make_sites(site: Path, work: Path) -> dict[str, dict]:
    """{config: {"site": path, "env": {...}}}: hard-linked copies of the vLLM tree, patched."""
    status = patchkit("status", target=site)
    needed = [p["id"] for p in status["patches"] if p["state"] == "needed"]
    configs = {"unpatched": [], **{f"only:{p}": [p] for p in needed}, "default": needed}
    sites = {}
    for name, patches in configs.items():
        target = work / "sites" / name.replace(":", "-")
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for entry in site.iterdir():
            if entry.name == "vllm" or entry.name.startswith("vllm-"):
                subprocess.run(["cp", "-al", str(entry), str(target / entry.name)], check=True)
        if patches:
            patchkit("apply", *[a for p in patches for a in ("--only", p)], target=target)
        sites[name] = {"site": str(target), "patches": patches, "env": {}}
    sites["default+triton"] = {**sites["default"], "env": {"PATCHKIT_LORA_BACKEND": "triton"}}
    return sites


# ----- the engine, one per configuration (a child process) -----


def worker(model: Path, adapters: list[Path]) -> None:
    """Start an engine, say so, then run the workloads named on stdin, one per line."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    started = time.monotonic()
    llm = LLM(
        model=str(model),
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=ADAPTERS,
        max_num_seqs=MAX_SEQS,
        max_model_len=4608,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.12,
        kv_cache_memory_bytes=4 << 30,  # no KV sizing by profiling: engines start side by side
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 48, 64]},
        skip_tokenizer_init=True,
        language_model_only=True,
        attention_backend="TRITON_ATTN",
        gdn_prefill_backend="triton",
        dtype="bfloat16",
        seed=0,
    )
    requests = [LoRARequest(f"a{n}", n + 1, str(path)) for n, path in enumerate(adapters)]
    say({"ready": True, "start_s": time.monotonic() - started})
    for line in sys.stdin:
        command = json.loads(line)
        say(run_workload(llm, SamplingParams, requests, command["workload"], command["round"]))


def run_workload(llm, sampling_params, requests, name: str, round_: int) -> dict:
    spec = WORKLOADS[name]
    rnd = random.Random(f"{name}-{round_}")
    prompts = [
        {"prompt_token_ids": [rnd.randrange(1, 4000) for _ in range(spec["prompt"])]}
        for _ in range(spec["n"])
    ]
    out = spec["out"] if round_ > 0 else min(spec["out"], WARMUP_OUT)
    params = sampling_params(max_tokens=out, temperature=0.0, ignore_eos=True)
    lora = None
    if spec["lora"]:
        lora = [requests[(round_ + i) % len(requests)] for i in range(spec["n"])]
    started = time.perf_counter()
    results = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    seconds = time.perf_counter() - started
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    counted = spec["n"] * spec["prompt"] if spec["out"] == 1 else generated
    return {"workload": name, "round": round_, "seconds": seconds, "tok_s": counted / seconds,
            "generated": generated}  # fmt: skip


def say(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


# ----- run: start the engines, interleave the workloads -----


class Engine:
    def __init__(self, name: str, config: dict, work: Path, base_path: str):
        self.name = name
        cache = work / "cache" / name.replace(":", "-").replace("+", "-")
        shutil.rmtree(cache, ignore_errors=True)  # a fresh torch.compile cache per config
        cache.mkdir(parents=True)
        env = dict(os.environ, **config["env"], VLLM_CACHE_ROOT=str(cache), PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([config["site"], base_path])
        self.log = (work / f"engine-{name.replace(':', '-')}.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, __file__, "worker", str(work)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
            cwd=ROOT,
        )  # fmt: skip

    def read(self, deadline: float) -> dict:
        """The next message of the engine; its other output goes to the log."""
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"engine {self.name} exited; see {self.log.name}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            self.log.write(line)
        raise TimeoutError(f"engine {self.name}: no answer in time")

    def ask(self, workload: str, round_: int, deadline: float) -> dict:
        self.process.stdin.write(json.dumps({"workload": workload, "round": round_}) + "\n")
        self.process.stdin.flush()
        return self.read(deadline)

    def stop(self) -> None:
        if not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def run(work: Path, site: Path, rounds: int, deadline_s: float) -> dict:
    started = time.monotonic()
    deadline = started + deadline_s
    configs = make_sites(site, work)
    base_path = os.environ.get("PYTHONPATH", "")
    engines = {name: Engine(name, config, work, base_path) for name, config in configs.items()}
    results: dict = {"configs": configs, "rounds": [], "start_s": {}, "errors": {}}
    for name, engine in list(engines.items()):
        try:
            results["start_s"][name] = engine.read(deadline)["start_s"]
        except (RuntimeError, TimeoutError) as exc:
            results["errors"][name] = str(exc)
            engine.process.kill()
            del engines[name]
    round_times = []
    for round_ in range(rounds + 1 if engines else 0):
        began = time.monotonic()
        if round_ > 1 and began + 1.2 * max(round_times[1:]) > deadline:
            break  # judged by the counted rounds: the warm-up round is shorter
        order = list(engines)
        order = order[round_ % len(order) :] + order[: round_ % len(order)]
        try:
            for workload in WORKLOADS:
                for name in order:
                    result = engines[name].ask(workload, round_, deadline)
                    results["rounds"].append({"config": name, **result})
        except (RuntimeError, TimeoutError) as exc:  # keep what was measured
            results["errors"]["run"] = f"round {round_}: {exc}"
            results["rounds"] = [r for r in results["rounds"] if r["round"] != round_]
            break
        round_times.append(time.monotonic() - began)
        save_partial(work, results)
    for engine in engines.values():
        engine.process.stdin.close()  # all at once: each then shuts down on its own
    for engine in engines.values():
        engine.stop()
    return results


def save_partial(work: Path, results: dict) -> None:
    """results.json after each round, so a run cut short keeps its finished rounds."""
    (work / "results.json").write_text(json.dumps(results, indent=1))


def table(results: dict, meta: dict) -> str:
    """Markdown: median tok/s of the counted rounds; in brackets the median, over
    rounds, of each configuration's ratio to unpatched in the same round (drift
    over time cancels within a round)."""
    counted = [r for r in results["rounds"] if r["round"] > 0]
    configs = list(results["configs"])
    lines = [
        f"{meta['date']}, {meta['gpu']}, vLLM {meta['vllm']}, torch {meta['torch']}; "
        f"median of {meta['rounds']} rounds after a warm-up round; tok/s "
        "(decode: output tokens, prefill: prompt tokens); in brackets the median of the "
        "per-round ratios to unpatched and their range",
        "",
        "| workload | " + " | ".join(configs) + " |",
        "|---|" + "---|" * len(configs),
    ]
    for workload in WORKLOADS:
        by_round = {}
        for r in counted:
            if r["workload"] == workload:
                by_round.setdefault(r["round"], {})[r["config"]] = r["tok_s"]
        cells = []
        for name in configs:
            values = [row[name] for row in by_round.values() if name in row]
            ratios = [row[name] / row["unpatched"] for row in by_round.values()
                      if name in row and row.get("unpatched")]  # fmt: skip
            if not values:
                cells.append("n/a")
            elif name != "unpatched" and ratios:
                cells.append(f"{statistics.median(values):.0f} "
                             f"({100 * statistics.median(ratios):.1f} %, "
                             f"{100 * min(ratios):.0f}-{100 * max(ratios):.0f})")  # fmt: skip
            else:
                cells.append(f"{statistics.median(values):.0f}")
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("build").add_argument("dir", type=Path)
    work = sub.add_parser("worker")
    work.add_argument("dir", type=Path)
    go = sub.add_parser("run")
    go.add_argument("dir", type=Path)
    go.add_argument("--site", type=Path, required=True, help="the directory holding vllm/")
    go.add_argument("--rounds", type=int, default=6, help="counted rounds at most")
    go.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole run")
    go.add_argument("--json", type=Path)
    go.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    if args.step == "build":
        build(args.dir)
    elif args.step == "worker":
        worker(args.dir / "model", [args.dir / f"adapter-{n}" for n in range(ADAPTERS)])
    else:
        results = run(args.dir, args.site, args.rounds, args.deadline)
        import torch
        import vllm

        counted = {r["round"] for r in results["rounds"] if r["round"] > 0}
        meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                "vllm": vllm.__version__, "torch": torch.__version__, "rounds": len(counted),
                "command": " ".join(sys.argv)}  # fmt: skip
        results["meta"] = meta
        text = table(results, meta)
        print(text)
        print(json.dumps({"start_s": results["start_s"], "errors": results["errors"]}))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        if args.markdown:
            args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
