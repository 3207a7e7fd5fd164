"""Hostile round two (issue 18): each reproduction of the attack report, as a test.

Each test plants what an attacker, a bad environment or a reinstall would, on
a copy of a real vLLM tree, and checks that patchkit never changes anything
outside the tree, never loses the user's vLLM, never hangs and never prints a
traceback. The numbers in the test names are the report's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, copy_tree, git, release_tree, run_cli, snapshot
from tests.helpers import stacked_catalogue
from tests.test_hostile import one_line_failure
from tests.test_write_points import normalized, slim_tree

UTILS = "vllm/lora/ops/triton_ops/utils.py"
PUNICA = "vllm/lora/punica_wrapper/punica_gpu.py"
CREATED = "vllm/lora/punica_wrapper/patchkit_lora_matmul.py"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def patchkit(*args: str, env: dict | None = None, timeout: float = 60, code: str = ""):
    """patchkit in a child Python (a hang fails the test instead of stopping the suite)."""
    prelude = code + "\nfrom patchkit.cli.entry import main\nmain()\n"
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", prelude, *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def one_line(result, code: int = 1) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.strip().splitlines() if not ln.startswith("known issue")]
    assert len(lines) == 1 and lines[0].startswith("patchkit: error:"), result.stderr
    return lines[0]


@pytest.fixture
def slim(tmp_path: Path) -> Path:
    return slim_tree(tmp_path / "t")


# ----- 2. a directory swapped for a link between the check and the write -----

RENAME_EXCHANGE = 2

# utils.py's temporary file is opened three times: for the journal's copy, the
# backup, then the tree's own file, whose path was checked just before. The swap
# goes between that check and that open.
SWAP_AT_WRITE = r"""
import ctypes, os, sys
_libc = ctypes.CDLL(None, use_errno=True)
_seen = []
def _hook(event, args):
    if event == "open" and str(args[0]).endswith(".utils.py.patchkit-tmp"):
        _seen.append(1)
        if len(_seen) != 3:
            return
        ops = {ops!r}
        if _libc.renameat2(-100, (ops + "/triton_ops").encode(), -100,
                           (ops + "/swapped").encode(), 2) != 0:
            raise OSError(ctypes.get_errno(), "renameat2")
