"""`adapter check --target` says for every module of an adapter whether the release's LoRA
code wraps it, read from real release trees: the names PEFT writes for the text-only model
served on the multimodal one (vLLM #34186), the vision tower, 0.34.0's refusal of layers
that share a LoRA name but are no LoRA layer, and an adapter whose factors are all zero."""

from __future__ import annotations

import json

import pytest

from patchkit.adapters import reach
from patchkit.adapters.check import check
from patchkit.adapters.release import lora_support
from patchkit.adapters.report import Kind
from patchkit.cli.adapter_target_words import reach_words
from patchkit.cli.adapter_words import finding_words
from patchkit.codes import Code, Reason
from patchkit.vllmtree.tree import locate
from tests import adapter_helpers as ah
from tests.conftest import release_tree, run_cli

MULTIMODAL = "Qwen3_5ForConditionalGeneration"
TEXT_ONLY = "base_model.model.model.layers."  # PEFT's names on the text-only Qwen3.5


@pytest.fixture
def dense(tmp_path):
    return ah.write_model(tmp_path / "dense", moe=False)


def tree(version: str):
    return locate(str(release_tree(version)))


def text_only(tensors: dict) -> dict:
    """The same factors under the names PEFT writes for Qwen3_5ForCausalLM."""
    return {k.replace(ah.P, TEXT_ONLY): v for k, v in tensors.items()}


def notes(report) -> list[str]:
    return [finding_words(note) for note in report.notes]


def codes(report) -> list[str]:
    return [str(f.message.code) for f in report.findings]


@pytest.mark.parametrize("version", ["0.21.0", "0.26.0", "0.30.0", "0.34.0"])
def test_every_module_of_a_healthy_adapter_is_wrapped(tmp_path, dense, version):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    report = check(adapter, dense, tree(version))
    assert report.ok, report.findings
    assert {row["outcome"] for row in report.targets} == {"wrapped"}
    assert len(report.targets) == len({k.split(".lora_")[0] for k in ah.dense_tensors()})
    q = next(row for row in report.targets if row["module"].endswith("1.self_attn.q_proj"))
    assert q["vllm_module"] == "language_model.model.layers.1.self_attn.q_proj"
    assert q["why"] == Reason.of(Code.REACH_WRAPPED, packed="qkv_proj")  # the release wraps
    assert reach_words(q["why"]) == "part of qkv_proj"


@pytest.mark.parametrize("version", ["0.21.0", "0.26.0", "0.34.0"])
def test_text_only_names_on_the_multimodal_model_are_served_as_the_base_model(
    tmp_path, dense, version
):
    adapter = ah.write_adapter(tmp_path / "a", text_only(ah.dense_tensors()))
    report = check(adapter, dense, tree(version))
    assert codes(report) == ["adapter-served-as-base"]
    finding = report.findings[0]
    assert finding.kind == Kind.RELEASE
    assert finding_words(finding.message).startswith(
        f"vLLM {version} would serve this adapter as the base model: none of its 11 modules "
        "reaches a module its LoRA code wraps (e.g. model.layers.0.linear_attn.in_proj_qkv -> "
        "model.layers.0.linear_attn.in_proj_qkv: no module of Qwen3_5ForConditionalGeneration "
        "is named so (its language model's layers are language_model.model.layers.N...))"
    )
    assert finding.tensor == f"{TEXT_ONLY}0.linear_attn.in_proj_qkv.lora_A.weight"
    assert {row["outcome"] for row in report.targets} == {"ignored"}


def test_some_modules_under_another_prefix_are_named_as_ignored(tmp_path, dense):
    t = ah.dense_tensors()
    moved = {k: v for k, v in t.items() if ".mlp." in k}
    adapter = ah.write_adapter(tmp_path / "a", {k: v for k, v in t.items() if k not in moved})
    (tmp_path / "a" / "adapter_model.safetensors").unlink()
    ah.write_safetensors(
        tmp_path / "a" / "adapter_model.safetensors",
        {k: v for k, v in t.items() if k not in moved} | text_only(moved),
    )
    report = check(adapter, dense, tree("0.26.0"))
    assert codes(report) == ["adapter-modules-ignored"]
    assert finding_words(report.findings[0].message).startswith(
        "vLLM 0.26.0 ignores 3 of the adapter's 11 modules: their weights reach no module its "
        "LoRA code wraps, so they serve as the base model (e.g. model.layers.0.mlp.down_proj"
    )


