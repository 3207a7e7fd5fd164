"""The merged reference of `verify --model` (verify/mergeplan.py, mergewrite.py) on tiny Qwen3.5.

The checkpoints and adapters are written here with a safetensors writer of
the test's own, and read back with a reader of its own, so the expected
weights never go through patchkit's reader or writer. Adapters use PEFT's
file format: ``get_peft_model_state_dict`` (huggingface/peft
``src/peft/utils/save_and_load.py``) saves the PEFT model's parameter names
with the adapter name removed, ``base_model.model.<module>.lora_A.weight``
(r, in) / ``.lora_B.weight`` (out, r), ``<module>.lora_embedding_A`` /
``lora_embedding_B`` for embeddings; ``target_parameters`` wrappers on the
fused experts save ``<experts>.base_layer.lora_A.weight`` (gate_up_proj) and
``<experts>.lora_A.weight`` (down_proj) with ParamWrapper's shapes
(``peft/tuners/lora/layer.py``): for Qwen3.5's (E, out, in) experts A
(r*E, in), B (out, r*E) from PEFT 0.20.0 on, A (r*E, out), B (in, r*E) in
PEFT 0.17-0.19. Expected weights are computed with torch on whole tensors:
W + scale * (B @ A), and for fused experts ParamWrapper.get_delta_weight's
einsum of the PEFT release that writes the layout (for the current one
also vLLM's reshape/permute, which must agree).

Factors are small multiples of 1/8 (exact in bf16, and B @ A is exact in
float32 whatever the summation order), so merged bf16 weights must equal the
expected ones bit for bit; one test uses random normal factors with a
tolerance instead.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch

from patchkit.adapters import safetensorsfile
from patchkit.errors import PatchkitError, Refused
from patchkit.verify import checkpoint, mergeplan, mergewrite
from tests.checkpoint_helpers import (
    HEAD_DIM,
    HEADS,
    I_DENSE,
    I_MOE,
    I_SHARED,
    KV_HEADS,
    LAYERS,
    QKV,
    SHARDS,
    V_HEADS,
    VALUE_DIM,
    VL,
    E,
    H,
    V,
    base_tensors,
    dyadic,
    lin,
    st_raw,
    st_read,
    st_write,
    write_adapter,
    write_checkpoint,
)


def expected_linear(w: torch.Tensor, a, b, scale: float) -> torch.Tensor:
    return (w.float() + (b.float() @ a.float()) * scale).to(w.dtype)


def peft_expert_delta(a, b, n: int) -> torch.Tensor:
    """PEFT >= 0.20 ParamWrapper.get_delta_weight for a 3-D (E, out, in) parameter (in/out
    swapped), before scaling."""
    r = a.shape[0] // n
    return torch.einsum(
        "o r e, e r i -> e o i", b.float().reshape(b.shape[0], r, n), a.float().reshape(n, r, -1)
    )


def legacy_expert_delta(a, b, n: int) -> torch.Tensor:
    """PEFT 0.17-0.19 ParamWrapper.get_delta_weight for a 3-D parameter (no swap)."""
    r = a.shape[0] // n
    return torch.einsum(
        "o r e, e r i -> e i o", b.float().reshape(b.shape[0], r, n), a.float().reshape(n, r, -1)
    )


def vllm_expert_delta(a, b, n: int) -> torch.Tensor:
    """The delta vLLM's FusedMoE3DWithLoRA applies (model_manager._stack_moe_lora_weights)."""
    r = a.shape[0] // n
    a3 = a.float().reshape(n, r, a.shape[-1])
    b3 = b.float().reshape(b.shape[0], r, n).permute(2, 0, 1)
    return b3 @ a3


def merged_tensors(dest: Path) -> dict[str, torch.Tensor]:
    out = {}
    for name in SHARDS:
        out.update(st_read(dest / name))
    return out


def check_index(dest: Path) -> dict:
    index = json.loads((dest / checkpoint.INDEX_NAME).read_text())
    weight_map = index["weight_map"]
    seen = {}
    total = 0
    for name in set(weight_map.values()):
        for key, data in st_raw(dest / name).items():
            seen[key] = name
            total += len(data)
    assert seen == weight_map
    assert index["metadata"]["total_size"] == total
    return index


def run_merge(tmp_path: Path, model: Path, adapter: Path, name="merged"):
    plan = mergeplan.plan_merge(model, adapter)
    dest = tmp_path / name
    mergewrite.write_merged(plan, dest)
    return plan, dest


DENSE_MODULES = {
    0: {
        "linear_attn.in_proj_qkv": (QKV, H),
        "linear_attn.in_proj_z": (VALUE_DIM, H),
        "linear_attn.in_proj_b": (V_HEADS, H),
        "linear_attn.in_proj_a": (V_HEADS, H),
        "linear_attn.out_proj": (H, VALUE_DIM),
    },
    1: {
        "self_attn.q_proj": (2 * HEADS * HEAD_DIM, H),
        "self_attn.k_proj": (KV_HEADS * HEAD_DIM, H),
        "self_attn.v_proj": (KV_HEADS * HEAD_DIM, H),
        "self_attn.o_proj": (H, HEADS * HEAD_DIM),
    },
}
MLP = {"mlp.gate_proj": (I_DENSE, H), "mlp.up_proj": (I_DENSE, H), "mlp.down_proj": (H, I_DENSE)}


def all_dense_modules() -> dict[str, tuple[int, int]]:
    mods = {}
    for i, kind in enumerate(LAYERS):
        layer = DENSE_MODULES[0 if kind == "linear_attention" else 1] | MLP
        mods.update({f"{VL}layers.{i}.{m}": shape for m, shape in layer.items()})
    mods["lm_head"] = (V, H)
    return mods


