"""vLLM engines for `verify --e2e` and `verify --model`, one child process per engine.

A job names the model, its LoRA adapters, the mode (eager, or torch.compile
+ CUDA graphs), the tensor-parallel size, token-id prompts and the requests
in order. The child (``python -m patchkit.verify.serving JOB OUT``) runs them
with ``vllm.LLM`` and writes what came back; the parent only starts, waits
and reads. A child per engine because vLLM keeps process-wide state (CUDA
context, compile caches, distributed groups) that no second engine in the
same process may inherit, and because a crashed engine must not take the
verdict with it. vllm and torch are imported in the child only.

Memory: each engine reserves a fixed KV cache (``kv_cache_memory_bytes``),
which skips vLLM's memory profiling. Profiling fails when another process
frees GPU memory meanwhile ("Error in memory profiling", gpu_worker.py in
0.26.0), which engines started side by side do; with a fixed reservation
they can start together, as many as fit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patchkit import signals
from patchkit.errors import UsageProblem

MODES = ("eager", "cudagraph")
GENERATED = 16
MAX_NUM_SEQS = 4
MAX_BATCHED_TOKENS = 4096
# vLLM's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks, 0.22-0.33).
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
GIB = 1 << 30
# How often the pool looks at its children and at what is ready (seconds).
POLL_S = 1.0


@dataclass
class Job:
    """One engine and the requests it serves, in order: (label, prompt, adapter or None)."""

    name: str
    model: str
    mode: str
    prompts: dict[str, list[int]]
    requests: list[tuple[str, str, str | None]]
    loras: dict[str, str] = field(default_factory=dict)
    # {LoRA name: fault}: loras the engine serves changed as a bug in its LoRA code would
    # (patchkit.verify.enginefaults), installed in its workers right after it starts
    faults: dict[str, str] = field(default_factory=dict)
    max_lora_rank: int = 16
    tensor_parallel_size: int = 1
    max_model_len: int = 4096
    seed: int = 0
    gpu_memory_utilization: float = 0.3
    kv_cache_bytes: int = 2 * GIB
    # The module the child runs (``python -m RUNNER JOB OUT``): this one for a vLLM
    # engine; patchkit.verify.peftref for the transformers + PEFT reference.
    runner: str = "patchkit.verify.serving"


def check_tensor_parallel(size: int, visible: int) -> None:
    """A tensor-parallel size this machine can run, or one line (exit 2)."""
    if size < 1:
        raise UsageProblem(f"--tensor-parallel-size {size}: must be 1 or more")
    if size > visible:
        raise UsageProblem(
            f"--tensor-parallel-size {size} needs {size} GPUs and {visible} "
            f"{'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES); "
            f"use at most {visible}"
        )


def lora_rank_limit(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds ``rank``."""
    return next((r for r in LORA_RANKS if r >= rank), rank)


def engine_memory(weight_bytes: int, vocab: int, tp: int, kv_bytes: int, total: int) -> float:
    """gpu_memory_utilization for one engine: weights, KV cache and working memory.

    vLLM only checks it against free memory at start when the KV cache is
    fixed; the working memory is the prompt log-probabilities of a chunk
    (tokens x vocab in float32, three copies) plus 3 GiB for CUDA context,
    activations and graphs.
    """
    need = weight_bytes / tp + kv_bytes + 3 * MAX_BATCHED_TOKENS * vocab * 4 + 3 * GIB
    return round(min(0.9, need / total), 3)


def side_by_side(fraction: float, free_fraction: float) -> int:
    """How many engines of ``fraction`` fit in ``free_fraction`` of the GPU at once."""
    return max(1, int(free_fraction / fraction))


# ----- the child: one engine -----


