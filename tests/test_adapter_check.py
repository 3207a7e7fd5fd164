"""`patchkit adapter check` names every bad tensor, shape, rank and target of a PEFT adapter,
on crafted adapters with PEFT's real names and layouts (dense, 3D experts, one expert
parameter), against a Qwen3.5 config.json and real vLLM release trees; exit 0 clean, 1 with
findings, 2 on usage."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from patchkit.adapters import nonfinite
from patchkit.adapters.check import check
from patchkit.adapters.report import Kind
from patchkit.adapters.safetensorsfile import SafetensorsFile
from patchkit.vllmtree.tree import locate
from tests import adapter_helpers as ah
from tests.conftest import applied, release_tree, run_cli


def lines(result) -> list[str]:
    return result.stdout.splitlines()


def kinds(report) -> list[str]:
    return [str(f.kind) for f in report.findings]


@pytest.fixture
def dense(tmp_path):
    return ah.write_model(tmp_path / "dense", moe=False)


@pytest.fixture
def moe(tmp_path):
    return ah.write_model(tmp_path / "moe", moe=True)


def test_clean_dense_adapter_exits_0(tmp_path, dense):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    result = run_cli("adapter", "check", str(adapter), "--model", str(dense))
    assert result.exit_code == 0, result.stdout
    assert "clean" in lines(result)[-1]
    assert any("skipped" in line and "--target" in line for line in lines(result))


def test_clean_3d_experts_exit_0(tmp_path, moe):
    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapter = ah.write_adapter(tmp_path / "a", ah.moe_tensors(), target_parameters=params)
    report = check(adapter, moe)
    assert report.ok, report.findings


def test_nan_and_inf_named_with_count_and_first_index(tmp_path, dense):
    t = ah.dense_tensors()
    key = f"{ah.P}1.self_attn.o_proj.lora_B.weight"
    t[key] = ah.tensor((ah.H, 4), poison={5: ah.BF16_INF, 9: ah.BF16_NAN, 11: ah.BF16_NEG_INF})
    adapter = ah.write_adapter(tmp_path / "a", t)
    result = run_cli("adapter", "check", str(adapter), "--model", str(dense))
    assert result.exit_code == 1
    bad = [line for line in lines(result) if line.startswith("nonfinite")]
    assert bad == [
        f"nonfinite: adapter_model.safetensors: {key}: 3 non-finite of 64 (1 NaN, 2 Inf); "
        "first at flat index 5 (inf), BF16 (16, 4)"
    ]


@pytest.mark.parametrize(
    "dtype, raw, value", [("F16", ah.F16_INF, "inf"), ("F32", ah.F32_NAN, "nan")]
)
def test_nonfinite_in_f16_and_f32_across_chunks(tmp_path, dtype, raw, value):
    path = tmp_path / "t.safetensors"
    ah.write_safetensors(path, {"x": ah.tensor((100, 7), dtype, poison={3: raw, 650: raw})})
    with SafetensorsFile(path) as st:
        found = nonfinite.scan(st, st.tensors["x"], chunk_bytes=64)  # many chunks
    assert (found.count, found.first, found.first_value) == (2, 3, value)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_numpy_and_the_standard_library_judge_a_chunk_alike(dtype, seed):
    """A chunk with candidates goes to numpy where it is installed, to the byte lanes
    where not: both give a float-by-float reference's counts, first index and value
    (NaN, +Inf and -Inf scattered among finite values of every exponent)."""
    import random
    import struct

    np = pytest.importorskip("numpy")
    rnd = random.Random(seed)
    size = 4 if dtype == "F32" else 2
    words = [rnd.getrandbits(8 * size) for _ in range(4096)]
    exponent = {"BF16": 0x7F80, "F16": 0x7C00, "F32": 0x7F800000}[dtype]
    words = [w & ~exponent if w & exponent == exponent else w for w in words]  # finite
    for _ in range(rnd.randrange(1, 40)):
        sign = rnd.choice([0, 1 << (8 * size - 1)])
        tail = rnd.choice([0, 1, exponent >> 3 & ~exponent or 1])  # Inf or a NaN payload
        words[rnd.randrange(len(words))] = sign | exponent | (tail & ~exponent)
    fmt = "<" + ("I" if size == 4 else "H") * len(words)
    data = struct.pack(fmt, *words)
    mantissa = {"BF16": 0x007F, "F16": 0x03FF, "F32": 0x007FFFFF}[dtype]
    bad = [i for i, w in enumerate(words) if w & exponent == exponent]
    nans = sum(1 for i in bad if words[i] & mantissa)
    first = bad[0]
    kind = "nan" if words[first] & mantissa else "-inf" if words[first] >> (8 * size - 1) else "inf"
    want = (nans, len(bad) - nans, first, kind)
    top = data[size - 1 :: size].translate(nonfinite._EXP[nonfinite._LAYOUTS[dtype][1][0][1]])
    assert nonfinite._chunk_numpy(np, data, dtype) == want
    assert nonfinite._chunk_bits(data, dtype, top) == want


def test_finite_extremes_are_not_flagged(tmp_path):
    """The largest finite bf16 (0x7F7F) and -0.0 share bits with Inf's lanes but are finite."""
    path = tmp_path / "t.safetensors"
    ah.write_safetensors(path, {"x": ah.tensor((8,), poison={0: b"\x7f\x7f", 1: b"\x00\x80"})})
    with SafetensorsFile(path) as st:
        assert nonfinite.scan(st, st.tensors["x"]) is None