def test_the_text_report_has_one_line_per_target_name(tmp_path, dense):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    result = run_cli(
        "adapter", "check", str(adapter), "--model", str(dense), "--target",
        str(release_tree("0.26.0")),
    )  # fmt: skip
    assert result.exit_code == 0, result.stdout
    targets = [line for line in result.stdout.splitlines() if line.startswith("on vLLM")]
    assert targets == [
        "on vLLM 0.26.0: model.language_model.layers.N.linear_attn.in_proj_qkv (layers 0, 2): "
        "wrapped (part of in_proj_qkvz)",
        "on vLLM 0.26.0: model.language_model.layers.N.linear_attn.in_proj_z (layers 0, 2): "
        "wrapped (part of in_proj_qkvz)",
        "on vLLM 0.26.0: model.language_model.layers.N.linear_attn.out_proj (layers 0, 2): wrapped",
        "on vLLM 0.26.0: model.language_model.layers.N.mlp.down_proj (layers 0-2): wrapped",
        "on vLLM 0.26.0: model.language_model.layers.N.self_attn.o_proj (layer 1): wrapped",
        "on vLLM 0.26.0: model.language_model.layers.N.self_attn.q_proj (layer 1): wrapped "
        "(part of qkv_proj)",
    ]


def test_json_lists_every_module_and_the_finding_code(tmp_path, dense):
    adapter = ah.write_adapter(tmp_path / "a", text_only(ah.dense_tensors()))
    result = run_cli(
        "adapter", "check", str(adapter), "--model", str(dense), "--target",
        str(release_tree("0.34.0")), "--json",
    )  # fmt: skip
    data = json.loads(result.stdout)
    assert result.exit_code == 1
    assert [f["code"] for f in data["findings"]] == ["adapter-served-as-base"]
    assert len(data["targets"]) == 11
    assert set(data["targets"][0]) == {"module", "vllm_module", "outcome", "why", "reason"}
    assert data["targets"][0]["reason"]["code"].startswith("reach-")
    assert data["targets"][0]["reason"]["message"] == data["targets"][0]["why"]


@pytest.mark.parametrize(
    "version, refused",
    [("0.26.0", False), ("0.34.0", True)],  # 0.34.0: unsupported_lora_modules
)
def test_the_vision_towers_conv3d_is_refused_by_034_when_tower_lora_is_on(
    tmp_path, dense, version, refused
):
    """Qwen3-VL's patch embedding is a Conv3d named `proj`, a name the tower's linear layers
    share; 0.34.0 refuses LoRA on it where LoRA is on for the tower, earlier releases never
    wrap it. Without --enable-tower-connector-lora no tower module is wrapped: a note."""
    t = ah.dense_tensors()
    t[f"{ah.P[: -len('language_model.layers.')]}visual.patch_embed.proj.lora_A.weight"] = ah.tensor(
        (4, 8)
    )
    t[f"{ah.P[: -len('language_model.layers.')]}visual.patch_embed.proj.lora_B.weight"] = ah.tensor(
        (8, 4)
    )
    adapter = ah.write_adapter(tmp_path / "a", t)
    report = check(adapter, dense, tree(version))
    row = next(r for r in report.targets if r["module"] == "model.visual.patch_embed.proj")
    assert row["outcome"] == "ignored" and row["vllm_module"] == "visual.patch_embed.proj"
    assert row["why"].code == Code.REACH_VISION_TOWER
    assert reach_words(row["why"]).startswith(
        "the vision tower, wrapped only with --enable-tower-connector-lora"
    )
    assert ("refused: patch_embed.proj is no LoRA layer" in reach_words(row["why"])) is refused
    assert not [f for f in report.findings if f.kind == Kind.RELEASE]
    assert any("1 module(s) in the vision tower" in note for note in notes(report))


@pytest.mark.parametrize(
    "version, drops",
    [
        ("0.20.0", set()),  # the whole mapper
        ("0.26.0", {"stacked"}),  # get_unstacked_mapper
        ("0.34.0", {"stacked", "substr:none", "prefix:none", "suffix:none"}),  # rename
    ],
)
def test_the_mapper_variant_is_read_from_the_loader(version, drops):
    assert reach.variant_drops(tree(version)) == drops


