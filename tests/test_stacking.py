"""Patches stack, as quilt's do: two patches on one real vLLM 0.26.0 file.

``lower`` and ``upper`` (tests/helpers.py) both edit
vllm/lora/ops/triton_ops/utils.py; ``upper``'s diff is made on ``lower``'s
result. Every test checks the file, the status of both, and that revert
gives the tree back byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import pytest

from tests.conftest import release_tree, run_cli, run_subprocess, slim_tree, snapshot
from tests.helpers import LOWER, STACKED_FILE, UPPER, stacked_catalogue


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, dict]:
    tree = slim_tree(tmp_path / "site")
    catalogue = stacked_catalogue(tmp_path / "catalogue", release_tree("0.26.0"))
    return tree, {"PATCHKIT_PATCHES_DIR": str(catalogue)}


def states(tree: Path, env: dict) -> dict[str, str]:
    result = run_cli("status", "--target", str(tree), "--json", env=env)
    assert result.exit_code == 0, result.output
    return {p["id"]: p["state"] for p in json.loads(result.stdout)["patches"]}


def text(tree: Path) -> str:
    return (tree / STACKED_FILE).read_text()


def test_both_apply_in_series_order_and_revert_byte_identical(pair):
    tree, env = pair
    pristine = snapshot(tree)
    assert states(tree, env) == {"lower": "needed", "upper": "needed"}  # upper seen on lower
    result = run_cli("apply", "--target", str(tree), env=env)
    assert result.exit_code == 0, result.output
    assert text(tree).count(LOWER + UPPER) == 1
    assert states(tree, env) == {"lower": "applied", "upper": "applied"}
    recorded = json.loads((tree / ".patchkit/state.json").read_text())["patches"]
    lower, upper = ({r["id"]: r for r in recorded}[i]["files"][0] for i in ("lower", "upper"))
    assert lower["post_sha256"] == upper["pre_sha256"]  # upper recorded on lower's result
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0  # no-op
    result = run_cli("revert", "--target", str(tree), env=env)
    assert result.exit_code == 0, result.output
    assert snapshot(tree) == pristine


def test_one_at_a_time_and_off_from_the_top(pair):
    tree, env = pair
    pristine = snapshot(tree)
    assert run_cli("apply", "--target", str(tree), "--only", "lower", env=env).exit_code == 0
    assert states(tree, env) == {"lower": "applied", "upper": "needed"}
    assert run_cli("apply", "--target", str(tree), "--only", "upper", env=env).exit_code == 0
    assert states(tree, env) == {"lower": "applied", "upper": "applied"}
    both = snapshot(tree)

    refused = run_cli("revert", "--target", str(tree), "--only", "lower", env=env)
    assert refused.exit_code == 1
    assert "upper is applied on top of it" in refused.stderr
    assert "patchkit revert --only upper --only lower" in refused.stderr
    assert snapshot(tree) == both

    assert run_cli("revert", "--target", str(tree), "--only", "upper", env=env).exit_code == 0
    assert states(tree, env) == {"lower": "applied", "upper": "needed"}
    assert LOWER in text(tree) and UPPER not in text(tree)
    assert run_cli("revert", "--target", str(tree), "--only", "lower", env=env).exit_code == 0
    assert snapshot(tree) == pristine


def test_upper_alone_needs_lower_underneath(pair):
    tree, env = pair
    before = snapshot(tree)
    result = run_cli("apply", "--target", str(tree), "--only", "upper", env=env)
    assert result.exit_code == 1
    assert "upper: conflict" in result.stderr and STACKED_FILE in result.stderr
    assert snapshot(tree) == before


def test_a_lower_patch_is_not_slid_under_an_applied_upper_one(tmp_path):
    """Independent hunks: upper applies alone, but lower may not go in below it afterwards."""
    tree = slim_tree(tmp_path / "site")
    catalogue = stacked_catalogue(tmp_path / "cat", release_tree("0.26.0"), independent=True)
    env = {"PATCHKIT_PATCHES_DIR": str(catalogue)}
    assert run_cli("apply", "--target", str(tree), "--only", "upper", env=env).exit_code == 0
    before = snapshot(tree)
    result = run_cli("apply", "--target", str(tree), "--only", "lower", env=env)
    assert result.exit_code == 1
    assert "upper, later in the series, is applied" in result.stderr
    assert snapshot(tree) == before
    assert run_cli("revert", "--target", str(tree), env=env).exit_code == 0
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0  # now in order
    assert text(tree).index(LOWER) < text(tree).index(UPPER)


def test_an_edit_on_top_of_the_stack_is_a_conflict_of_the_top_patch(pair):
    tree, env = pair
    pristine = snapshot(tree)
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0
    path = tree / STACKED_FILE
    path.write_text(path.read_text() + "# a local edit\n")
    status = json.loads(run_cli("status", "--target", str(tree), "--json", env=env).stdout)
    reasons = {
        p["id"]: (p["state"], (p["reason"] or {}).get("message", "")) for p in status["patches"]
    }
    assert reasons["lower"][0] == "conflict" and reasons["upper"][0] == "conflict"
    assert "edited after patchkit applied upper" in reasons["lower"][1]
    edited = snapshot(tree)
    refused = run_cli("revert", "--target", str(tree), env=env)
    assert refused.exit_code == 1 and "--force" in refused.stderr
    assert snapshot(tree) == edited
    assert run_cli("revert", "--target", str(tree), "--force", env=env).exit_code == 0
    assert snapshot(tree) == pristine


def test_a_reinstalled_vllm_under_a_stale_stack_is_decided_by_content(pair):
    tree, env = pair
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0
    (tree / STACKED_FILE).write_bytes((release_tree("0.26.0") / STACKED_FILE).read_bytes())
    assert states(tree, env) == {"lower": "needed", "upper": "needed"}
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0
    assert states(tree, env) == {"lower": "applied", "upper": "applied"}


CRASH_AT_STATE_WRITE = """
import os, patchkit.fs.safepath as s
_real = s.Root.write
def _crash(self, relpath, data, origin):
    if relpath.endswith("state.json"):
        os._exit(137)  # killed after the file write, before the commit point
    _real(self, relpath, data, origin)