def test_shape_transposed_and_rank_findings(tmp_path, dense):
    t = ah.dense_tensors()
    q = f"{ah.P}1.self_attn.q_proj"
    t[f"{q}.lora_A.weight"] = ah.tensor((4, ah.H + 1))  # wrong hidden size
    o = f"{ah.P}1.self_attn.o_proj"  # (16, 8): A (r, 8), B (16, r) saved as A (r, 16), B (8, r)
    t[f"{o}.lora_A.weight"] = ah.tensor((4, ah.H))
    t[f"{o}.lora_B.weight"] = ah.tensor((ah.HEADS * ah.HEAD_DIM, 4))
    d = f"{ah.P}0.mlp.down_proj"
    t[f"{d}.lora_B.weight"] = ah.tensor((ah.H, 8))  # rank 4 in A, 8 in B
    adapter = ah.write_adapter(tmp_path / "a", t)
    report = check(adapter, dense)
    found = {(f.kind, f.tensor) for f in report.findings}
    assert found == {
        (Kind.SHAPE, f"{q}.lora_A.weight"),
        (Kind.LAYOUT, f"{o}.lora_A.weight"),
        (Kind.RANK, f"{d}.lora_A.weight"),
    }


def test_rank_against_config_and_max_lora_rank(tmp_path, dense):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors(r=8), r=8, lora_alpha=16)
    assert check(adapter, dense).ok
    result = run_cli(
        "adapter", "check", str(adapter), "--model", str(dense), "--max-lora-rank", "4"
    )
    assert result.exit_code == 1
    assert [line.split(":")[0] for line in lines(result)].count("rank-limit") == 1
    other = ah.write_adapter(tmp_path / "b", ah.dense_tensors(r=8), r=4)
    assert set(kinds(check(other))) == {"rank"}  # every module's rank 8 against r=4


def test_targets_the_model_lacks(tmp_path, dense):
    t = ah.dense_tensors()
    t |= ah.linear("0.self_attn.q_proj", 16, ah.H)  # layer 0 is GDN
    t |= ah.linear("7.mlp.down_proj", ah.H, ah.I_DENSE)  # 3 layers
    t |= ah.experts(1)  # a dense model
    adapter = ah.write_adapter(tmp_path / "a", t)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["target_modules"].append("fc_nowhere")
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    report = check(adapter, dense)
    assert kinds(report).count("target") == 5  # q_proj, layer 7, 2 experts, fc_nowhere
    messages = " | ".join(f.message for f in report.findings)
    assert "no self_attn.q_proj in layer 0 (linear_attention" in messages
    assert "layer 7: the model has 3 layers" in messages
    assert "'fc_nowhere'" in messages


