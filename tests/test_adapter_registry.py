"""`adapter check --target` judges module names by the model class the release's own registry
serves for the architecture on CUDA (0.34.0: the nvidia package `vllm/models/qwen3_5`), read
from the real release trees; a registry entry that points outside vllm/ or at a missing file is
one line naming the file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from patchkit.adapters.check import check
from patchkit.adapters.registry import served_class
from patchkit.adapters.release import lora_support
from patchkit.adapters.report import Kind
from patchkit.cli.adapter_words import finding_words
from patchkit.vllmtree.tree import locate
from tests import adapter_helpers as ah
from tests.conftest import applied, copy_tree, release_tree, run_cli

ARCHS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
SERVED = {
    "0.33.0": "vllm/model_executor/models/qwen3_5.py",
    "0.34.0": "vllm/models/qwen3_5/nvidia/model.py",
}
NVIDIA = "vllm/models/qwen3_5/nvidia/model.py"
LEGACY = "vllm/model_executor/models/qwen3_5.py"
REGISTRY = "vllm/model_executor/models/registry.py"
GDN_MAPPING = '"in_proj_qkvz": ["in_proj_qkv", "in_proj_z"]'


@pytest.fixture
def moe(tmp_path):
    return ah.write_model(tmp_path / "moe", moe=True)


def release_findings(report) -> list[str]:
    return [finding_words(f.message) for f in report.findings if f.kind == Kind.RELEASE]


@pytest.mark.parametrize("version", sorted(SERVED))
@pytest.mark.parametrize("arch", ARCHS)
def test_the_file_read_is_the_one_the_registry_serves_on_cuda(version, arch):
    root = release_tree(version)
    tree = locate(str(root))
    served = served_class(tree, arch)
    assert served.file == SERVED[version] and served.cls == arch
    support = lora_support(tree, arch)
    assert support.files[0] == SERVED[version]
    text = (root / SERVED[version]).read_text()
    # the served file's own GDN mapping, and every Linear it assigns, as the file says
    assert GDN_MAPPING in text
    assert support.packed["in_proj_qkvz"] == ["in_proj_qkv", "in_proj_z"]
    assert support.packed["in_proj_ba"] == ["in_proj_b", "in_proj_a"]
    # its Linear attributes (0.34.0's nvidia model builds none itself) and embedding_modules
    linears = set(re.findall(r"self\.(\w+)\s*=\s*\w*Linear\(", text))
    embedding = set(re.findall(r'"(\w+)": "(?:input|output)_embeddings"', text))
    assert embedding and linears | embedding <= support.wrapped
    # what the model builds from its imports: GDN and attention projections, the MLP
    gdn = {"in_proj_qkvz", "in_proj_ba", "out_proj", "qkv_proj", "o_proj", "down_proj"}
    assert gdn <= support.wrapped
    assert support.is_3d == ("Moe" in arch)


def test_0340_registry_names_the_package_and_cuda_takes_the_nvidia_model():
    tree = locate(str(release_tree("0.34.0")))
    served = served_class(tree, "Qwen3_5MoeForConditionalGeneration")
    assert served.module == "vllm.models.qwen3_5"
    assert served.via == ("vllm/models/qwen3_5/__init__.py", NVIDIA)
    assert served_class(tree, "Qwen3NextForCausalLM").file == (
        "vllm/model_executor/models/qwen3_next.py"
    )
    assert served_class(tree, "NoSuchModelForCausalLM") is None


def test_an_altered_nvidia_mapping_changes_the_verdict_on_0340(tmp_path, moe):
    """Alters a copy of the real 0.34.0 tree: the nvidia model's packed mapping names
    in_proj_zz instead of in_proj_z; the legacy qwen3_5.py (which the nvidia model still
    imports) keeps in_proj_z, so only reading the served file refuses the adapter."""
    adapter = ah.write_adapter(
        tmp_path / "a",
        ah.linear("0.linear_attn.in_proj_qkv", ah.QKV, ah.H)
        | ah.linear("0.linear_attn.in_proj_z", ah.Z, ah.H),
    )
    assert check(adapter, moe, locate(str(release_tree("0.34.0")))).ok
    root = copy_tree("0.34.0", tmp_path / "site")
    model = root / NVIDIA
    text = model.read_text()
    assert GDN_MAPPING in text and GDN_MAPPING in (root / LEGACY).read_text()
    model.write_text(text.replace(GDN_MAPPING, '"in_proj_qkvz": ["in_proj_qkv", "in_proj_zz"]'))
    report = check(adapter, moe, locate(str(root)))
    messages = release_findings(report)
    assert len(messages) == 1, messages
    assert (
        "wraps no module named like model.language_model.layers.0.linear_attn.in_proj_z"
        in (messages[0])
    )


@pytest.mark.parametrize("module", ["in_proj_z", "in_proj_qkv"])
def test_a_partial_gdn_adapter_passes_on_pristine_0340(tmp_path, moe, module):
    """0.34.0 fixed the partial GDN adapter upstream (partial-gdn-adapter: upstream)."""
    out = ah.QKV if module == "in_proj_qkv" else ah.Z
    adapter = ah.write_adapter(tmp_path / "a", ah.linear(f"0.linear_attn.{module}", out, ah.H))
    target = str(release_tree("0.34.0"))
    result = run_cli("adapter", "check", str(adapter), "--model", str(moe), "--target", target)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "vLLM 0.34.0" in result.stdout


@pytest.mark.slow
def test_one_expert_parameter_is_a_finding_until_patchkit_apply_on_0340(tmp_path, moe):
    adapter = ah.write_adapter(
        tmp_path / "a", ah.experts(0, ("down_proj",)), target_parameters=["experts.down_proj"]
    )
    root = copy_tree("0.34.0", tmp_path / "site")
    messages = release_findings(check(adapter, moe, locate(str(root))))
    assert len(messages) == 1 and "layer 0: an adapter on one expert parameter" in messages[0]
    applied(root)
    result = run_cli("adapter", "check", str(adapter), "--model", str(moe), "--target", str(root))
    assert result.exit_code == 0, result.stdout + result.stderr


def _skipped_line(report) -> str:
    lines = [finding_words(s) for s in report.skipped if "LoRA code wraps" in finding_words(s)]
    assert len(lines) == 1 and "\n" not in lines[0] and "Traceback" not in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "entry, words",
    [
        ('"../../../../etc/passwd"', "not a module under vllm/"),
        ('"vllm.models.nowhere"', "vllm/models/nowhere.py is missing"),
    ],
)
def test_a_hostile_registry_entry_is_one_line_naming_the_file(tmp_path, moe, entry, words):
    """Alters a copy of the real 0.34.0 tree's registry.py: the dense Qwen3.5 entry points
    outside vllm/, or at a module the tree lacks."""
    root = copy_tree("0.34.0", tmp_path / "site")
    registry = root / REGISTRY
    text = registry.read_text()
    old = '"Qwen3_5ForConditionalGeneration": (\n        "vllm.models.qwen3_5",'
    assert old in text
    registry.write_text(text.replace(old, f'"Qwen3_5ForConditionalGeneration": (\n{entry},'))
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    dense = ah.write_model(tmp_path / "dense", moe=False)
    line = _skipped_line(check(adapter, dense, locate(str(root))))
    assert words in line
    assert str(registry) in line or str(root / "vllm/models/nowhere.py") in line


def test_a_missing_nvidia_model_is_one_line_naming_it(tmp_path, moe):
    """Deletes the nvidia model from a copy of the real 0.34.0 tree."""
    root = copy_tree("0.34.0", tmp_path / "site")
    (root / NVIDIA).unlink()
    adapter = ah.write_adapter(tmp_path / "a", ah.moe_tensors())
    line = _skipped_line(check(adapter, moe, locate(str(root))))
    assert f"{root / NVIDIA} is missing" in line


def test_an_architecture_the_registry_does_not_name_is_skipped_as_before(tmp_path):
    """0.26.0's registry has no text-only Qwen3_5ForCausalLM (0.27.0 added it)."""
    model = ah.write_model(tmp_path / "m", moe=False)
    cfg = (
        (model / "config.json")
        .read_text()
        .replace("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
    )
    (model / "config.json").write_text(cfg)
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    report = check(adapter, model, locate(str(release_tree("0.26.0"))))
    assert "architecture Qwen3_5ForCausalLM;" in _skipped_line(report)
    assert Path(release_tree("0.26.0") / REGISTRY).is_file()
