"""`patchkit doctor --kernels` on real wheels: every LoRA kernel compiled and read.

Triton (3.7.1, what vLLM 0.27-0.32 get; 3.6.0, what 0.26.0 gets) is
downloaded once into the tests' cache and put on the child's PYTHONPATH;
the test venv itself has no Triton, which is also what the "Triton is not
importable" test needs. No GPU is used: the kernels are compiled for sm_90
and their SASS is read. Triton's cache and patchkit's readings live next to
that Triton (keyed by its version), so a second run compiles nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TEST_CACHE, copy_tree, release_tree, run_cli
from tests.kernelscan_helpers import TRITON, scan_env, small_moe_model, triton_site

NAN_BUG = "vLLM #48590"
DENSE = {"_lora_shrink_kernel", "_lora_expand_kernel"}
FP8 = {"_lora_shrink_kernel_fp8", "_lora_expand_kernel_fp8", "_fused_moe_lora_kernel_fp8"}
MOE = {"_fused_moe_lora_kernel", "_fused_moe_lora_one_shot_kernel",
       "_fused_moe_lora_small_batch_kernel"}  # fmt: skip
GEMV = {"_gemv_shrink_kernel", "_gemv_expand_kernel"}  # matmul-add-lora-linear's module
KERNELS = {
    "0.22.0": DENSE | FP8 | MOE,
    "0.26.0": DENSE | FP8 | MOE,
    "0.33.0": DENSE | FP8 | MOE | {"_lora_shrink_reduce_kernel"},
}
READ = {"hazard", "clean", "no-register-operand"}  # verdicts of a kernel that was compiled and read


def doctor(tree: Path, *args: str, version: str = TRITON, **extra: str):
    """`patchkit doctor --kernels` in a child that can import Triton."""
    command = [sys.executable, "-m", "patchkit", "doctor", "--kernels", "--target", str(tree)]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, env={**scan_env(version), **extra},
        timeout=900,
    )  # fmt: skip


def doctor_kernels(tree: Path, version: str = TRITON, **extra: str) -> dict:
    done = doctor(tree, "--json", version=version, **extra)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert not report["kernels"].get("error"), report["kernels"]
    return report


def nan_verdict(report: dict) -> dict:
    return next(v for v in report["verdicts"] if v["bug"].startswith(NAN_BUG))


def cases(report: dict, kernel: str, **where) -> list[dict]:
    found = [c for c in report["kernels"]["cases"] if c["kernel"] == kernel]
    return [c for c in found if all(c["constants"].get(k) == v for k, v in where.items())]


def single_slice_fp32_expand(report: dict) -> list[dict]:
    """The expand add_lora_linear runs on one slice: fp32 input, adds into the output."""
    found = cases(report, "_lora_expand_kernel", SLICE_NUM=1, ADD_INPUTS=True, USE_GDC=False)
    return [c for c in found if c["signature"]["input_ptr"] == "*fp32"]


@pytest.mark.network
@pytest.mark.parametrize(
    "version, triton",
    [("0.22.0", TRITON), ("0.26.0", TRITON), ("0.33.0", TRITON), ("0.26.0", "3.6.0")],  # fmt: skip
)
def test_every_lora_kernel_the_release_launches_is_compiled_and_read(version, triton):
    report = doctor_kernels(release_tree(version), version=triton)
    scan = report["kernels"]
    assert scan["toolchain"]["triton"] == triton
    assert set(scan["kernels"]) == KERNELS[version]  # found in the tree's own source
    for kernel in KERNELS[version]:
        read = [c for c in scan["cases"] if c["kernel"] == kernel and c["verdict"] in READ]
        compiled = [c for c in scan["cases"] if c["kernel"] == kernel]
        assert compiled, f"{kernel} has no case"
        if kernel != "_fused_moe_lora_kernel_fp8":  # see the fp8 MoE test below
            assert read, f"{kernel}: {compiled[0]['error']}"
    assert not [c for c in scan["cases"] if c["approximate"]]  # all built as vLLM builds them
    assert len({c["key"] for c in scan["cases"]}) == len(scan["cases"])  # distinct compiles
    moe = {c["kernel"] for c in scan["cases"] if c["family"] == "moe" and c["called"]}
    assert moe == MOE  # the fast paths and the fully-sharded two-kernel path all run
    fp8 = [c for c in scan["cases"] if c["family"] == "fp8"]
    assert fp8 and not any(c["called"] for c in fp8)  # no vLLM code calls the fp8 ops
    assert "fp8" in fp8[0]["why_not_called"]


@pytest.mark.network
def test_the_fp8_moe_kernel_is_reported_as_vllm_ships_it():
    """vLLM's fp8 MoE LoRA kernel reads B as the output dtype, so w8a8 (fp8 activations,
    bf16 output) does not compile: the scan says so for that kernel, and it is not run."""
    report = doctor_kernels(release_tree("0.26.0"))
    fp8_moe = cases(report, "_fused_moe_lora_kernel_fp8")
    errors = [c for c in fp8_moe if c["verdict"] == "error"]
    assert errors and "Unsupported lhs dtype fp8e4nv" in errors[0]["error"]
    assert not any(c["called"] for c in fp8_moe)


@pytest.mark.network
@pytest.mark.parametrize("version", ["0.26.0", "0.30.0"])
def test_unpatched_default_has_the_hazard_and_expand_block_n_removes_it(tmp_path, version):
    tree = copy_tree(version, tmp_path / "t")
    before = doctor_kernels(tree)
    expand = single_slice_fp32_expand(before)
    hazards = [c for c in expand if c["verdict"] == "hazard"]
    assert hazards and all(c["called"] for c in hazards)
    assert {(c["config"]["BLOCK_N"], c["config"]["num_stages"]) for c in hazards} == {(128, 2)}
    assert all(c["register_a"] > 0 and len(c["hazards"]) >= 6 for c in hazards)
    assert all(h["instruction"] and h["address"].startswith("0x") for h in hazards[0]["hazards"])
    verdict = nan_verdict(before)
    assert verdict["status"] == "exposed" and "kernel scan" in verdict["reason"]["message"]
    assert verdict["fix"]["message"] == f"patchkit apply --target {tree}"

    assert run_cli("apply", "--target", str(tree), "--only", "expand-block-n").exit_code == 0
    after = doctor_kernels(tree)
    assert {c["config"]["BLOCK_N"] for c in single_slice_fp32_expand(after)} == {32}
    assert [c["label"] for c in after["kernels"]["cases"] if c["verdict"] == "hazard"] == []
    assert nan_verdict(after)["status"] == "protected"
    assert "no overwrite" in nan_verdict(after)["reason"]["message"]


@pytest.mark.network
def test_0330_ships_one_stage_and_is_clean():
    report = doctor_kernels(release_tree("0.33.0"))
    expand = single_slice_fp32_expand(report)
    assert {c["config"]["num_stages"] for c in expand} == {1}
    assert {c["verdict"] for c in expand} == {"clean"}
    assert not [c for c in report["kernels"]["cases"] if c["verdict"] == "hazard"]
    assert nan_verdict(report)["status"] == "not-affected"
    reduce = cases(report, "_lora_shrink_reduce_kernel")
    assert reduce and not any(c["called"] for c in reduce)  # batch-invariant mode only
    assert "VLLM_BATCH_INVARIANT" in reduce[0]["why_not_called"]


@pytest.mark.network
def test_the_torch_path_replaces_the_dense_kernels_only(tmp_path):
    tree = copy_tree("0.26.0", tmp_path / "t")
    only = ["--only", "matmul-add-lora-linear"]
    assert run_cli("apply", "--target", str(tree), *only).exit_code == 0
    report = doctor_kernels(tree)
    expand = single_slice_fp32_expand(report)
    assert "hazard" in {c["verdict"] for c in expand}  # compiled, but not run
    dense = [c for c in report["kernels"]["cases"] if c["family"] == "dense"]
    assert dense and not any(c["called"] for c in dense)
    assert "torch matmuls" in dense[0]["why_not_called"]
    assert any(c["called"] for c in report["kernels"]["cases"] if c["family"] == "moe")
    verdict = nan_verdict(report)
    assert verdict["status"] == "protected" and "torch matmuls" in verdict["reason"]["message"]
    gemv = [c for c in report["kernels"]["cases"] if c["family"] == "gemv"]
    assert {c["kernel"] for c in gemv} == GEMV  # the torch path's own kernels: no wgmma
    assert {c["verdict"] for c in gemv} == {"no-register-operand"}
    adding = [c for c in gemv if c["constants"].get("ADD_INPUTS") is not False]
    assert adding and all(c["called"] for c in adding)  # on by default; writing: dual stream
    assert not any(c["called"] for c in gemv if c["constants"].get("ADD_INPUTS") is False)
    dual = doctor_kernels(tree, VLLM_LORA_ENABLE_DUAL_STREAM="1", VLLM_LORA_DISABLE_PDL="1")
    gemv = [c for c in dual["kernels"]["cases"] if c["family"] == "gemv"]
    assert all(c["called"] for c in gemv if c["constants"].get("ADD_INPUTS") is False)
    off = doctor_kernels(tree, PATCHKIT_LORA_GEMV="0")  # the way back: a scan of its own
    gemv = [c for c in off["kernels"]["cases"] if c["family"] == "gemv"]
    assert gemv and not any(c["called"] for c in gemv)
    assert "PATCHKIT_LORA_GEMV=0" in gemv[0]["why_not_called"]
    triton_backend = doctor_kernels(tree, PATCHKIT_LORA_BACKEND="triton")
    assert nan_verdict(triton_backend)["status"] == "exposed"
    gemv = [c for c in triton_backend["kernels"]["cases"] if c["family"] == "gemv"]
    assert gemv and not any(c["called"] for c in gemv)
    assert "torch LoRA path" in gemv[0]["why_not_called"]


@pytest.mark.network
def test_a_tuned_config_that_brings_block_n_128_back_is_named(tmp_path):
    tree = copy_tree("0.26.0", tmp_path / "t")
    assert run_cli("apply", "--target", str(tree), "--only", "expand-block-n").exit_code == 0
    folder = tmp_path / "tuned"
    folder.mkdir()
    leaf = {"block_m": 64, "block_n": 128, "block_k": 32, "num_warps": 4, "num_stages": 2,
            "num_ctas": 1, "max_nreg": None}  # fmt: skip
    config = {"4": {"1": {"16": {"64": {"5120": leaf}}}}}
    (folder / "NVIDIA_H200_EXPAND_TRUE.json").write_text(json.dumps(config))
    report = doctor_kernels(tree, VLLM_TUNED_CONFIG_FOLDER=str(folder))
    tuned = [c for c in report["kernels"]["cases"] if c["sources"] and c["verdict"] != "error"]
    fp32 = [c for c in tuned if c["signature"]["input_ptr"] == "*fp32"]
    assert "hazard" in {c["verdict"] for c in fp32}  # block_n 128, 2 stages again
    assert {(c["config"]["BLOCK_N"], c["config"]["num_stages"]) for c in fp32} == {(128, 2)}
    assert all(c["gpus"] == ["NVIDIA H200"] for c in tuned)  # the file is named for the H200
    assert {c["kernel"] for c in tuned} <= {"_lora_expand_kernel", "_lora_expand_kernel_fp8"}
    # vLLM itself raises KeyError for 2 and 3 slices: that file has no such entry
    raised = [c for c in report["kernels"]["cases"] if "KeyError" in c["error"]]
    assert raised and "vLLM's own code raises" in raised[0]["error"]
    verdict = nan_verdict(report)
    assert (
        verdict["status"] == "exposed"
        and "NVIDIA_H200_EXPAND_TRUE.json" in verdict["fix"]["message"]
    )


SCAN = """
import json, sys
from pathlib import Path
from patchkit.doctor import configs
from patchkit.doctor import kernelscan
from patchkit.cli.commands.doctor import scan_json
from patchkit.vllmtree.tree import locate
tree, wanted = locate(sys.argv[1]), sys.argv[2].split("|")
models = configs.DEFAULT_MODELS
if len(sys.argv) > 3:
    models = [configs.model_from_dir(Path(sys.argv[3]), [Path(a) for a in sys.argv[4:]])]