s.Root.write = _crash
"""


def test_a_crash_mid_apply_of_the_pair_is_rolled_back(pair):
    tree, env = pair
    pristine = snapshot(tree)
    crashed = run_subprocess("apply", "--target", str(tree), env=env, code=CRASH_AT_STATE_WRITE)
    assert crashed.returncode == 137
    assert LOWER in text(tree)  # the merged write of both patches happened
    assert run_cli("revert", "--target", str(tree), env=env).exit_code == 0
    assert snapshot(tree) == pristine
    crashed = run_subprocess("apply", "--target", str(tree), env=env, code=CRASH_AT_STATE_WRITE)
    assert crashed.returncode == 137
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0
    assert states(tree, env) == {"lower": "applied", "upper": "applied"}


@pytest.mark.slow
def test_concurrent_runs_on_the_pair_serialise(pair):
    tree, env = pair
    pristine = snapshot(tree)
    command = [sys.executable, "-m", "patchkit", "apply", "--target", str(tree)]
    runs = [
        subprocess.Popen(command, env={**os.environ, **env}, text=True, stdout=PIPE, stderr=PIPE)
        for _ in range(4)
    ]
    for run in runs:
        run.wait(timeout=120)
        assert run.returncode == 0, run.stderr.read()
    assert states(tree, env) == {"lower": "applied", "upper": "applied"}
    assert text(tree).count(LOWER) == 1 and text(tree).count(UPPER) == 1
    assert run_cli("revert", "--target", str(tree), env=env).exit_code == 0
    assert snapshot(tree) == pristine