# ---------------------------------------------------------------------------
# dense
# ---------------------------------------------------------------------------


def test_dense_adapter_on_every_module_merges_exactly(tmp_path):
    base = base_tensors()
    model = write_checkpoint(tmp_path / "model", base)
    mods = all_dense_modules()
    factors = {m: lin(shape, 4, seed=i) for i, (m, shape) in enumerate(mods.items())}
    emb_a, emb_b = dyadic(4, V, seed=77), dyadic(H, 4, seed=78)
    factors[VL + "embed_tokens"] = ("emb", emb_a, emb_b)
    adapter = write_adapter(tmp_path / "lora", factors)
    plan, dest = run_merge(tmp_path, model, adapter)

    scale = 8 / 4
    expected = {
        f"{m}.weight": expected_linear(base[f"{m}.weight"], *factors[m], scale) for m in mods
    }
    emb = base[VL + "embed_tokens.weight"]
    expected[VL + "embed_tokens.weight"] = (emb.float() + (emb_b @ emb_a).T * scale).to(emb.dtype)
    merged = merged_tensors(dest)
    assert set(merged) == set(base)
    for key, want in expected.items():
        assert torch.equal(merged[key], want), key
        assert not torch.equal(merged[key], base[key]), f"{key} did not change"
    raw_before = {}
    for name in SHARDS:
        raw_before.update(st_raw(model / name))
    raw_after = {}
    for name in SHARDS:
        raw_after.update(st_raw(dest / name))
    for key in set(base) - set(expected):
        assert raw_after[key] == raw_before[key], key
    assert sorted(plan.changed_tensors) == sorted(expected)
    assert {m.module for m in plan.modules} == set(factors)
    assert all(m.scale == scale and m.rank == 4 for m in plan.modules)
    assert plan.rewrite == list(SHARDS) and plan.link == []
    check_index(dest)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (dest / name).read_bytes() == (model / name).read_bytes()


def test_random_factors_f32_checkpoint_within_float32_rounding(tmp_path):
    base = base_tensors(dtype=torch.float32, seed=3)
    model = write_checkpoint(tmp_path / "model", base)
    g = torch.Generator().manual_seed(5)
    mods = all_dense_modules()
    factors = {
        m: (torch.randn(8, s[1], generator=g), torch.randn(s[0], 8, generator=g))
        for m, s in mods.items()
    }
    adapter = write_adapter(tmp_path / "lora", factors, dtype=torch.float32, r=8, lora_alpha=16)
    _, dest = run_merge(tmp_path, model, adapter)
    merged = merged_tensors(dest)
    for m, (a, b) in factors.items():
        want = base[f"{m}.weight"] + 2.0 * (b @ a)
        torch.testing.assert_close(merged[f"{m}.weight"], want, rtol=1e-6, atol=1e-6)
        assert (merged[f"{m}.weight"] - base[f"{m}.weight"]).abs().max() > 0.1


@pytest.mark.parametrize(
    "member,other",
    [("in_proj_qkv", "in_proj_z"), ("in_proj_z", "in_proj_qkv")],
    ids=["qkv-only", "z-only"],
)
def test_partial_gdn_adapter_changes_only_its_member(tmp_path, member, other):
    base = base_tensors()
    model = write_checkpoint(tmp_path / "model", base)
    shape = DENSE_MODULES[0][f"linear_attn.{member}"]
    mods = [f"{VL}layers.{i}.linear_attn.{member}" for i in (0, 2)]
    factors = {m: lin(shape, 4, seed=i) for i, m in enumerate(mods)}
    adapter = write_adapter(tmp_path / "lora", factors)
    plan, dest = run_merge(tmp_path, model, adapter)
    merged = merged_tensors(dest)
    raw_before = {k: v for n in SHARDS for k, v in st_raw(model / n).items()}
    raw_after = {k: v for n in SHARDS for k, v in st_raw(dest / n).items()}
    for m in mods:
        assert torch.equal(
            merged[f"{m}.weight"], expected_linear(base[f"{m}.weight"], *factors[m], 2.0)
        )
    changed = {f"{m}.weight" for m in mods}
    assert {k for k in base if raw_before[k] != raw_after[k]} == changed
    assert (
        raw_after[f"{VL}layers.0.linear_attn.{other}.weight"]
        == raw_before[f"{VL}layers.0.linear_attn.{other}.weight"]
    )
    assert plan.rewrite == [SHARDS[0], SHARDS[2]] and plan.link == [SHARDS[1]]


def test_byte_estimate_and_links(tmp_path):
    base = base_tensors()
    model = write_checkpoint(tmp_path / "model", base)
    (model / "README.md").write_text("tiny\n")
    m = f"{VL}layers.1.self_attn.o_proj"
    adapter = write_adapter(tmp_path / "lora", {m: lin((H, HEADS * HEAD_DIM), 4, seed=1)})
    plan, dest = run_merge(tmp_path, model, adapter)
    assert plan.rewrite == [SHARDS[1]]
    assert plan.link == [SHARDS[0], SHARDS[2]]
    assert plan.copy == ["README.md", "config.json", "generation_config.json", "tokenizer.json"]
    written = 0
    for path in dest.iterdir():
        source = model / path.name
        if path.is_symlink():
            assert path.name in plan.link and path.resolve() == source.resolve()
            continue
        if source.exists() and path.stat().st_ino == source.stat().st_ino:
            assert path.name in plan.link
            continue
        written += path.stat().st_size
    assert written == plan.bytes_needed
    expected = sum((model / n).stat().st_size for n in plan.rewrite + plan.copy)
    assert plan.bytes_needed == expected + (dest / checkpoint.INDEX_NAME).stat().st_size
    for name in plan.link:  # linked, so byte-identical and free
        assert (dest / name).read_bytes() == (model / name).read_bytes()
        assert (dest / name).is_symlink() or (dest / name).stat().st_ino == (
            model / name
        ).stat().st_ino
    assert mergeplan.human_bytes(plan.bytes_needed) in plan.describe()[0]