sys.addaudithook(_hook)
"""


def test_2_a_directory_swapped_for_a_link_mid_write_never_redirects_it(tmp_path, slim):
    victim = tmp_path / "V"
    victim.mkdir()
    (victim / "mine.txt").write_text("precious\n")
    ops = slim / "vllm/lora/ops"
    (ops / "swapped").symlink_to(victim)  # exchanged with triton_ops (renameat2) mid-write
    before = snapshot(victim)
    hook = SWAP_AT_WRITE.replace("{ops!r}", repr(str(ops)))
    result = patchkit("apply", "--target", str(slim), code=hook)
    assert (ops / "triton_ops").is_symlink(), "the swap did not happen"
    assert snapshot(victim) == before, "a write went through the link"
    assert "Traceback" not in result.stderr
    # the write went where the walk had opened: the real directory, now named "swapped"
    assert "block_n" in (ops / "swapped" / "utils.py").read_text()
    assert (ops / "swapped" / "utils.py").read_bytes() != (
        release_tree("0.26.0") / UTILS
    ).read_bytes()


# ----- 3 and 6. caches: mounts, links above the last component, absent caches -----


def clear(tree: Path, home: Path, **env: str) -> dict:
    full = {"HOME": str(home), "XDG_CACHE_HOME": "", **env}
    result = patchkit("apply", "--target", str(tree), "--clear-caches", "--json", env=full)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is True
    return {c["name"].split()[0]: c for c in data["caches_removed"]}


@pytest.fixture
def bind_mount(tmp_path):
    mounts = []

    def mount(source: Path, target: Path) -> None:
        done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot bind-mount here (needs root): {done.stderr.decode().strip()}")
        mounts.append(target)

    yield mount
    for target in mounts:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_3_clear_caches_never_crosses_a_bind_mount(tmp_path, slim, bind_mount):
    victim = tmp_path / "data"  # files only: Triton's layout, so only the mount check stops it
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work\n")
    cache = tmp_path / "triton"
    hashed = cache / ("A" * 52)
    hashed.mkdir(parents=True)
    bind_mount(victim, hashed)
    (cache / ("B" * 52)).mkdir()
    home = tmp_path / "home"
    home.mkdir()
    triton = clear(slim, home, TRITON_CACHE_DIR=str(cache))["Triton"]
    assert triton["removed"] is False and "mount point" in triton["reason"], triton
    assert (victim / "thesis.tex").read_text() == "years of work\n"
    assert (cache / ("B" * 52)).is_dir()  # refused as a whole: nothing was removed


def test_6_cache_links_above_the_last_component_are_not_followed(tmp_path, slim):
    real = tmp_path / "real"
    kernel = real / "cache" / ("C" * 52) / "k.cubin"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"k")
    (tmp_path / "up").symlink_to(real)  # TRITON_CACHE_DIR=<tmp>/up/cache: a link above it
    vllm_real = tmp_path / "vllm-real" / "torch_compile_cache" / ("d" * 10)
    vllm_real.mkdir(parents=True)
    (vllm_real / "graph").write_bytes(b"g")
    (tmp_path / "vllm-link").symlink_to(tmp_path / "vllm-real")  # VLLM_CACHE_ROOT a link
    home = tmp_path / "home"
    home.mkdir()
    found = clear(
        slim,
        home,
        TRITON_CACHE_DIR=str(tmp_path / "up" / "cache"),
        VLLM_CACHE_ROOT=str(tmp_path / "vllm-link"),
    )
    for name in ("Triton", "vLLM"):
        assert found[name]["removed"] is False and "symbolic link" in found[name]["reason"]
    assert kernel.read_bytes() == b"k" and (vllm_real / "graph").read_bytes() == b"g"


def test_6_an_absent_cache_is_not_reported_as_cleared(tmp_path, slim):
    home = tmp_path / "home"
    home.mkdir()
    found = clear(slim, home, TRITON_CACHE_DIR=str(tmp_path / "nowhere"))
    assert found["Triton"]["removed"] is False and found["Triton"]["state"] == "absent"
    assert found["vLLM"]["state"] == "absent"


# ----- 5. forged state and journal entries -----


def test_5_a_forged_state_entry_for_a_file_no_diff_touches_is_refused(slim):
    assert run_cli("apply", "--target", str(slim)).exit_code == 0
    state_file = slim / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    init = slim / "vllm/__init__.py"
    forged = {"path": "vllm/__init__.py", "pre_sha256": None, "post_sha256": sha(init),
              "backup": None}  # fmt: skip
    data["patches"][0]["files"].append(forged)
    state_file.write_text(json.dumps(data))
    before = snapshot(slim)
    for command in ("revert", "apply", "status"):
        line = one_line_failure(run_cli(command, "--target", str(slim)))
        assert "not acted on" in line and "vllm/__init__.py" in line
    assert snapshot(slim) == before and init.is_file()


@pytest.mark.parametrize("names_patches", [False, True])
def test_5_a_journal_entry_with_before_null_for_a_foreign_file_is_refused(slim, names_patches):
    """``before: null`` means "the run created it": rolling back would delete the file."""
    init = slim / "vllm/__init__.py"
    txn = slim / ".patchkit" / "txn"
    txn.mkdir(parents=True)
    entry = {"path": "vllm/__init__.py", "before": None, "after": sha(init)}
    if names_patches:
        entry["patches"] = ["expand-block-n"]  # a real patch, whose diffs never touch it
    (txn / "journal.json").write_text(json.dumps({"state_sha256": "0" * 64, "files": [entry]}))
    before = snapshot(slim)
    for command in ("apply", "revert"):
        line = one_line_failure(run_cli(command, "--target", str(slim)))
        assert "journal" in line and "not acted on" in line
    assert snapshot(slim) == before and init.is_file()


# ----- 7 and 11. reinstalls of another or the same release -----


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


def test_7_after_a_reinstall_as_another_release_no_backup_goes_over_its_files(tmp_path):
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
    assert matmul["state"] == "conflict" and "patchkit revert --only" in matmul["reason"]
    assert run_cli("revert", "--target", str(tree)).exit_code == 0
    assert not (tree / CREATED).exists() and not (tree / ".patchkit").exists()
    fresh = copy_tree("0.21.0", tmp_path / "fresh")
    assert snapshot(tree / "vllm") == snapshot(fresh / "vllm")


def test_11_a_reinstall_of_the_same_release_leaves_no_state_behind(slim):
    pristine = normalized(slim)
    assert run_cli("apply", "--target", str(slim)).exit_code == 0
    source = release_tree("0.26.0")
    for relpath in (UTILS, PUNICA, "vllm/lora/layers/base.py",
                    "vllm/lora/layers/column_parallel_linear.py"):  # fmt: skip
        (slim / relpath).write_bytes((source / relpath).read_bytes())
    (slim / CREATED).unlink()
    result = run_cli("revert", "--target", str(slim))
    assert result.exit_code == 0, result.output
    assert "dropped the stale record" in result.stdout
    assert not (slim / ".patchkit").exists()
    assert normalized(slim) == pristine


def test_11_an_unknown_patch_in_the_state_is_reported_not_acted_on(slim):
    assert run_cli("apply", "--target", str(slim), "--only", "expand-block-n").exit_code == 0
    state_file = slim / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    ghost = json.loads(json.dumps(data["patches"][0]))
    ghost["id"] = "ghost"
    ghost["files"][0]["backup"] = f"backups/ghost/{UTILS}"
    data["patches"].append(ghost)  # claims utils.py, which still holds what it "wrote"
    state_file.write_text(json.dumps(data))
    status = run_cli("status", "--target", str(slim))
    assert "'ghost', which this patchkit does not know" in status.stderr
    before = snapshot(slim)
    line = one_line_failure(run_cli("revert", "--target", str(slim)))
    assert "'ghost'" in line and "nothing was changed" in line
    assert snapshot(slim) == before


def test_11_an_unknown_patch_whose_files_are_back_is_dropped(slim):
    pristine = normalized(slim)
    assert run_cli("apply", "--target", str(slim), "--only", "expand-block-n").exit_code == 0
    state_file = slim / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    data["patches"][0]["id"] = "ghost"  # a patch a newer patchkit applied, since undone
    data["patches"][0]["files"][0]["backup"] = f"backups/ghost/{UTILS}"
    state_file.write_text(json.dumps(data))
    (slim / UTILS).write_bytes((release_tree("0.26.0") / UTILS).read_bytes())
    shutil.move(slim / ".patchkit/backups/expand-block-n", slim / ".patchkit/backups/ghost")
    assert run_cli("revert", "--target", str(slim)).exit_code == 0
    assert not (slim / ".patchkit").exists() and normalized(slim) == pristine


def test_11_the_upper_patch_of_a_stack_alone_is_applied_not_edited(tmp_path):
    tree = copy_tree("0.26.0", tmp_path / "site")
    catalogue = stacked_catalogue(tmp_path / "catalogue", release_tree("0.26.0"), independent=True)
    env = {"PATCHKIT_PATCHES_DIR": str(catalogue)}
    assert run_cli("apply", "--target", str(tree), "--only", "upper", env=env).exit_code == 0
    status = json.loads(run_cli("status", "--target", str(tree), "--json", env=env).stdout)
    states = {p["id"]: (p["state"], p["reason"]) for p in status["patches"]}
    assert states["upper"][0] == "applied", states
    assert "revert it first" in states["lower"][1]


# ----- 8. a file patchkit created, deleted by hand -----


def test_8_a_deleted_created_file_is_no_dead_end(slim):
    pristine = normalized(slim)
    assert run_cli("apply", "--target", str(slim)).exit_code == 0
    (slim / CREATED).unlink()
    status = json.loads(run_cli("status", "--target", str(slim), "--json").stdout)
    matmul = next(p for p in status["patches"] if p["id"] == "matmul-add-lora-linear")
    assert (
        matmul["state"] == "conflict" and "revert --only matmul-add-lora-linear" in matmul["reason"]
    )
    result = run_cli("revert", "--target", str(slim))
    assert result.exit_code == 0, result.output
    assert normalized(slim) == pristine


# ----- 9. failures after the commit are warnings, with the patches applied -----


def test_9_bytecode_that_cannot_be_removed_is_a_warning_after_the_commit(slim, monkeypatch):
    pycache = slim / "vllm/lora/ops/triton_ops/__pycache__"
    pycache.mkdir()
    (pycache / "utils.cpython-312.pyc").write_bytes(b"stale")
    real_unlink = os.unlink

    def refusing(path, *args, **kwargs):
        if str(path).endswith(".pyc"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refusing)
    result = run_cli("apply", "--target", str(slim), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True
    assert {p["action"] for p in data["patches"]} >= {"applied"}
    assert any("utils.cpython-312.pyc could not be removed" in w for w in data["warnings"])


def test_9_an_over_long_cache_name_names_the_variable(tmp_path, slim):
    home = tmp_path / "home"
    home.mkdir()
    found = clear(slim, home, TRITON_CACHE_DIR=str(tmp_path / ("x" * 300)))
    assert found["Triton"]["removed"] is False
    assert "TRITON_CACHE_DIR" in found["Triton"]["reason"]
    assert "--target" not in found["Triton"]["reason"]
    assert (
        json.loads(run_cli("status", "--target", str(slim), "--json").stdout)["patches"][0]["state"]
        == "applied"
    )


# ----- 10. fork mode: exactly as before on any git failure -----

GIT_ENV = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
IDENTITY = {
    **GIT_ENV,
    **{f"GIT_{who}_NAME": "Fork Dev" for who in ("AUTHOR", "COMMITTER")},
    **{f"GIT_{who}_EMAIL": "dev@example.invalid" for who in ("AUTHOR", "COMMITTER")},
}
NO_IDENTITY = {
    **GIT_ENV,
    "GIT_CONFIG_COUNT": "1",
    "GIT_CONFIG_KEY_0": "user.useConfigOnly",
    "GIT_CONFIG_VALUE_0": "true",
}


def git_state(root: Path) -> tuple:
    return (
        git(root, "rev-parse", "HEAD"),
        git(root, "branch", "--show-current"),
        git(root, "branch", "--list"),
        git(root, "status", "--porcelain", "--ignored"),
        snapshot(root / "vllm"),
        git(
            root, "ls-files", "--stage"
        ),  # the index's entries (git status refreshes its stat data)
    )


def test_10_fork_mode_without_a_git_identity_changes_nothing(checkout):
    before = git_state(checkout)
    line = one_line(patchkit("apply", "--target", str(checkout), env=NO_IDENTITY))
    assert "user.name" in line and "user.email" in line and "nothing was changed" in line
    assert git_state(checkout) == before and not (checkout / ".patchkit").exists()


def reject_commits(root: Path) -> None:
    hook = root / ".git" / "hooks" / "pre-commit"
    hook.write_text("#!/bin/sh\necho 'policy: no commits on Fridays' >&2\nexit 1\n")
    hook.chmod(0o755)


def test_10_a_rejecting_pre_commit_hook_leaves_the_checkout_as_before(checkout):
    reject_commits(checkout)
    before = git_state(checkout)
    line = one_line(patchkit("apply", "--target", str(checkout), env=IDENTITY))
    assert "no commits on Fridays" in line and "as before" in line
    assert git_state(checkout) == before and not (checkout / ".patchkit").exists()


def test_10_a_rejecting_hook_during_revert_leaves_the_checkout_as_before(checkout):
    assert patchkit("apply", "--target", str(checkout), env=IDENTITY).returncode == 0
    reject_commits(checkout)
    before = git_state(checkout)
    state = (checkout / ".patchkit" / "state.json").read_bytes()
    line = one_line(patchkit("revert", "--target", str(checkout), env=IDENTITY))
    assert "no commits on Fridays" in line
    assert git_state(checkout) == before
    assert (checkout / ".patchkit" / "state.json").read_bytes() == state


def test_10_an_invalid_branch_name_is_a_usage_error(checkout):
    before = git_state(checkout)
    line = one_line(
        patchkit("apply", "--target", str(checkout), "--branch", "bad..name", env=IDENTITY), code=2
    )
    assert "bad..name" in line
    assert git_state(checkout) == before


# ----- 12. no tracebacks, no exit 3 -----


def test_12_a_5000_digit_version_is_a_usage_error(slim):
    result = patchkit("status", "--target", str(slim), "--vllm-version", "1" * 5000, "--json")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert json.loads(result.stdout)["ok"] is False


INTERRUPT_AT_IMPORT = """
import sys
def _hook(event, args):
    if event == "import" and args[0] == "click":
        raise KeyboardInterrupt
