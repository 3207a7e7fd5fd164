"""Serving throughput of vLLM under each patchkit configuration, side by side on one GPU.

What it measures: a model cut to 8 layers (6 Gated DeltaNet + 2 attention,
random bf16 weights; `build --layers L` for a deeper cut, 3 GDN + 1 attention
repeated) with N random rank-R adapters (`build --adapters N
--rank R`, default 4 x 64; max_loras N, max_lora_rank R), served by vllm.LLM
with its defaults (torch.compile, CUDA graphs), max_num_seqs 64:
  dense27b  Qwen3.5-27B widths, about 3.1 B parameters, adapters on every
            linear module
  moe35b    Qwen3.5-35B-A3B widths (256 routed experts, top 8, a shared
            expert), about 6.8 B parameters, adapters on attention, GDN, the
            shared expert and the routed experts (PEFT's target_parameters)
BENCH_GPU_MEMORY sets each engine's gpu_memory_utilization (default 0.12) and
BENCH_KV_GIB its KV cache (default 4 GiB; a MoE engine's peak was 20.1 GiB with 4). Each
configuration gets its own engine, in its own process, on its own copy of the
vLLM tree (hard links; patchkit writes new files, so the copies never share a
patched file) and its own empty compile cache:

  unpatched            the release as installed
  only:<patch>         `patchkit apply --only <patch>`, for each patch this release needs
  default              `patchkit apply` (torch LoRA path)
  default+triton       the same tree, PATCHKIT_LORA_BACKEND=triton
  default+gemv         the same tree, PATCHKIT_LORA_GEMV=1 (the torch path's GEMV route
                       for decode steps of at most 8 tokens, opt-in when it was measured
                       first, the default since); only when asked for by --configs
  default-gemv         the same tree, PATCHKIT_LORA_GEMV=0 (the GEMV route off: the
                       torch path's GEMM route alone); only when asked for by --configs
  default-active       the same tree, PATCHKIT_LORA_ACTIVE_ONLY=0 (prefill-sized calls'
                       GEMMs over every slot, not only the batch's); only when asked for
                       by --configs
  default+nan-probe    its own tree: `patchkit apply`, then `patchkit apply --only
                       nan-probe`, served with PATCHKIT_PROBE_LOG set (the probe's
                       cost); only when asked for by --configs
  unpatched-twin       a second engine on the unpatched tree: identical code, so its
                       ratios are the method's own spread in the same rounds (A/A);
                       only when asked for by --configs

All engines start together and stay up; the workloads then run one engine
at a time, configurations in a new order each round and each twice, the
second pass mirrored (A B C C B A), so drift over time falls on all of them
alike; a configuration's two legs are pooled. Every adapter is loaded before
an engine says it is ready. Round 0 warms up (Triton JIT; the same batch
shapes, 32 tokens out) and is not counted; the table gives the median of the
rounds after it, as many as fit the deadline, judged by the time of the step's
own rounds.

Workloads (token-id prompts, greedy, ignore_eos; no prefix caching):
  decode_b64_lora / _base   64 prompts of 128 tokens, 256 tokens out each; output tok/s
                            (LoRA: the adapters round-robin)
  decode_b4_lora / _base    4 prompts of 128 tokens, 256 out; output tok/s
  decode_b1_lora / _base    1 prompt of 128 tokens, 256 out; output tok/s
  prefill_lora / _base      16 prompts of 4096 tokens, 1 out; prompt tok/s
  reload_lora               no request: the adapters in turn removed and loaded again
                            (vLLM's remove_lora, add_lora: from the files into a free
                            GPU slot); adapters a minute in the tok/s column

Steps (the GPU host has no network; see ../shared/device):
  python scripts/bench_serving.py build DIR [--model dense27b|moe35b] [--adapters N] [--rank R]
        [--layers L] [--model-from EARLIER_DIR]   (hard links to an earlier build's model,
        same weights) [--linked-adapters]   (adapters 1..N-1 hard links to adapter 0)
  python scripts/bench_serving.py run DIR --site /opt/site [--rounds 6] [--deadline 480]
        [--configs default ...] [--base unpatched] [--after FILE] [--keep] [--json FILE]
        [--markdown FILE]
  python scripts/bench_serving.py more DIR [--rounds N] [--deadline S] [--workloads KIND ...]
        [--leg-seconds S] [--keep] [...]   (--rounds counts from the run's first round; a
        workload new to the engines is warmed up first, uncounted; --leg-seconds, on run
        too: each leg repeats its requests for at least S seconds)
  python scripts/bench_serving.py profile DIR [--workloads KIND ...] [--keep] [--markdown FILE]
        each workload once per engine under vLLM's torch profiler: GPU busy time, kernels
        and LoRA's kernels per engine step (scripts/kernel_trace.py), into DIR/results.json
  python scripts/bench_serving.py stop DIR   (the engines a run kept, without measuring)
  python scripts/bench_serving.py table RESULTS.json [--markdown FILE] [--clocks FILE]
        the tables again (--clocks: gpu_session.sh's clocks.log joined with the legs)
  python scripts/bench_serving.py verdict RESULTS ...   (the batch-1 criterion, a file a set;
        an unpatched twin by the control's rule: identical code within +-3 %, q1 >= 97 %)

Each engine is its own session (setsid) and takes its commands from a FIFO
under DIR/engines/, so with --keep the engines stay up after `run` ends and
`more`, in a later command, measures further rounds on them: the cold start
(about 4 minutes for six engines) is paid once. Each measurement also
records the engine's CPU seconds and the guest's stolen CPU seconds
(/proc/stat), to tell a slow host from a slow configuration.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import itertools
import json
import math
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

from patchkit.verify.toolkit import (  # noqa: E402
    DENSE27B_WIDTHS,
    MOE35B_WIDTHS,
    MOE_TARGET_MODULES,
    TARGET_MODULES,
    qwen35_config,
    qwen35_moe_config,
)

MAX_SEQS = 64
LAYERS = 8  # 6 Gated DeltaNet + 2 attention, unless `build --layers`
MOE_WIDTHS = MOE35B_WIDTHS  # 256 routed experts (top 8) and a shared expert


def widths(model: str, layers: int = LAYERS) -> dict:
    """The model's widths cut to `layers` (a multiple of 4: three Gated DeltaNet layers,
    then one attention layer, as Qwen3.5 repeats them).

    Why deeper cuts: with CUDA graphs a decode step's host work does not grow with
    the layers, its GPU work does; on the 8-layer cut a batch-1 step is mostly the
    host's, whose speed strays by 10-20 % a leg (docs/evidence.md, 2026-12-02), so
    a deeper cut measures the LoRA path's GPU time against less of the host's noise.
    """
    if layers <= 0 or layers % 4:
        raise SystemExit(f"--layers {layers}: a positive multiple of 4 (3 GDN + 1 attention)")
    base = MOE_WIDTHS if model == "moe35b" else DENSE27B_WIDTHS
    kinds = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    return dict(base, num_hidden_layers=layers, layer_types=kinds)


WIDTHS = widths("dense27b")  # Qwen3.5-27B widths, 8 layers (6 Gated DeltaNet + 2 attention)


MODELS = ("dense27b", "moe35b")
WORKLOADS = {
    "decode_b64_lora": dict(n=64, prompt=128, out=256, lora=True),
    "decode_b64_base": dict(n=64, prompt=128, out=256, lora=False),
    "decode_b4_lora": dict(n=4, prompt=128, out=256, lora=True),
    "decode_b4_base": dict(n=4, prompt=128, out=256, lora=False),
    "decode_b1_lora": dict(n=1, prompt=128, out=256, lora=True),
    "decode_b1_base": dict(n=1, prompt=128, out=256, lora=False),
    "prefill_lora": dict(n=16, prompt=4096, out=1, lora=True),
    "prefill_base": dict(n=16, prompt=4096, out=1, lora=False),
    # No request: an adapter removed and loaded again (its files, then every LoRA
    # layer's set_lora into a free GPU slot), one after another; adapters a minute.
    "reload_lora": dict(n=1, prompt=0, out=0, lora=True, reload=True),
}
WARMUP_OUT = 32  # round 0 loads the adapters at the counted rounds' batch shapes, briefly


# ----- build: the model and the adapters -----


def build(
    directory: Path,
    model: str = "dense27b",
    adapters: int = 4,
    rank: int = 64,
    model_from: Path | None = None,
    layers: int = LAYERS,
    linked: bool = False,
) -> None:
    """Save the cut model (bf16, `layers` deep) and `adapters` random adapters of `rank`,
    built on the GPU.

    DIR/bench.json records what was built; the engines read it (max_loras =
    the adapter count, max_lora_rank = the rank). With `model_from` (an earlier
    build of the same model) its model files are hard-linked, not written again:
    the weights come from the same seed, and a second 13 GB MoE copy would not fit
    beside the first on the GPU host's disk. With `linked`, adapters 1..N-1 are hard
    links to adapter 0's files: N adapters to vLLM (N slots, N CPU copies), the
    weights of one on disk (the MoE's 16 rank-64 adapters with expert factors are
    2 GB each, and the GPU host's /dev/shm is its RAM); the LoRA path's work does
    not depend on the values.
    """
    import torch

    text = widths(model, layers)  # before any work: a bad --layers says so at once
    torch.manual_seed(0)
    if model == "moe35b":
        from transformers import Qwen3_5MoeForConditionalGeneration as model_class

        config, targets = qwen35_moe_config(**text), MOE_TARGET_MODULES
    else:
        from transformers import Qwen3_5ForConditionalGeneration as model_class

        config, targets = qwen35_config(**text), TARGET_MODULES
    with torch.device("cuda"):
        built = model_class(config).to(torch.bfloat16)
    if model_from is None:
        save_model(built, directory / "model")
    else:
        link_model(model_from, directory, model, layers)
    print(f"model: {sum(p.numel() for p in built.parameters()) / 1e9:.2f} B parameters")
    peft_model = adapter_model(built, rank, targets)
    for number in range(adapters):
        if linked and number > 0:
            link_files(directory / "adapter-0", directory / f"adapter-{number}")
            continue
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    param.normal_(0.0, param.shape[-1] ** -0.5 * (0.3 if "lora_B" in name else 1))
        out = directory / f"adapter-{number}"
        peft_model.save_pretrained(out)
        if model == "moe35b":
            add_expert_factors(out, rank, seed=number, layers=layers)
    spec = {"model": model, "adapters": adapters, "rank": rank, "layers": layers}
    if linked:
        spec["linked"] = True
    (directory / "bench.json").write_text(json.dumps(spec))


MODEL_SHARD = "4GB"  # the largest safetensors file of a built model


def save_model(built, folder: Path, shard: str = MODEL_SHARD) -> None:
    """Save the model in safetensors files of at most `shard`.

    Why: transformers writes one file up to 50 GB, and safetensors holds a file's
    tensors as CPU bytes until it writes them, so a GPU-built model passes whole
    through the host's RAM beside its copy on /dev/shm (which is RAM too). A
    28-layer MoE cut is about 47 GB: 94 GB of the GPU host's 134 at once. In
    files of 4 GB the build needs the model's size on /dev/shm and one file more.
    vLLM reads the index a sharded checkpoint has, as it does for every real model.
    """
    built.save_pretrained(folder, max_shard_size=shard)


def adapter_model(built, rank: int, targets):
    """`built` wrapped by PEFT for random adapters of `rank`, kept in the model's dtype.

    PEFT casts a bf16 model's adapter weights to float32 by default (for training), and
    saves them so; vLLM then casts every tensor back to its bf16 LoRA dtype on the CPU as
    it loads an adapter. At 32 layers that was 16 files of 0.87 GB an engine, and all 16
    vCPUs were busy for about 4 minutes before three engines were ready (2026-12-02c,
    `cpu.log`; how much of it the loading was, their `engine_s` will say). What the
    engines serve is bf16 either way.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False)
    return get_peft_model(built, config, autocast_adapter_dtype=False)