@pytest.mark.parametrize(
    "text, key",
    [
        (None, ""),
        ("{not json", ""),
        ('{"r": 0, "lora_alpha": 8, "target_modules": ["q_proj"]}', "r"),
        ('{"r": 4, "lora_alpha": "8", "target_modules": ["q_proj"]}', "lora_alpha"),
        ('{"r": 4, "lora_alpha": 8, "target_modules": [], "use_rslora": "false"}', "use_rslora"),
        ('{"r": 4, "lora_alpha": 8}', "target_modules"),
        ('{"r": 4, "lora_alpha": 8, "target_modules": [], "use_dora": true}', "use_dora"),
    ],
)
def test_adapter_config_problems(tmp_path, text, key):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    if text is None:
        (adapter / "adapter_config.json").unlink()
    else:
        (adapter / "adapter_config.json").write_text(text)
    report = check(adapter)
    config = [f for f in report.findings if f.kind == Kind.CONFIG]
    assert len(config) == 1 and config[0].file == "adapter_config.json"
    assert config[0].tensor == key


@pytest.mark.parametrize(
    "r, alpha, rslora, bad",
    [
        (4, 8, False, False),
        (64, 1, False, False),
        (128, 1, False, True),
        (4, 80, False, True),
        (64, 16, True, False),
        (4, 0, False, True),
        (4, 40, True, True),
    ],
)
def test_scale_range(tmp_path, r, alpha, rslora, bad):
    adapter = ah.write_adapter(
        tmp_path / "a", ah.dense_tensors(r=r), r=r, lora_alpha=alpha, use_rslora=rslora
    )
    assert ("scaling" in kinds(check(adapter))) is bad


def test_expert_layouts(tmp_path, moe):
    legacy = ah.write_adapter(tmp_path / "legacy", ah.experts(0, legacy=True))
    report = check(legacy, moe)
    assert kinds(report) == ["layout", "layout"]
    assert "PEFT <= 0.19" in report.findings[0].message
    single = ah.write_adapter(
        tmp_path / "single", ah.experts(2, ("down_proj",)), target_parameters=["experts.down_proj"]
    )
    assert check(single, moe).ok
    wrong = ah.write_adapter(
        tmp_path / "wrong", ah.experts(2, ("down_proj",)), target_parameters=["gate_up_proj"]
    )
    assert "shape" in kinds(check(wrong, moe))  # named gate_up_proj, shaped as down_proj
    per_expert = ah.write_adapter(
        tmp_path / "pe", ah.linear("0.mlp.experts.5.down_proj", ah.H, ah.I_MOE)
    )
    assert "expert 5: the model has 4 experts" in check(per_expert, moe).findings[0].message


def test_release_refusals_on_0260(tmp_path, moe):
    """0.26.0 as released: one expert parameter stops at the assert, in_proj_z alone crashes
    expand_packed_lora, a per-expert module is no name its 3D MoE wraps."""
    tree = locate(str(release_tree("0.26.0")))
    t = ah.experts(0, ("down_proj",)) | ah.linear("2.linear_attn.in_proj_z", ah.Z, ah.H)
    t |= ah.linear("1.mlp.experts.0.down_proj", ah.H, ah.I_MOE)
    adapter = ah.write_adapter(tmp_path / "a", t)
    report = check(adapter, moe, tree)
    release = [f for f in report.findings if f.kind == Kind.RELEASE]
    assert len(release) == 3
    text = " | ".join(f.message for f in release)
    assert "layer 0: an adapter on one expert parameter" in text
    assert "layer 2: in_proj_z without in_proj_qkv" in text
    assert "wraps no module named like model.language_model.layers.1.mlp.experts.0" in text
    assert report.vllm_version == "0.26.0"