sys.addaudithook(_hook)
"""


def test_12_ctrl_c_while_starting_is_one_line(slim):
    one_line(patchkit("status", "--target", str(slim), code=INTERRUPT_AT_IMPORT), code=130)


def break_dist_info(tree: Path, how: str) -> None:
    dist_info = next(tree.glob("vllm-*.dist-info"))
    record, metadata = dist_info / "RECORD", dist_info / "METADATA"
    if how == "short-hash":
        lines = record.read_text().splitlines()
        lines[0] = lines[0].split(",")[0] + ",sha256=a,1"
        record.write_text("\n".join(lines) + "\n")
    elif how == "record-not-utf8":
        record.write_bytes(record.read_bytes() + b"vllm/\xff\xfe.py,sha256=x,1\n")
    elif how == "metadata-not-utf8":
        metadata.write_bytes(b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\nSummary: \xff\n")
    elif how == "huge-field":
        record.write_text(record.read_text() + "vllm/" + "x" * (128 * 1024 + 10) + ",,\n")
    elif how == "long-version":
        text = metadata.read_text().replace("Version: 0.26.0", "Version: " + "1" * 5000, 1)
        metadata.write_text(text)


@pytest.mark.parametrize(
    "how", ["short-hash", "record-not-utf8", "metadata-not-utf8", "huge-field", "long-version"]
)
def test_12_a_broken_dist_info_is_one_line_naming_it(slim, how):
    break_dist_info(slim, how)
    before = snapshot(slim)
    for command in ("status", "apply", "revert"):
        line = one_line(patchkit(command, "--target", str(slim)))
        assert "dist-info" in line, line
    assert snapshot(slim) == before


NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("where", ["state", "journal"])
def test_12_deeply_nested_json_is_one_line(slim, where):
    directory = slim / ".patchkit" / ("txn" if where == "journal" else "")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ("journal.json" if where == "journal" else "state.json")).write_text(NESTED)
    before = snapshot(slim)
    for command in ("apply", "revert"):
        line = one_line(patchkit(command, "--target", str(slim)))
        assert "nested too deeply" in line and "not acted on" in line
    assert snapshot(slim) == before


def test_12_a_deeply_nested_tuned_config_is_a_finding(tmp_path, slim):
    folder = tmp_path / "tuned"
    folder.mkdir()
    (folder / "NVIDIA_H200_EXPAND_TRUE.json").write_text(NESTED)
    result = patchkit("doctor", "--target", str(slim), "--json",
                      env={"VLLM_TUNED_CONFIG_FOLDER": str(folder)})  # fmt: skip
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "nested too deeply" in result.stdout


# ----- 13. FIFOs never hang a command -----


def test_13_a_fifo_in_place_of_a_patched_file(slim):
    (slim / UTILS).unlink()
    os.mkfifo(slim / UTILS)
    for command in ("status", "apply", "revert"):
        line = one_line(patchkit(command, "--target", str(slim), timeout=30))
        assert "a FIFO" in line and UTILS in line


CRASH_AT_STATE = """
import os, patchkit.fs.safepath as s
_real = s.Root.write
def _crash(self, relpath, data, origin):
    if relpath.endswith("state.json"):
        os._exit(137)
    _real(self, relpath, data, origin)