def link_model(source: Path, directory: Path, model: str, layers: int = LAYERS) -> None:
    """DIR/model as hard links to an earlier build's model files, refused when that build
    was of another model or depth (its bench.json says which)."""
    spec = bench_spec(source)
    built, deep = spec["model"], spec.get("layers", LAYERS)
    if (built, deep) != (model, layers):
        raise SystemExit(f"--model-from {source}: a build of {built} with {deep} layers, "
                         f"not {model} with {layers}")  # fmt: skip
    link_files(source / "model", directory / "model")


def link_files(source: Path, target: Path) -> None:
    """`target` as a new folder of hard links to `source`'s files (a model's, or an
    adapter's config and weights)."""
    target.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        os.link(path, target / path.name)


def add_expert_factors(adapter: Path, rank: int, seed: int, layers: int = LAYERS) -> None:
    """The routed experts' factors, as PEFT >= 0.20 saves `target_parameters` on
    mlp.experts.gate_up_proj and mlp.experts.down_proj (patchkit.verify.e2e.build_moe)."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator(device="cuda").manual_seed(1000 + seed)
    hidden, inter = MOE_WIDTHS["hidden_size"], MOE_WIDTHS["moe_intermediate_size"]
    rows = rank * MOE_WIDTHS["num_experts"]
    tensors = load_file(adapter / "adapter_model.safetensors")
    for layer in range(layers):
        root = f"base_model.model.model.language_model.layers.{layer}.mlp.experts"
        for wrapper, d_out, d_in in (
            (root + ".base_layer", 2 * inter, hidden),
            (root, hidden, inter),
        ):
            a = torch.randn(rows, d_in, generator=gen, device="cuda") / d_in**0.5
            b = torch.randn(d_out, rows, generator=gen, device="cuda") * (0.3 / rank**0.5)
            tensors[f"{wrapper}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            tensors[f"{wrapper}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
    save_file(tensors, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    config_file.write_text(json.dumps(config, indent=2))


def bench_spec(work: Path) -> dict:
    """What `build` made: {model, adapters, rank} (a DIR built before bench.json: 4 x 64)."""
    path = work / "bench.json"
    return (
        json.loads(path.read_text())
        if path.exists()
        else {"model": "dense27b", "adapters": 4, "rank": 64}
    )


# ----- sites: one vLLM tree per configuration -----


def stem(config: str) -> str:
    """A configuration's name as a file name (its site, cache and mailbox)."""
    return config.replace(":", "-").replace("+", "-")


def patchkit(*args: str, target: Path) -> dict:
    command = [sys.executable, "-m", "patchkit", *args, "--target", str(target), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"patchkit {' '.join(args)} on {target}: {done.stdout}{done.stderr}")
    return json.loads(done.stdout)


def config_patches(site: Path) -> dict[str, list[str]]:
    """{config: the patches its tree gets}, for every configuration this release has."""
    status = patchkit("status", target=site)
    needed = [p["id"] for p in status["patches"] if p["state"] == "needed"]
    return {"unpatched": [], **{f"only:{p}": [p] for p in needed}, "default": needed}


PROBE = "default+nan-probe"
# A second engine on the unpatched tree: the same code as the base, so its ratios to
# the base are what the method reads for identical code in the same rounds (an A/A
# control, beside the base workloads).
TWIN = "unpatched-twin"
# Configurations served from the default tree with an environment variable set.
SAME_TREE = {
    "default+triton": {"PATCHKIT_LORA_BACKEND": "triton"},
    "default+gemv": {"PATCHKIT_LORA_GEMV": "1"},
    "default-gemv": {"PATCHKIT_LORA_GEMV": "0"},
    "default-active": {"PATCHKIT_LORA_ACTIVE_ONLY": "0"},
}


def make_sites(
    site: Path, work: Path, wanted: list[str] | None, base: str = "unpatched"
) -> dict[str, dict]:
    """{config: {"site": path, "env": {...}}}: hard-linked copies of the vLLM tree, patched.

    `wanted` narrows the run to some configurations (`base` is always one:
    every ratio is to it); None keeps them all but default+nan-probe.
    """
    configs = config_patches(site)
    known = [*configs, *SAME_TREE, PROBE, TWIN]
    if base not in known:
        raise SystemExit(f"--base {base}: this release has {', '.join(known)}")
    if wanted is not None:
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise SystemExit(f"unknown configuration {', '.join(unknown)}; "
                             f"this release has: {', '.join(known)}")  # fmt: skip
        keep = {base, *wanted}
        if PROBE in keep:
            configs[PROBE] = configs["default"]
        if keep & set(SAME_TREE):
            keep.add("default")  # the same tree
        configs = {name: patches for name, patches in configs.items() if name in keep}
    sites = {}
    for name, patches in configs.items():
        target = work / "sites" / stem(name)
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for entry in site.iterdir():
            if entry.name == "vllm" or entry.name.startswith("vllm-"):
                subprocess.run(["cp", "-al", str(entry), str(target / entry.name)], check=True)
        if patches:
            patchkit("apply", *[a for p in patches for a in ("--only", p)], target=target)
        env = {}
        if name == PROBE:  # stacked on the default set, as a user would apply it
            patchkit("apply", "--only", "nan-probe", target=target)
            patches = [*patches, "nan-probe"]
            env = {"PATCHKIT_PROBE_LOG": str(work / f"probe-{stem(name)}.jsonl")}
        sites[name] = {"site": str(target), "patches": patches, "env": env}
    for name, env in SAME_TREE.items():
        if name == base or (name in wanted if wanted else name == "default+triton"):
            sites[name] = {**sites["default"], "env": env}
    if wanted is not None and TWIN in wanted and "unpatched" in sites:
        sites[TWIN] = dict(sites["unpatched"])
    if wanted is not None and "default" not in {base, *wanted}:
        del sites["default"]
    return sites