def test_rewritten_shard_keeps_every_other_byte(tmp_path):
    base = base_tensors()
    model = tmp_path / "model"
    model.mkdir()
    st_write(model / "model.safetensors", base, gap=8)  # one file, no index
    m = f"{VL}layers.1.self_attn.o_proj"
    adapter = write_adapter(tmp_path / "lora", {m: lin((H, HEADS * HEAD_DIM), 4, seed=1)})
    plan, dest = run_merge(tmp_path, model, adapter)
    assert plan.rewrite == ["model.safetensors"] and plan.index_text is None
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"]
    before, after = (
        (model / "model.safetensors").read_bytes(),
        (dest / "model.safetensors").read_bytes(),
    )
    assert len(before) == len(after)
    with safetensorsfile.SafetensorsFile(model / "model.safetensors") as f:
        info = f.tensors[m + ".weight"]
    assert before[: info.begin] == after[: info.begin] and before[info.end :] == after[info.end :]
    assert before[info.begin : info.end] != after[info.begin : info.end]
    want = expected_linear(base[m + ".weight"], *lin((H, HEADS * HEAD_DIM), 4, seed=1), 2.0)
    assert st_read(dest / "model.safetensors")[m + ".weight"].equal(want)


def test_adapter_saved_as_bin(tmp_path):
    base = base_tensors()
    model = write_checkpoint(tmp_path / "model", base)
    m = f"{VL}layers.0.linear_attn.out_proj"
    a, b = lin((H, VALUE_DIM), 4, seed=2)
    adapter = write_adapter(tmp_path / "lora", {})
    (adapter / "adapter_model.safetensors").unlink()
    torch.save(
        {f"base_model.model.{m}.lora_A.weight": a, f"base_model.model.{m}.lora_B.weight": b},
        adapter / "adapter_model.bin",
    )
    _, dest = run_merge(tmp_path, model, adapter)
    assert torch.equal(
        merged_tensors(dest)[m + ".weight"], expected_linear(base[m + ".weight"], a, b, 2.0)
    )


def test_adapter_with_text_only_names_merges_onto_vl_checkpoint(tmp_path):
    base = base_tensors()
    model = write_checkpoint(tmp_path / "model", base)
    module = "model.layers.2.linear_attn.in_proj_qkv"
    factors = {module: lin((QKV, H), 4, seed=9)}
    adapter = write_adapter(tmp_path / "lora", factors)
    plan, dest = run_merge(tmp_path, model, adapter)
    key = f"{VL}layers.2.linear_attn.in_proj_qkv.weight"
    assert plan.changed_tensors == [key]
    assert torch.equal(merged_tensors(dest)[key], expected_linear(base[key], *factors[module], 2.0))
    assert any(
        "model.language_model.layers.2" in n and "hf_to_vllm_mapper" in n for n in plan.notes
    )


# ---------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------


def expert_factors(layout: str, n_layers=(0, 1, 2), r=2, seed=100) -> tuple[dict, dict]:
    """3-D adapter factors for gate_up_proj (E, 2I, H) and down_proj (E, H, I) of each layer."""
    factors, params = {}, {}
    for i in n_layers:
        root = f"{VL}layers.{i}.mlp.experts"
        for wrapper, param, (d1, d2) in (
            (root + ".base_layer", "gate_up_proj", (2 * I_MOE, H)),
            (root, "down_proj", (H, I_MOE)),
        ):
            seed += 2
            if layout == "legacy":  # PEFT <= 0.19: A (r*E, d1), B (d2, r*E)
                a, b = dyadic(r * E, d1, seed=seed), dyadic(d2, r * E, seed=seed + 1)
            else:  # PEFT >= 0.20 and vLLM: A (r*E, d2), B (d1, r*E)
                a, b = dyadic(r * E, d2, seed=seed), dyadic(d1, r * E, seed=seed + 1)
            factors[wrapper] = (a, b)
            params[wrapper] = f"{root}.{param}"
    return factors, params


SHARED = {
    "mlp.shared_expert.gate_proj": (I_SHARED, H),
    "mlp.shared_expert.up_proj": (I_SHARED, H),
    "mlp.shared_expert.down_proj": (H, I_SHARED),
    "mlp.shared_expert_gate": (1, H),
}


@pytest.mark.parametrize("named", [True, False], ids=["target_parameters", "no-config"])
@pytest.mark.parametrize("layout", ["current", "legacy"])
def test_fused_experts_and_shared_expert_merge_exactly(tmp_path, layout, named):
    base = base_tensors(moe=True)
    model = write_checkpoint(tmp_path / "model", base, arch="Qwen3_5MoeForConditionalGeneration")
    factors, params = expert_factors(layout)
    dense = {f"{VL}layers.1.self_attn.q_proj": (2 * HEADS * HEAD_DIM, H)}
    dense |= {f"{VL}layers.{i}.{m}": s for i in (0, 2) for m, s in SHARED.items()}
    factors |= {m: lin(s, 2, seed=i) for i, (m, s) in enumerate(dense.items())}
    target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if named else None
    adapter = write_adapter(
        tmp_path / "lora", factors, r=2, lora_alpha=4, target_parameters=target_parameters
    )
    plan, dest = run_merge(tmp_path, model, adapter)
    merged = merged_tensors(dest)
    scale = 4 / 2
    delta = peft_expert_delta if layout == "current" else legacy_expert_delta
    for wrapper, key in params.items():
        if layout == "current":  # what vLLM applies is what PEFT means
            assert torch.equal(delta(*factors[wrapper], E), vllm_expert_delta(*factors[wrapper], E))
        want = (base[key].float() + delta(*factors[wrapper], E) * scale).to(torch.bfloat16)
        assert merged[key].shape == base[key].shape
        assert torch.equal(merged[key], want), key
    for m in dense:
        assert torch.equal(
            merged[f"{m}.weight"], expected_linear(base[f"{m}.weight"], *factors[m], scale)
        ), m
    untouched = set(base) - set(params.values()) - {f"{m}.weight" for m in dense}
    for key in untouched:
        assert torch.equal(merged[key], base[key]), key
    kinds = {m.module: m.kind for m in plan.modules}
    assert kinds[f"{VL}layers.0.mlp.experts.base_layer"] == (
        "experts" if layout == "current" else "experts-legacy"
    )
    legacy_notes = [n for n in plan.notes if "PEFT <= 0.19" in n]
    assert len(legacy_notes) == (layout == "legacy")
    if legacy_notes:
        assert "6 fused expert modules" in legacy_notes[0] and "misreads" in legacy_notes[0]
    check_index(dest)