report = kernelscan.scan(tree, models=models, select=lambda c: any(w in c.label() for w in wanted))
print(json.dumps(scan_json(report)))
"""


def scan_calls(tree: Path, wanted: str, **extra: str) -> dict:
    """The scan in a child, limited to the calls whose label contains ``wanted`` (or one
    of its |-separated parts)."""
    done = subprocess.run(
        [sys.executable, "-c", SCAN, str(tree), wanted], capture_output=True, text=True,
        env={**scan_env(), **extra}, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


ONE_CALL = "down_proj (1 slice), 16 tokens, rank 64"
STRACE = shutil.which("strace")


@pytest.mark.network
def test_triton_ptxas_path_is_the_ptxas_the_scan_uses():
    ptxas = TEST_CACHE / f"triton-{TRITON}-ptxas-copy" / "ptxas"  # kept: its readings stay warm
    if not ptxas.is_file():
        ptxas.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(triton_site() / "triton/backends/nvidia/bin/ptxas", ptxas)
    scan = scan_calls(release_tree("0.26.0"), ONE_CALL, TRITON_PTXAS_PATH=str(ptxas))
    assert scan["toolchain"]["ptxas"] == str(ptxas)
    assert scan["toolchain"]["ptxas_source"] == "TRITON_PTXAS_PATH"
    assert scan["toolchain"]["ptxas_version"] == "12.8.93"


# A prefill of 1000 tokens (not 16-divisible) and one of 4096: Triton specialises the
# launches apart, and the fp32 expand compiles to the same machine code for both. A
# decode of one token: its small blocks compile to mma.sync, no wgmma.
THREE_CALLS = ("down_proj (1 slice), 1000 tokens, rank 64|down_proj (1 slice), 4096 tokens, "
               "rank 64|down_proj (1 slice), 1 tokens, rank 64")  # fmt: skip


@pytest.mark.network
def test_the_machine_code_is_disassembled_in_one_run_per_core_and_only_where_ptx_has_wgmma(
    tmp_path,
):
    """Every compile is still made, but only the distinct cubins whose PTX has a wgmma
    are disassembled, all of them in one raw nvdisasm run per core (not a cuobjdump per
    cubin). Those left unread do disassemble to SASS without an HGMMA, as their
    no-register-operand verdict says; the raw run reads the others as cuobjdump does,
    hazards and their addresses included, wherever a kernel lies in the run."""
    from patchkit.doctor import cubinfile, kernelbuild, sass

    if STRACE is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    triton_cache, trace = tmp_path / "triton", tmp_path / "execve"
    caches = {"TRITON_CACHE_DIR": str(triton_cache), "PATCHKIT_CACHE_DIR": str(tmp_path / "pk")}
    execs = [STRACE, "-f", "-qq", "--seccomp-bpf", "-e", "trace=execve", "-o", str(trace)]
    done = subprocess.run(
        [*execs, sys.executable, "-c", SCAN, str(release_tree("0.26.0")), THREE_CALLS],
        capture_output=True, text=True, env={**scan_env(), **caches}, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    scan = json.loads(done.stdout)
    read = [c for c in scan["cases"] if c["verdict"] in READ]
    cubins = {p: p.read_bytes() for p in triton_cache.rglob("*.cubin")}
    with_wgmma = {b for p, b in cubins.items() if "wgmma" in p.with_suffix(".ptx").read_text()}
    without = set(cubins.values()) - with_wgmma
    assert len(cubins) == len(read)  # one compile per case, each with a verdict
    assert len(with_wgmma) < len([b for b in cubins.values() if b in with_wgmma])  # shared code
    assert with_wgmma and without  # the decode's kernels have no wgmma, the prefills' do
    execs = re.findall(r'execve\("[^"]*/(cuobjdump|nvdisasm)"', trace.read_text())
    assert execs == ["nvdisasm"] * min(len(with_wgmma), os.cpu_count() or 2)

    bin_dir = triton_site() / "triton/backends/nvidia/bin"
    alone = {}  # what cuobjdump on each cubin shows
    for n, cubin in enumerate([*with_wgmma, *without]):
        path = tmp_path / f"{n}.cubin"
        path.write_bytes(cubin)
        cuobjdump = [str(bin_dir / "cuobjdump"), "-sass", str(path)]
        listing = subprocess.run(cuobjdump, capture_output=True, text=True, check=True).stdout
        assert sass.parse(listing)
        alone[cubin] = sass.scan(listing)
    assert all(alone[c].hgmma == 0 for c in without)
    assert any(alone[c].hazards for c in with_wgmma)  # the prefill's fp32 expand
    for order in (sorted(with_wgmma), sorted(with_wgmma, reverse=True)):  # each kernel moved
        batch = [(str(n), cubinfile.code(c)) for n, c in enumerate(order)]
        raw = kernelbuild.read_raw(batch, str(bin_dir / "nvdisasm"))
        got = {c: raw[str(n)] for n, c in enumerate(order)}
        assert {c: (r.hgmma, r.register_a, r.hazards) for c, r in got.items()} == {
            c: (alone[c].hgmma, alone[c].register_a, alone[c].hazards) for c in order
        }


@pytest.mark.network
def test_host_code_the_scan_cannot_follow_is_labelled_approximate(tmp_path):
    """A launcher that asks an unmodelled vLLM helper is still compiled, but never passes
    for vLLM's own choice: the case says which stand-in it leaned on."""
    tree = copy_tree("0.26.0", tmp_path / "t")
    op = tree / "vllm/lora/ops/triton_ops/lora_expand_op.py"
    text = op.read_text()
    anchor = "    # Triton kernel configs.\n"
    assert text.count(anchor) == 1
    probe = (
        "    from vllm.utils.import_utils import has_triton_kernels\n    if has_triton_kernels():\n"
    )
    op.write_text(text.replace(anchor, probe + "        pass\n" + anchor))

    scan = scan_calls(tree, ONE_CALL)
    expand = [c for c in scan["cases"] if c["kernel"] == "_lora_expand_kernel"]
    assert expand and all("has_triton_kernels" in c["approximate"] for c in expand)
    assert {c["config"]["BLOCK_N"] for c in expand} == {128}  # what the launcher chose, kept
    shrink = [c for c in scan["cases"] if c["kernel"] == "_lora_shrink_kernel"]
    assert shrink and not any(c["approximate"] for c in shrink)  # its launcher is untouched
    pristine = scan_calls(release_tree("0.26.0"), ONE_CALL)
    assert not any(c["approximate"] for c in pristine["cases"])
    text = doctor(tree).stdout
    approximate = re.compile(r"  (\w+): \d+ configs? approximate \(vLLM's host code used vllm")
    assert [m.group(1) for m in approximate.finditer(text)] == ["_lora_expand_kernel"]