# ----- the engine, one per configuration (a detached process) -----


def worker(work: Path, name: str) -> None:
    """Start an engine, say so, then run each workload written to its mailbox.

    The mailbox is a FIFO (`<name>.in`, one JSON command a line) and an
    append-only file of answers (`<name>.out`), so that the engine outlives
    the `run` that started it: a later `more` writes to the same FIFO.
    """
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    started = time.monotonic()
    spec = bench_spec(work)
    llm = LLM(
        model=str(work / "model"),
        enable_lora=True,
        max_lora_rank=spec["rank"],
        max_loras=spec["adapters"],
        max_num_seqs=MAX_SEQS,
        max_model_len=4608,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        gpu_memory_utilization=float(os.environ.get("BENCH_GPU_MEMORY", "0.12")),
        # No KV sizing by profiling: engines start side by side. BENCH_KV_GIB (4 by
        # default) fits more engines on one GPU.
        kv_cache_memory_bytes=int(float(os.environ.get("BENCH_KV_GIB", "4")) * 2**30),
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 48, 64]},
        skip_tokenizer_init=True,
        language_model_only=True,
        attention_backend="TRITON_ATTN",
        gdn_prefill_backend="triton",
        dtype="bfloat16",
        seed=0,
        # Off until a `profile` step starts it (vLLM creates the profiler then); no
        # factor of the compile cache's key.
        profiler_config={
            "profiler": "torch",
            "torch_profiler_dir": str(profile_dir(work, name)),
            "torch_profiler_with_stack": False,
            "torch_profiler_dump_cuda_time_total": False,
        },  # fmt: skip
    )
    adapters = [work / f"adapter-{n}" for n in range(spec["adapters"])]
    requests = [LoRARequest(f"a{n}", n + 1, str(path)) for n, path in enumerate(adapters)]
    engine_s = time.monotonic() - started
    memory = {"engine": gpu_peak(llm)}
    load_every_adapter(llm, SamplingParams, requests)
    memory["adapters"] = gpu_peak(llm)
    mailbox = Mailbox(work, name)
    mailbox.answer({"ready": True, "start_s": time.monotonic() - started, "engine_s": engine_s,
                    "memory": memory})  # fmt: skip
    for command in mailbox.commands():
        if command.get("stop"):
            break
        try:
            result = run_command(llm, SamplingParams, requests, command, work, name)
        except Exception as exc:  # noqa: BLE001 - the leg failed, the engine serves on
            result = {"error": f"{command.get('workload')}: {type(exc).__name__}: {exc}"}
        mailbox.answer({"id": command["id"], **result, **gpu_peak(llm)})


def run_command(llm, sampling_params, requests, command: dict, work: Path, name: str) -> dict:
    """A run's command to an engine: a leg of a workload, or one under the profiler."""

    def leg() -> dict:
        return run_workload(llm, sampling_params, requests, command["workload"],
                            command["round"], command.get("min_seconds", 0.0))  # fmt: skip

    if command.get("profile"):
        return profiled(llm, leg, profile_dir(work, name))
    return leg()


def profile_dir(work: Path, name: str) -> Path:
    """Where an engine's profiler writes its traces."""
    return work / "profiles" / stem(name)


def profiled(llm, leg, folder: Path) -> dict:
    """`leg()` (a workload's leg) under vLLM's torch profiler; the traces it wrote (vLLM
    names them itself, so they are told apart from earlier ones by being new)."""
    before = set(folder.glob("*.pt.trace.json*"))
    llm.start_profile()
    try:
        result = leg()
    finally:
        llm.stop_profile()
    traces = sorted(set(folder.glob("*.pt.trace.json*")) - before)
    return {**result, "traces": [str(path) for path in traces]}


def load_every_adapter(llm, sampling_params, requests) -> None:
    """One token with each adapter before the engine says it is ready: max_loras is the
    adapter count, so every adapter then stays in its GPU slot, and no counted round pays
    an adapter's first load from disk (the batch-1 and batch-4 workloads use one or four
    adapters a round, so their warm-up round loads only those)."""
    prompts = [{"prompt_token_ids": [1 + n, 2, 3, 4]} for n in range(len(requests))]
    llm.generate(prompts, sampling_params(max_tokens=1), lora_request=requests, use_tqdm=False)


def allocator_peak(worker) -> dict:
    """Run in vLLM's worker process: its torch allocator's peak since the engine started
    (weights, LoRA slots, the fixed KV cache, CUDA graph pools and every temporary)."""
    import torch

    return {"peak": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "allocated": torch.cuda.memory_allocated()}  # fmt: skip


def gpu_peak(llm) -> dict:
    """The worker's allocator peak and reserved bytes so far, or nothing where vLLM will not
    run a function in its worker."""
    found = worker_call(llm, allocator_peak)
    if not found:
        return {}
    return {"gpu_peak_bytes": found["peak"], "gpu_reserved_bytes": found["reserved"],
            "gpu_allocated_bytes": found["allocated"]}  # fmt: skip


def host_cpu() -> dict:
    """This process's CPU seconds, and the whole guest's busy and stolen seconds
    (/proc/stat), so a slow measurement can be told apart from a host that took the CPU
    away or a guest busy with something else (the idle engines, the sitting's own tools)."""
    times = os.times()
    steal = busy = 0.0
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        steal = fields[7] / tick
        busy = (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / tick
    except (OSError, IndexError, ValueError):
        pass
    return {"cpu_s": times.user + times.system, "steal_s": steal, "busy_s": busy}


def run_workload(llm, sampling_params, requests, name: str, round_: int,
                 min_seconds: float = 0.0) -> dict:  # fmt: skip
    """One leg: the workload's requests, generated again until the leg has lasted
    `min_seconds` (a counted round's legs; the warm-up runs them once). Where the
    host's decode speed changes level within seconds, a longer leg averages over
    the levels instead of landing on one."""
    spec = WORKLOADS[name]
    if spec.get("reload"):
        return reload_leg(llm, requests, name, round_, min_seconds)
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

    def generate() -> int:
        results = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in results)

    leg = timed_leg(generate, round_, min_seconds)
    counted = leg["calls"] * spec["n"] * spec["prompt"] if spec["out"] == 1 else leg["generated"]
    return {"workload": name, "round": round_, "tok_s": counted / leg["seconds"], **leg}


def reload_leg(llm, requests, name: str, round_: int, min_seconds: float = 0.0) -> dict:
    """One leg of reload_lora: an adapter removed and added again, the next one after
    it, until the leg has lasted `min_seconds` (the warm-up: one).

    Why: a server with more tenants' adapters than slots loads them again and again,
    and a load is where the default path does work of its own (it checks the new
    slot's weights on the device and reads the answers on the host); at start the
    engines loaded their adapters at the same time as others captured graphs, which
    said nothing.
    vLLM's add_lora loads the files and activates the adapter, so no request runs."""
    engine = llm.llm_engine
    turn = round_ % len(requests)
    order = itertools.cycle(requests[turn:] + requests[:turn])  # this round's adapter first

    def reload() -> int:
        request = next(order)
        if not engine.remove_lora(request.lora_int_id):  # else add_lora only touches it
            raise RuntimeError(f"{name}: adapter {request.lora_name} was not loaded to remove")
        if not engine.add_lora(request):
            raise RuntimeError(f"{name}: adapter {request.lora_name} did not load again")
        return 0

    timed = worker_call(llm, time_adapter_loads)  # once an engine; no time of the leg's
    leg = timed_leg(reload, round_, min_seconds)
    found = {"workload": name, "round": round_, "tok_s": 60 * leg["calls"] / leg["seconds"], **leg}
    if timed:
        found["adapter_loads"] = worker_call(llm, adapter_load_times) or []
    return found


def time_adapter_loads(worker) -> bool:
    """Run in vLLM's worker: time each add_adapter of its LoRA manager that loads an
    adapter, and the reading of its files inside it (_load_adapter), for
    adapter_load_times; True once the timers are in (they go in once).

    Why: a reload's seconds hold the files, which both sides read alike, and the
    activation into the slot, where the default path does work of its own; with the
    files' share apart, what the paths differ by is the activation's. Timed on the
    host: vLLM's copies into the slot are non_blocking, so an add_adapter that does
    not wait for them returns before they end."""
    import time

    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        return False
    if hasattr(manager, "bench_load_times"):  # in already: a new leg, its own loads only
        manager.bench_load_times.clear()
        return True
    times, reads = [], []
    add, read = manager.add_adapter, manager._load_adapter

    def timed_read(*args, **kwargs):
        started = time.perf_counter()
        try:
            return read(*args, **kwargs)
        finally:
            reads.append(time.perf_counter() - started)

    def timed_add(*args, **kwargs):
        before, started = len(reads), time.perf_counter()
        try:
            return add(*args, **kwargs)
        finally:
            if len(reads) > before:  # a load, not the touch of an adapter in its slot
                times.append([time.perf_counter() - started, sum(reads[before:])])

    manager._load_adapter, manager.add_adapter = timed_read, timed_add
    manager.bench_load_times = times
    return True