def serve(job: Job, out_file: Path) -> None:
    """Run the job's requests through vllm.LLM and write what came back."""
    started = time.monotonic()
    llm = _engine(job)
    engine_seconds = time.monotonic() - started
    installed = _install_faults(llm, job)
    runs = _run_requests(llm, job)
    result = {
        "name": job.name,
        "mode": job.mode,
        "engine_seconds": engine_seconds,
        "corrupted_requests": _corrupted(llm),
        "runs": runs,
    }
    if job.loras:  # what decides whether base rows must come out bit-identical (baserows)
        result |= {"lora_backend": lora_backend(), "routed_experts": routed_experts(job.model)}
    if job.faults:  # what each worker found, and every fault it applied (id, slot, fault, n)
        result["faults"] = _faults_applied(llm, job, installed, runs)
    out_file.write_text(json.dumps(result))


def _faults_applied(llm, job: Job, installed: list, runs: dict) -> dict:
    """What the workers applied; a control whose fault changed nothing is marked not
    served in ``runs`` (its answers are the adapter's own: a control of nothing)."""
    from patchkit.verify import enginefaults

    applied = llm.collective_rpc(enginefaults.APPLIED)
    missing = enginefaults.not_applied(lora_ids(job), job.faults, applied)
    for label, _, adapter in job.requests:
        if adapter in missing:
            runs[label] = {"error": missing[adapter]}
    return {"asked": job.faults, "installed": installed, "applied": applied,
            "not_applied": sorted(missing), "extension": enginefaults.EXTENSION}  # fmt: skip


def lora_ids(job: Job) -> dict[str, int]:
    """Each LoRA name's int id in the engine: 1, 2, ... in the job's order."""
    return {name: number for number, name in enumerate(job.loras, start=1)}


def _install_faults(llm, job: Job) -> list:
    """The engine-side faults installed in every worker ({id: fault}); what each found."""
    if not job.faults:
        return []
    from patchkit.verify import enginefaults

    ids = lora_ids(job)
    faults = {ids[name]: fault for name, fault in job.faults.items()}
    return llm.collective_rpc(enginefaults.INSTALL, args=(faults,))


def lora_backend() -> str:
    """'torch' where patchkit's matmul-add-lora-linear path serves LoRA, else 'triton'
    (vLLM's punica kernels: the patch is not applied, or PATCHKIT_LORA_BACKEND=triton)."""
    try:
        from vllm.lora.punica_wrapper import patchkit_lora_matmul
    except ImportError:
        return "triton"
    return patchkit_lora_matmul.LORA_BACKEND


def routed_experts(model: str) -> int:
    """The model's routed experts per MoE layer (0 for a dense model), from config.json."""
    config = json.loads((Path(model) / "config.json").read_text())
    return experts_in({**config, **(config.get("text_config") or {})})


def experts_in(text_config: dict) -> int:
    """The routed experts per MoE layer a text config names (0: a dense model)."""
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return next((int(text_config[k]) for k in keys if text_config.get(k)), 0)


def _engine(job: Job):
    """vllm.LLM for the job, with the kernels that need no FlashInfer or DeepGEMM."""
    os.environ["VLLM_COMPUTE_NANS_IN_LOGITS"] = "1"
    import importlib.util

    from vllm import LLM

    extra = {}
    if importlib.util.find_spec("flashinfer") is None:  # pick kernels that need no FlashInfer
        extra = {"attention_backend": "TRITON_ATTN", "gdn_prefill_backend": "triton"}
        # 0.22's sampler imports FlashInfer unless told not to (seen on the test H200).
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if importlib.util.find_spec("deep_gemm") is None:
        # 0.22 warms DeepGEMM up at start and stops if it is missing (seen on the test H200).
        os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
    if job.faults:
        from patchkit.verify import enginefaults

        extra["worker_extension_cls"] = enginefaults.EXTENSION
    if job.loras:
        extra |= {
            "enable_lora": True,
            "max_lora_rank": job.max_lora_rank,
            "max_loras": min(len(job.loras), 4),
        }
    return LLM(
        model=job.model,
        enforce_eager=(job.mode == "eager"),
        skip_tokenizer_init=True,
        language_model_only=True,
        tensor_parallel_size=job.tensor_parallel_size,
        gpu_memory_utilization=job.gpu_memory_utilization,
        kv_cache_memory_bytes=job.kv_cache_bytes,
        max_model_len=job.max_model_len,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        dtype="bfloat16",
        seed=job.seed,
        disable_log_stats=False,
        **extra,
    )