@pytest.mark.network
def test_vllms_own_triton_is_named_and_a_different_one_voids_the_evidence(tmp_path):
    tree = copy_tree("0.26.0", tmp_path / "site-packages")
    info = tree / "triton-3.6.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: triton\nVersion: 3.6.0\n")
    (tree / "triton").mkdir()
    report = doctor_kernels(tree)
    assert report["triton_next_to_vllm"]["version"] == "3.6.0"
    verdict = nan_verdict(report)
    assert "compiled with Triton 3.7.1" in verdict["reason"]["message"]
    assert "vLLM here runs Triton 3.6.0" in verdict["reason"]["message"]
    assert "-m patchkit doctor --kernels" in verdict["reason"]["message"]
    fix = f"patchkit apply --target {tree}"
    assert verdict["status"] == "exposed" and verdict["fix"]["message"] == fix  # by the rules
    text = doctor(tree).stdout
    assert f"Triton next to vLLM: 3.6.0 ({tree / 'triton'}" in text

    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: triton\nVersion: 3.7.1\n")
    same = nan_verdict(doctor_kernels(tree))
    assert (
        "vLLM here runs" not in same["reason"]["message"]
        and "kernel scan:" in same["reason"]["message"]
    )


@pytest.mark.network
def test_the_text_is_one_line_per_kernel_and_verdict_and_every_config_with_verbose():
    tree = release_tree("0.26.0")
    report = doctor_kernels(tree)
    short = doctor(tree)
    assert short.returncode == 0, short.stderr
    lines = short.stdout.splitlines()
    start = next(n for n, ln in enumerate(lines) if ln.startswith("kernel scan ("))
    end = lines.index("", start)  # the verdicts follow a blank line
    scan_lines = lines[start + 1 : end]
    assert len(scan_lines) <= 4 * len(KERNELS["0.26.0"]) < len(report["kernels"]["cases"])
    assert all(ln.split(":")[0].strip() in KERNELS["0.26.0"] for ln in scan_lines)
    hazard = [ln for ln in scan_lines if ln.startswith("  _lora_expand_kernel: hazard in ")]
    assert hazard and "configs this install runs (first: block M64 N128 K32" in hazard[0]
    assert not any(ln.lstrip().startswith("[") for ln in scan_lines)

    verbose = doctor(tree, "-v").stdout.splitlines()
    configs = [ln for ln in verbose if ln.startswith("  [")]
    assert len(configs) == len(report["kernels"]["cases"])
    assert any(ln.startswith("  [hazard] _lora_expand_kernel block M64 N128 K32") for ln in configs)