def adapter_load_times(worker) -> list:
    """Run in vLLM's worker: [add_adapter seconds, of it the files' seconds] of each load
    since the last call, then forgotten."""
    manager = worker.model_runner.lora_manager
    found = list(manager.bench_load_times)
    manager.bench_load_times.clear()
    return found


def worker_call(llm, function):
    """`function(worker)` in vLLM's worker process, or None where vLLM will not run it
    (VLLM_ALLOW_INSECURE_SERIALIZATION is set for the engines)."""
    try:
        return llm.collective_rpc(function)[0]
    except Exception:  # noqa: BLE001 - numbers the leg can do without
        return None


def timed_leg(call, round_: int, min_seconds: float) -> dict:
    """`call()` again and again until the leg has lasted `min_seconds` (the warm-up,
    round 0: once): when it began ("wall", to line it up with the sitting's GPU clock
    log), its seconds, the calls, the tokens the calls returned, and the CPU it took."""
    before = host_cpu()
    wall = time.time()
    started = time.perf_counter()
    calls = generated = 0
    while True:
        generated += call()
        calls += 1
        seconds = time.perf_counter() - started
        if round_ == 0 or seconds >= min_seconds:
            break
    after = host_cpu()
    return {"wall": wall, "seconds": seconds, "generated": generated, "calls": calls,
            "cpu_s": after["cpu_s"] - before["cpu_s"],
            "steal_s": after["steal_s"] - before["steal_s"],
            "guest_busy_s": after["busy_s"] - before["busy_s"]}  # fmt: skip


class Mailbox:
    """The files an engine and the runs that talk to it share, under DIR/engines/."""

    def __init__(self, work: Path, name: str):
        folder = work / "engines"
        self.inbox, self.outbox = folder / f"{stem(name)}.in", folder / f"{stem(name)}.out"
        self.log = folder / f"{stem(name)}.log"

    def create(self) -> None:
        self.inbox.parent.mkdir(parents=True, exist_ok=True)
        for path in (self.inbox, self.outbox):
            path.unlink(missing_ok=True)
        os.mkfifo(self.inbox)
        self.outbox.touch()

    def commands(self):
        """Commands, across writers: at a writer's end (EOF) wait for the next one."""
        while True:
            with self.inbox.open() as inbox:
                for line in inbox:
                    yield json.loads(line)

    def answer(self, message: dict) -> None:
        with self.outbox.open("a") as outbox:
            outbox.write(json.dumps(message) + "\n")

    def answers(self) -> list[dict]:
        return [json.loads(line) for line in self.outbox.read_text().splitlines() if line]


