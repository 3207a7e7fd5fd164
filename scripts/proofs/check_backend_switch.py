"""GPU check: PATCHKIT_LORA_BACKEND takes effect at the next engine start, warm cache or not.

Serves the e2e tiny Qwen3.5 + LoRA adapter with CUDA graphs and torch.compile
three times (torch, triton, torch) with one torch.compile cache, and records
per start: the ops punica_gpu bound, the variable's value in vLLM's
envs.compile_factors(), whether the graph came from the cache, and the cache
directories. Run with a patched vLLM importable and its cache cleared first:

    rm -rf ~/.cache/vllm/torch_compile_cache
    python3 scripts/proofs/check_backend_switch.py OUTDIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from patchkit.verify import toolkit  # noqa: E402

CHILD = r"""
import importlib.util, json, os, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
extra = {}
if importlib.util.find_spec("flashinfer") is None:
    extra = {"attention_backend": "TRITON_ATTN", "gdn_prefill_backend": "triton"}
llm = LLM(model=sys.argv[1], enable_lora=True, max_lora_rank=64, max_loras=2,
          enforce_eager=False, skip_tokenizer_init=True, language_model_only=True,
          gpu_memory_utilization=0.3, max_model_len=2048, max_num_seqs=4,
          max_num_batched_tokens=2048, dtype="bfloat16", **extra)
out = llm.generate([{"prompt_token_ids": list(range(1, 200))}],
                   SamplingParams(max_tokens=8, temperature=0),
                   lora_request=LoRARequest("a", 1, sys.argv[2]), use_tqdm=False)
import vllm.envs as envs
import vllm.lora.punica_wrapper.punica_gpu as punica
print("RESULT", json.dumps({
    "backend": os.environ.get("PATCHKIT_LORA_BACKEND"),
    "lora_shrink": punica.lora_shrink.__name__, "lora_expand": punica.lora_expand.__name__,
    "in_compile_factors": envs.compile_factors().get("PATCHKIT_LORA_BACKEND"),
    "tokens": list(out[0].outputs[0].token_ids)}))
"""


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir, adapter_dir = toolkit.build_model(out_dir / "model-and-adapter", 4321)
    cache = Path.home() / ".cache/vllm/torch_compile_cache"
    results = []
    for n, backend in enumerate(("torch", "triton", "torch"), start=1):
        env = {**os.environ, "PATCHKIT_LORA_BACKEND": backend}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: punica is ours
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(model_dir), str(adapter_dir)],
            env=env, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        log = done.stdout + done.stderr
        line = next((ln for ln in log.splitlines() if ln.startswith("RESULT ")), None)
        entry = json.loads(line[len("RESULT ") :]) if line else {"error": log[-1500:]}
        entry["seconds"] = round(time.monotonic() - started, 1)
        entry["loaded_from_cache"] = log.count("Directly load the compiled graph")
        entry["cache_dirs"] = sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []
        results.append(entry)
        print(json.dumps(entry), flush=True)
        (out_dir / f"switch-{n}-{backend}.log").write_text(log)
    (out_dir / "switch-check.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