s.Root.write = _crash
"""


def test_13_a_fifo_in_the_journal_copy(slim):
    assert patchkit("apply", "--target", str(slim), code=CRASH_AT_STATE).returncode == 137
    orig = slim / ".patchkit/txn/orig" / UTILS
    orig.unlink()
    os.mkfifo(orig)
    for command in ("apply", "revert"):
        line = one_line(patchkit(command, "--target", str(slim), timeout=30))
        assert "a FIFO" in line


def test_13_a_fifo_in_the_tuned_config_folder(tmp_path, slim):
    folder = tmp_path / "tuned"
    folder.mkdir()
    os.mkfifo(folder / "NVIDIA_H200_EXPAND_TRUE.json")
    result = patchkit("doctor", "--target", str(slim), "--json", timeout=30,
                      env={"VLLM_TUNED_CONFIG_FOLDER": str(folder)})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "a FIFO, not a regular file" in result.stdout


def test_11_revert_only_never_restores_under_a_patch_this_patchkit_lacks(slim):
    """Attack round three M1: a newer patchkit's patch stacked on expand-block-n's file."""
    assert run_cli("apply", "--target", str(slim), "--only", "expand-block-n").exit_code == 0
    state_file = slim / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    lower = data["patches"][0]["files"][0]
    newer = (slim / UTILS).read_text() + "# future-fix\n"
    (slim / UTILS).write_text(newer)
    backup = slim / ".patchkit" / "backups" / "future-fix" / UTILS
    backup.parent.mkdir(parents=True)
    backup.write_bytes((slim / UTILS).read_bytes()[: -len("# future-fix\n")])
    future = {"id": "future-fix", "patch_sha256": "0" * 64, "variant": "v", "applied_at": "x",
              "files": [{"path": UTILS, "pre_sha256": lower["post_sha256"],
                         "post_sha256": sha(slim / UTILS),
                         "backup": f"backups/future-fix/{UTILS}"}]}  # fmt: skip
    data["patches"].append(future)
    state_file.write_text(json.dumps(data))
    before = snapshot(slim)
    result = run_cli("revert", "--target", str(slim), "--only", "expand-block-n")
    assert result.exit_code == 1 and "future-fix" in result.stderr
    assert snapshot(slim) == before
    status = json.loads(run_cli("status", "--target", str(slim), "--json").stdout)
    assert "revert --only" not in json.dumps(status)  # no advice to force a revert here
    assert any("'future-fix', which this patchkit does not know" in w for w in status["warnings"])


# ----- round three: what the attacker found in the fixes above -----


def test_a_directory_of_docker_containers_is_not_a_triton_cache(tmp_path, slim):
    containers = tmp_path / "containers"
    secret = containers / ("c" * 64) / "mounts" / "secrets"
    secret.parent.mkdir(parents=True)
    secret.write_text("pw\n")
    project = tmp_path / "proj" / "torch_compile_cache" / "deadbeef00" / "src"
    project.mkdir(parents=True)
    (project / "main.py").write_text("print('mine')\n")
    home = tmp_path / "home"
    home.mkdir()
    found = clear(slim, home, TRITON_CACHE_DIR=str(containers),
                  VLLM_CACHE_ROOT=str(tmp_path / "proj"))  # fmt: skip
    assert found["Triton"]["state"] == "left-alone" and found["vLLM"]["state"] == "left-alone"
    assert secret.read_text() == "pw\n" and (project / "main.py").is_file()


def test_a_bind_mount_in_the_state_directory_is_refused_before_anything(tmp_path, slim,
                                                                        bind_mount):  # fmt: skip
    assert run_cli("apply", "--target", str(slim), "--only", "expand-block-n").exit_code == 0
    user = tmp_path / "u"
    (user / "sub").mkdir(parents=True)
    (user / "a").write_text("x\n")
    (user / "sub" / "b").write_text("y\n")
    inside = slim / ".patchkit" / "backups" / "expand-block-n" / "vllm" / "extra"
    inside.mkdir()
    bind_mount(user, inside)
    before = snapshot(user)
    for command in ("apply", "revert"):
        line = one_line(patchkit(command, "--target", str(slim)))
        assert "is a mount point" in line
    assert snapshot(user) == before


def test_fork_mode_never_writes_through_links_in_dot_git(tmp_path, checkout):
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    exclude = checkout / ".git" / "info" / "exclude"
    exclude.unlink(missing_ok=True)
    exclude.symlink_to(victim)
    line = one_line(patchkit("apply", "--target", str(checkout), env=IDENTITY))
    assert "symbolic link" in line
    assert victim.read_text() == "mine\n"


def test_a_fifo_in_dot_git_is_refused_not_waited_on(checkout):
    exclude = checkout / ".git" / "info" / "exclude"
    exclude.unlink(missing_ok=True)
    os.mkfifo(exclude)
    line = one_line(patchkit("apply", "--target", str(checkout), "--allow-dirty",
                             env=IDENTITY, timeout=30))  # fmt: skip
    assert "a FIFO" in line


SIGNAL_PARENT_HOOK = """#!/bin/sh
# SIGTERM to patchkit (git's parent) while this commit runs; the commit then succeeds.
kill -TERM $(ps -o ppid= -p $PPID)
sleep 1
exit 0
"""


def test_a_signal_during_git_commit_leaves_no_commit_behind(checkout):
    hook = checkout / ".git" / "hooks" / "pre-commit"
    hook.write_text(SIGNAL_PARENT_HOOK)
    hook.chmod(0o755)
    before = git_state(checkout)
    result = patchkit("apply", "--target", str(checkout), env=IDENTITY, timeout=60)
    assert result.returncode == 143, result.stderr
    import time

    time.sleep(2)  # had git gone on alone, its commit would land now
    assert git_state(checkout) == before and not (checkout / ".patchkit").exists()


def test_fetch_staging_cleanup_removes_the_marker_last(tmp_path):
    from patchkit.releases.fetch import STAGING_MARKER, _empty_staging

    staging = tmp_path / ".vllm-0.26.0-x"
    (staging / "tree" / "vllm").mkdir(parents=True)
    (staging / "vllm-0.26.0.whl").write_bytes(b"w" * 10)
    (staging / STAGING_MARKER).write_text('{"pid": 1}')
    order = []
    real_unlink = os.unlink

    def recording(name, *args, **kwargs):
        order.append(str(name))
        return real_unlink(name, *args, **kwargs)

    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.unlink = recording
        _empty_staging(fd, staging)
    finally:
        os.unlink = real_unlink
        os.close(fd)
    assert order[-1] == STAGING_MARKER and list(staging.iterdir()) == []


def test_a_marker_with_an_impossible_pid_is_a_dead_fetch(tmp_path):
    cache = tmp_path / "cache"
    tree = copy_tree("0.26.0", cache / "trees" / "vllm-0.26.0")
    stale = cache / "trees" / ".vllm-x"
    stale.mkdir()
    (stale / ".patchkit-staging").write_text('{"pid": 4294967296}')
    result = run_cli("fetch", "0.26.0", "--json", env={"PATCHKIT_CACHE_DIR": str(cache)})
    assert result.exit_code == 0, result.output
    assert not stale.exists() and tree.is_dir()


def test_a_read_only_pristine_tree_is_a_no_op_for_revert(tmp_path, slim, bind_mount):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    bind_mount(slim, read_only)
    remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(read_only)],
                             capture_output=True)  # fmt: skip
    if remount.returncode != 0:
        pytest.skip(f"cannot remount read-only: {remount.stderr.decode().strip()}")
    result = patchkit("revert", "--target", str(read_only))
    assert result.returncode == 0, result.stderr
    assert "nothing needed writing" in result.stdout


def test_a_device_at_the_lock_is_refused_before_it_is_opened(slim):
    (slim / ".patchkit").mkdir()
    try:
        os.mknod(slim / ".patchkit" / "lock", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs root")
    traced = subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=openat", sys.executable, "-c",
         "from patchkit.cli.entry import main; main()", "apply", "--target", str(slim)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    ) if shutil.which("strace") else None  # fmt: skip
    result = patchkit("apply", "--target", str(slim))
    assert "not a regular file" in one_line(result)
    if traced is not None:
        assert '"lock", O_RDWR' not in traced.stderr


def test_a_directory_swapped_in_under_a_staging_name_is_never_removed(tmp_path, monkeypatch):
    """Attack round three H4: the staging directory is exchanged (renameat2) with a
    user's directory between the marker read and the removal."""
    import ctypes

    from patchkit.releases import fetch

    parent = tmp_path / "fr"
    staging, user = parent / "stg", parent / "userdir"
    staging.mkdir(parents=True)
    (staging / fetch.STAGING_MARKER).write_text('{"pid": 2147483646}')
    user.mkdir()
    (user / "thesis.tex").write_text("precious\n")
    libc = ctypes.CDLL(None, use_errno=True)
    real = fetch._dead_marker

    swapped = []

    def swap_after_reading(staging_root):
        dead = real(staging_root)
        if not swapped:  # once: the first directory looked at is the staging one
            swapped.append(libc.renameat2(-100, bytes(staging), -100, bytes(user), 2))
        return dead

    monkeypatch.setattr(fetch, "_dead_marker", swap_after_reading)
    fetch.remove_stale_staging(parent)
    assert swapped == [0]
    assert (parent / "stg" / "thesis.tex").read_text() == "precious\n"  # swapped in, kept
    assert not (parent / "userdir" / fetch.STAGING_MARKER).exists()  # the real staging, emptied


