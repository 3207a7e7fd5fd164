"""The reinstall a refusal names: the tree's own environment's pip, and where pip says the
tree came from (patchkit.vllmtree.reinstall)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from patchkit.fs.safepath import Root
from patchkit.vllmtree import reinstall
from tests.conftest import (
    CATALOGUE,
    WITHOUT_ROOTS_POWERS,
    run_cli,
    run_subprocess,
    slim_tree,
    snapshot,
)

UTILS = "vllm/lora/ops/triton_ops/utils.py"
DIST_INFO = "vllm-0.26.0.dist-info"
WHEEL = "https://example.org/wheels/vllm-0.26.0-cp38-abi3-manylinux1_x86_64.whl"


def tree_in_environment(tmp_path: Path, direct_url: dict | None = None) -> tuple[Path, Path]:
    """(site-packages holding the real slim 0.26.0 tree, its environment's python), the
    environment's path with a space and a '$' in it, as a shell would expand them."""
    env = tmp_path / "my env $HOME"
    site = env / "lib" / "python3.11" / "site-packages"
    slim_tree(site)
    python = env / "bin" / "python3.11"
    python.parent.mkdir(parents=True)
    python.write_text("")
    if direct_url is not None:
        (site / DIST_INFO / "direct_url.json").write_text(json.dumps(direct_url))
    return site, python


def named_reinstall(text: str) -> str:
    """The command in a message's "reinstall vLLM (`COMMAND`)", as printed."""
    found = re.search(r"reinstall vLLM \(`([^`]*)`", text)
    assert found, text
    return found.group(1)


def refused_reinstall(site: Path) -> list[str]:
    """apply on the tree with a line added to a file a patch changes (it differs from
    RECORD): refused, nothing changed; the reinstall it names, split as a shell would."""
    with (site / UTILS).open("a") as handle:
        handle.write("# a local note\n")
    before = snapshot(site)
    refused = run_cli("apply", "--target", str(site))
    assert refused.exit_code == 1 and snapshot(site) == before
    command = named_reinstall(refused.stderr)
    return shlex.split(command)


def test_a_tree_in_an_environment_is_reinstalled_by_that_environments_pip(tmp_path):
    """The pip first on PATH may be another environment's: the command names the tree's."""
    site, python = tree_in_environment(tmp_path)
    wanted = [str(python), "-m", "pip", "install", "--force-reinstall", "--no-deps"]
    assert refused_reinstall(site) == [*wanted, "vllm==0.26.0"]


def test_a_wheel_installed_from_a_url_is_reinstalled_from_it(tmp_path):
    """pip recorded the archive it installed (PEP 610): the index may not have that wheel."""
    site, python = tree_in_environment(tmp_path, {"url": WHEEL, "archive_info": {}})
    assert refused_reinstall(site)[-1] == WHEEL


def test_a_tree_outside_an_environment_names_pip_and_the_version(tmp_path):
    site = slim_tree(tmp_path / "t")
    assert refused_reinstall(site)[:2] == ["pip", "install"]
    assert refused_reinstall(site)[-1] == "vllm==0.26.0"


@pytest.mark.parametrize(
    ("record", "wanted"),
    [
        ({"url": WHEEL, "archive_info": {"hashes": {}}}, WHEEL),
        ({"url": "https://github.com/vllm-project/vllm",
          "vcs_info": {"vcs": "git", "commit_id": "0123abc"}},
         "git+https://github.com/vllm-project/vllm@0123abc"),
        ({"url": "https://github.com/vllm-project/vllm", "vcs_info": {"vcs": "git"}},
         "vllm==0.26.0"),
        ({"url": "file:///src/vllm", "dir_info": {"editable": True}}, "vllm==0.26.0"),
        ({"url": "file:///src/vllm", "dir_info": {}}, "vllm==0.26.0"),
        ({"url": 5, "archive_info": {}}, "vllm==0.26.0"),
        (["not", "an", "object"], "vllm==0.26.0"),
    ],
)  # fmt: skip
def test_what_pip_recorded_is_read_as_pep_610_says(tmp_path, record, wanted):
    (tmp_path / DIST_INFO).mkdir()
    (tmp_path / DIST_INFO / "direct_url.json").write_text(json.dumps(record))
    assert reinstall.installed_from(Root.open(tmp_path), DIST_INFO, "0.26.0") == wanted


@pytest.mark.parametrize("kind", ["missing", "garbage", "deep", "large", "link", "directory"])
def test_a_direct_url_that_cannot_be_read_names_the_index(tmp_path, kind):
    """Only advice: whatever is there, the requirement falls back to the version."""
    info = tmp_path / DIST_INFO
    info.mkdir()
    path = info / "direct_url.json"
    if kind == "garbage":
        path.write_bytes(b"\xff{")
    elif kind == "deep":
        path.write_text("[" * 60_000)
    elif kind == "large":
        path.write_text(json.dumps({"url": WHEEL, "archive_info": {}, "pad": "x" * 70_000}))
    elif kind == "link":
        (tmp_path / "elsewhere.json").write_text(json.dumps({"url": WHEEL, "archive_info": {}}))
        path.symlink_to(tmp_path / "elsewhere.json")
    elif kind == "directory":
        path.mkdir()
    assert reinstall.installed_from(Root.open(tmp_path), DIST_INFO, "0.26.0") == "vllm==0.26.0"


@pytest.mark.parametrize(
    "record",
    [
        {"url": "-rhttps://evil.example/requirements.txt", "archive_info": {}},
        {"url": "--index-url=https://evil.example/simple", "archive_info": {}},
        {"url": "https://github.com/vllm-project/vllm",
         "vcs_info": {"vcs": "-e git", "commit_id": "0123abc"}},
        {"url": "https://github.com/vllm-project/vllm",
         "vcs_info": {"vcs": "git", "commit_id": "0123abc -rhttps://evil.example/r.txt"}},
        {"url": WHEEL + ' ; python_version < "3"', "archive_info": {}},
        {"url": WHEEL + "\n\x1b[31mred\x00", "archive_info": {}},
        {"url": "https://example.org/\ud800.whl", "archive_info": {}},
    ],
)  # fmt: skip
def test_a_direct_url_that_is_no_plain_url_names_the_index(tmp_path, record):
    """direct_url.json is the tree's: an option where the URL goes (pip reads '-rURL' as a
    requirements file to fetch), a space (a marker that skips the install), or a character
    the terminal shows escaped is not what pip recorded; the index is named instead."""
    (tmp_path / DIST_INFO).mkdir()
    (tmp_path / DIST_INFO / "direct_url.json").write_text(json.dumps(record))
    assert reinstall.installed_from(Root.open(tmp_path), DIST_INFO, "0.26.0") == "vllm==0.26.0"


def test_the_printed_reinstall_runs_pip_on_one_requirement(tmp_path):
    """Pasted into a shell, the command is the environment's pip installing one
    requirement, never an option in its place."""
    record = {"url": "-rhttps://evil.example/requirements.txt", "archive_info": {}}
    site, python = tree_in_environment(tmp_path, record)
    wanted = [str(python), "-m", "pip", "install", "--force-reinstall", "--no-deps"]
    assert refused_reinstall(site) == [*wanted, "vllm==0.26.0"]


@pytest.mark.parametrize("damage", ["not-utf8", "not-csv", "not-a-sha256"])
def test_a_dist_info_patchkit_cannot_read_names_the_environments_pip(tmp_path, damage):
    """A RECORD patchkit cannot trust is refused before the tree is known, with the same
    reinstall as every refusal: the environment's pip and the release the dist-info is
    named after, never the pip on PATH and the newest vLLM ('vllm' alone, with --no-deps
    another release without its dependencies)."""
    site, python = tree_in_environment(tmp_path)
    record = site / DIST_INFO / "RECORD"
    text = record.read_bytes()
    if damage == "not-utf8":
        record.write_bytes(text + b"vllm/x.py,,\xff\n")
    elif damage == "not-csv":
        record.write_bytes(text + b"vllm/x.py," + b"x" * 200_000 + b"\n")
    else:
        record.write_bytes(re.sub(rb"sha256=[^,]*", b"sha256=zz", text, count=1))
    before = snapshot(site)
    result = run_cli("status", "--target", str(site))
    assert result.exit_code == 1 and snapshot(site) == before
    command = named_reinstall(result.stderr)
    wanted = [str(python), "-m", "pip", "install", "--force-reinstall", "--no-deps"]
    assert shlex.split(command) == [*wanted, "vllm==0.26.0"]


def test_a_journal_not_acted_on_names_the_environments_reinstall(tmp_path):
    """An invalid journal is refused with a reinstall: the environment's pip and this
    release, in the words and in --json, never the pip on PATH and the newest vLLM."""
    site, python = tree_in_environment(tmp_path)
    txn = site / ".patchkit" / "txn"
    txn.mkdir(parents=True)
    (txn / "journal.json").write_text(json.dumps({"state_sha256": "0" * 64, "files": 5}))
    before = snapshot(site)
    wanted = [str(python), "-m", "pip", "install", "--force-reinstall", "--no-deps"]
    refused = run_cli("apply", "--target", str(site))
    assert refused.exit_code == 1 and snapshot(site) == before
    command = named_reinstall(refused.stderr.replace("Reinstall vLLM", "reinstall vLLM"))
    assert shlex.split(command) == [*wanted, "vllm==0.26.0"]
    error = json.loads(run_cli("apply", "--json", "--target", str(site)).stdout)["error"]
    assert shlex.split(error["reinstall_command"]) == [*wanted, "vllm==0.26.0"]


def test_a_file_changed_since_an_interrupted_run_names_the_environments_reinstall(tmp_path):
    """A journal whose file is neither its before nor its after cannot be rolled back: the
    refusal names the environment's reinstall (the words and --json alike)."""
    site, python = tree_in_environment(tmp_path)
    txn = site / ".patchkit" / "txn"
    txn.mkdir(parents=True)
    entry = {"path": UTILS, "before": "1" * 64, "after": "2" * 64, "patches": ["expand-block-n"]}
    (txn / "journal.json").write_text(json.dumps({"state_sha256": "0" * 64, "files": [entry]}))
    before = snapshot(site)
    wanted = [str(python), "-m", "pip", "install", "--force-reinstall", "--no-deps"]
    refused = run_cli("apply", "--target", str(site))
    assert refused.exit_code == 1 and snapshot(site) == before
    assert "cannot be rolled back safely" in refused.stderr
    command = named_reinstall(refused.stderr)
    assert shlex.split(command) == [*wanted, "vllm==0.26.0"]
    error = json.loads(run_cli("apply", "--json", "--target", str(site)).stdout)["error"]
    assert shlex.split(error["reinstall_command"]) == [*wanted, "vllm==0.26.0"]


def test_an_environment_this_user_cannot_search_costs_only_the_advice(tmp_path):
    """The environment's bin/ another user's, closed to others (0700): patchkit cannot
    stat its python. status still reports the tree, apply refuses as it would, naming the
    pip on PATH; the advice never ended the run ('accessing .../bin/python3.11 failed:
    permission denied', exit 1 from status)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run patchkit without root's powers")
    site, python = tree_in_environment(tmp_path)
    with (site / UTILS).open("a") as handle:
        handle.write("# a local note\n")
    os.chown(python.parent, 65534, 65534)
    python.parent.chmod(0o700)
    before = snapshot(site)
    status = run_subprocess("status", "--json", "--target", str(site), prefix=WITHOUT_ROOTS_POWERS)
    if "setpriv" in status.stderr:
        pytest.skip(f"setpriv cannot drop root's powers here: {status.stderr.strip()}")
    assert status.returncode == 0, status.stderr
    assert '"reinstall_command": "pip install --force-reinstall --no-deps vllm==0.26.0"' in (
        status.stdout
    )
    applied = run_subprocess("apply", "--target", str(site), prefix=WITHOUT_ROOTS_POWERS)
    assert applied.returncode == 1 and "reinstall vLLM (`pip install" in applied.stderr
    assert snapshot(site) == before


def test_a_backup_of_another_release_names_the_reinstall_of_this_one(tmp_path):
    """revert --force on an edited file of a tree without a RECORD that now reports another
    version: the backup may be the old release's, so it is refused, naming the
    environment's reinstall of the release the tree reports now."""
    site, python = tree_in_environment(tmp_path)
    (site / DIST_INFO / "RECORD").unlink()  # no RECORD: the version alone vouches for it
    assert run_cli("apply", "--target", str(site)).exit_code == 0
    with (site / UTILS).open("a") as handle:
        handle.write("# a local note\n")
    metadata = site / DIST_INFO / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.26.0", "Version: 0.26.1"))
    before = snapshot(site)
    refused = run_cli("revert", "--force", "--target", str(site))
    assert refused.exit_code == 1 and snapshot(site) == before
    assert "applied to vLLM 0.26.0 and this tree reports 0.26.1" in refused.stderr
    wanted = [str(python), "-m", "pip", "install", "--force-reinstall", "--no-deps"]
    assert shlex.split(named_reinstall(refused.stderr)) == [*wanted, "vllm==0.26.1"]


def test_refresh_without_its_backup_names_the_environments_reinstall(tmp_path):
    """refresh makes the diff against the backup; one that is not the original any more
    is refused, naming the environment's reinstall (words and --json), nothing written."""
    catalogue = tmp_path / "patches"
    shutil.copytree(CATALOGUE.root, catalogue)
    env = {"PATCHKIT_PATCHES_DIR": str(catalogue)}
    site, python = tree_in_environment(tmp_path)
    args = ["--target", str(site)]
    assert run_cli("apply", *args, "--only", "expand-block-n", env=env).exit_code == 0
    with (site / UTILS).open("a") as handle:
        handle.write("# a local note\n")
    state = json.loads((site / ".patchkit" / "state.json").read_text())
    (patch,) = [p for p in state["patches"] if p["id"] == "expand-block-n"]
    (backup,) = [f["backup"] for f in patch["files"]]
    (site / ".patchkit" / backup).write_text("not the original\n")
    before, patches = snapshot(site), snapshot(catalogue)
    refused = run_cli("refresh", "expand-block-n", *args, env=env)
    assert refused.exit_code == 1, refused.output
    assert snapshot(site) == before and snapshot(catalogue) == patches
    wanted = [str(python), "-m", "pip", "install", "--force-reinstall", "--no-deps"]
    assert shlex.split(named_reinstall(refused.stderr)) == [*wanted, "vllm==0.26.0"]
    error = json.loads(run_cli("refresh", "expand-block-n", "--json", *args, env=env).stdout)
    assert shlex.split(error["error"]["reinstall_command"]) == [*wanted, "vllm==0.26.0"]