class Engine:
    """The run's handle on one engine: its process id and its mailbox."""

    def __init__(self, name: str, work: Path, pid: int):
        self.name, self.pid = name, pid
        self.mailbox = Mailbox(work, name)
        self.writer = None

    @classmethod
    def start(cls, name: str, config: dict, work: Path, base_path: str) -> Engine:
        cache = work / "cache" / stem(name)
        shutil.rmtree(cache, ignore_errors=True)  # a fresh torch.compile cache per config
        cache.mkdir(parents=True)
        env = dict(os.environ, **config["env"], VLLM_CACHE_ROOT=str(cache), PYTHONUNBUFFERED="1")
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # gpu_peak's function, our own code
        env["PYTHONPATH"] = os.pathsep.join([config["site"], base_path])
        mailbox = Mailbox(work, name)
        mailbox.create()
        cpus = config.get("cpus")
        with mailbox.log.open("w") as log:
            process = subprocess.Popen(
                [sys.executable, __file__, "worker", str(work), name],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=ROOT, start_new_session=True,  # lives on after this run, for `more`
                # vLLM's engine core process, started later by the worker, inherits these
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )  # fmt: skip
        return cls(name, work, process.pid)

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except OSError:
            return False
        try:  # a child of this run that exited stays a zombie until reaped
            return "State:\tZ" not in Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return False

    def wait_for(self, match, deadline: float) -> dict:
        while time.monotonic() < deadline:
            found = [m for m in self.mailbox.answers() if match(m)]
            if found:
                return found[-1]
            if not self.alive():
                raise RuntimeError(f"engine {self.name} exited; see {self.mailbox.log}")
            time.sleep(0.05)
        raise TimeoutError(f"engine {self.name}: no answer in time")

    def send(self, command: dict, deadline: float) -> None:
        if self.writer is None:
            self.writer = self._open_inbox(deadline)
        self.writer.write(json.dumps(command) + "\n")
        self.writer.flush()

    def _open_inbox(self, deadline: float):
        """The FIFO's write end, once the engine reads it (an engine that died never will)."""
        while True:
            try:
                fd = os.open(self.mailbox.inbox, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: nobody reads it yet
                    raise
                if not self.alive() or time.monotonic() > deadline:
                    message = f"engine {self.name} does not read {self.mailbox.inbox}"
                    raise RuntimeError(message) from exc
                time.sleep(0.05)
                continue
            os.set_blocking(fd, True)
            return os.fdopen(fd, "w")

    def ask(self, workload: str, round_: int, deadline: float, profile: bool = False,
            min_seconds: float = 0.0) -> dict:  # fmt: skip
        ident = f"{workload}-{round_}-{time.time_ns()}"
        command = {"id": ident, "workload": workload, "round": round_}
        if profile:
            command["profile"] = True
        if min_seconds:
            command["min_seconds"] = min_seconds
        self.send(command, deadline)
        answer = self.wait_for(lambda m: m.get("id") == ident, deadline)
        if "error" in answer:  # the engine lives on; the round is dropped (ask_round)
            raise RuntimeError(f"engine {self.name}: {answer['error']}")
        return {k: v for k, v in answer.items() if k != "id"}

    def stop(self) -> None:
        """Ask the engine to exit (it shuts vLLM down on its own)."""
        if self.alive():
            self.send({"stop": True}, time.monotonic() + 10)
        if self.writer is not None:
            self.writer.close()


def cpu_shares(spec: str, engines: int) -> list[list[int]]:
    """BENCH_CPUS ("0-5", "0,2,4-7": the CPUs this run's engines may use) split into
    `engines` equal runs in order, one an engine; none when unset.

    Why: at batch 1 and 4 a decode step is the host's, and a leg's speed strays by
    10-20 % on every engine, identical code included (docs/evidence.md, 2026-12-02);
    an engine on CPUs of its own, apart from the others' idle threads and the
    scheduler's moves, is what that noise is to be measured against.
    """
    if not spec.strip():
        return []
    cpus: list[int] = []
    for part in spec.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise SystemExit(f"BENCH_CPUS={spec!r}: not a CPU list such as 0-5 or 0,2,4-7")
        cpus += range(int(low), int(high or low) + 1)
    each = len(cpus) // engines
    if each == 0:
        raise SystemExit(f"BENCH_CPUS={spec!r}: {len(cpus)} CPUs for {engines} engines")
    return [cpus[n * each : (n + 1) * each] for n in range(engines)]


def start(
    work: Path,
    site: Path,
    wanted: list[str] | None,
    deadline: float,
    base: str = "unpatched",
    workloads: list[str] | None = None,
) -> dict:
    """Patch the trees, start one engine per configuration, wait until all are ready."""
    configs = make_sites(site, work, wanted, base)
    base_path = os.environ.get("PYTHONPATH", "")
    shares = cpu_shares(os.environ.get("BENCH_CPUS", ""), len(configs))
    for name, cpus in zip(configs, shares, strict=False):  # no shares: no CPUs named
        configs[name]["cpus"] = cpus
    engines = {
        name: Engine.start(name, config, work, base_path) for name, config in configs.items()
    }
    results: dict = {"configs": configs, "rounds": [], "start_s": {}, "errors": {},
                     "pids": {name: e.pid for name, e in engines.items()},
                     "base": base, "workloads": workloads or pick_workloads(None)}  # fmt: skip
    for name, engine in engines.items():
        try:
            ready = engine.wait_for(lambda m: m.get("ready"), deadline)
        except (RuntimeError, TimeoutError) as exc:
            results["errors"][name] = str(exc)
            continue
        results["start_s"][name] = ready["start_s"]
        if "engine_s" in ready:  # the rest of start_s: every adapter's first load
            results.setdefault("engine_s", {})[name] = ready["engine_s"]
        if "memory" in ready:  # the allocator after the engine's init and after the adapters
            results.setdefault("start_memory", {})[name] = ready["memory"]
    save_partial(work, results)
    return results


def attach(work: Path) -> tuple[dict, dict[str, Engine]]:
    """The results so far and the engines still serving, from DIR/results.json."""
    results = json.loads((work / "results.json").read_text())
    engines = {name: Engine(name, work, pid) for name, pid in results["pids"].items()
               if name not in results["errors"]}  # fmt: skip
    for name, engine in list(engines.items()):
        if not engine.alive():
            results["errors"][name] = f"engine {name} is gone (pid {engine.pid})"
            del engines[name]
    return results, engines


def measure(work: Path, results: dict, engines: dict[str, Engine], rounds: int, deadline: float):
    """Rounds after those already in results, one engine at a time, rotating the order.

    Stops before a round that would not finish by the deadline, judged by the
    slowest round of this step (a `more` may measure other workloads than the
    run before it, with rounds ten times as long). A workload new to these
    engines gets a warm-up pass first, as round 0 (not counted).
    """
    done = [r["round"] for r in results["rounds"]]
    first = max(done) + 1 if done else 0
    workloads = results.get("workloads", WORKLOADS)
    this_step: list[float] = []
    seen = {r["workload"] for r in results["rounds"]}
    new = [w for w in workloads if w not in seen]
    if first > 0 and engines and new:
        began = time.monotonic()
        if ask_round(results, engines, new, 0, deadline):
            this_step.append(time.monotonic() - began)  # no counted round is shorter
    for round_ in range(first, rounds + 1 if engines else 0):
        began = time.monotonic()
        if this_step and began + 1.2 * max(this_step) > deadline:
            break
        if not ask_round(results, engines, workloads, round_, deadline):
            break
        this_step.append(time.monotonic() - began)
        results.setdefault("round_s", []).append(this_step[-1])
        save_partial(work, results)


def ask_round(results: dict, engines: dict[str, Engine], workloads: list[str], round_: int,
              deadline: float) -> bool:  # fmt: skip
    """One round of `workloads` on every engine, in this round's rotated, mirrored order;
    False (the round's rows dropped, the error kept) when an engine failed or timed out."""
    order = list(engines)
    order = order[round_ % len(order) :] + order[: round_ % len(order)]
    leg_s = results.get("leg_seconds", 0.0)
    try:
        for workload in workloads:
            for leg, name in mirrored(order):
                result = engines[name].ask(workload, round_, deadline, min_seconds=leg_s)
                results["rounds"].append({"config": name, "leg": leg, **result})
    except (RuntimeError, TimeoutError) as exc:  # keep what was measured
        results["errors"]["run"] = f"round {round_}: {exc}"
        results["rounds"] = [r for r in results["rounds"]
                             if r["round"] != round_ or r["workload"] not in workloads]  # fmt: skip
        return False
    return True


PROFILED_RELOAD_S = 2.0  # reload_lora under the profiler: reloads for this long, at least one


def profile(results: dict, engines: dict[str, Engine], workloads: list[str],
            deadline: float) -> None:  # fmt: skip
    """Each engine runs each of `workloads` once more (as counted round 1 would: the same
    prompts, every token) under vLLM's torch profiler; results["profiles"][config]
    [workload] sums up its traces per engine step (kernel_trace.summary), or per
    reload for reload_lora, which reloads for PROFILED_RELOAD_S: where a reload's
    time goes (the files, vLLM's copies into the slots, the default path's check of
    each slot) is in its host ops. Not a counted round: the profiler slows the host.
    Profile after the rounds: once vLLM's profiler has run, every later step of the
    engine annotates itself for it (0.26.0's gpu_worker.annotate_profile), a host
    cost the rounds must not carry."""
    import kernel_trace

    found = results.setdefault("profiles", {})
    for workload in workloads:
        spec = WORKLOADS[workload]
        reload = spec.get("reload")
        for name, engine in engines.items():
            answer = engine.ask(workload, 1, deadline, profile=True,
                                min_seconds=PROFILED_RELOAD_S if reload else 0.0)  # fmt: skip
            # per reload, or per decode step (a token out), or per prefill call
            steps = answer["calls"] if reload else max(spec["out"], 1)
            traces = [Path(t) for t in answer["traces"]]
            found.setdefault(name, {})[workload] = {
                "seconds": answer["seconds"], **kernel_trace.summary(traces, steps)}  # fmt: skip


def profile_table(results: dict) -> str:
    """Markdown: per workload and configuration, per engine step (decode) or call
    (prefill): the step's wall time while profiled, the GPU's busy time, kernels,
    LoRA-named kernels, the host's eager aten ops and CUDA runtime calls; then each
    LoRA workload's top kernels per configuration, and the kernels and host ops whose
    time differs most from the base configuration's."""
    found = results.get("profiles", {})
    configs = [c for c in results["configs"] if c in found]
    lines = ["Profiled once per configuration and workload (vLLM's torch profiler, "
             "kernels of CUDA-graph replays included), per engine step for decode, "
             "per call for prefill and per reload for reload_lora: wall, GPU busy and "
             "LoRA-named kernels in microseconds (how many in brackets); kernels, host "
             "aten ops and host CUDA calls counted", "",
             "| workload | configuration | wall | GPU busy | kernels | LoRA-named kernels "
             "| host aten ops | host CUDA calls |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    workloads = [w for w in WORKLOADS if any(w in found[c] for c in configs)]
    for workload in workloads:
        for name in configs:
            row = found[name].get(workload)
            if row and row.get("kernels"):
                wall = 1e6 * row["seconds"] / row["steps"]
                host = row.get("host", {})
                ops, calls = (host.get(c, {}).get("events", 0) for c in ("cpu_op", "cuda_runtime"))
                lines.append(f"| {workload} | {name} | {wall:.0f} | {row['gpu_busy_us']:.0f} | "
                             f"{row['kernels']:.0f} | {row['lora_us']:.0f} "
                             f"({row['lora_kernels']:.0f}) | {ops:.1f} | {calls:.1f} |"
                             )  # fmt: skip
    for workload in (w for w in workloads if w.endswith("_lora")):
        for name in configs:
            row = found[name].get(workload)
            if not row or not row.get("kernels"):
                continue
            lines += ["", f"Top kernels, {workload}, {name}: launches and microseconds per step",
                      "", "| kernel | launches | µs |", "|---|---|---|"]  # fmt: skip
            lines += [f"| `{kernel[:90]}` | {count:.1f} | {us:.1f} |"
                      for kernel, count, us in row["top"]]  # fmt: skip
    base = results.get("base")
    for workload in (w for w in workloads if w.endswith("_lora")):
        for name in configs:
            if name == base or base not in found:
                continue
            pair = found[base].get(workload) or {}, found[name].get(workload) or {}
            title = f"{workload}, {name} against {base}"
            lines += differences(*(p.get("by_name") for p in pair), f"Kernels, {title}")
            lines += differences(*(p.get("host", {}).get("cpu_op", {}).get("top") for p in pair),
                                 f"Host aten ops (each side's most time), {title}")  # fmt: skip
    return "\n".join(lines)


def differences(base: list | None, other: list | None, title: str, top: int = 15) -> list:
    """Markdown lines: the names ([name, count, µs] per step, as kernel_trace gives
    them) whose time per step differs most between two profiles of one workload (a
    name only one of them has counts from 0)."""
    if base is None or other is None or not (base or other):
        return []
    before = {name: (count, us) for name, count, us in base}
    after = {name: (count, us) for name, count, us in other}
    names = set(before) | set(after)
    delta = {n: after.get(n, (0, 0.0))[1] - before.get(n, (0, 0.0))[1] for n in names}
    ranked = sorted(names, key=lambda n: -abs(delta[n]))[:top]
    lines = ["", f"{title}: differing most, count and µs per step", "",
             "| name | count (base) | count | µs (base) | µs | difference |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for n in ranked:
        (c0, u0), (c1, u1) = before.get(n, (0, 0.0)), after.get(n, (0, 0.0))
        lines.append(f"| `{n[:80]}` | {c0:.1f} | {c1:.1f} | {u0:.1f} | {u1:.1f} | "
                     f"{delta[n]:+.1f} |")  # fmt: skip
    return lines


def measured(results: dict) -> list[str]:
    """The workloads that have counted rows, in WORKLOADS' order."""
    seen = {r["workload"] for r in results["rounds"] if "workload" in r}
    return [w for w in WORKLOADS if w in seen] or pick_workloads(None)


def pick_workloads(kinds: list[str] | None) -> list[str]:
    """--workloads decode_b1 prefill ...: each kind's _lora and _base workloads; a
    workload's own name (prefill_base) picks it alone, for rounds of the cells still
    open (a base cell's legs spread most and need the most rounds). Without kinds,
    every workload but reload_lora, which is asked for by name (`reload`): the runs
    written down before it measured the others only."""
    if not kinds:
        return [w for w, spec in WORKLOADS.items() if not spec.get("reload")]
    known = sorted({w.rsplit("_", 1)[0] for w in WORKLOADS})
    unknown = [k for k in kinds if k not in known and k not in WORKLOADS]
    if unknown:
        raise SystemExit(f"--workloads {' '.join(unknown)}: known are {', '.join(known)}, "
                         "or a workload's own name (decode_b1_base)")  # fmt: skip
    return [w for w in WORKLOADS if w in kinds or w.rsplit("_", 1)[0] in kinds]


def mirrored(order: list[str]) -> list[tuple[int, str]]:
    """Each configuration twice, the second pass in reverse (A B C C B A): a host that
    speeds up or slows down during the workload weighs on every configuration alike."""
    return [(0, name) for name in order] + [(1, name) for name in reversed(order)]


def per_round(counted: list[dict], workload: str) -> dict[int, dict[str, float]]:
    """{round: {config: tok/s}} for one workload, a configuration's legs pooled
    (tokens over seconds)."""
    tokens: dict = {}
    for r in counted:
        if r["workload"] == workload:
            cell = tokens.setdefault(r["round"], {}).setdefault(r["config"], [0.0, 0.0])
            cell[0] += r["tok_s"] * r["seconds"]
            cell[1] += r["seconds"]
    return {round_: {name: t / s for name, (t, s) in row.items()}
            for round_, row in tokens.items()}  # fmt: skip


def round_ratios(by_round: dict[int, dict[str, float]], name: str, base: str) -> list[float]:
    """`name`'s tok/s over the base's, in each round (of per_round) that has both."""
    return [row[name] / row[base] for row in by_round.values() if name in row and row.get(base)]


def save_partial(work: Path, results: dict) -> None:
    """results.json after each round, so a run cut short keeps its finished rounds."""
    (work / "results.json").write_text(json.dumps(results, indent=1))


def table_head(caption: str, configs: list[str]) -> list[str]:
    """A caption, then a markdown table's header: a workload column, one per configuration."""
    return [caption, "", "| workload | " + " | ".join(configs) + " |",
            "|---|" + "---|" * len(configs)]  # fmt: skip


def counted_rows(results: dict) -> list[dict]:
    """The rows of the counted rounds (round 0 warms up and is not counted)."""
    return [r for r in results["rounds"] if r["round"] > 0]


def table(results: dict, meta: dict) -> str:
    """Markdown: median tok/s of the counted rounds; in brackets the median, over
    rounds, of each configuration's ratio to the base (unpatched unless --base)
    in the same round (drift over time cancels within a round)."""
    counted = counted_rows(results)
    configs = list(results["configs"])
    base = results.get("base", "unpatched")
    built = f"{meta.get('model', 'dense27b')}, {meta.get('adapters', 4)} adapters of rank "
    built += f"{meta.get('rank', 64)}, {meta.get('layers', LAYERS)} layers"
    if meta.get("linked"):
        built += " (one adapter's weights under every name)"
    units = "(decode: output tokens, prefill: prompt tokens"
    if any(WORKLOADS[w].get("reload") for w in measured(results)):
        units += "; reload_lora: adapters reloaded a minute"
    lines = table_head(
        f"{meta['date']}, {meta['gpu']}, vLLM {meta['vllm']}, torch {meta['torch']}, {built}; "
        "median of the counted rounds after a warm-up round (how many: the last column); tok/s "
        f"{units}); in brackets the median of the "
        f"per-round ratios to {base}, their lower quartile (q1) and their range",
        [*configs, "rounds"],
    )
    for workload in measured(results):
        by_round = per_round(counted, workload)
        cells = []
        for name in configs:
            values = [row[name] for row in by_round.values() if name in row]
            ratios = round_ratios(by_round, name, base)
            if not values:
                cells.append("n/a")
            elif name != base and ratios:
                cells.append(f"{statistics.median(values):.0f} ({ratio_summary(ratios)})")
            else:
                cells.append(f"{statistics.median(values):.0f}")
        cells.append(str(len(by_round)))
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    lines += ["", *leg_table(counted, configs, base), *memory_lines(results["rounds"], configs)]
    lines += start_memory_lines(results.get("start_memory", {}), configs)
    lines += adapter_load_lines(counted, configs)
    lines += ["", *spread_table(counted, configs, base, measured(results))]
    lines += ["", *noise_table(counted, configs, measured(results))]
    stolen = [r.get("steal_s", 0.0) for r in counted]
    lines += ["", f"Stolen CPU (guest, /proc/stat) during the {len(counted)} counted "
              f"measurements: {sum(stolen):.1f} s in all, "
              f"some in {sum(x > 0 for x in stolen)}."]  # fmt: skip
    return "\n".join(lines)


def adapter_load_lines(counted: list[dict], configs: list[str]) -> list[str]:
    """One line: each engine's median add_adapter of the counted reloads, as its worker
    timed it (time_adapter_loads), and of it the files and the rest (the activation into
    the slot); nothing when no leg has the worker's times."""
    cells = []
    for name in configs:
        loads = [load for r in counted if r["config"] == name
                 for load in r.get("adapter_loads", [])]  # fmt: skip
        if loads:
            add, files = (statistics.median(x[i] for x in loads) * 1000 for i in (0, 1))
            rest = statistics.median((a - f) * 1000 for a, f in loads)
            cells.append(f"{name} {add:.0f} (the files {files:.0f}, the rest {rest:.0f}; "
                         f"{len(loads)} loads)")  # fmt: skip
    if not cells:
        return []
    return ["", "Adapter loads in the worker (reload_lora, its add_adapter timed there), "
            "median ms: " + "; ".join(cells) + "."]  # fmt: skip


def memory_lines(rows: list[dict], configs: list[str]) -> list[str]:
    """One line: each engine's largest allocator peak over all its measurements (warm-up
    included) and its reserved bytes then, in GiB; nothing when no engine told it."""
    cells = []
    for name in configs:
        told = [r for r in rows if r["config"] == name and "gpu_peak_bytes" in r]
        if told:
            top = max(told, key=lambda r: r["gpu_peak_bytes"])
            cells.append(f"{name} {top['gpu_peak_bytes'] / 2**30:.2f} "
                         f"(reserved {top['gpu_reserved_bytes'] / 2**30:.2f})")  # fmt: skip
    if not cells:
        return []
    return ["", "GPU memory, the engine worker's torch allocator peak over the run, GiB: "
            + "; ".join(cells) + "."]  # fmt: skip


def start_memory_lines(start_memory: dict, configs: list[str]) -> list[str]:
    """One line: each engine's allocator after its init and after its adapters' first load
    (allocated now, and the peak so far), in GiB; nothing for results without them.

    Why: an engine's peak over the run says how much more a configuration needs, not
    when it takes it; these two points tell the engine's own start (weights, slots,
    the profiling run, KV cache, graphs) from the loading of the adapters."""
    cells = []
    for name in configs:
        found = start_memory.get(name, {})
        points = [(when, found.get(key, {})) for when, key in
                  (("after init", "engine"), ("after the adapters", "adapters"))]  # fmt: skip
        told = [f"{when} {m['gpu_allocated_bytes'] / 2**30:.2f} (peak "
                f"{m['gpu_peak_bytes'] / 2**30:.2f})"
                for when, m in points if "gpu_allocated_bytes" in m]  # fmt: skip
        if told:
            cells.append(f"{name} " + ", ".join(told))
    if not cells:
        return []
    return ["", "GPU memory at the start, the engine worker's torch allocator, allocated "
            "(peak so far), GiB: " + "; ".join(cells) + "."]  # fmt: skip


def lower_quartile(values: list[float]) -> float:
    """The first quartile (statistics.quantiles, inclusive); the value itself when alone."""
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=4, method="inclusive")[0]


def ratio_summary(ratios: list[float]) -> str:
    """'101.2 %, q1 98.7 %, 95-104': median, lower quartile and range of per-round ratios."""
    return (f"{100 * statistics.median(ratios):.1f} %, q1 {100 * lower_quartile(ratios):.1f} %, "
            f"{100 * min(ratios):.0f}-{100 * max(ratios):.0f}")  # fmt: skip


def bootstrap_median(ratios: list[float], draws: int = 5000, seed: int = 1) -> tuple:
    """The 5th and 95th percentiles of the median over `draws` resamplings of the
    ratios (with replacement; a fixed seed, so the table is the same every time)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(draws))  # fmt: skip
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


def spread_table(counted: list[dict], configs: list[str], base: str,
                 workloads: list[str]) -> list[str]:  # fmt: skip
    """Markdown: for each configuration's per-round ratios to the base, their
    geometric mean, how many rounds fell below 100 %, and a bootstrap 90 % interval
    of their median: whether a median off 100 % is more than the rounds' spread."""
    others = [c for c in configs if c != base]
    lines = table_head(
        f"Per-round ratios to {base}: geometric mean; rounds below 100 % of all; "
        "bootstrap 90 % interval of the median (5,000 resamplings)",
        others,
    )
    for workload in workloads:
        by_round = per_round(counted, workload)
        cells = []
        for name in others:
            ratios = round_ratios(by_round, name, base)
            if not ratios:
                cells.append("n/a")
                continue
            geometric = math.exp(statistics.fmean(math.log(r) for r in ratios))
            low, high = bootstrap_median(ratios)
            below = sum(r < 1 for r in ratios)
            cells.append(f"{100 * geometric:.1f} %; {below} of {len(ratios)}; "
                         f"{100 * low:.1f}-{100 * high:.1f} %")  # fmt: skip
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return lines


# The batch-1 criterion (docs/evidence.md, "Where criterion 1 ... stands"): on every
# LoRA workload the median of the per-round ratios >= 100 % and their lower quartile
# >= 97 %; base workloads (the same code on both sides) within +-3 %. Fewer rounds
# than VERDICT_ROUNDS decide nothing. The unpatched twin is identical code on every
# workload, so it is held to what identical code must read if the method can judge
# the criterion at all: median within +-3 % and lower quartile >= 97 % (the control).
VERDICT_ROUNDS = 5


def verdict_cell(ratios: list[float], rule: str) -> str:
    """'met', 'missed' (and what) or 'undecided' for one configuration and workload,
    by `rule`: "lora", "base" or "control" (see above)."""
    if len(ratios) < VERDICT_ROUNDS:
        return f"undecided ({len(ratios)} round{'s' * (len(ratios) != 1)})"
    middle, q1 = statistics.median(ratios), lower_quartile(ratios)
    said = f"{100 * middle:.1f} %, q1 {100 * q1:.1f} %, {len(ratios)} rounds"
    checks = {
        "lora": (("median", middle < 1.0), ("q1", q1 < 0.97)),
        "base": (("+-3 %", abs(middle - 1.0) > 0.03),),
        "control": (("+-3 %", abs(middle - 1.0) > 0.03), ("q1", q1 < 0.97)),
    }[rule]
    misses = [what for what, bad in checks if bad]
    return f"missed: {', '.join(misses)} ({said})" if misses else f"met ({said})"


def verdict_rule(config: str, workload: str) -> str:
    """The rule a configuration's workload is judged by: the twin's is the control."""
    if config == TWIN:
        return "control"
    return "lora" if workload.endswith("_lora") else "base"


def verdict_table(sets: list[dict]) -> list[str]:
    """Markdown: for each results file (one adapter set), each workload's verdict for
    every configuration against the base; an unpatched twin's rows say whether the
    method resolves the criterion's bounds for identical code in the same rounds.
    reload_lora is not one of the criterion's workloads: `table` gives its ratios."""
    lines = ["| set | workload | configuration | verdict |", "|---|---|---|---|"]
    cells = []
    for number, results in enumerate(sets):
        meta = results.get("meta", {})
        name = (f"{meta.get('model', 'dense27b')} {meta.get('adapters', 4)} x "
                f"r{meta.get('rank', 64)}, {meta.get('layers', LAYERS)} layers")  # fmt: skip
        counted = counted_rows(results)
        base = results.get("base", "unpatched")
        for workload in [w for w in measured(results) if not WORKLOADS[w].get("reload")]:
            by_round = per_round(counted, workload)
            for config in [c for c in results["configs"] if c != base]:
                ratios = round_ratios(by_round, config, base)
                cell = verdict_cell(ratios, verdict_rule(config, workload))
                lines.append(f"| {name} | {workload} | {config} | {cell} |")
                cells.append((number, name, config, workload, cell))
    return lines + ["", *verdict_counts(cells)]


def verdict_counts(cells: list[tuple[int, str, str, str, str]]) -> list[str]:
    """Markdown: per results file and configuration, the decided cells met, LoRA and
    base workloads apart, and the undecided ones; what a write-up counts, counted here."""
    tally: dict = {}
    for number, name, config, workload, cell in cells:
        counts = tally.setdefault((number, name, config),
                                  {"lora": [0, 0], "base": [0, 0], "open": 0})  # fmt: skip
        if cell.startswith("undecided"):
            counts["open"] += 1
            continue
        kind = counts["lora" if workload.endswith("_lora") else "base"]
        kind[0] += cell.startswith("met")
        kind[1] += 1
    lines = ["| set | configuration | LoRA workloads met | base workloads met | undecided |",
             "|---|---|---|---|---|"]  # fmt: skip
    for (_, name, config), c in tally.items():
        lines.append(f"| {name} | {config} | {c['lora'][0]} of {c['lora'][1]} | "
                     f"{c['base'][0]} of {c['base'][1]} | {c['open']} |")  # fmt: skip
    return lines


def leg_noise(counted: list[dict], workload: str, name: str) -> tuple[float, float] | None:
    """(spread of single legs, spread of the legs measured right after one another), in
    log tok/s around the engine's own median, for one configuration and workload.

    The first is how far one leg strays; the second (the difference of neighbouring
    legs of the same round, over the square root of 2) is the part of it that even the
    next leg, seconds later, does not share: what no finer interleaving removes. Both
    are robust standard deviations (1.4826 median absolute deviations), so that one
    leg that met a first-time compile does not stand for all."""
    legs = sorted((r for r in counted if r["workload"] == workload and r["config"] == name),
                  key=lambda r: (r["round"], r.get("wall", 0.0), r.get("leg", 0)))  # fmt: skip
    if len(legs) < 3:
        return None
    middle = statistics.median(r["tok_s"] for r in legs)
    logs = [math.log(r["tok_s"] / middle) for r in legs]
    pairs = zip(logs, logs[1:], legs, legs[1:], strict=False)  # each leg and the next
    steps = [b - a for a, b, ra, rb in pairs if ra["round"] == rb["round"]]
    apart = robust_sd(steps) / math.sqrt(2) if len(steps) > 1 else float("nan")
    return robust_sd(logs), apart


def robust_sd(values: list[float]) -> float:
    """1.4826 times the median absolute deviation from the median: the standard
    deviation for normal noise, unmoved by a few outliers."""
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - middle) for v in values)