@pytest.mark.parametrize("named", [True, False], ids=["target_parameters", "by-shape"])
@pytest.mark.parametrize("only", ["gate_up_proj", "down_proj"])
def test_one_fused_expert_parameter_is_the_outer_wrapper(tmp_path, only, named):
    """With one target parameter PEFT saves it as `experts` (no base_layer); without
    target_parameters in the config the shapes say which parameter it is."""
    base = base_tensors(moe=True)
    model = write_checkpoint(tmp_path / "model", base)
    root = f"{VL}layers.2.mlp.experts"
    d1, d2 = (2 * I_MOE, H) if only == "gate_up_proj" else (H, I_MOE)
    a, b = dyadic(2 * E, d2, seed=1), dyadic(d1, 2 * E, seed=2)
    adapter = write_adapter(
        tmp_path / "lora",
        {root: (a, b)},
        r=2,
        lora_alpha=4,
        target_parameters=[f"mlp.experts.{only}"] if named else None,
    )
    plan, dest = run_merge(tmp_path, model, adapter)
    key = f"{root}.{only}"
    assert plan.changed_tensors == [key]
    assert any(f"adapt one parameter ({only})" in n for n in plan.notes)
    want = (base[key].float() + peft_expert_delta(a, b, E) * 2.0).to(torch.bfloat16)
    assert torch.equal(merged_tensors(dest)[key], want)