@pytest.mark.network
def test_a_models_own_shapes_and_adapter_ranks(tmp_path):
    from patchkit.doctor.configs import model_from_dir

    model, adapter = small_moe_model(tmp_path, "float16", {"r": 32, "rank_pattern": {"x": 8}})
    shapes = model_from_dir(model, [adapter])
    assert (shapes.hidden, shapes.experts, shapes.top_k, shapes.moe_intermediate) == (
        1024, 64, 4, 256,
    )  # fmt: skip
    assert (shapes.q, shapes.kv, shapes.intermediate, shapes.dtype) == (1024, 256, 512, "float16")
    assert shapes.ranks == (8, 32)

    usage = run_cli("doctor", "--model", str(model))
    assert usage.exit_code == 2 and "--kernels" in usage.output
    plumbing = run_cli("doctor", "--kernels", "--json", "--model", str(model), "--adapter",
                       str(adapter), "--target", str(release_tree("0.26.0")))  # fmt: skip
    models = json.loads(plumbing.stdout)["kernels"]["models"]  # no Triton in this process
    assert [(m["hidden"], m["ranks"]) for m in models] == [(1024, [8, 32])]

    done = subprocess.run(
        [sys.executable, "-c", SCAN, str(release_tree("0.26.0")), "16 tokens, rank 8,", str(model),
         str(adapter)], capture_output=True, text=True, env=scan_env(), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    scan = json.loads(done.stdout)
    labels = [label for c in scan["cases"] for label in c["calls"]]
    assert labels and all(", fp16" in label for label in labels)
    one_shot = [c for c in scan["cases"] if c["kernel"] == "_fused_moe_lora_one_shot_kernel"]
    assert one_shot and all(c["signature"]["x_ptr"] == "*fp16" for c in one_shot)
    assert {c["constants"]["BLOCK_R"] for c in one_shot} == {16}  # rank 8, padded to 16
    qkv = [c for c in scan["cases"] if any("qkv_proj" in call for call in c["calls"])]
    assert qkv and all(c["constants"]["SLICE_NUM"] == 3 for c in qkv)


GEMV_SCANS: dict[str, dict] = {}  # by Triton version: one scan of the GEMV calls per test run


def gemv_scan(version: str, tmp_path_factory) -> dict:
    """The scan of every GEMV call (default models) on a tree with the torch path."""
    if version not in GEMV_SCANS:
        tree = copy_tree("0.26.0", tmp_path_factory.mktemp("gemv") / "t")
        only = ["--only", "matmul-add-lora-linear"]
        assert run_cli("apply", "--target", str(tree), *only).exit_code == 0
        done = subprocess.run(
            [sys.executable, "-c", SCAN, str(tree), "patchkit gemv_linear"],
            capture_output=True, text=True, env=scan_env(version), timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        GEMV_SCANS[version] = json.loads(done.stdout)
    return GEMV_SCANS[version]


CALL = re.compile(r"\((\d) slices?\), (\d+) slots, (\d+) tokens, rank (\d+), bf16(, dual-stream)?$")


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("version", ["3.6.0", TRITON])
def test_the_torch_paths_gemv_kernels_are_read_in_every_config_its_host_code_picks(
    version, tmp_path_factory
):
    """The torch path's decode route launches Triton kernels of its own, from the module
    the patch adds beside the punica wrapper: the scan finds them, runs the module's own
    host code (gemv_linear) at every row count it takes (1-8, on 1, 8 and 16 slots),
    every rank vLLM admits, every slice count of Qwen3.5's layers (1-4), adding and
    dual-stream writing, and reads every config that host code picks: no wgmma at all,
    so no register-A race, on Triton 3.6.0 and 3.7.1 with their own ptxas."""
    from patchkit.doctor import configs
    from tests.conftest import created_source, module_from_source

    scan = gemv_scan(version, tmp_path_factory)
    assert scan["toolchain"]["triton"] == version
    assert GEMV <= set(scan["kernels"])  # found in the patched tree's source
    gemv = [c for c in scan["cases"] if c["family"] == "gemv"]
    assert {c["kernel"] for c in gemv} == GEMV  # no error case: gemv_linear took every call
    assert [(c["label"], c["verdict"], c["error"]) for c in gemv
            if c["verdict"] != "no-register-operand" or c["hgmma"]] == []  # fmt: skip
    assert not any(c["approximate"] for c in gemv)
    module = module_from_source(
        "patchkit_lora_matmul_scan", created_source("matmul-add-lora-linear",
        "vllm/lora/punica_wrapper/patchkit_lora_matmul.py"), tmp_path_factory.mktemp("m"),
    )  # fmt: skip
    assert configs.GEMV_MAX_TOKENS == module.GEMV_MAX_TOKENS
    # Every call compiled both kernels (one shrink, an expand per slice), and the calls
    # are every (slices, slots, tokens, rank, setting) the route admits.
    reached = {k: {label for c in gemv if c["kernel"] == k for label in c["calls"]} for k in GEMV}
    assert reached["_gemv_shrink_kernel"] == reached["_gemv_expand_kernel"]
    found = {CALL.search(label).groups() for label in reached["_gemv_shrink_kernel"]}
    wanted = {
        (str(slices), str(slots), str(tokens), str(rank), setting)
        for slices in (1, 2, 3, 4)
        for slots in (1, 8, 16)
        for tokens in range(1, min(module.GEMV_MAX_TOKENS, slots) + 1)
        for rank in configs.VLLM_RANKS
        for setting in (None, ", dual-stream")
    }
    assert found == wanted
    shrink = [c["constants"] for c in gemv if c["kernel"] == "_gemv_shrink_kernel"]
    expand = [c["constants"] for c in gemv if c["kernel"] == "_gemv_expand_kernel"]
    assert {(c["SPLIT_K"], c["BLOCK_N"], c["BLOCK_K"]) for c in shrink} == {
        (module.GEMV_SPLIT_K, module.GEMV_BLOCK_N, module.GEMV_BLOCK_K)
    }
    assert {c["BLOCK_R"] for c in expand} == {16, 32, 64, 128}
    assert {c["BLOCK_W"] for c in expand} == {module.GEMV_BLOCK_W}
    assert {c["ADD_INPUTS"] for c in expand} == {True, False}
    # Triton's own specialisations reached too: rank 1 and one slot become constants.
    assert any(c.get("rank") == 1 for c in shrink) and any(c.get("stride_w") == 1 for c in expand)


def elf(sections: list[tuple[str, bytes]]) -> bytes:
    """A little-endian ELF64 file holding ``sections`` (after the null one), names last."""
    import struct

    names = b"\0" + b"".join(name.encode() + b"\0" for name, _ in sections) + b".shstrtab\0"
    body, placed = b"", []
    for name, data in sections:
        placed.append((names.index(name.encode() + b"\0"), 64 + len(body), len(data)))
        body += data
    placed.append((len(names) - len(".shstrtab\0"), 64 + len(body), len(names)))
    body += names
    offset, count = 64 + len(body), len(placed) + 1
    header = (
        b"\x7fELF\x02\x01\x01"
        + bytes(9)
        + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, offset, 0, 64, 0, 0, 64, count, count - 1)
    )
    table = bytes(64) + b"".join(
        struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, at, size, 0, 0, 1, 0) for name, at, size in placed
    )
    return header + body + table