def noise_table(counted: list[dict], configs: list[str], workloads: list[str]) -> list[str]:
    """Markdown: each engine's single-leg spread (leg_noise), in %: the noise a per-round
    ratio inherits from its legs, the same code on both sides included."""
    lines = table_head(
        "Single legs' spread around each engine's median (robust standard deviation "
        "of log tok/s, %); after the slash the part the same engine's next leg in the "
        "round does not share",
        configs,
    )
    for workload in workloads:
        cells = []
        for name in configs:
            found = leg_noise(counted, workload, name)
            cells.append("n/a" if found is None else f"{100 * found[0]:.1f} / {100 * found[1]:.1f}")
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return lines


def clock_samples(path: Path) -> list[tuple[float, int, int]]:
    """(epoch seconds, SM clock MHz, throttle reasons) from gpu_session.sh's clocks.log
    (nvidia-smi's csv, its timestamp in UTC as the test host keeps it)."""
    samples = []
    for line in path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if line.startswith("#") or len(fields) < 8 or not fields[1].endswith("MHz"):
            continue
        stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f")
        stamp = stamp.replace(tzinfo=datetime.timezone.utc).timestamp()
        samples.append((stamp, int(fields[1].split()[0]), int(fields[-1], 16)))
    return samples


def clock_table(counted: list[dict], samples: list[tuple[float, int, int]],
                workloads: list[str]) -> list[str]:  # fmt: skip
    """Markdown: the GPU's SM clock during each workload's counted legs (their "wall"
    start and seconds) and how many of those samples had a throttle reason: whether a
    slow leg was the GPU's clock or not."""
    lines = ["GPU clocks during the counted legs (clocks.log, one sample a second): "
             "samples, SM clock MHz median (lowest), samples with a throttle reason "
             "(which: nvidia-smi's clocks_event_reasons bits)", "",
             "| workload | samples | SM clock | throttled |", "|---|---|---|---|"]  # fmt: skip
    for workload in workloads:
        spans = [(r["wall"], r["wall"] + r["seconds"]) for r in counted
                 if r["workload"] == workload and "wall" in r]  # fmt: skip
        inside = [s for s in samples if any(a <= s[0] <= b for a, b in spans)]
        if not inside:
            lines.append(f"| {workload} | 0 | n/a | n/a |")
            continue
        clocks = [s[1] for s in inside]
        reasons = sorted({s[2] for s in inside if s[2]})
        throttled = sum(1 for s in inside if s[2])
        which = f" ({', '.join(f'{r:#x}' for r in reasons)})" if reasons else ""
        lines.append(f"| {workload} | {len(inside)} | {statistics.median(clocks):.0f} "
                     f"({min(clocks)}) | {throttled}{which} |")  # fmt: skip
    return lines