def test_fused_adapter_onto_per_expert_checkpoint(tmp_path):
    base = base_tensors(moe=True, per_expert=True)
    model = write_checkpoint(tmp_path / "model", base)
    factors, params = expert_factors("current", n_layers=(1,))
    adapter = write_adapter(
        tmp_path / "lora",
        factors,
        r=2,
        lora_alpha=4,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    plan, dest = run_merge(tmp_path, model, adapter)
    merged = merged_tensors(dest)
    root = f"{VL}layers.1.mlp.experts"
    gate_up = peft_expert_delta(*factors[root + ".base_layer"], E) * 2.0
    down = peft_expert_delta(*factors[root], E) * 2.0
    for e in range(E):
        for key, d in (
            (f"{root}.{e}.gate_proj.weight", gate_up[e, :I_MOE]),
            (f"{root}.{e}.up_proj.weight", gate_up[e, I_MOE:]),
            (f"{root}.{e}.down_proj.weight", down[e]),
        ):
            assert torch.equal(merged[key], (base[key].float() + d).to(torch.bfloat16)), key
    assert len(plan.changed_tensors) == 3 * E


def test_per_expert_adapter_onto_fused_checkpoint(tmp_path):
    base = base_tensors(moe=True)
    model = write_checkpoint(tmp_path / "model", base, arch="Qwen3_5MoeForConditionalGeneration")
    root = f"{VL}layers.0.mlp.experts"
    factors = {}
    for e in (1, 3):
        factors[f"{root}.{e}.gate_proj"] = lin((I_MOE, H), 2, seed=10 * e)
        factors[f"{root}.{e}.up_proj"] = lin((I_MOE, H), 2, seed=10 * e + 3)
        factors[f"{root}.{e}.down_proj"] = lin((H, I_MOE), 2, seed=10 * e + 6)
    adapter = write_adapter(tmp_path / "lora", factors, r=2, lora_alpha=4)
    plan, dest = run_merge(tmp_path, model, adapter)
    merged = merged_tensors(dest)
    gate_up = base[root + ".gate_up_proj"].float().clone()
    down = base[root + ".down_proj"].float().clone()
    for e in (1, 3):
        a, b = factors[f"{root}.{e}.gate_proj"]
        gate_up[e, :I_MOE] += (b @ a) * 2.0
        a, b = factors[f"{root}.{e}.up_proj"]
        gate_up[e, I_MOE:] += (b @ a) * 2.0
        a, b = factors[f"{root}.{e}.down_proj"]
        down[e] += (b @ a) * 2.0
    assert torch.equal(merged[root + ".gate_up_proj"], gate_up.to(torch.bfloat16))
    assert torch.equal(merged[root + ".down_proj"], down.to(torch.bfloat16))
    for e in (0, 2):  # experts without LoRA keep their bytes
        assert torch.equal(merged[root + ".gate_up_proj"][e], base[root + ".gate_up_proj"][e])
    assert plan.changed_tensors == [root + ".down_proj", root + ".gate_up_proj"]
    assert any(
        "6 per-expert modules" in n and "enable-mixed-moe-lora-format" in n for n in plan.notes
    )


# ---------------------------------------------------------------------------
# scaling
# ---------------------------------------------------------------------------


def test_rslora_rank_pattern_alpha_pattern(tmp_path):
    base = base_tensors(moe=True)
    model = write_checkpoint(tmp_path / "model", base)
    q = f"{VL}layers.1.self_attn.q_proj"
    o = f"{VL}layers.1.self_attn.o_proj"
    z = f"{VL}layers.0.linear_attn.in_proj_z"
    root = f"{VL}layers.2.mlp.experts"
    factors = {
        q: lin((2 * HEADS * HEAD_DIM, H), 8, seed=1),  # r 8, alpha from alpha_pattern: 4
        o: lin((H, HEADS * HEAD_DIM), 4, seed=2),  # r 4 from rank_pattern "o_proj"
        z: lin((VALUE_DIM, H), 8, seed=3),  # defaults
        root: (dyadic(2 * E, I_MOE, seed=4), dyadic(H, 2 * E, seed=5)),  # down_proj, r 2
        root + ".base_layer": (dyadic(8 * E, H, seed=6), dyadic(2 * I_MOE, 8 * E, seed=7)),
    }
    adapter = write_adapter(
        tmp_path / "lora",
        factors,
        r=8,
        lora_alpha=16,
        use_rslora=True,
        # PEFT's get_pattern_key: a key matches a whole dotted suffix ("proj" matches
        # nothing here), and the first matching key wins.
        rank_pattern={"o_proj": 4, "experts.down_proj": 2, "down_proj": 5},
        alpha_pattern={"proj": 100, q: 4, "down_proj": 2},
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    plan, dest = run_merge(tmp_path, model, adapter)
    scales = {m.module: m.scale for m in plan.modules}
    assert scales[q] == 4 / math.sqrt(8)
    assert scales[o] == 16 / math.sqrt(4)
    assert scales[z] == 16 / math.sqrt(8)
    assert scales[root] == 2 / math.sqrt(2)
    assert scales[root + ".base_layer"] == 16 / math.sqrt(8)
    merged = merged_tensors(dest)
    for m in (q, o, z):
        assert torch.equal(
            merged[f"{m}.weight"], expected_linear(base[f"{m}.weight"], *factors[m], scales[m])
        ), m
    for wrapper, param in ((root, "down_proj"), (root + ".base_layer", "gate_up_proj")):
        key = f"{root}.{param}"
        want = (base[key].float() + peft_expert_delta(*factors[wrapper], E) * scales[wrapper]).to(
            torch.bfloat16
        )
        assert torch.equal(merged[key], want), key
    note = next(n for n in plan.notes if "vLLM before 0.32" in n)
    assert "3 modules" in note


def test_rank_that_contradicts_the_config_is_refused(tmp_path):
    model = write_checkpoint(tmp_path / "model", base_tensors())
    m = f"{VL}layers.1.self_attn.o_proj"
    adapter = write_adapter(tmp_path / "lora", {m: lin((H, 8), 8, seed=1)}, r=4)
    with pytest.raises(PatchkitError, match=r"rank 8 but adapter_config.json gives r=4") as err:
        mergeplan.plan_merge(model, adapter)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "config",
    [
        {"rank_pattern": [1]},
        {"alpha_pattern": [1]},
        {"alpha_pattern": {"q_proj": "x"}},
        {"alpha_pattern": {"q_proj": float("nan")}},
        {"lora_alpha": float("inf")},
        {"lora_alpha": float("nan")},
        {"r": 4.7},
        {"target_parameters": [1, {"a": 2}]},
    ],
)
def test_adapter_config_values_of_the_wrong_kind_are_one_line(tmp_path, config):
    """A list for rank_pattern/alpha_pattern, a string alpha in alpha_pattern raised
    AttributeError/TypeError (exit 3); a NaN or inf alpha and r 4.7 (read as 4) merged."""
    model = write_checkpoint(tmp_path / "model", base_tensors())
    m = f"{VL}layers.1.self_attn.q_proj"
    adapter = write_adapter(tmp_path / "lora", {m: lin((2 * HEADS * HEAD_DIM, H), 4, seed=1)})
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    with pytest.raises(PatchkitError, match="adapter_config.json") as err:
        mergeplan.plan_merge(model, adapter)
    assert "\n" not in str(err.value)


def test_a_weight_file_that_is_a_fifo_is_named_as_such(tmp_path):
    """A model dir whose only *.safetensors is a FIFO: the error blamed an index file that
    does not exist ('model.safetensors.index.json: names model.safetensors')."""
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "model.safetensors")
    factors = {f"{VL}layers.1.self_attn.q_proj": lin((16, H), 2, seed=1)}
    adapter = write_adapter(tmp_path / "lora", factors)
    with pytest.raises(PatchkitError) as err:
        mergeplan.plan_merge(model, adapter)
    weights = model / "model.safetensors"
    assert str(err.value) == f"{weights}: not a regular file (a weight file expected)"


def test_write_merged_never_removes_a_directory_it_did_not_make(tmp_path):
    """A user's directory named like the staging one (.merged.partial-<pid>, e.g. in a
    --keep DIR) was removed by name before the write; a symlink of that name was rmtree'd."""
    model = write_checkpoint(tmp_path / "model", base_tensors())
    m = f"{VL}layers.1.self_attn.q_proj"
    adapter = write_adapter(tmp_path / "lora", {m: lin((2 * HEADS * HEAD_DIM, H), 4, seed=1)})
    mine = tmp_path / f".merged.partial-{os.getpid()}"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    plan, dest = run_merge(tmp_path, model, adapter)
    assert (mine / "notes.txt").read_text() == "mine"
    assert (dest / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["model", "lora", "merged", mine.name]
    )


# ---------------------------------------------------------------------------
# memory: row blocks
# ---------------------------------------------------------------------------