def test_the_served_mapper_is_read_from_the_class_and_its_bases():
    """0.26.0: Qwen3_5ForConditionalGeneration has none of its own, Qwen3-VL's applies;
    0.34.0 adds `mtp.` -> None to it, which the rename variant drops."""
    old = reach.lora_mapper(tree("0.26.0"), lora_support(tree("0.26.0"), MULTIMODAL))
    new = reach.lora_mapper(tree("0.34.0"), lora_support(tree("0.34.0"), MULTIMODAL))
    assert old.prefix == {
        "model.visual.": "visual.",
        "lm_head.": "language_model.lm_head.",
        "model.language_model.": "language_model.model.",
    }
    assert new.prefix == old.prefix  # mtp. -> None dropped by get_rename_mapper
    assert reach.module_name(old, "lm_head") == "language_model.lm_head"


def test_a_map_to_none_maps_a_name_to_nothing():
    mapper = reach.Mapper(prefix={"mtp.": None, "model.": "m."})
    assert mapper.map("mtp.layers.0.x") is None
    assert mapper.map("model.layers.0.x") == "m.layers.0.x"
    assert reach.module_name(mapper, "mtp.fc") is None


# ----- factors that are all zero -----


def test_an_adapter_whose_every_lora_b_is_zero_is_a_finding(tmp_path, dense):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors(zero_b=True))
    result = run_cli("adapter", "check", str(adapter), "--model", str(dense), "--json")
    data = json.loads(result.stdout)
    assert result.exit_code == 1
    [finding] = data["findings"]
    assert finding["kind"] == "effect" and finding["code"] == "adapter-zero-factors"
    assert finding["message"].startswith(
        "lora_B is all zero in every one of its 11 modules: the adapter changes nothing"
    )
    assert finding["tensor"].endswith(".lora_B.weight")


def test_some_zero_modules_are_a_note(tmp_path, dense):
    t = ah.dense_tensors() | ah.linear("1.mlp.down_proj", ah.H, ah.I_DENSE, zero_b=True)
    report = check(ah.write_adapter(tmp_path / "a", t), dense)
    assert report.ok, report.findings
    assert notes(report) == [
        "1 of 11 modules have an all-zero lora_B and change nothing (e.g. "
        "model.language_model.layers.1.mlp.down_proj)"
    ]


def test_negative_zero_is_zero_and_one_tiny_value_is_not(tmp_path, dense):
    t = ah.dense_tensors(zero_b=True)
    key = f"{ah.P}1.mlp.down_proj.lora_B.weight"
    t[key] = ah.tensor((ah.H, 4), poison={0: b"\x00\x80"}, zero=True)  # -0.0
    assert [f.kind for f in check(ah.write_adapter(tmp_path / "a", t), dense).findings] == [
        Kind.EFFECT
    ]
    t[key] = ah.tensor((ah.H, 4), poison={63: b"\x01\x00"}, zero=True)  # the last, subnormal
    report = check(ah.write_adapter(tmp_path / "b", t), dense)
    assert report.ok and "10 of 11 modules have an all-zero lora_B" in notes(report)[0]


@pytest.mark.parametrize("version", ["0.26.0", "0.34.0"])
def test_a_moe_adapters_fused_experts_and_shared_expert_are_wrapped(tmp_path, version):
    moe = ah.write_model(tmp_path / "moe", moe=True)
    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapter = ah.write_adapter(tmp_path / "a", ah.moe_tensors(), target_parameters=params)
    report = check(adapter, moe, tree(version))
    assert report.ok, report.findings
    assert {row["outcome"] for row in report.targets} == {"wrapped"}
    experts = [r for r in report.targets if r["module"].endswith("0.mlp.experts.base_layer")]
    assert experts[0]["vllm_module"] == "language_model.model.layers.0.mlp.experts.base_layer"


def test_without_target_another_layout_than_the_models_is_a_note(tmp_path, dense):
    adapter = ah.write_adapter(tmp_path / "a", text_only(ah.dense_tensors()))
    report = check(adapter, dense)
    assert report.ok
    assert notes(report) == [
        "the adapter's layers are under model.layers.N, the model's checkpoint "
        "(Qwen3_5ForConditionalGeneration) has them under model.language_model.layers.N: a "
        "release that does not map one to the other serves those modules as the base model "
        "(vLLM #34186); --target says what a release does"
    ]
    assert check(ah.write_adapter(tmp_path / "b", ah.dense_tensors()), dense).notes == []