def leg_table(counted: list[dict], configs: list[str], base: str = "unpatched") -> list[str]:
    """Markdown: each configuration's slowest, median and fastest single leg, as % of
    the base's (unpatched's unless --base) same statistic.

    Why beside the per-round ratios: where a host puts single measurements on
    two speed levels at random (decode on the test H200's guest), a ratio of
    two legs compares levels as often as configurations; the extremes and the
    median of many legs each compare like with like.
    """
    lines = table_head(
        "Single legs (each configuration measured twice a round): slowest / median / "
        f"fastest tok/s, and each as % of {base}'s",
        configs,
    )
    for workload in measured({"rounds": counted}):
        stats = {}
        for name in configs:
            legs = sorted(r["tok_s"] for r in counted
                          if r["workload"] == workload and r["config"] == name)  # fmt: skip
            if legs:
                stats[name] = (legs[0], statistics.median(legs), legs[-1])
        reference = stats.get(base)
        cells = []
        for name in configs:
            if name not in stats:
                cells.append("n/a")
                continue
            values = " / ".join(f"{v:.0f}" for v in stats[name])
            if name != base and reference:
                pairs = zip(stats[name], reference, strict=True)
                shares = " / ".join(f"{100 * v / b:.0f}" for v, b in pairs)
                values += f" ({shares} %)"
            cells.append(values)
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    make = sub.add_parser("build", help="the model and its adapters")
    make.add_argument("dir", type=Path)
    make.add_argument("--model", choices=MODELS, default="dense27b")
    make.add_argument("--adapters", type=int, default=4, help="how many (max_loras)")
    make.add_argument("--rank", type=int, default=64)
    make.add_argument("--layers", type=int, default=LAYERS,
                      help="how deep a cut (a multiple of 4; default 8)")  # fmt: skip
    make.add_argument("--linked-adapters", action="store_true",
                      help="adapters 1..N-1 as hard links to adapter 0")  # fmt: skip
    make.add_argument("--model-from", type=Path, metavar="DIR",
                      help="hard-link the model of an earlier build of the same model")  # fmt: skip
    work = sub.add_parser("worker")
    work.add_argument("dir", type=Path)
    work.add_argument("name")
    go = sub.add_parser("run", help="start the engines and measure")
    more = sub.add_parser("more", help="measure more rounds on the engines a run kept")
    for step in (go, more):
        step.add_argument("dir", type=Path)
        step.add_argument("--rounds", type=int, default=6, help="counted rounds in all, at most")
        step.add_argument("--deadline", type=float, default=480.0, help="seconds for this step")
        step.add_argument("--keep", action="store_true", help="leave the engines up for `more`")
        step.add_argument("--json", type=Path)
        step.add_argument("--markdown", type=Path)
        step.add_argument("--leg-seconds", type=float, metavar="S",
                          help="each counted leg repeats its requests until it has "
                               "lasted S seconds (default: once; for `more`, as the step "
                               "before)")  # fmt: skip
    look = sub.add_parser("profile", help="each workload once under the torch profiler, "
                          "on the engines a run kept")  # fmt: skip
    look.add_argument("dir", type=Path)
    look.add_argument("--workloads", nargs="+", metavar="KIND",
                      help="only these (default: those of the run)")  # fmt: skip
    look.add_argument("--deadline", type=float, default=300.0, help="seconds for this step")
    look.add_argument("--keep", action="store_true", help="leave the engines up")
    look.add_argument("--markdown", type=Path)
    judge = sub.add_parser("verdict", help="the batch-1 criterion on results files, one a set")
    judge.add_argument("results", type=Path, nargs="+", help="--json files (or DIR/results.json)")
    halt = sub.add_parser("stop", help="stop the engines a run kept (results unchanged)")
    halt.add_argument("dir", type=Path)
    again = sub.add_parser("table", help="print the tables of a results file again")
    again.add_argument("results", type=Path, help="the --json file (or DIR/results.json)")
    again.add_argument("--markdown", type=Path)
    again.add_argument(
        "--clocks", type=Path, metavar="FILE", help="gpu_session.sh's clocks.log (GPU clocks)"
    )
    go.add_argument("--site", type=Path, required=True, help="the directory holding vllm/")
    go.add_argument("--configs", nargs="+", metavar="NAME",
                    help="only these configurations beside the base (default: all but "
                         f"{PROBE})")  # fmt: skip
    for step in (go, more):
        step.add_argument("--workloads", nargs="+", metavar="KIND",
                          help="only these workloads, each with LoRA and base: decode_b64, "
                               "decode_b4, decode_b1, prefill, or one alone by its name "
                               "(prefill_base) (default: all; for `more`, those of the "
                               "step before)")  # fmt: skip
    go.add_argument(
        "--after",
        type=Path,
        metavar="FILE",
        help="start the engines now, measure once FILE exists (other GPU work done)",
    )
    go.add_argument(
        "--base",
        default="unpatched",
        metavar="NAME",
        help="the configuration every ratio is to (default: unpatched)",
    )
    args = parser.parse_args()
    if args.step == "table":
        results = json.loads(args.results.read_text())
        text = table(results, results.get("meta") or cut_short_meta(results, args.results))
        if args.clocks:
            counted = counted_rows(results)
            found = clock_table(counted, clock_samples(args.clocks), measured(results))
            text += "\n\n" + "\n".join(found)
        if results.get("profiles"):
            text += "\n\n" + profile_table(results)
        print(text)
        if args.markdown:
            args.markdown.write_text(text + "\n")
        return 0
    if args.step == "verdict":
        print("\n".join(verdict_table([json.loads(p.read_text()) for p in args.results])))
        return 0
    args.dir = args.dir.resolve()  # patchkit runs from the repository root
    if args.step == "run":
        args.site = args.site.resolve()
    if args.step == "build":
        build(args.dir, args.model, args.adapters, args.rank, args.model_from, args.layers,
              args.linked_adapters)  # fmt: skip
        return 0
    if args.step == "worker":
        worker(args.dir, args.name)
        return 0
    if args.step == "stop":  # results.json as it was: no report, no meta of this command
        for engine in attach(args.dir)[1].values():
            engine.stop()
        return 0
    deadline = time.monotonic() + args.deadline
    if args.step == "run":
        start(args.dir, args.site, args.configs, deadline, args.base,
              pick_workloads(args.workloads))  # fmt: skip
        wait_for_file(args.after, deadline)
    results, engines = attach(args.dir)
    if args.step == "profile":  # its workloads are this step's only, not the rounds'
        return profile_step(args, results, engines, deadline)
    if args.step == "more" and args.workloads:
        results["workloads"] = pick_workloads(args.workloads)
    if args.leg_seconds is not None:
        results["leg_seconds"] = args.leg_seconds
    measure(args.dir, results, engines, args.rounds, deadline)
    if not args.keep:
        for engine in engines.values():
            engine.stop()
    report(results, args)
    return 0