def test_row_blocks_bound_reads_and_give_the_same_bytes(tmp_path, monkeypatch):
    base = base_tensors(moe=True)
    model = write_checkpoint(tmp_path / "model", base)
    factors, _ = expert_factors("legacy")
    factors[f"{VL}layers.1.self_attn.q_proj"] = lin((16, H), 2, seed=3)
    adapter = write_adapter(
        tmp_path / "lora",
        factors,
        r=2,
        lora_alpha=4,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    _, whole = run_merge(tmp_path, model, adapter, "whole")
    rows_read = []
    real = safetensorsfile.SafetensorsFile.read_rows

    def spy(self, name, row0, nrows):
        rows_read.append((name, nrows * self.tensors[name].shape[-1]))
        return real(self, name, row0, nrows)

    monkeypatch.setattr(safetensorsfile.SafetensorsFile, "read_rows", spy)
    monkeypatch.setattr(mergewrite, "_CHUNK_ELEMENTS", 5 * H)  # 5 rows: blocks straddle experts
    monkeypatch.setattr(mergewrite, "_CACHE_BYTES", 1)  # factors evicted and read again
    _, blocks = run_merge(tmp_path, model, adapter, "blocks")
    assert rows_read and max(n for _, n in rows_read) <= 5 * H
    assert max(n for _, n in rows_read if n) >= 4  # down_proj rows are 6 wide: blocks of 13 rows
    for name in SHARDS:
        assert (blocks / name).read_bytes() == (whole / name).read_bytes()


# ---------------------------------------------------------------------------
# refusals: one line each
# ---------------------------------------------------------------------------

O_PROJ = f"{VL}layers.1.self_attn.o_proj"


def _o_proj_factors():
    return {O_PROJ: lin((H, HEADS * HEAD_DIM), 4, seed=1)}


REFUSALS = {
    "dora": (dict(use_dora=True), "use_dora"),
    "bias": (dict(bias="all"), "bias is 'all'"),
    "lora_bias": (dict(lora_bias=True), "lora_bias"),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    "trainable_tokens": (dict(trainable_token_indices=[1, 2]), "trainable_token_indices"),
    "pissa": (dict(init_lora_weights="pissa"), "init_lora_weights is 'pissa'"),
    "loftq": (dict(init_lora_weights="loftq"), "init_lora_weights is 'loftq'"),
    "layer_replication": (dict(layer_replication=[[0, 2]]), "layer_replication"),
    "alora": (dict(alora_invocation_tokens=[5]), "aLoRA"),
    "qalora": (dict(use_qalora=True), "use_qalora"),
    "ia3": (dict(peft_type="IA3"), "peft_type is 'IA3', not LORA"),
    "dora_tensor": (
        dict(_extra={f"base_model.model.{O_PROJ}.lora_magnitude_vector": torch.ones(H)}),
        "DoRA magnitude vector",
    ),
    "lora_b_bias": (
        dict(_extra={f"base_model.model.{O_PROJ}.lora_B.bias": torch.ones(H)}),
        "lora_bias",
    ),
    "full_weight": (
        dict(_extra={f"base_model.model.{O_PROJ}.weight": torch.ones(H, 8)}),
        "is not a LoRA factor",
    ),
}


def said(error: PatchkitError) -> str:
    """An error's one line: a refusal's words as the command line makes them, else its own."""
    from patchkit.cli.words import say

    return say(error.reason) if isinstance(error, Refused) else str(error)


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unsupported_peft_features_are_refused(tmp_path, case):
    config, message = REFUSALS[case]
    model = write_checkpoint(tmp_path / "model", base_tensors())
    adapter = write_adapter(tmp_path / "lora", _o_proj_factors(), **config)
    with pytest.raises(PatchkitError) as err:
        mergeplan.plan_merge(model, adapter)
    assert message in said(err.value)
    assert "\n" not in said(err.value)


def _refuse(tmp_path, factors, match, base=None, tie=False, **config):
    model = write_checkpoint(tmp_path / "model", base or base_tensors(), tie=tie)
    adapter = write_adapter(tmp_path / "lora", factors, **config)
    with pytest.raises(PatchkitError) as err:
        mergeplan.plan_merge(model, adapter)
    text = str(err.value)
    assert "\n" not in text
    for part in match:
        assert part in text, text
    return text


def test_vllm_fused_name_has_no_base_tensor(tmp_path):
    m = f"{VL}layers.0.linear_attn.in_proj_qkvz"
    _refuse(
        tmp_path,
        {m: lin((QKV + VALUE_DIM, H), 4, seed=1)},
        [m, "no base tensor", "vLLM's fused name", "in_proj_qkv and in_proj_z"],
    )


def test_module_without_base_tensor(tmp_path):
    m = f"{VL}layers.1.self_attn.nonexistent"
    _refuse(tmp_path, {m: lin((4, H), 4, seed=1)}, [m, "no base tensor", f"{m}.weight"])


def test_shape_mismatch_names_file_module_and_shapes(tmp_path):
    m = f"{VL}layers.0.linear_attn.in_proj_z"
    _refuse(
        tmp_path,
        {m: lin((VALUE_DIM + 1, H), 4, seed=1)},
        [
            "adapter_model.safetensors",
            m,
            "(9, 4)",
            "(4, 16)",
            f"{m}.weight in {SHARDS[0]}",
            "(8, 16)",
        ],
    )


def test_expert_shapes_that_fit_no_parameter(tmp_path):
    root = f"{VL}layers.0.mlp.experts"
    _refuse(
        tmp_path,
        {root: (dyadic(2 * E, 5, seed=1), dyadic(7, 2 * E, seed=2))},
        [root, "fit no expert parameter", "(8, 5)", f"{root}.down_proj (4, 16, 6)"],
        base=base_tensors(moe=True),
        r=2,
        target_parameters=["experts.down_proj"],
    )


def test_lora_on_conv1d_is_refused(tmp_path):
    m = f"{VL}layers.0.linear_attn.conv1d"
    _refuse(tmp_path, {m: (dyadic(4, 1, 4, seed=1), dyadic(QKV, 4, 1, seed=2))}, [m, "convolution"])


def test_lm_head_of_tied_model_is_refused(tmp_path):
    _refuse(
        tmp_path, {"lm_head": lin((V, H), 4, seed=1)}, ["lm_head", "tie_word_embeddings"], tie=True
    )


def test_quantized_base_tensor_is_refused(tmp_path):
    base = base_tensors()
    base[O_PROJ + ".weight"] = ("F8_E4M3", [H, 8], bytes(H * 8))
    _refuse(tmp_path, _o_proj_factors(), [O_PROJ, "F8_E4M3", SHARDS[1]], base=base)


def test_missing_lora_b_is_refused(tmp_path):
    model = write_checkpoint(tmp_path / "model", base_tensors())
    adapter = write_adapter(
        tmp_path / "lora", {}, _extra={f"base_model.model.{O_PROJ}.lora_A.weight": torch.ones(4, 8)}
    )
    with pytest.raises(PatchkitError, match="has lora_A but no lora_B"):
        mergeplan.plan_merge(model, adapter)


def test_missing_files_and_corrupt_headers(tmp_path):
    model = write_checkpoint(tmp_path / "model", base_tensors())
    adapter = write_adapter(tmp_path / "lora", _o_proj_factors())
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(Refused) as err:  # adapter_config.json's rule refuses with a reason
        mergeplan.plan_merge(model, adapter)
    assert "adapter_config.json: missing" in said(err.value)
    adapter = write_adapter(tmp_path / "lora2", {})
    with pytest.raises(PatchkitError, match="holds no LoRA factors"):
        mergeplan.plan_merge(model, adapter)
    adapter = write_adapter(tmp_path / "lora3", _o_proj_factors())
    (model / SHARDS[2]).write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(PatchkitError, match="not a safetensors file") as err:
        mergeplan.plan_merge(model, adapter)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------
# writing: destination, space, sources, cleanup
# ---------------------------------------------------------------------------


def test_write_refuses_full_disk_busy_dest_and_changed_source(tmp_path, monkeypatch):
    model = write_checkpoint(tmp_path / "model", base_tensors())
    adapter = write_adapter(tmp_path / "lora", _o_proj_factors())
    plan = mergeplan.plan_merge(model, adapter)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(PatchkitError, match="exists and is not empty"):
        mergewrite.write_merged(plan, busy)

    class Usage:
        free = plan.bytes_needed - 1

    monkeypatch.setattr(mergewrite.shutil, "disk_usage", lambda _: Usage)
    with pytest.raises(PatchkitError, match="needs .* is free"):
        mergewrite.write_merged(plan, tmp_path / "out")
    monkeypatch.undo()
    shard = model / SHARDS[1]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(PatchkitError, match="changed since the merge was planned"):
        mergewrite.write_merged(plan, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    model = write_checkpoint(tmp_path / "model", base_tensors())
    adapter = write_adapter(tmp_path / "lora", _o_proj_factors())
    plan = mergeplan.plan_merge(model, adapter)

    def boom(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(mergewrite, "_rewrite_shard", boom)
    with pytest.raises(KeyboardInterrupt):
        mergewrite.write_merged(plan, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora", "model"]
    assert all(p.exists() for p in (model / n for n in SHARDS))


def test_merged_checkpoint_context_cleans_up(tmp_path):
    model = write_checkpoint(tmp_path / "model", base_tensors())
    adapter = write_adapter(tmp_path / "lora", _o_proj_factors())
    lines = []
    work = tmp_path / "work"
    with mergewrite.merged_checkpoint(model, adapter, work, progress=lines.append) as (dest, plan):
        assert (dest / SHARDS[1]).is_file() and plan.rewrite == [SHARDS[1]]
        inside = sorted(p.name for p in dest.iterdir())
    assert not dest.exists()
    assert all((model / n).is_file() for n in SHARDS)
    assert lines[0].startswith("merged copy of") and "merging " + SHARDS[1] in lines
    assert checkpoint.INDEX_NAME in inside


# ---------------------------------------------------------------------------
# the reader and writer
# ---------------------------------------------------------------------------


def test_safetensors_reader_and_writer_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(4, 2, generator=g).half(),
        "bf16": torch.randn(2, 3, 4, generator=g).bfloat16(),
        "i64": torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4),
        "empty": torch.zeros(0, 4),
    }
    safetensorsfile.save_safetensors(tmp_path / "a.safetensors", tensors, metadata={"format": "pt"})
    back = st_read(tmp_path / "a.safetensors")
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    st_write(tmp_path / "b.safetensors", tensors)
    with safetensorsfile.SafetensorsFile(tmp_path / "b.safetensors") as f:
        for name, t in tensors.items():
            assert torch.equal(f.tensor(name), t), name
        assert torch.equal(f.read_rows("bf16", 2, 3), tensors["bf16"].reshape(6, 4)[2:5])
        assert f.tensors["i64"].dtype == "I64" and f.tensors["i64"].shape == (3, 4)


def test_unchanged_shards_are_symlinked_when_hard_links_fail(tmp_path, monkeypatch):
    model = write_checkpoint(tmp_path / "model", base_tensors())
    adapter = write_adapter(tmp_path / "lora", _o_proj_factors())
    plan = mergeplan.plan_merge(model, adapter)

    def no_link(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(mergewrite.os, "link", no_link)
    done = mergewrite.write_merged(plan, tmp_path / "out")
    assert done == {SHARDS[0]: "symlink", SHARDS[1]: "merged", SHARDS[2]: "symlink"}
    for name in (SHARDS[0], SHARDS[2]):
        assert (tmp_path / "out" / name).resolve() == (model / name).resolve()

    def no_symlink(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(mergewrite.os, "symlink", no_symlink)
    with pytest.raises(PatchkitError, match="cannot hard-link or symlink") as err:
        mergewrite.write_merged(plan, tmp_path / "out2")
    assert "\n" not in str(err.value) and not (tmp_path / "out2").exists()


def test_the_rounding_control_rounds_each_merged_value_to_a_neighbour_at_random(tmp_path):
    """verify --model's rounding control: the same merge, each changed value rounded to
    one of its two bf16 neighbours at random (unbiased), reproducible from the seed;
    tensors the adapter does not touch are the base's bytes."""
    base = base_tensors()
    model = write_checkpoint(tmp_path / "model", base)
    mods = all_dense_modules()
    factors = {m: lin(shape, 4, seed=i) for i, (m, shape) in enumerate(mods.items())}
    adapter = write_adapter(tmp_path / "lora", factors)
    plan = mergeplan.plan_merge(model, adapter)
    for name, seed in (("near", None), ("a", 1), ("b", 1), ("c", 2)):
        mergewrite.write_merged(plan, tmp_path / name, stochastic_seed=seed)
    near, a, b, c = (merged_tensors(tmp_path / n) for n in ("near", "a", "b", "c"))
    moved = total = 0
    for key in base:
        module = key.removesuffix(".weight")
        if module not in factors:
            assert torch.equal(a[key], base[key]), key
            continue
        exact = base[key].float() + (factors[module][1] @ factors[module][0]) * 2.0
        assert torch.equal(near[key], expected_linear(base[key], *factors[module], 2.0))
        assert torch.equal(a[key], b[key]), f"{key}: the same seed rounded differently"
        other = torch.nextafter(near[key], torch.where(exact > near[key].float(), 1e9, -1e9).to(
            torch.bfloat16))  # fmt: skip
        assert bool(((a[key] == near[key]) | (a[key] == other)).all()), key
        moved += int((a[key] != near[key]).sum())
        total += a[key].numel()
    assert 0.1 < moved / total < 0.4  # a quarter on average: |rest| / gap, uniform in [0, 0.5]
    assert any(not torch.equal(a[k], c[k]) for k in a), "another seed rounded the same way"
    errors = torch.cat(
        [
            (a[f"{m}.weight"].float() - base[f"{m}.weight"].float()).flatten()
            - ((factors[m][1] @ factors[m][0]) * 2.0).flatten()
            for m in factors
        ]
    )
    assert abs(float(errors.mean())) < 0.05 * float(errors.abs().mean())  # unbiased


def test_stochastic_rounding_keeps_nan_and_inf():
    generator = torch.Generator().manual_seed(0)
    values = torch.tensor([math.nan, math.inf, -math.inf, 1.0, -0.0, 3.4e38])  # last: finite
    rounded = mergewrite.round_stochastically(values, generator)
    assert rounded.dtype == torch.bfloat16
    assert torch.isnan(rounded[0]) and rounded[1:3].isinf().all() and rounded[3] == 1.0
    assert rounded[4] == 0 and math.copysign(1, float(rounded[4])) < 0
    assert math.isfinite(float(values[5])) and rounded[5] == math.inf  # overflows as to nearest


@pytest.mark.parametrize("value", [1 + 0.3 * 2**-7, -(1 + 0.3 * 2**-7), 3 + 0.2 * 2**-6])
def test_stochastic_rounding_is_right_on_average_value_by_value(value):
    """One value, rounded 100,000 times: up with the share of the step it lies above
    its lower neighbour, so the mean is the value. A constant chance, or one off by
    a factor, is caught here (symmetric remainders over many values would hide it)."""
    generator = torch.Generator().manual_seed(3)
    block = torch.full((100_000,), value, dtype=torch.float32)
    rounded = mergewrite.round_stochastically(block, generator).float()
    low = block.to(torch.bfloat16).float()[0]  # these values lie nearer their lower neighbour
    step = float(torch.nextafter(low.to(torch.bfloat16), torch.tensor(math.copysign(9, value),
        dtype=torch.bfloat16)).float() - low)  # fmt: skip
    share = (value - float(low)) / step
    moved = float((rounded != low).float().mean())
    assert abs(moved - share) < 0.01, (moved, share)
    assert abs(float(rounded.mean()) - value) < 0.01 * abs(step)


def test_the_rounding_control_of_a_float32_checkpoint_holds_bf16_values(tmp_path):
    """vLLM serves the references in bf16, so a float32 checkpoint's control is rounded
    to bf16 at random (and stored as float32); the reference stays float32, which vLLM
    rounds to nearest at load."""
    base = base_tensors(dtype=torch.float32)
    model = write_checkpoint(tmp_path / "model", base)
    module = f"{VL}layers.0.mlp.down_proj"
    factors = {module: lin(all_dense_modules()[module], 4, seed=5)}
    plan = mergeplan.plan_merge(model, write_adapter(tmp_path / "lora", factors))
    mergewrite.write_merged(plan, tmp_path / "near")
    mergewrite.write_merged(plan, tmp_path / "control", stochastic_seed=4)
    key = module + ".weight"
    near = merged_tensors(tmp_path / "near")[key]
    control = merged_tensors(tmp_path / "control")[key]
    assert near.dtype == control.dtype == torch.float32
    assert torch.equal(near, expected_linear(base[key], *factors[module], 2.0))
    assert torch.equal(control.to(torch.bfloat16).float(), control)  # bf16 values
    assert not torch.equal(control, near.to(torch.bfloat16).float())  # not nearest