def _run_requests(llm, job: Job) -> dict:
    """Each request in order; an adapter that fails to load marks its label with the error."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(max_tokens=GENERATED, temperature=0.0, prompt_logprobs=0, logprobs=0)
    ids = lora_ids(job)
    runs: dict = {}
    for label, prompt, adapter in job.requests:
        group = runs.setdefault(label, {})
        if "error" in group:
            continue
        request = None
        if adapter is not None:
            request = LoRARequest(f"patchkit-{adapter}", ids[adapter], job.loras[adapter])
        try:
            [result] = llm.generate(
                [{"prompt_token_ids": job.prompts[prompt]}],
                params,
                lora_request=request,
                use_tqdm=False,
            )
        except Exception as exc:  # e.g. the partial-adapter bug: the adapter does not load
            if adapter is None:
                raise
            runs[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            continue
        group[prompt] = collect(result, job.prompts[prompt])
    return runs


def _corrupted(llm) -> float:
    """vllm:corrupted_requests, summed over engines (VLLM_COMPUTE_NANS_IN_LOGITS=1)."""
    return sum(
        getattr(m, "value", 0) or 0
        for m in llm.get_metrics()
        if m.name.startswith("vllm:corrupted_requests")
    )


def collect(result, ids: list[int]) -> dict:
    """Prompt log-probs of the actual prompt tokens, generated tokens and their log-probs."""
    prompt = [
        entry[tok].logprob for entry, tok in zip(result.prompt_logprobs[1:], ids[1:], strict=True)
    ]
    completion = result.outputs[0]
    sampled = [
        entry[tok].logprob
        for entry, tok in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    return {
        "prompt_logprobs": prompt,
        "tokens": list(completion.token_ids),
        "token_logprobs": sampled,
    }


# ----- the parent: start, wait, read -----


def start(jobs: list[Job], workdir: Path) -> dict:
    """One child process per job, all at once; each writes its log under workdir."""
    children = {}
    for job in jobs:
        job_file = workdir / f"vllm-{job.name}.job.json"
        job_file.write_text(json.dumps(asdict(job)))
        env = {**os.environ, "VLLM_CACHE_ROOT": str(workdir / f"vllm-cache-{job.name}")}
        with (workdir / f"vllm-{job.name}.log").open("w") as log:  # the child keeps its copy
            children[job.name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    job.runner,
                    str(job_file),
                    str(workdir / f"vllm-{job.name}.json"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: TP workers go with it
            )
    return children


def result(name: str, child: subprocess.Popen, workdir: Path) -> dict:
    """What a finished child wrote, or an error quoting its log's first error line."""
    out = workdir / f"vllm-{name}.json"
    if child.returncode == 0 and out.exists():
        return json.loads(out.read_text())
    return {
        "error": f"vLLM ({name}) exited {child.returncode}: "
        + first_error(workdir / f"vllm-{name}.log")
    }