def profile_step(args, results: dict, engines: dict[str, Engine], deadline: float) -> int:
    """`profile`: the profiles into DIR/results.json, their table printed (and written)."""
    workloads = pick_workloads(args.workloads) if args.workloads else results["workloads"]
    try:
        profile(results, engines, workloads, deadline)
    except (RuntimeError, TimeoutError) as exc:  # keep what was profiled
        results["errors"]["profile"] = str(exc)
    save_partial(args.dir, results)
    if not args.keep:
        for engine in engines.values():
            engine.stop()
    text = profile_table(results)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


def cut_short_meta(results: dict, path: Path) -> dict:
    """The caption's facts for a results file whose run ended before its report (a sitting
    packed while it ran: results.json is saved after each round): the build's, from
    bench.json beside it, and the day of its first round; what only the report could
    know (the GPU, the versions) is said to be unknown."""
    unknown = "unknown (the run ended before its report)"
    first = min((r["wall"] for r in results["rounds"] if "wall" in r), default=None)
    day = time.strftime("%Y-%m-%d", time.gmtime(first)) if first is not None else unknown
    return {"date": day, "gpu": f"GPU {unknown}", "vllm": unknown, "torch": unknown,
            **bench_spec(path.parent)}  # fmt: skip


def wait_for_file(path: Path | None, deadline: float) -> None:
    """Until ``path`` exists (the GPU's other work has ended), or a minute before the
    deadline: the rounds measure the engines alone on the host where they can."""
    while path is not None and not path.exists() and time.monotonic() < deadline - 60:
        time.sleep(1)


def report(results: dict, args) -> None:
    import torch
    import vllm

    counted = {r["round"] for r in counted_rows(results)}
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "vllm": vllm.__version__, "torch": torch.__version__, "rounds": len(counted),
            "command": " ".join(sys.argv), **bench_spec(args.dir)}  # fmt: skip
    results["meta"] = meta
    save_partial(args.dir, results)
    text = table(results, meta)
    print(text)
    print(json.dumps({key: results.get(key, {}) for key in ("start_s", "engine_s", "errors")}))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
