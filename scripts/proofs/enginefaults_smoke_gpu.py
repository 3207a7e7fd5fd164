"""Smoke test of verify's engine-side controls in a real vLLM engine (one GPU, ~2 min).

  python scripts/proofs/enginefaults_smoke_gpu.py OUT

Builds e2e's tiny Qwen3.5 hybrid and its rank-64 adapter, then serves, in one eager
engine through patchkit.verify.serving (as `verify --model` does), the base, the adapter,
the adapter again under a LoRA id of its own for each engine-side fault
(patchkit.verify.enginefaults), and the adapter once more. Writes OUT/smoke.json and
prints one verdict line; exit 0 when: every worker installed the faults, each fault was
applied to a slot with tensors changed, each faulted answer differs from the adapter's,
and the adapter's answer after them equals its first (no fault leaked into its slot).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from patchkit.verify.toolkit import DENSE_FAULTS, Job, build_model, serve  # noqa: E402


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model_dir, adapter_dir = build_model(out, seed=7)
    faults = {f"a+engine-{f}": f for f in DENSE_FAULTS}
    loras = {"a": str(adapter_dir), **{name: str(adapter_dir) for name in faults}}
    prompt = {"p300": [1 + (i * 37) % 3900 for i in range(300)]}
    requests = [("base", "p300", None), ("lora:a", "p300", "a")]
    requests += [(f"control:{name}", "p300", name) for name in faults]
    requests += [("lora_again", "p300", "a")]
    job = Job("smoke", str(model_dir), "eager", prompt, requests, loras=loras,
                      faults=faults, max_lora_rank=64, max_model_len=1024,
                      gpu_memory_utilization=0.5)  # fmt: skip
    serve(job, out / "served.json")
    served = json.loads((out / "served.json").read_text())
    runs = served["runs"]

    def lp(label):
        return runs[label]["p300"]["prompt_logprobs"]

    def diff(a, b):
        return max(abs(x - y) for x, y in zip(lp(a), lp(b), strict=True))

    applied = [a for worker in served["faults"]["applied"] for a in worker]
    found = {
        "installed": served["faults"]["installed"],
        "applied": applied,
        "lora_vs_base": diff("lora:a", "base"),
        "faulted_vs_lora": {n: diff(f"control:{n}", "lora:a") for n in faults},
        "lora_again_vs_lora": diff("lora_again", "lora:a"),
    }
    ok = (
        all(w["modules"] > 0 for w in found["installed"])
        and {a[2] for a in applied if a[3] > 0} == set(faults.values())
        and all(d > 0.01 for d in found["faulted_vs_lora"].values())
        and found["lora_again_vs_lora"] < 0.05
    )
    found["ok"] = ok
    (out / "smoke.json").write_text(json.dumps(found, indent=1))
    print(f"enginefaults smoke: {'PASSED' if ok else 'FAILED'}: {json.dumps(found)[:900]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