def kill(child: subprocess.Popen) -> None:
    """The engine and the processes it started (its tensor-parallel workers)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)  # its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        child.kill()
    child.wait()


# "AttributeError: '_OpNamespace' '_moe_C' object has no attribute 'topk_softmax'",
# after vLLM's "(Worker_TP1 pid=1) ERROR 11-30 17:01:58 [file.py:1007] " prefix.
RAISED = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.*)$")


def first_error(log: Path) -> str:
    """The first exception a failed engine raised, as its type and message.

    The first line with "Error" in it is often vLLM's log prefix on a source
    line of the traceback (``raise AttributeError(``); the exception itself is
    the line that reads ``SomeError: message``.
    """
    lines = log.read_text(errors="replace").strip().splitlines()
    raised = [m.group(1) + ": " + m.group(2) for m in map(RAISED.search, lines) if m]
    errors = [line.strip() for line in lines if "Error" in line and "Traceback" not in line]
    found = raised or errors
    return (found[0] if found else " | ".join(lines[-3:]))[:300]


def serve_all(
    jobs: list[Job],
    workdir: Path,
    timeout: float,
    at_once: int,
    ready: Callable[[Job], bool] | None = None,
) -> dict:
    """The jobs, ``at_once`` at a time (pool); a job that failed then gets one run alone.

    A failure beside other engines can be theirs (memory, ports); alone it is
    the engine's own. The first error is kept in the result. The result is in the
    jobs' order, whatever order they ran in.
    """
    served = pool(jobs, workdir, timeout, at_once, ready or _always)
    for job in [j for j in jobs if "error" in served[j.name]]:
        first = served[job.name]["error"]
        served[job.name] = alone(job, workdir, timeout)
        served[job.name]["first_attempt"] = first
    return {job.name: served[job.name] for job in jobs}


def alone(job: Job, workdir: Path, timeout: float) -> dict:
    """One job's result, its child alone on the GPUs (a second attempt, or the PEFT
    reference, which takes every GPU): the pool of one, so that a signal leaves no
    child of it running either."""
    return pool([job], workdir, timeout, 1, _always)[job.name]


def _always(job: Job) -> bool:
    return True


def pool(
    jobs: list[Job], workdir: Path, timeout: float, at_once: int, ready: Callable[[Job], bool]
) -> dict:
    """Each job in a slot of ``at_once`` as soon as one is free and the job is ``ready``
    (what it reads is written: the merged references, written while the first engines
    start), the CUDA-graph engines first (first_slow); each child given ``timeout``.

    Waves of ``at_once`` lasted each as long as its slowest engine: on the 35B-A3B-wide
    cut on an H100, three at a time, a CUDA-graph engine took 223-260 s and an eager one
    54-110 s (2026-12-07), so two eager engines waited for the third slot's compile
    twice. A slot frees when its child has exited, so as many engines hold the GPU at
    once as in a wave, and each reserves a fixed KV cache (no memory profiling to break
    when a neighbour frees memory: the module's docstring). ``ready`` may raise (the
    references could not be written): the children running are killed and it goes on.
    """
    waiting, running, served = first_slow(jobs), {}, {}
    try:
        while waiting or running:
            for name, (child, deadline) in list(running.items()):
                if child.poll() is None and time.monotonic() < deadline:
                    continue
                if child.poll() is None:
                    kill(child)
                served[name] = result(name, child, workdir)
                del running[name]
            for job in [j for j in waiting if ready(j)][: at_once - len(running)]:
                waiting.remove(job)
                with signals.deferred():  # no child started and not yet in running
                    child = start([job], workdir)[job.name]
                    running[job.name] = (child, time.monotonic() + timeout)
            if running or waiting:
                time.sleep(POLL_S)
    except BaseException:
        # SIGTERM (CI, `timeout`, Kubernetes), Ctrl-C, or the references' writer failing:
        # the engines would go on holding the GPUs, orphaned, their workdir removed. A
        # second signal meanwhile waits until every one is killed.
        with signals.deferred():
            for child, _ in running.values():
                kill(child)
        raise
    return served


def first_slow(jobs: list[Job]) -> list[Job]:
    """The CUDA-graph engines first (compiling and capturing graphs makes them the slowest
    of a run, 3-4 times an eager engine on the wide cut), else as given."""
    return sorted(jobs, key=lambda job: job.mode != "cudagraph")  # stable


if __name__ == "__main__":  # the child process of start(); TP workers re-import this module
    serve(Job(**json.loads(Path(sys.argv[1]).read_text())), Path(sys.argv[2]))
