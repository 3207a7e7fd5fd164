"""What the benchmarks and GPU proofs under scripts/ may take from patchkit.verify.

scripts/ backs the ledger's numbers with code that must keep running as verify
changes inside; it imports from verify only this module
(tests/test_scripts_surface.py keeps it so). A name here is a promise to those
scripts: the model shapes and builders of `verify --e2e`, the one add_lora_linear
call of the kernel checks, the merge of an adapter into base weights, and the
rule's excess over vLLM's own error (scripts/verify_rule_excess.py), and one
vLLM engine served as verify serves it, engine-side faults included
(scripts/proofs/enginefaults_smoke_gpu.py).
"""

from __future__ import annotations

from patchkit.verify.e2e import (
    DENSE27B_WIDTHS,
    MOE35B_WIDTHS,
    MOE_TARGET_MODULES,
    RANK,
    TARGET_MODULES,
    VOCAB,
    build_model,
    build_moe,
    expert_factors,
    qwen35_config,
    qwen35_moe_config,
    save_expert_adapter,
    scale_lora_b,
)
from patchkit.verify.enginefaults import DENSE_FAULTS
from patchkit.verify.kernelcheck import (
    forced_expand_config,
    installed_backend,
    lora_linear_call,
    relative_error,
)
from patchkit.verify.mergeplan import plan_merge
from patchkit.verify.mergewrite import write_merged
from patchkit.verify.rule import FAIL_EXCESS, PASS_EXCESS, excess, median_distance
from patchkit.verify.serving import Job, serve

__all__ = [
    "DENSE_FAULTS",
    "Job",
    "serve",
    "FAIL_EXCESS",
    "PASS_EXCESS",
    "excess",
    "median_distance",
    "DENSE27B_WIDTHS",
    "MOE35B_WIDTHS",
    "MOE_TARGET_MODULES",
    "RANK",
    "TARGET_MODULES",
    "VOCAB",
    "build_model",
    "build_moe",
    "expert_factors",
    "forced_expand_config",
    "installed_backend",
    "lora_linear_call",
    "plan_merge",
    "qwen35_config",
    "qwen35_moe_config",
    "relative_error",
    "save_expert_adapter",
    "scale_lora_b",
    "write_merged",
]
