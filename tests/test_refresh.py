"""`patchkit refresh`: diffs are made from trees, never kept by hand.

The drift test refreshes every variant of the shipped catalogue on the real
release tree it is made on (``made_on``) into a copy of the catalogue, and
fails on any byte of difference: what is committed is what refresh writes,
so a maintainer can edit a tree and refresh without a surprise. The other
tests walk the maintainer's loop (apply, edit, refresh) and its refusals.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.conftest import CATALOGUE, copy_tree, release_tree, run_cli, snapshot
from tests.helpers import stacked_catalogue

VARIANTS = [(p.id, v) for p in CATALOGUE.patches for v in p.variants]
# Each id carries the release the variant is made on, so `pytest -k 0.34.0` selects
# the refresh of every variant made on 0.34.0 with the rest of that release's tests.
VARIANT_IDS = [f"{p}/{v.name}@{v.made_on}" for p, v in VARIANTS]
UTILS = "vllm/lora/ops/triton_ops/utils.py"


def catalogue_copy(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "patches"
    shutil.copytree(CATALOGUE.root, root)
    return root, {"PATCHKIT_PATCHES_DIR": str(root)}


@pytest.mark.slow
@pytest.mark.parametrize("patch_id,variant", VARIANTS, ids=VARIANT_IDS)
def test_every_diff_is_what_refresh_makes_on_its_release(tmp_path, patch_id, variant):
    root, env = catalogue_copy(tmp_path)
    tree = copy_tree(variant.made_on, tmp_path / "site")
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0
    if CATALOGUE.get(patch_id).opt_in:  # plain apply leaves it out
        assert run_cli("apply", "--target", str(tree), "--only", patch_id, env=env).exit_code == 0
    result = run_cli("refresh", patch_id, "--target", str(tree), "--json", env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["variant"] == variant.name
    assert snapshot(root) == snapshot(CATALOGUE.root), f"{patch_id}/{variant.name} drifted"


@pytest.mark.slow
def test_edit_then_refresh_rewrites_the_diff_and_keeps_the_tree_applied(tmp_path):
    root, env = catalogue_copy(tmp_path)
    tree = copy_tree("0.26.0", tmp_path / "site")
    args = ["--target", str(tree)]
    assert run_cli("apply", *args, "--only", "expand-block-n", env=env).exit_code == 0
    path = tree / UTILS
    path.write_text(path.read_text().replace("Hopper takes 32", "Hopper takes 32 (edited)"))
    result = run_cli("refresh", "expand-block-n", *args, env=env)
    assert result.exit_code == 0, result.output
    assert "refresh: 1 diffed" in result.stdout
    diff = (root / "expand-block-n" / "block-k-32.diff").read_text()
    assert "+            # (vllm#48590, triton#9433). Hopper takes 32 (edited)" in diff
    status = json.loads(run_cli("status", *args, "--json", env=env).stdout)
    block_n = next(p for p in status["patches"] if p["id"] == "expand-block-n")
    assert block_n["state"] == "applied" and not block_n["warnings"]
    assert run_cli("revert", *args, env=env).exit_code == 0
    assert path.read_bytes() == (release_tree("0.26.0") / UTILS).read_bytes()
    fresh = copy_tree("0.26.0", tmp_path / "fresh")  # the edited patch applies on its own
    assert (
        run_cli("apply", "--target", str(fresh), "--only", "expand-block-n", env=env).exit_code == 0
    )
    assert "Hopper takes 32 (edited)" in (fresh / UTILS).read_text()


def test_a_created_file_edited_in_the_tree_goes_back_to_its_source(tmp_path):
    root, env = catalogue_copy(tmp_path)
    made_on = CATALOGUE.get("matmul-add-lora-linear").variants[0].made_on
    tree = copy_tree(made_on, tmp_path / "site")  # the diff's own release: only the file moves
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0
    created = "vllm/lora/punica_wrapper/patchkit_lora_matmul.py"
    (tree / created).write_text((tree / created).read_text() + "# edited in the tree\n")
    result = run_cli("refresh", "matmul-add-lora-linear", "--target", str(tree), env=env)
    assert result.exit_code == 0, result.output
    source = root / "matmul-add-lora-linear" / "files" / created
    assert source.read_text().endswith("# edited in the tree\n")
    assert (root / "matmul-add-lora-linear" / "torch-ops.diff").read_bytes() == (
        CATALOGUE.root / "matmul-add-lora-linear" / "torch-ops.diff"
    ).read_bytes()


@pytest.mark.slow
def test_refresh_refuses_a_patch_that_is_not_applied(tmp_path):
    root, env = catalogue_copy(tmp_path)
    tree = copy_tree("0.26.0", tmp_path / "site")
    result = run_cli("refresh", "expand-block-n", "--target", str(tree), env=env)
    assert result.exit_code == 1 and "is not applied" in result.stderr
    assert snapshot(root) == snapshot(CATALOGUE.root)


def test_refresh_not_applied_names_an_apply_a_shell_runs_as_written(tmp_path):
    """A copy of the real 0.26.0 tree under a directory whose name is shell code: the
    apply refresh names quotes it (it was pasted bare, and $(...) ran)."""
    root, env = catalogue_copy(tmp_path)
    tree = copy_tree("0.26.0", tmp_path / "$(touch PWNED) it's" / "site")
    result = run_cli("refresh", "expand-block-n", "--target", str(tree), env=env)
    assert result.exit_code == 1
    (command,) = re.findall(r"`([^`]+)`", result.stderr)
    assert shlex.split(command) == [
        "patchkit", "apply", "--only", "expand-block-n", "--target", str(tree)
    ]  # fmt: skip


@pytest.mark.slow
def test_refresh_refuses_a_patch_with_a_later_one_on_its_file(tmp_path):
    catalogue = stacked_catalogue(tmp_path / "catalogue", release_tree("0.26.0"))
    env = {"PATCHKIT_PATCHES_DIR": str(catalogue)}
    tree = copy_tree("0.26.0", tmp_path / "site")
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0
    before = snapshot(catalogue)
    result = run_cli("refresh", "lower", "--target", str(tree), env=env)
    assert result.exit_code == 1 and "upper, later in the series" in result.stderr
    assert snapshot(catalogue) == before
    assert run_cli("refresh", "upper", "--target", str(tree), env=env).exit_code == 0


@pytest.mark.slow
def test_refresh_add_puts_another_file_into_the_patch(tmp_path):
    root, env = catalogue_copy(tmp_path)
    tree = copy_tree("0.26.0", tmp_path / "site")
    args = ["--target", str(tree)]
    assert run_cli("apply", *args, "--only", "expand-block-n", env=env).exit_code == 0
    other = tree / "vllm/lora/ops/triton_ops/__init__.py"
    other.write_text(other.read_text() + "# patchkit test: added\n")
    pristine = ["--pristine", str(release_tree("0.26.0"))]
    result = run_cli("refresh", "expand-block-n", *args, "--add", str(other.relative_to(tree)),
                     *pristine, env=env)  # fmt: skip
    assert result.exit_code == 0, result.output
    diff = (root / "expand-block-n" / "block-k-32.diff").read_text()
    assert "+++ b/vllm/lora/ops/triton_ops/__init__.py" in diff
    assert run_cli("revert", *args, env=env).exit_code == 0
    assert snapshot(tree) == snapshot(copy_tree("0.26.0", tmp_path / "fresh"))


@pytest.mark.slow
def test_a_new_patch_is_made_from_edits_of_a_pristine_tree(tmp_path):
    """patch-package's way: declare the patch, edit a fetched tree, refresh with --add."""
    from tests.helpers import make_catalogue

    catalogue = make_catalogue(tmp_path / "catalogue", release_tree("0.26.0"), diff_text="")
    (catalogue / "two-files" / "two-files.diff").unlink()  # declared, not made yet
    env = {"PATCHKIT_PATCHES_DIR": str(catalogue)}
    tree = copy_tree("0.26.0", tmp_path / "site")
    status = json.loads(run_cli("status", "--target", str(tree), "--json", env=env).stdout)
    assert status["patches"][0]["state"] == "conflict"
    assert "not made yet" in status["patches"][0]["reason"]["message"]
    (tree / UTILS).write_text((tree / UTILS).read_text() + "# a new patch\n")
    made = run_cli("refresh", "two-files", "--variant", "only", "--add", UTILS, "--target",
                   str(tree), "--pristine", str(release_tree("0.26.0")), env=env)  # fmt: skip
    assert made.exit_code == 0, made.output
    assert "+# a new patch" in (catalogue / "two-files" / "two-files.diff").read_text()
    status = json.loads(run_cli("status", "--target", str(tree), "--json", env=env).stdout)
    assert status["patches"][0]["state"] == "applied"
    assert run_cli("revert", "--target", str(tree), env=env).exit_code == 0
    assert snapshot(tree) == snapshot(copy_tree("0.26.0", tmp_path / "fresh"))
    assert run_cli("apply", "--target", str(tree), env=env).exit_code == 0
    assert (tree / UTILS).read_text().endswith("# a new patch\n")