def test_release_after_patchkit_apply(tmp_path, moe, slim_tree_0260):
    applied(slim_tree_0260)
    t = ah.experts(0, ("down_proj",)) | ah.linear("2.linear_attn.in_proj_z", ah.Z, ah.H)
    adapter = ah.write_adapter(tmp_path / "a", t)
    report = check(adapter, moe, locate(str(slim_tree_0260)))
    assert report.ok, report.findings
    # the slim tree lacks the GDN layer's file: the names are not judged from fewer files
    assert "qwen_gdn_linear_attn.py is missing" in report.skipped[0]


def test_release_0200_gdn_separate_and_per_expert_3d(tmp_path, moe):
    """0.20.0 keeps in_proj_qkv and in_proj_z apart (no partial-GDN finding)."""
    tree = locate(str(release_tree("0.20.0")))
    adapter = ah.write_adapter(tmp_path / "a", ah.linear("0.linear_attn.in_proj_z", ah.Z, ah.H))
    assert check(adapter, moe, tree).ok


def test_skipped_without_model_and_target(tmp_path):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    report = check(adapter)
    assert report.ok and len(report.skipped) == 2
    result = run_cli("adapter", "check", str(adapter))
    skipped = [line for line in lines(result) if line.startswith("skipped: ")]
    assert skipped[0] == "skipped: shapes and targets against the model (no --model)"
    assert all(line.count("skipped") == 1 for line in skipped)  # said once a line


def test_json(tmp_path, dense):
    t = ah.dense_tensors()
    t[f"{ah.P}0.mlp.down_proj.lora_A.weight"] = ah.tensor((4, ah.I_DENSE), poison={0: ah.BF16_NAN})
    adapter = ah.write_adapter(tmp_path / "a", t)
    result = run_cli("adapter", "check", str(adapter), "--model", str(dense), "--json")
    data = json.loads(result.stdout)
    assert result.exit_code == 1 and data["exit_code"] == 1 and not data["ok"]
    assert data["findings"][0]["kind"] == "nonfinite"
    assert data["findings"][0]["tensor"].endswith("0.mlp.down_proj.lora_A.weight")


def test_usage_errors_exit_2(tmp_path):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    assert run_cli("adapter", "check", str(adapter), "--max-lora-rank", "0").exit_code == 2
    assert run_cli("adapter", "check", str(tmp_path / "nowhere")).exit_code == 2


def test_pickles_refused_in_one_line(tmp_path):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    os.rename(adapter / "adapter_model.safetensors", adapter / "adapter_model.bin")
    result = run_cli("adapter", "check", str(adapter))
    assert result.exit_code == 1
    assert lines(result)[0].startswith("file: adapter_model.bin: refused: a pickle")


