"""A tree changed under patchkit has a way out, and no backup goes over new files.

pip reinstalls another release or the same one over a patched tree, a file
patchkit created is deleted by hand, the upper patch of a stack is applied
alone: status names the state and what to run, and revert gives back the
installed release's own files without --force where that is safe.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import copy_tree, normalized, release_tree, run_cli, slim_tree, snapshot
from tests.helpers import CREATED, PUNICA, UTILS, stacked_catalogue


def reinstall(tree: Path, version: str) -> None:
    """What pip does: remove the installed release's files (by its RECORD), unpack the other."""
    for dist_info in tree.glob("vllm-*.dist-info"):
        for line in (dist_info / "RECORD").read_text().splitlines():
            (tree / line.split(",")[0]).unlink(missing_ok=True)
        shutil.rmtree(dist_info)
    source = release_tree(version)
    shutil.copytree(source / "vllm", tree / "vllm", dirs_exist_ok=True)
    for dist_info in source.glob("vllm-*.dist-info"):
        shutil.copytree(dist_info, tree / dist_info.name)


@pytest.mark.slow
def test_after_a_reinstall_as_another_release_no_backup_goes_over_its_files(tmp_path):
    tree = copy_tree("0.26.0", tmp_path / "site")
    assert run_cli("apply", "--target", str(tree)).exit_code == 0
    reinstall(tree, "0.21.0")
    pristine_0210 = release_tree("0.21.0") / UTILS
    status = json.loads(run_cli("status", "--target", str(tree), "--json").stdout)
    block_n = next(p for p in status["patches"] if p["id"] == "expand-block-n")
    assert block_n["state"] == "needed"  # 0.21.0's own file: the 0.26.0 record is stale
    assert "--force" not in json.dumps(status)
    forced = run_cli("revert", "--target", str(tree), "--only", "expand-block-n", "--force")
    assert forced.exit_code == 0, forced.output
    assert (tree / UTILS).read_bytes() == pristine_0210.read_bytes()
    matmul = next(p for p in status["patches"] if p["id"] == "matmul-add-lora-linear")
    assert matmul["state"] == "conflict" and "patchkit revert --only" in matmul["reason"]["message"]
    assert run_cli("revert", "--target", str(tree)).exit_code == 0
    assert not (tree / CREATED).exists() and not (tree / ".patchkit").exists()
    fresh = copy_tree("0.21.0", tmp_path / "fresh")
    assert snapshot(tree / "vllm") == snapshot(fresh / "vllm")


def test_a_reinstall_of_the_same_release_leaves_no_state_behind(slim_tree_0260):
    pristine = normalized(slim_tree_0260)
    assert run_cli("apply", "--target", str(slim_tree_0260)).exit_code == 0
    source = release_tree("0.26.0")
    for relpath in (UTILS, PUNICA, "vllm/lora/layers/base.py",
                    "vllm/lora/layers/column_parallel_linear.py"):  # fmt: skip
        (slim_tree_0260 / relpath).write_bytes((source / relpath).read_bytes())
    (slim_tree_0260 / CREATED).unlink()
    result = run_cli("revert", "--target", str(slim_tree_0260))
    assert result.exit_code == 0, result.output
    assert "dropped the stale record" in result.stdout
    assert not (slim_tree_0260 / ".patchkit").exists()
    assert normalized(slim_tree_0260) == pristine


def test_a_deleted_created_file_is_no_dead_end(slim_tree_0260):
    pristine = normalized(slim_tree_0260)
    assert run_cli("apply", "--target", str(slim_tree_0260)).exit_code == 0
    (slim_tree_0260 / CREATED).unlink()
    status = json.loads(run_cli("status", "--target", str(slim_tree_0260), "--json").stdout)
    matmul = next(p for p in status["patches"] if p["id"] == "matmul-add-lora-linear")
    assert (
        matmul["state"] == "conflict"
        and "revert --only matmul-add-lora-linear" in matmul["reason"]["message"]
    )
    result = run_cli("revert", "--target", str(slim_tree_0260))
    assert result.exit_code == 0, result.output
    assert normalized(slim_tree_0260) == pristine


def test_the_upper_patch_of_a_stack_alone_is_applied_not_edited(tmp_path):
    tree = slim_tree(tmp_path / "site")
    catalogue = stacked_catalogue(tmp_path / "catalogue", release_tree("0.26.0"), independent=True)
    env = {"PATCHKIT_PATCHES_DIR": str(catalogue)}
    assert run_cli("apply", "--target", str(tree), "--only", "upper", env=env).exit_code == 0
    status = json.loads(run_cli("status", "--target", str(tree), "--json", env=env).stdout)
    states = {
        p["id"]: (p["state"], p["reason"] and p["reason"]["message"]) for p in status["patches"]
    }
    assert states["upper"][0] == "applied", states
    assert "revert it first" in states["lower"][1]