def test_a_cubins_raw_code_is_its_one_code_section_or_none():
    """The raw run reads a cubin's code only where it is the whole program: one code
    section, no relocation against it, whole instructions; else the cubin is read alone."""
    from patchkit.doctor import cubinfile

    code = bytes(range(32))  # two 16-byte instructions
    assert cubinfile.code(elf([(".text._k", code), (".nv.info._k", b"x")])) == code
    assert cubinfile.code(elf([(".text._k", code), (".rela.text._k", bytes(24))])) is None
    assert cubinfile.code(elf([(".text._k", code), (".rela.text._k", b"")])) == code
    assert cubinfile.code(elf([(".text._k", code), (".text._f", code)])) is None
    assert cubinfile.code(elf([(".text._k", code[:24])])) is None  # not whole instructions
    assert cubinfile.code(elf([(".nv.info._k", b"x")])) is None
    whole = elf([(".text._k", code)])
    assert cubinfile.code(whole[: len(whole) - 70]) is None  # its section table cut short
    assert cubinfile.code(b"\x7fELF\x01\x01" + whole[6:]) is None  # ELF32
    assert cubinfile.code(b"not an ELF file") is None


def test_the_raw_runs_hold_at_most_a_batch_each_and_one_per_core_at_least():
    from patchkit.doctor.kernelbuild import RAW_BATCH, batches

    for count in (0, 1, 2, 3, RAW_BATCH * 2, RAW_BATCH * 2 + 1, 200):
        dealt = batches(list(range(count)), cores=2)
        assert sorted(n for batch in dealt for n in batch) == list(range(count))
        assert all(0 < len(batch) <= RAW_BATCH for batch in dealt)
        assert len(dealt) == min(count, max(2, -(-count // RAW_BATCH)))


@pytest.mark.parametrize("version", ["0.17.0", "0.26.0", "0.33.0"])
def test_the_scan_takes_every_rank_the_release_admits(version):
    """The GEMV calls' ranks are vLLM's MaxLoRARanks, as the release's config says."""
    from patchkit.doctor import configs

    text = (release_tree(version) / "vllm/config/lora.py").read_text()
    admitted = re.search(r"^MaxLoRARanks = Literal\[([\d, ]+)\]", text, re.M).group(1)
    assert tuple(int(r) for r in admitted.split(",")) == configs.VLLM_RANKS


def test_a_qwen35_config_gives_the_linear_attention_projections(tmp_path):
    """in_proj_qkvz (4 slices) and in_proj_ba (2) from a Qwen3.5 config's GDN sizes,
    as the default dense model has them."""
    from patchkit.doctor import configs

    text = {"hidden_size": 5120, "num_attention_heads": 24, "num_key_value_heads": 4,
            "head_dim": 256, "intermediate_size": 17408, "linear_num_key_heads": 16,
            "linear_key_head_dim": 128, "linear_num_value_heads": 48,
            "linear_value_head_dim": 128}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text}))
    for model in (configs.model_from_dir(tmp_path), configs.DEFAULT_MODELS[0]):
        layers = {name: slices for name, _, slices in configs.gemv_layers(model)}
        assert layers["in_proj_qkvz"] == (2048, 2048, 6144, 6144)
        assert layers["in_proj_ba"] == (48, 48)
        assert {len(s) for s in layers.values()} == {1, 2, 3, 4}


def test_without_triton_the_scan_says_so_in_one_line_and_doctor_runs_on(tree_0260):
    result = run_cli("doctor", "--kernels", "--target", str(tree_0260))
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("kernel scan")]
    assert lines == [lines[0]] and "Triton is not installed" in lines[0]
    assert "[exposed] vLLM #48590" in result.stdout  # judged by the version rules instead