def _header(data: dict) -> bytes:
    raw = json.dumps(data).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    "content, words",
    [
        (struct.pack("<Q", 1 << 40) + b"{}", "header length"),
        (
            _header(
                {
                    "x.lora_A.weight": {
                        "dtype": "BF16",
                        "shape": [4, 4],
                        "data_offsets": [0, 1 << 30],
                    }
                }
            ),
            "lies outside the file",
        ),
        (
            _header({"x.lora_A.weight": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 8]}})
            + b"\0" * 8,
            "holds 8 bytes",
        ),
        (b"\x01\x02", "shorter than 8 bytes"),
        (  # two factors over the same bytes: every reader would scan them twice
            _header(
                {
                    "x.lora_A.weight": {"dtype": "F32", "shape": [8, 4], "data_offsets": [0, 128]},
                    "x.lora_B.weight": {"dtype": "F32", "shape": [4, 8], "data_offsets": [64, 192]},
                }
            )
            + b"\0" * 192,
            "overlaps",
        ),
    ],
)
def test_hostile_files_are_one_line_findings(tmp_path, content, words):
    adapter = ah.write_adapter(tmp_path / "a", {})
    (adapter / "adapter_model.safetensors").write_bytes(content)
    result = run_cli("adapter", "check", str(adapter))
    assert result.exit_code == 1
    file_lines = [line for line in lines(result) if line.startswith("file:")]
    assert len(file_lines) == 1 and words in file_lines[0], result.stdout
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "shape, shown",
    [
        ([0, 1 << 63], "F32 (0, 9223372036854775808) holds no values"),
        (
            [0] + [1 << 62] * 63,
            f"F32 (0, {', '.join([str(1 << 62)] * 5)}, ... 64 dimensions) holds no values",
        ),
    ],
)
def test_a_float_tensor_with_no_values_is_named_as_empty_not_as_not_floating(
    tmp_path, shape, shown
):
    """A zero-sized F32 factor was reported 'is F32; LoRA factors are floating point' (the
    dtype test after the size test caught it), and a 64-dimension shape made a 4 kB line:
    it is a shape finding, its shape cut to six dimensions."""
    adapter = ah.write_adapter(tmp_path / "a", {})
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    header = {key: {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    (adapter / "adapter_model.safetensors").write_bytes(_header(header))
    result = run_cli("adapter", "check", str(adapter))
    assert result.exit_code == 1, result.output
    [line] = [ln for ln in lines(result) if ln.startswith("shape:")]
    assert line == (
        f"shape: adapter_model.safetensors: {key}: {shown}; a LoRA factor is (r, in) or "
        "(out, r) with r and both sizes above 0"
    )
    assert "floating point" not in result.stdout
    assert max(len(ln) for ln in lines(result)) < 400


def test_file_cut_short_after_its_header_was_read(tmp_path, monkeypatch):
    """A file truncated between the header and the scan: a finding, not a traceback."""
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    path = adapter / "adapter_model.safetensors"
    real = nonfinite.scan

    def truncate_then_scan(st, info, *args):
        os.truncate(path, st.data_start + 8)
        return real(st, info, *args)

    monkeypatch.setattr(nonfinite, "scan", truncate_then_scan)
    report = check(adapter)
    assert kinds(report) == ["file"] and "truncated" in report.findings[0].message


def test_links_out_of_the_directory_refused(tmp_path):
    outside = ah.write_adapter(tmp_path / "outside", ah.dense_tensors())
    adapter = tmp_path / "a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text((outside / "adapter_config.json").read_text())
    (adapter / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    report = check(adapter)
    assert kinds(report) == ["file"] and "out of the directory" in report.findings[0].message
    os.rename(outside / "adapter_model.safetensors", adapter / "v2.safetensors")
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").symlink_to("v2.safetensors")
    assert check(adapter).ok  # a link to a file beside it is followed


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_dangling_link_is_a_finding_like_any_bad_file(tmp_path, name):
    """``adapter_config.json -> missing`` ended the command with 'accessing missing
    failed'; it is one finding naming the file and the link, the rest still checked."""
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    (adapter / name).unlink()
    (adapter / name).symlink_to("missing")
    result = run_cli("adapter", "check", str(adapter))
    assert result.exit_code == 1, result.output
    found = [line for line in lines(result) if name in line]
    assert len(found) == 1 and "a link to 'missing', which is not there" in found[0], found
    assert "error" not in result.stderr and "Traceback" not in result.output


def test_fifo_refused_without_hanging(tmp_path):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    (adapter / "adapter_model.safetensors").unlink()
    os.mkfifo(adapter / "adapter_model.safetensors")
    report = check(adapter)
    assert kinds(report) == ["file"] and "not a regular file" in report.findings[0].message


def test_imports_neither_torch_nor_vllm_nor_numpy(tmp_path, moe):
    import subprocess
    import sys

    adapter = ah.write_adapter(tmp_path / "a", ah.moe_tensors())
    code = (
        "import sys\nfrom patchkit.cli.main import main\n"
        f"try:\n    main([ 'adapter', 'check', {str(adapter)!r}, '--model', {str(moe)!r}])\n"
        "except SystemExit as e:\n    code = e.code\n"
        "bad = [m for m in ('torch', 'vllm', 'numpy') if m in sys.modules]\n"
        "print('CODE', code, 'LOADED', bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "CODE 0 LOADED []" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    "key, value", [("num_hidden_layers", 9_000_000_000_000_000_000), ("hidden_size", 1 << 40)]
)
def test_a_model_config_of_absurd_sizes_is_one_line_not_a_memory_exhaustion(
    tmp_path, dense, key, value
):
    """A 200-byte config.json with 9e18 layers made the layer list exhaust memory."""
    config = json.loads((dense / "config.json").read_text())
    config.get("text_config", config)[key] = value
    (dense / "config.json").write_text(json.dumps(config))
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    result = run_cli("adapter", "check", str(adapter), "--model", str(dense))
    assert result.exit_code in (1, 2), result.output
    assert f"{key} is {value}"[:40] in result.output and "expected" in result.output
    assert "Traceback" not in result.output


def hf_snapshot(root: Path, files: Path, blobs_as_link: bool = False) -> Path:
    """A Hugging Face cache repository as huggingface_hub writes it: the files in
    blobs/ by hash, snapshots/REV/NAME a link to ../../blobs/HASH."""
    repo = root / "models--org--adapter"
    blobs = repo / "blobs"
    (root / "elsewhere" if blobs_as_link else blobs).mkdir(parents=True)
    if blobs_as_link:
        repo.mkdir()
        blobs.symlink_to(root / "elsewhere")
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for number, path in enumerate(sorted(files.iterdir())):
        blob = f"{number:040x}"
        (blobs / blob).write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(f"../../blobs/{blob}")
    return snapshot


def test_a_hugging_face_cache_snapshot_is_read_through_its_blobs(tmp_path, dense):
    """Adapters downloaded with huggingface_hub are links into ../../blobs: read, not
    refused; the same link from a directory that is no snapshot, or to a blobs that is
    itself a link, stays refused."""
    files = ah.write_adapter(tmp_path / "files", ah.dense_tensors())
    snapshot = hf_snapshot(tmp_path / "hub", files)
    result = run_cli("adapter", "check", str(snapshot), "--model", str(dense))
    assert result.exit_code == 0, result.output
    plain = tmp_path / "plain" / "adapter"
    plain.mkdir(parents=True)
    for link in snapshot.iterdir():
        (plain / link.name).symlink_to(os.readlink(link))
    (tmp_path / "plain" / "blobs").symlink_to(snapshot.parent.parent / "blobs")
    assert run_cli("adapter", "check", str(plain)).exit_code == 1
    linked = hf_snapshot(tmp_path / "hub2", files, blobs_as_link=True)
    result = run_cli("adapter", "check", str(linked))
    assert result.exit_code == 1 and "out of the directory" in result.output


def test_a_shape_of_64_dimensions_is_shown_cut_in_every_message(tmp_path):
    """A header may declare 64 dimensions of 2**62; the line naming it stays short."""
    shape = [1 << 62] * 64
    entry = {"dtype": "BF16", "shape": shape, "data_offsets": [0, 8]}
    adapter = ah.write_adapter(tmp_path / "a", {})
    (adapter / "adapter_model.safetensors").write_bytes(
        _header({"x.lora_A.weight": entry}) + b"\0" * 8
    )
    result = run_cli("adapter", "check", str(adapter))
    assert result.exit_code == 1
    assert "... 64 dimensions)" in result.output
    assert max(len(line) for line in result.output.splitlines()) < 400