# ----- what the attacker's third round still found (low) -----


def test_a_state_path_with_a_newline_gives_one_line(slim):
    """A forged path may hold a newline; the error still fits one line (written escaped)."""
    assert run_cli("apply", "--target", str(slim)).exit_code == 0
    state_file = slim / ".patchkit" / "state.json"
    data = json.loads(state_file.read_text())
    data["patches"][0]["files"][0]["path"] = "vllm/lora\nINJECTED: all good"
    state_file.write_text(json.dumps(data))
    before = snapshot(slim)
    for command in ("status", "revert", "apply"):
        result = patchkit(command, "--target", str(slim))
        line = one_line(result)
        assert "vllm/lora\\nINJECTED" in line, line
    assert snapshot(slim) == before


def test_a_journal_that_lists_a_file_twice_is_refused(slim):
    """patchkit writes each file once; a second entry could restore half of a rollback."""
    assert run_cli("apply", "--only", "expand-block-n", "--target", str(slim)).exit_code == 0
    utils = slim / UTILS
    txn = slim / ".patchkit" / "txn"
    (txn / "orig" / Path(UTILS).parent).mkdir(parents=True)
    (txn / "orig" / UTILS).write_bytes(utils.read_bytes())
    entry = {"path": UTILS, "before": sha(utils), "after": sha(utils),
             "patches": ["expand-block-n"]}  # fmt: skip
    journal = {"state_sha256": "0" * 64, "files": [entry, dict(entry)]}
    (txn / "journal.json").write_text(json.dumps(journal))
    before = snapshot(slim)
    for command in ("apply", "revert"):
        line = one_line_failure(run_cli(command, "--target", str(slim)))
        assert "listed twice" in line and "not acted on" in line
    assert snapshot(slim) == before


