"""`patchkit adapter check` names every bad tensor, shape, rank and target of a PEFT adapter,
on crafted adapters with PEFT's real names and layouts (dense, 3D experts, one expert
parameter), against a Qwen3.5 config.json and real vLLM release trees; exit 0 clean, 1 with
findings, 2 on usage."""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path

import pytest

from patchkit.adapters import nonfinite
from patchkit.adapters.check import check
from patchkit.adapters.report import Kind
from patchkit.adapters.safetensorsfile import SafetensorsFile
from patchkit.cli.adapter_words import finding_words
from patchkit.vllmtree.tree import locate
from tests import adapter_helpers as ah
from tests.conftest import applied, copy_tree, release_tree, run_cli


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


def decoded(dtype: str, word: int) -> float:
    """An element's value, decoded by struct (BF16 as float32's upper half; the 8-bit floats
    by their definitions): the reference the bit rules are checked against."""
    import math

    if dtype == "BF16":
        return struct.unpack("<f", struct.pack("<I", word << 16))[0]
    if dtype in ("F16", "F32", "F64"):
        fmt, raw = {"F16": ("<e", "<H"), "F32": ("<f", "<I"), "F64": ("<d", "<Q")}[dtype]
        return struct.unpack(fmt, struct.pack(raw, word))[0]
    sign = -1.0 if word & 0x80 else 1.0
    if dtype == "F8_E4M3":  # e4m3fn: 0x7F/0xFF NaN, no Inf
        exp, man = (word >> 3) & 0xF, word & 0x7
        if exp == 0xF and man == 0x7:
            return math.nan
        return sign * (man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    exp, man = (word >> 2) & 0x1F, word & 0x3  # F8_E5M2
    if exp == 0x1F:
        return sign * math.inf if man == 0 else math.nan
    return sign * (man / 4 * 2.0**-14 if exp == 0 else (1 + man / 4) * 2.0 ** (exp - 15))


SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
BF16_LARGEST = (2 - 2**-7) * 2.0**127  # 0x7F7F
# bfloat16's largest, and the next value up, in the types that hold larger values
BF16_EDGE = {"F32": (0x7F7F0000, 0x7F7F0001), "F64": (0x47EFE00000000000, 0x47EFE00000000001)}


@pytest.mark.parametrize("dtype", nonfinite.FLOATS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_numpy_and_the_standard_library_judge_a_chunk_alike(dtype, seed):
    """A chunk with candidates goes to numpy where it is installed, to the byte lanes
    where not: both give the counts, first index and value that decoding every element
    gives (NaN, +Inf and -Inf, and for F32/F64 values past bfloat16's largest, scattered
    among values of every exponent)."""
    import math
    import random

    np = pytest.importorskip("numpy")
    rnd = random.Random(seed)
    size = SIZE[dtype]
    words = [rnd.getrandbits(8 * size) for _ in range(4096)]
    words = [w for w in words if math.isfinite(decoded(dtype, w))][:3000]
    top = (1 << (8 * size - 1)) - 1  # the largest magnitude: a NaN
    # a NaN, Inf (or a NaN payload, or the largest finite), bfloat16's largest and the next
    extremes = [top, top >> 1 << 1, *BF16_EDGE.get(dtype, ())]
    for number in range(rnd.randrange(1, 40)):
        sign = rnd.choice([0, 1 << (8 * size - 1)])
        extreme = top if number == 0 else rnd.choice(extremes)
        words.insert(rnd.randrange(len(words)), sign | extreme)
    data = b"".join(w.to_bytes(size, "little") for w in words)
    values = [decoded(dtype, w) for w in words]
    nan = [math.isnan(v) for v in values]
    inf = [math.isinf(v) for v in values]
    beyond = [math.isfinite(v) and abs(v) > BF16_LARGEST for v in values]
    first = next(i for i in range(len(words)) if nan[i] or inf[i] or beyond[i])
    value = values[first]
    shown = (
        "nan" if nan[first] else ("-inf" if value < 0 else "inf") if inf[first] else f"{value:.4g}"
    )
    want = (sum(nan), sum(inf), sum(beyond), first, shown)
    assert nonfinite._chunk_numpy(np, data, dtype) == want
    assert nonfinite._chunk_bits(data, dtype) == want
    assert nonfinite._chunk(data, dtype) == want


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
    messages = " | ".join(finding_words(f.message) for f in report.findings)
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
    assert "PEFT <= 0.19" in finding_words(report.findings[0].message)
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
    assert "expert 5: the model has 4 experts" in finding_words(
        check(per_expert, moe).findings[0].message
    )


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
    text = " | ".join(finding_words(f.message) for f in release)
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
    assert "qwen_gdn_linear_attn.py is missing" in finding_words(report.skipped[0])


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
    found = data["findings"][0]
    assert found["kind"] == "nonfinite"
    assert found["tensor"].endswith("0.mlp.down_proj.lora_A.weight")
    # a typed finding: a code finer than its kind and the facts its words are made from
    assert found["code"] == "adapter-nonfinite-values"
    assert (found["nan"], found["inf"], found["first"], found["shape"]) == (
        1,
        0,
        0,
        [4, ah.I_DENSE],
    )
    assert found["message"].startswith("1 non-finite of ")


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
    real = nonfinite.scan_values

    def truncate_then_scan(st, info, *args):
        os.truncate(path, st.data_start + 8)
        return real(st, info, *args)

    monkeypatch.setattr(nonfinite, "scan_values", truncate_then_scan)
    report = check(adapter)
    assert kinds(report) == ["file"] and "truncated" in finding_words(report.findings[0].message)


def test_links_out_of_the_directory_refused(tmp_path):
    outside = ah.write_adapter(tmp_path / "outside", ah.dense_tensors())
    adapter = tmp_path / "a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text((outside / "adapter_config.json").read_text())
    (adapter / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    report = check(adapter)
    assert kinds(report) == ["file"] and "out of the directory" in finding_words(
        report.findings[0].message
    )
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
    assert kinds(report) == ["file"] and "not a regular file" in finding_words(
        report.findings[0].message
    )


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


# ----- every floating type is scanned; a type it cannot scan is a finding -----


@pytest.mark.parametrize(
    "dtype, raw, words",
    [
        ("F64", ah.F64_NAN, "1 non-finite of 96 (1 NaN, 0 Inf); first at flat index 5 (nan), F64"),
        (
            "F64",
            struct.pack("<d", -1e300),
            "1 non-finite once served of 96 (0 NaN, 0 Inf, 1 past bfloat16's largest (3.39e+38), "
            "Inf once vLLM casts them to a bf16 model's LoRA dtype); first at flat index 5 "
            "(-1e+300), F64",
        ),
        ("F32", struct.pack("<f", 3.4e38), "first at flat index 5 (3.4e+38), F32"),
        ("F8_E4M3", b"\x7f", "1 non-finite of 96 (1 NaN, 0 Inf); first at flat index 5 (nan)"),
        ("F8_E5M2", b"\xfc", "1 non-finite of 96 (0 NaN, 1 Inf); first at flat index 5 (-inf)"),
    ],
)
def test_every_floating_type_is_scanned(tmp_path, dtype, raw, words):
    """An F64 factor holding NaN was reported clean, exit 0 (F64 was accepted and never
    scanned); vLLM casts it into the LoRA dtype, NaN and all. A F64 or F32 value past
    bfloat16's largest is finite in the file and Inf once cast to a bf16 model's dtype."""
    key = f"{ah.P}0.mlp.down_proj.lora_A.weight"
    t = ah.dense_tensors() | {key: ah.tensor((4, ah.I_DENSE), dtype, poison={5: raw})}
    adapter = ah.write_adapter(tmp_path / "a", t)
    result = run_cli("adapter", "check", str(adapter))
    assert result.exit_code == 1, result.output
    [line] = [line for line in lines(result) if line.startswith("nonfinite:")]
    assert line.startswith(f"nonfinite: adapter_model.safetensors: {key}: ") and words in line
    assert "clean" not in result.stdout


@pytest.mark.parametrize("dtype", nonfinite.FLOATS)
def test_finite_factors_of_every_floating_type_are_clean(tmp_path, dense, dtype):
    t = {k: ah.tensor(shape, dtype) for k, (_, shape, _) in ah.dense_tensors().items()}
    report = check(ah.write_adapter(tmp_path / "a", t), dense)
    assert report.ok, report.findings
    assert report.bytes_scanned == sum(len(data) for _, _, data in t.values())


@pytest.mark.parametrize(
    "dtype, words",
    [
        ("F8_E8M0", "is 'F8_E8M0', a type patchkit does not scan for NaN/Inf"),
        ("F4", "is 'F4', a type patchkit does not scan for NaN/Inf"),
        ("C64", "is 'C64', a type patchkit does not scan for NaN/Inf"),
        ("I8", "is I8; LoRA factors are floating point"),
    ],
)
def test_a_type_patchkit_does_not_scan_is_refused_as_a_finding(tmp_path, dtype, words):
    key = f"{ah.P}0.mlp.down_proj.lora_A.weight"
    adapter = ah.write_adapter(tmp_path / "a", {})
    entry = {"dtype": dtype, "shape": [4, ah.I_DENSE], "data_offsets": [0, 96]}
    (adapter / "adapter_model.safetensors").write_bytes(_header({key: entry}) + b"\0" * 96)
    result = run_cli("adapter", "check", str(adapter))
    assert result.exit_code == 1, result.output
    assert f"name: adapter_model.safetensors: {key}: {words}" in lines(result)[0]


# ----- adapter_config.json: one reader and one rule with verify -----

# name: (the config's values over write_adapter's, the key adapter check and verify name,
# or None when both accept it)
SHARED = {
    "r 8.0 (vLLM takes it as 8)": ({"r": 8.0, "lora_alpha": 16}, None),
    "r 4.7": ({"r": 4.7}, "r"),
    "r true": ({"r": True}, "r"),
    "r a string": ({"r": "4"}, "r"),
    "r 0": ({"r": 0}, "r"),
    "r missing": ({"r": None}, "r"),
    "lora_alpha a string": ({"lora_alpha": "8"}, "lora_alpha"),
    "use_rslora a string": ({"use_rslora": "false"}, "use_rslora"),
    "peft_type": ({"peft_type": "LOHA"}, "peft_type"),
    "use_dora": ({"use_dora": True}, "use_dora"),
    "bias": ({"bias": "all"}, "bias"),
    "bias null": ({"bias": None}, "bias"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "lora_bias": ({"lora_bias": True}, "lora_bias"),
    "trainable_token_indices": ({"trainable_token_indices": [7, 8]}, "trainable_token_indices"),
    "init_lora_weights pissa": ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights"),
    "init_lora_weights gaussian": ({"init_lora_weights": "gaussian"}, None),
    "layer_replication": ({"layer_replication": [[0, 2], [1, 3]]}, "layer_replication"),
    "alora_invocation_tokens": ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    "use_qalora": ({"use_qalora": True}, "use_qalora"),
    "use_bdlora": ({"use_bdlora": {"nblocks": 2}}, "use_bdlora"),
    "target_modules of objects": ({"target_modules": [{"a": 1}]}, "target_modules"),
    "target_parameters a number": ({"target_parameters": 5}, "target_parameters"),
    "rank_pattern a list": ({"rank_pattern": [1]}, "rank_pattern"),
    "rank_pattern rank 8.0": ({"rank_pattern": {"q_proj": 8.0}}, "rank_pattern['q_proj']"),
    "rank_pattern key (": ({"rank_pattern": {"(": 4}}, "rank_pattern"),
    "alpha_pattern key with a lookbehind": (
        {"alpha_pattern": {"(?<=self_attn.)q_proj": 8}},
        "alpha_pattern",
    ),
    "alpha_pattern value a string": ({"alpha_pattern": {"q_proj": "8"}}, "alpha_pattern['q_proj']"),
}


@pytest.mark.parametrize("name", SHARED)
def test_adapter_check_and_verify_read_adapter_config_by_one_rule(tmp_path, name):
    """`r = 8.0` was refused by adapter check and accepted by verify; lora_bias, PiSSA inits,
    aLoRA, layer_replication, QALoRA, BD-LoRA and trainable tokens were refused by verify
    and never looked at by adapter check; adapter check never compiled a pattern key. Now
    both read the file once, by one rule: what adapter check names as a config finding is
    what verify refuses, in the same words."""
    from patchkit.cli.words import say
    from patchkit.errors import Refused
    from patchkit.verify.adapterfiles import read_adapter_config

    values, key = SHARED[name]
    r = values.get("r")
    rank = int(r) if type(r) in (int, float) and r >= 1 and r == int(r) else 4
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors(r=rank), **values)
    if "r" in values and values["r"] is None:
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        del cfg["r"]
        (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    report = check(adapter)
    if key is None:
        assert report.ok, report.findings
        assert read_adapter_config(adapter).r == rank
        return
    config = [f for f in report.findings if f.kind == Kind.CONFIG]
    assert [f.tensor for f in config] == [key], report.findings
    with pytest.raises(Refused) as refused:
        read_adapter_config(adapter)
    words = finding_words(config[0].message)
    assert say(refused.value.reason) == f"{adapter / 'adapter_config.json'}: {key} {words}"
    assert refused.value.reason["problem"] == config[0].message  # one reason, both commands


def test_verify_names_how_many_more_problems_adapter_check_lists(tmp_path):
    from patchkit.cli.words import say
    from patchkit.errors import Refused
    from patchkit.verify.adapterfiles import read_adapter_config

    adapter = ah.write_adapter(
        tmp_path / "a", ah.dense_tensors(), lora_bias=True, use_qalora=True, r="4"
    )
    assert len([f for f in check(adapter).findings if f.kind == Kind.CONFIG]) == 3
    with pytest.raises(Refused) as refused:
        read_adapter_config(adapter)
    assert re.match(r"^.*: r is '4'; .* \(2 more problems: `patchkit", say(refused.value.reason))


def test_a_modules_rank_is_the_one_its_rank_pattern_key_gives(tmp_path, dense):
    """vLLM (0.32.0 on) and PEFT give a module the rank of the first rank_pattern key that
    matches its name; the factors are judged against that rank, not against any rank the
    config mentions."""
    q = f"{ah.P}1.self_attn.q_proj.lora_A.weight"
    t = ah.dense_tensors() | ah.linear("1.self_attn.q_proj", 2 * ah.HEADS * ah.HEAD_DIM, ah.H, 8)
    good = ah.write_adapter(tmp_path / "good", t, rank_pattern={r"self_attn\.q_proj": 8})
    assert check(good, dense).ok
    bad = ah.write_adapter(tmp_path / "bad", t, rank_pattern={"o_proj": 8})
    found = {f.tensor: finding_words(f.message) for f in check(bad, dense).findings}
    o = f"{ah.P}1.self_attn.o_proj.lora_A.weight"
    assert found == {
        q: "rank 8, but adapter_config.json gives r=4 and no rank_pattern key matches it",
        o: "rank 4, but adapter_config.json gives 8 (rank_pattern['o_proj'])",
    }


def test_a_rank_pattern_rank_above_max_lora_rank_is_named(tmp_path):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors(), rank_pattern={"zz_proj": 32})
    report = check(adapter, max_rank=16)
    assert [(f.kind, f.tensor) for f in report.findings] == [
        (Kind.RANK_LIMIT, "rank_pattern['zz_proj']")
    ]
    assert "vLLM refuses the adapter" in finding_words(report.findings[0].message)


def test_a_pattern_key_that_matches_past_its_work_bound_is_one_finding(tmp_path, monkeypatch):
    from patchkit.adapters import patterns

    monkeypatch.setattr(patterns, "MAX_WORK", 50)
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors(), rank_pattern={"(a|b)*q": 4})
    report = check(adapter)
    assert [(f.kind, f.tensor) for f in report.findings] == [(Kind.CONFIG, "rank_pattern")]
    assert "is refused: matching it against the model's module names takes more" in (
        finding_words(report.findings[0].message)
    )


@pytest.mark.parametrize("version, unread", [("0.26.0", True), ("0.33.0", False)])
def test_patterns_a_release_never_reads_are_a_release_finding(tmp_path, moe, version, unread):
    """Before 0.32.0 vLLM's PEFTHelper has no rank_pattern/alpha_pattern field: from_dict
    drops them and every module is served at lora_alpha / r (8 / 4 here), the one PEFT
    trained at 8 / 8 included. Read from the tree's peft_helper.py."""
    t = ah.linear("0.linear_attn.in_proj_qkv", ah.QKV, ah.H) | ah.linear(
        "0.linear_attn.in_proj_z", ah.Z, ah.H, 8
    )
    adapter = ah.write_adapter(tmp_path / "a", t, rank_pattern={"in_proj_z": 8})
    report = check(adapter, moe, locate(str(release_tree(version))))
    release = [f for f in report.findings if f.kind == Kind.RELEASE]
    if not unread:
        assert release == []
        return
    assert [(f.file, f.tensor) for f in release] == [("adapter_config.json", "rank_pattern")]
    assert f"vLLM {version} does not read rank_pattern" in finding_words(release[0].message)
    assert "1 module(s) (e.g. model.language_model.layers.0.linear_attn.in_proj_z)" in (
        finding_words(release[0].message)
    )


# ----- what the user's files say never reaches the terminal raw -----


def test_no_control_character_from_the_files_reaches_the_terminal(tmp_path, dense):
    """config.json's `architectures` came out raw in the `skipped:` line (a \\r overprinted
    it with "clean"); every value from the files is escaped on every line, once."""
    config = json.loads((dense / "config.json").read_text())
    config["architectures"] = ["Evil\r\x1b[2Kadapter check: clean"]
    (dense / "config.json").write_text(json.dumps(config))
    poisoned = {"a": {0: ah.BF16_NAN}}  # a finding that names the tensor
    t = ah.dense_tensors() | ah.linear("0.mlp.\x1b]0;x\x07down_proj", ah.H, ah.I_DENSE, **poisoned)
    adapter = ah.write_adapter(tmp_path / "a\x1b[31m", t, peft_type="\x1b[2J", r=4)
    result = run_cli("adapter", "check", str(adapter), "--model", str(dense))
    assert result.exit_code == 1, result.output
    assert not [c for c in result.output if ord(c) < 32 and c != "\n" or c == "\x7f"]
    assert "skipped: shapes against the model (Evil\\r\\x1b[2Kadapter check: clean in" in (
        result.stdout
    )
    assert "config: adapter_config.json: peft_type: is '\\x1b[2J', not LORA" in result.stdout
    assert "mlp.\\x1b]0;x\\x07down_proj.lora_A.weight: 1 non-finite" in result.stdout
    assert "a\\x1b[31m: 2 findings" in lines(result)[-1]
    data = json.loads(
        run_cli("adapter", "check", str(adapter), "--model", str(dense), "--json").stdout
    )
    skipped = data["skipped"][0]
    assert skipped["architecture"] == "Evil\r\x1b[2Kadapter check: clean"  # the fact, exact
    assert "(Evil\\r\\x1b[2Kadapter" in skipped["message"]  # the words, as the text shows them


# ----- hostile values: one finding or line each, never exit 3 -----


@pytest.mark.parametrize("targets", [[{"a": 1}], [["q_proj"]], [3, "q_proj"], {"q": 1}])
def test_target_modules_of_the_wrong_type_is_one_finding_with_a_model(tmp_path, dense, targets):
    """A list holding an object or a list raised TypeError (unhashable) with --model."""
    from patchkit.adapters.safetensorsfile import shown

    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors(), target_modules=targets)
    result = run_cli("adapter", "check", str(adapter), "--model", str(dense))
    assert result.exit_code == 1, result.output
    assert [line for line in lines(result) if not line.startswith("skipped")][:-1] == [
        f"config: adapter_config.json: target_modules: is {shown(targets)}; a list of names "
        "or a str expected"
    ]


@pytest.mark.parametrize(
    "module, said",
    [
        ("1" * 5000 + ".mlp.down_proj", "a layer index no module of the model has"),
        ("01.mlp.down_proj", "a layer index no module of the model has"),
        ("1000000000.mlp.down_proj", "a layer index no module of the model has"),
        ("999999999.mlp.down_proj", "999999999"),
    ],
)
def test_a_layer_index_no_model_spells_is_a_target_finding(tmp_path, dense, module, said):
    """int() of a 5,000-digit layer index raised ValueError (exit 3); `layers.01` was read as
    layer 1, though vLLM finds no module of that name and skips the factors."""
    adapter = ah.write_adapter(tmp_path / "a", ah.linear(module, ah.H, ah.I_DENSE))
    for target in ([], ["--target", str(release_tree("0.26.0"))]):
        result = run_cli("adapter", "check", str(adapter), "--model", str(dense), *target)
        assert result.exit_code == 1, result.output
        [line] = [line for line in lines(result) if line.startswith("target:")]
        assert f"lora_A.weight: layer {said}: the model has 3 layers (0-2)" in line


@pytest.mark.parametrize("expert", ["9" * 5000, "05"])
def test_an_expert_index_no_model_spells_is_a_target_finding(tmp_path, moe, expert):
    adapter = ah.write_adapter(
        tmp_path / "a", ah.linear(f"0.mlp.experts.{expert}.down_proj", ah.H, ah.I_MOE)
    )
    result = run_cli("adapter", "check", str(adapter), "--model", str(moe))
    assert result.exit_code == 1, result.output
    assert "expert an index no expert of the model has: the model has 4 experts" in result.stdout


NVIDIA = "vllm/models/qwen3_5/nvidia/model.py"
REGISTRY = "vllm/model_executor/models/registry.py"
SERVED_MAPPING = (
    "    packed_modules_mapping = Qwen3VLForConditionalGeneration.packed_modules_mapping | {"
)
BASES = "".join(
    f"class Chain{i}(Chain{i - 1}):\n    packed_modules_mapping = "
    f"Chain{i - 1}.packed_modules_mapping | {{}}\n"
    for i in range(1, 100)
)
# name: (the file, what replaces SERVED_MAPPING (or the registry's dict), the words of the line)
HOSTILE_SOURCES = {
    "a mapping keyed by a list": (NVIDIA, SERVED_MAPPING + "\n        [1]: [...],", None),
    "an expression 3,000 deep": (
        NVIDIA,
        SERVED_MAPPING.replace("| {", "| " + "{} | " * 3000 + "{"),
        "nested deeper than 100",
    ),
    "a unary chain the parser cannot take": (
        NVIDIA,
        "    x = " + "-" * 100_000 + "1\n" + SERVED_MAPPING,
        "nested deeper than 100",
    ),
    "lists 150 deep (parsed, past the bound)": (
        NVIDIA,
        "    x = " + "[" * 150 + "]" * 150 + "\n" + SERVED_MAPPING,
        "nested deeper than 100",
    ),
    "a 5 MB file": (NVIDIA, "#" * (5 << 20) + "\n" + SERVED_MAPPING, "larger than the 4194304"),
    "a chain of 100 base classes": (
        NVIDIA,
        "    packed_modules_mapping = Chain99.packed_modules_mapping | {",
        "the bases of Chain",
    ),
    "_VLLM_MODELS built from 100 dicts": (REGISTRY, None, "merges more than 64 dicts"),
}


@pytest.mark.slow
def test_a_hostile_model_source_in_the_target_is_one_line_never_exit_3(tmp_path, dense):
    """The model files are read from the --target tree (registry.py, release.py): a packed
    mapping keyed by a list, an expression too deep for the parser or for the walks, a
    file of megabytes, a chain of classes or dicts each walk recurses through. Each is
    one `skipped:` line naming the file (or, for a mapping it cannot evaluate, every
    mapping read, merged), exit 0 or 1; never exit 3."""
    root = copy_tree("0.34.0", tmp_path / "site")
    originals = {rel: (root / rel).read_text() for rel in (NVIDIA, REGISTRY)}
    assert SERVED_MAPPING in originals[NVIDIA]
    chain = "\n\nclass Chain0:\n    packed_modules_mapping = {}\n\n\n" + BASES
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    for name, (rel, new, words) in HOSTILE_SOURCES.items():
        for other, text in originals.items():
            (root / other).write_text(text)
        text = originals[rel]
        if rel == REGISTRY:
            dicts = "".join(f"_D{i} = {{**_D{i - 1}}}\n" for i in range(1, 100))
            text = text.replace("_VLLM_MODELS = {", f"_D0 = {{}}\n{dicts}_VLLM_MODELS = {{**_D99,")
        else:
            text = text.replace(SERVED_MAPPING, new) + (chain if "Chain" in new else "")
        (root / rel).write_text(text)
        result = run_cli("adapter", "check", str(adapter), "--model", str(dense), "--target",
                         str(root))  # fmt: skip
        assert result.exit_code in (0, 1), (name, result.output)
        assert "internal error" not in result.output, name
        skipped = [line for line in lines(result) if "LoRA code wraps" in line]
        if words is None:
            assert skipped == [], (name, skipped)
            continue
        assert len(skipped) == 1 and words in skipped[0], (name, skipped)
        assert str(root / rel) in skipped[0], (name, skipped)


# ----- a device or a FIFO is refused before it is opened -----


def special_file(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:  # a character device: /dev/null's numbers (opening it would be harmless here)
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_device_or_fifo_is_refused_without_being_opened(tmp_path, dense, monkeypatch, kind):
    """The adapter's files and the model's config.json were opened (O_NONBLOCK) before
    their type was looked at; opening a device can act (a tape rewinds, a watchdog arms).
    Every open is watched: none names them."""
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod of a device needs root")
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors())
    names = ("adapter_config.json", "adapter_model.safetensors")
    for name in names:
        special_file(adapter / name, kind)
    special_file(dense / "config.json", kind)
    opened = []
    real_open = os.open

    def watched(path, *args, **kwargs):
        opened.append(os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", watched)
    report = check(adapter)
    result = run_cli("adapter", "check", str(adapter), "--model", str(dense))
    monkeypatch.undo()
    assert sorted(f.file for f in report.findings) == sorted(names)
    assert all("not a regular file" in finding_words(f.message) for f in report.findings), (
        report.findings
    )
    assert result.exit_code == 1 and "config.json: a " in result.stderr
    assert "not a regular file" in result.stderr
    assert not [path for path in opened if Path(str(path)).name in (*names, "config.json")]
