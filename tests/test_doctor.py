"""`patchkit doctor` on real release trees: facts, findings and verdicts.

The GPU and Triton's ptxas are stood in for by tiny executables on PATH /
TRITON_PTXAS_PATH that print what the real tools print, so every verdict
branch runs on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
import py_compile
import shlex
import shutil
import stat
import time
from pathlib import Path

import pytest

from tests.conftest import releases_with_variant, run_cli, run_subprocess
from tests.helpers import REPORT_IMPORTS
from tests.kernelscan_helpers import triton_site

NAN_BUG = "vLLM #48590"
PARTIAL_BUG = "vLLM #47639"
MOE_BUG = "vLLM #48460"
STALE = "stale bytecode"


def executable(path: Path, output: str) -> Path:
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def hopper(tmp_path: Path, monkeypatch) -> Path:
    """nvidia-smi reporting an H200, Triton's ptxas reporting 12.8.93; empty caches."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "nvidia-smi", "NVIDIA H200, 9.0")
    ptxas = executable(
        tmp_path / "ptxas",
        "ptxas: NVIDIA (R) Ptx optimizing assembler\nCuda compilation tools, release 12.8, "
        "V12.8.93",
    )
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(ptxas))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.delenv("PATCHKIT_LORA_BACKEND", raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    return tmp_path


def doctor(root: Path, **env) -> dict:
    result = run_cli("doctor", "--target", str(root), "--json", env=env or None)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def verdict(report: dict, bug: str) -> dict:
    return next(v for v in report["verdicts"] if v["bug"].startswith(bug))


@pytest.mark.slow
def test_unpatched_hopper_is_exposed_and_apply_protects_it(tree_0260: Path, hopper: Path):
    report = doctor(tree_0260)
    assert report["gpus"] == [{"name": "NVIDIA H200", "compute_capability": "9.0"}]
    assert report["triton"]["ptxas_version"] == "12.8.93"
    assert report["vllm"]["version"] == "0.26.0"
    nan = verdict(report, NAN_BUG)
    assert (
        nan["status"] == "exposed"
        and nan["fix"]["message"] == f"patchkit apply --target {tree_0260}"
    )
    assert verdict(report, PARTIAL_BUG)["status"] == "exposed"  # 0.21-0.28

    assert run_cli("apply", "--target", str(tree_0260)).exit_code == 0
    report = doctor(tree_0260)
    assert {p["id"]: p["state"] for p in report["patches"]}["matmul-add-lora-linear"] == "applied"
    assert verdict(report, NAN_BUG)["status"] == "protected"
    assert "torch matmuls" in verdict(report, NAN_BUG)["reason"]["message"]
    # With the Triton backend chosen, expand-block-n is what protects it.
    triton = verdict(doctor(tree_0260, PATCHKIT_LORA_BACKEND="triton"), NAN_BUG)
    assert triton["status"] == "protected" and "block_n 32" in triton["reason"]["message"]
    # Batch invariance keeps vLLM's Triton kernels too (any value but empty or 0).
    for value in ("1", "true"):
        invariant = verdict(doctor(tree_0260, VLLM_BATCH_INVARIANT=value), NAN_BUG)
        assert invariant["status"] == "protected" and "block_n 32" in invariant["reason"]["message"]
    torch_path = verdict(doctor(tree_0260, VLLM_BATCH_INVARIANT="0"), NAN_BUG)
    assert "torch matmuls" in torch_path["reason"]["message"]


@pytest.mark.slow
def test_a_setting_that_turns_the_only_fix_off_is_named(tree_0260: Path, hopper: Path):
    only = ["--only", "matmul-add-lora-linear"]
    assert run_cli("apply", "--target", str(tree_0260), *only).exit_code == 0
    assert verdict(doctor(tree_0260), NAN_BUG)["status"] == "protected"
    for env, value in (("VLLM_BATCH_INVARIANT", "1"), ("PATCHKIT_LORA_BACKEND", "triton")):
        off = verdict(doctor(tree_0260, **{env: value}), NAN_BUG)
        assert off["status"] == "exposed", off
        assert f"matmul-add-lora-linear is off ({env}={value})" in off["reason"]["message"]


@pytest.mark.slow
def test_tuned_expand_configs_that_undo_the_patch_are_named(tree_0260: Path, hopper: Path):
    folder = hopper / "tuned"
    folder.mkdir()
    risky = {"1": {"1": {"4096": {"64": {"5120": {"block_n": 128, "num_stages": 2}}}}}}
    (folder / "NVIDIA_H200_EXPAND_TRUE.json").write_text(json.dumps(risky))
    (folder / "NVIDIA_H200_EXPAND_FALSE.json").write_text(json.dumps({"1": {"2": {}}}))
    (folder / "NVIDIA_H200_SHRINK.json").write_text("{}")  # not an expand file: ignored
    assert run_cli("apply", "--target", str(tree_0260)).exit_code == 0
    report = doctor(tree_0260, VLLM_TUNED_CONFIG_FOLDER=str(folder), PATCHKIT_LORA_BACKEND="triton")
    problems = {Path(c["file"]).name: c["problem"]["message"] for c in report["tuned_configs"]}
    assert "replace the patched block_n 32" in problems["NVIDIA_H200_EXPAND_TRUE.json"]
    assert "KeyError" in problems["NVIDIA_H200_EXPAND_FALSE.json"]
    assert len(problems) == 2
    assert verdict(report, NAN_BUG)["status"] == "exposed"


@pytest.mark.slow
def test_other_gpus_and_new_ptxas_are_not_affected(tree_0260: Path, hopper: Path):
    executable(hopper / "bin" / "nvidia-smi", "NVIDIA A100-SXM4-80GB, 8.0")
    assert verdict(doctor(tree_0260), NAN_BUG)["status"] == "not-affected"
    executable(hopper / "bin" / "nvidia-smi", "NVIDIA H200, 9.0")
    executable(hopper / "ptxas", "Cuda compilation tools, release 13.3, V13.3.51")
    report = doctor(tree_0260)
    assert report["triton"]["ptxas_version"] == "13.3.51"
    assert verdict(report, NAN_BUG)["status"] == "not-affected"


@pytest.mark.slow
def test_stale_bytecode_and_old_compile_caches_are_found(tree_0260: Path, hopper: Path):
    module = tree_0260 / "vllm/lora/punica_wrapper/punica_gpu.py"
    cache_entry = hopper / "vllm-cache" / "torch_compile_cache" / "abc123"
    cache_entry.mkdir(parents=True)
    os.utime(cache_entry, (time.time() - 3600, time.time() - 3600))
    assert run_cli("apply", "--target", str(tree_0260)).exit_code == 0
    # A .pyc built from the unpatched source, left behind (as an image layer would).
    pyc = module.parent / "__pycache__" / "punica_gpu.cpython-311.pyc"
    pyc.parent.mkdir(exist_ok=True)
    original = module.read_text()
    module.write_text(original.replace("lora_shrink = torch_lora_shrink", "pass"))
    py_compile.compile(str(module), cfile=str(pyc))
    module.write_text(original)
    report = doctor(tree_0260)
    assert [Path(s.split(" ")[0]).name for s in report["stale_bytecode"]] == [pyc.name]
    (reason,) = report["stale_bytecode_reasons"]
    assert reason["code"] == "pyc-other-source" and reason["path"] == str(pyc)
    assert report["stale_bytecode"] == [reason["message"]]
    assert report["old_caches"][0]["entries"] == 1
    stale = verdict(report, STALE)
    assert stale["status"] == "exposed" and "--clear-caches" in stale["fix"]["message"]

    py_compile.compile(
        str(module), cfile=str(pyc), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH
    )
    assert "unchecked" in doctor(tree_0260)["stale_bytecode"][0]
    py_compile.compile(str(module), cfile=str(pyc))  # fresh, timestamp-checked: fine
    assert doctor(tree_0260)["stale_bytecode"] == []


def test_each_kind_of_stale_bytecode_is_a_reason_with_its_words(slim_tree_0260: Path):
    """Every way a .pyc can fail its source is a code of its own with the .pyc's path; the
    words (the text's line, the JSON's string) are made from them."""
    from patchkit.cli.words import say
    from patchkit.codes import Code
    from patchkit.doctor.doctor import stale_bytecode
    from patchkit.vllmtree.tree import locate

    relpath = "vllm/lora/ops/triton_ops/utils.py"
    source = slim_tree_0260 / relpath
    pyc = source.parent / "__pycache__" / "utils.cpython-311.pyc"
    pyc.parent.mkdir(exist_ok=True)
    original = source.read_bytes()
    hashed = py_compile.PycInvalidationMode

    def found() -> list:
        return stale_bytecode(locate(str(slim_tree_0260)), [relpath])

    py_compile.compile(str(source), cfile=str(pyc))
    assert found() == []
    cases = [
        (
            Code.PYC_UNCHECKED_HASH,
            "hash-based, unchecked: never re-validated",
            hashed.UNCHECKED_HASH,
        ),
        (Code.PYC_HASH_DIFFERS, "hash differs from source", hashed.CHECKED_HASH),
        (Code.PYC_OTHER_SOURCE, "built from another version of the source", hashed.TIMESTAMP),
    ]
    for code, words, mode in cases:
        source.write_bytes(original + b"\n# another version\n")
        py_compile.compile(str(source), cfile=str(pyc), invalidation_mode=mode)
        source.write_bytes(original)
        os.utime(source, (time.time() - 60, time.time() - 60))
        (reason,) = found()
        assert (reason.code, reason["path"], reason["source"]) == (code, str(pyc), str(source))
        assert say(reason) == f"{pyc} ({words})"
    pyc.write_bytes(pyc.read_bytes()[:10])
    (reason,) = found()
    assert reason.code == Code.PYC_TRUNCATED and say(reason) == f"{pyc} (truncated)"
    pyc.unlink()
    os.mkfifo(pyc)  # a .pyc that cannot be read as a file
    (reason,) = found()
    assert reason.code == Code.PYC_UNREADABLE
    assert say(reason) == f"{pyc} (unreadable: {reason['error']})" and reason["error"]


@pytest.mark.slow
def test_split_verdicts_follow_the_release(hopper: Path, tmp_path: Path):
    from tests.conftest import copy_tree

    old = copy_tree("0.17.0", tmp_path / "v17")
    report = doctor(old)
    assert verdict(report, "vLLM #35286")["status"] == "exposed"
    assert verdict(report, PARTIAL_BUG)["status"] == "not-affected"
    new = copy_tree("0.29.0", tmp_path / "v29")
    partial = verdict(doctor(new), PARTIAL_BUG)
    assert (
        partial["status"] == "exposed"
        and partial["fix"]["message"] == f"patchkit apply --target {new}"
    )
    assert run_cli("apply", "--target", str(new), "--only", "partial-gdn-adapter").exit_code == 0
    partial = verdict(doctor(new), PARTIAL_BUG)
    assert (
        partial["status"] == "protected" and "partial-gdn-adapter" in partial["reason"]["message"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("version", releases_with_variant("partial-moe-adapter"))
def test_the_one_expert_parameter_adapter_bug_is_named_until_the_patch_is_applied(
    hopper: Path, tmp_path: Path, version: str
):
    from tests.conftest import copy_tree

    root = copy_tree(version, tmp_path / "site")
    moe = verdict(doctor(root), MOE_BUG)
    assert moe["status"] == "exposed" and moe["fix"]["message"].startswith(
        "patchkit apply --target "
    )
    assert "down_proj or only their gate_up_proj" in moe["bug"]
    text = run_cli("doctor", "--target", str(root)).stdout
    assert f"[exposed] {MOE_BUG}: adapter on only the experts' down_proj" in text
    assert run_cli("apply", "--target", str(root), "--only", "partial-moe-adapter").exit_code == 0
    moe = verdict(doctor(root), MOE_BUG)
    assert moe["status"] == "protected" and "(partial-moe-adapter)" in moe["reason"]["message"]


def test_doctor_without_vllm_still_reports_and_imports_nothing(tmp_path: Path):
    result = run_subprocess("doctor", code=REPORT_IMPORTS)  # this Python has no vLLM
    assert result.returncode == 0, result.stderr
    assert "vLLM: vLLM is not installed for this Python" in result.stdout
    assert "IMPORTED: []" in result.stderr
    assert "[unknown] vLLM #35286" in result.stdout and "[unknown] vLLM #47639" in result.stdout
    assert "[unknown] vLLM #48460" in result.stdout


def scan_case(verdict: str, called: bool = True, tuned: str = ""):
    from patchkit.doctor.kernelscan import Case
    from patchkit.doctor.sass import Hazard

    hazards = [Hazard(0x44E0, "LDS.64 R90, [R140]", (90, 91), 0x46F0)]
    return Case(
        kernel="_lora_expand_kernel",
        family="dense",
        config={"BLOCK_N": 128, "num_stages": 2, "num_warps": 4},
        calls=["lora_shrink+lora_expand down_proj (1 slice), 16 tokens, rank 64, bf16"],
        sources=[tuned] if tuned else [],
        called=called,
        why_not_called="" if called else "dual-stream LoRA with PDL is off",
        verdict=verdict,
        hazards=hazards if verdict == "hazard" else [],
    )


@pytest.mark.parametrize(
    "cases, ptxas, states, status, words",
    [
        ([scan_case("hazard")], "12.8.93", {}, "exposed", "LDS.64 R90"),
        (
            [scan_case("clean")],
            "12.8.93",
            {"expand-block-n": "applied"},
            "protected",
            "no overwrite",
        ),
        ([scan_case("clean")], "13.3.33", {}, "not-affected", "from 13.3 on"),
        (
            [scan_case("clean"), scan_case("hazard", called=False)],
            "12.8.93",
            {},
            "not-affected",
            "not run here",
        ),
        (
            [scan_case("clean"), scan_case("error")],
            "12.8.93",
            {},
            "unknown",
            "could not be scanned",
        ),
        (
            [scan_case("hazard", tuned="/t/X_EXPAND_TRUE.json")],
            "12.8.93",
            {"expand-block-n": "applied"},
            "exposed",
            "X_EXPAND_TRUE.json",
        ),
    ],
)
def test_the_nan_verdict_rests_on_the_kernel_scan(cases, ptxas, states, status, words):
    from packaging.version import Version

    from patchkit.catalogue.load import load_catalogue
    from patchkit.cli.words import said, say
    from patchkit.doctor.doctor import DetectedGpu, DoctorReport, bug_groups, bug_verdict
    from patchkit.doctor.kernelscan import ScanReport
    from patchkit.doctor.toolchain import Toolchain
    from patchkit.vocabulary import PatchState, Verdict

    report = DoctorReport(gpus=[DetectedGpu("NVIDIA H200", "9.0")])
    tools = Toolchain(triton="3.7.1", ptxas="/x/ptxas", ptxas_version=ptxas)
    report.kernels = ScanReport(toolchain=tools, cases=cases)
    nan_patches = bug_groups(load_catalogue())[0]
    assert nan_patches[0].diagnosis.bugs == ("vllm#48590",)
    typed = {k: PatchState(v) for k, v in states.items()}
    verdict = bug_verdict(report, Version("0.26.0"), typed, nan_patches)
    assert isinstance(verdict.status, Verdict)
    reason, fix = say(verdict.reason), said(verdict.fix)
    assert verdict.status == status and "kernel scan" in reason
    assert words in reason + fix


RUNS_AND_SAYS = """#!/bin/sh
touch {ran}
echo "Cuda compilation tools, release 12.8, V12.8.93"
"""


@pytest.mark.parametrize("ptxas", ["a script", "the real binary"])
def test_the_ptxas_beside_the_tree_is_read_never_run(slim_tree_0260, tmp_path, ptxas):
    """doctor reads a tree; it ran the tree's triton/backends/nvidia/bin/ptxas --version,
    whatever the tree put there, with patchkit's rights (root's under sudo). The real
    0.26.0 tree with Triton 3.6.0's dist-info beside it, and its ptxas: the wheel's real
    binary, or a script that marks a file outside the tree when it runs. The version is
    read from the bytes (where --version's words are) and nothing runs."""
    site = triton_site("3.6.0")
    shutil.copytree(site / "triton-3.6.0.dist-info", slim_tree_0260 / "triton-3.6.0.dist-info")
    bundled = slim_tree_0260 / "triton" / "backends" / "nvidia" / "bin" / "ptxas"
    bundled.parent.mkdir(parents=True)
    ran = tmp_path / "ran"
    if ptxas == "a script":
        executable(bundled, "").write_text(RUNS_AND_SAYS.format(ran=ran))
    else:
        shutil.copy2(site / "triton" / "backends" / "nvidia" / "bin" / "ptxas", bundled)
    report = doctor(slim_tree_0260)
    assert report["triton_next_to_vllm"]["ptxas_version"] == "12.8.93"
    assert not ran.exists()


def test_a_fifo_as_the_triton_metadata_beside_the_tree_is_not_waited_on(slim_tree_0260):
    """triton-*.dist-info/METADATA beside the real 0.26.0 tree made a FIFO: doctor waited
    for a writer forever."""
    info = slim_tree_0260 / "triton-3.6.0.dist-info"
    info.mkdir()
    os.mkfifo(info / "METADATA")
    done = run_subprocess("doctor", "--target", str(slim_tree_0260), "--json", timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["triton_next_to_vllm"]["version"] is None


HOSTILE_DIR = "site $(touch PWNED) 'q'"


def test_the_command_to_scan_with_the_trees_triton_is_quoted_for_the_shell(
    slim_tree_0260, tmp_path
):
    """The real 0.26.0 tree (slim) moved under a directory whose name holds a space, a
    command substitution and quotes, beside a Triton of another release in a Python whose
    path has a space: the command doctor prints to scan with that Triton splits, as a
    shell would, into exactly that Python, the module and the tree."""
    from patchkit.cli.words import say
    from patchkit.doctor.doctor import DoctorReport, triton_mismatch
    from patchkit.doctor.toolchain import Toolchain, TreeTriton
    from patchkit.vllmtree.tree import locate

    root = shutil.move(slim_tree_0260, tmp_path / HOSTILE_DIR)
    python = str(tmp_path / "my env" / "bin" / "python3")
    report = DoctorReport(
        toolchain=Toolchain(triton="3.7.1", location="/x/triton"),
        tree_triton=TreeTriton("3.6.0", str(root / "triton"), python),
        tree=locate(str(root)),
    )
    words = say(triton_mismatch(report))
    command = words.split("scan with that one: ", 1)[1].removesuffix(" (patchkit installed there)")
    assert shlex.split(command) == [
        python, "-m", "patchkit", "doctor", "--kernels", "--target", str(root)
    ]  # fmt: skip


def test_fetch_s_note_on_a_patched_tree_names_revert_quoted_for_the_shell(tmp_path, capsys):
    """A tree fetch made earlier (its marker) and since patched (.patchkit/), under a
    directory whose name a shell would run: fetch hands it back with a note whose revert
    command splits into exactly that directory."""
    from patchkit.releases.fetch import MARKER, fetch

    dest = tmp_path / HOSTILE_DIR
    (dest / ".patchkit").mkdir(parents=True)
    (dest / MARKER).write_text("vllm-0.26.0-cp38-abi3-manylinux1_x86_64.whl\n")
    assert fetch("0.26.0", dest) == dest
    [note] = capsys.readouterr().err.splitlines()
    command = note.split("(`", 1)[1].split("`", 1)[0]
    assert shlex.split(command) == ["patchkit", "revert", "--target", str(dest)]