def test_a_component_swapped_back_to_a_directory_mid_walk_is_named_as_a_race(tmp_path):
    """ENOTDIR at the open, a directory at the lstat: a race, not 'a directory, not a directory'."""
    import errno

    from patchkit.fs import safepath

    (tmp_path / "d").mkdir()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        error = safepath._walk_error(
            OSError(errno.ENOTDIR, "Not a directory"), tmp_path / "d", fd, "d", "apply"
        )
    finally:
        os.close(fd)
    assert isinstance(error, safepath.UnsafePath)
    assert "changed while patchkit walked it" in str(error)
    assert "is a directory, not a directory" not in str(error)


# ----- review round: model and adapter JSON named on the command line -----


def _one_line(done, code: int, *needles: str) -> None:
    assert done.returncode == code, done.stderr
    lines = [x for x in done.stderr.strip().splitlines() if x.startswith("patchkit: error: ")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _patchkit(*args: str):
    import subprocess
    import sys

    code = "from patchkit.cli.main import main\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )


def test_a_fifo_named_config_json_is_refused_not_waited_on(tmp_path):
    """verify --model and doctor --kernels --model read config.json with read_text():
    a FIFO there hung both for ever."""
    import os

    model, adapter = tmp_path / "model", tmp_path / "adapter"
    model.mkdir()
    adapter.mkdir()
    os.mkfifo(model / "config.json")
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    verify = _patchkit("verify", "--model", str(model), "--lora", f"a={adapter}")
    _one_line(verify, 2, str(model), "config.json", "not a regular file")
    doctor = _patchkit("doctor", "--kernels", "--model", str(model), "--target", str(model))
    assert doctor.returncode in (1, 2) and "Traceback" not in doctor.stderr, doctor.stderr


def test_doctor_kernels_model_config_of_the_wrong_shape_is_one_line(tmp_path):
    """{} as config.json, a string hidden_size, a list as an adapter's rank_pattern:
    KeyError / ValueError / AttributeError, exit 3, before."""
    from patchkit.doctor import configs
    from patchkit.errors import PatchkitError

    model, adapter = tmp_path / "model", tmp_path / "adapter"
    model.mkdir()
    adapter.mkdir()
    for text in ("{}", '{"hidden_size": "x"}', "[1]", '{"text_config": 7}'):
        (model / "config.json").write_text(text)
        with pytest.raises(PatchkitError, match="config.json") as err:
            configs.model_from_dir(model)
        assert "\n" not in str(err.value)
    for text in ('{"rank_pattern": {}}', '{"r": 8, "rank_pattern": [1]}', '{"r": "x"}'):
        (adapter / "adapter_config.json").write_text(text)
        with pytest.raises(PatchkitError, match="adapter_config.json"):
            configs.adapter_ranks(adapter)
    from tests.conftest import release_tree

    (model / "config.json").write_text("{}")
    done = _patchkit("doctor", "--kernels", "--model", str(model), "--target",
                     str(release_tree("0.26.0")))  # fmt: skip
    _one_line(done, 1, "config.json")
