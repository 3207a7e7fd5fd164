"""Hostile input never reaches outside the target (issue 9).

Each test plants what an attacker, a bad environment variable or a broken
disk would, on a copy of the real vLLM 0.26.0 tree, and checks that
patchkit exits with one line, leaves the tree byte-identical and never
touches the directory V beside it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, copy_tree, run_cli, snapshot

UTILS = "vllm/lora/ops/triton_ops/utils.py"


@pytest.fixture
def site(tmp_path: Path) -> tuple[Path, Path]:
    """(T, V): a 0.26.0 tree and a victim directory beside it, with two files in V."""
    tree = copy_tree("0.26.0", tmp_path / "T")
    victim = tmp_path / "V"
    victim.mkdir()
    (victim / "a.txt").write_text("precious a\n")
    (victim / "d.txt").write_text("precious d\n")
    return tree, victim


def one_line_failure(result, code: int = 1) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("patchkit: error:"), result.stderr
    return lines[0]


def applied(tree: Path) -> Path:
    assert run_cli("apply", "--target", str(tree)).exit_code == 0
    return tree / ".patchkit" / "state.json"


def edit_state(state_file: Path, edit) -> None:
    data = json.loads(state_file.read_text())
    edit(data)
    state_file.write_text(json.dumps(data))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----- 1. cache variables -----


def clear_caches_in(cwd: Path, tree: Path, home: Path, **env: str) -> subprocess.CompletedProcess:
    code = "from patchkit.cli.main import main; main()"
    full_env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME",)}
    full_env.update(HOME=str(home), PYTHONPATH=str(REPO), **env)
    args = ["apply", "--target", str(tree), "--clear-caches", "--json"]
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=full_env, capture_output=True, text=True
    )


@pytest.mark.parametrize("variable", ["TRITON_CACHE_DIR", "VLLM_CACHE_ROOT"])
def test_an_empty_cache_variable_never_deletes_the_working_directory(tmp_path, variable):
    work = tmp_path / "work"
    tree = copy_tree("0.26.0", work / "t")
    (work / "notes.txt").write_text("mine\n")
    home = tmp_path / "home"
    home.mkdir()
    result = clear_caches_in(work, tree, home, **{variable: ""})
    assert result.returncode == 0, result.stderr
    assert (work / "notes.txt").read_text() == "mine\n"
    assert (tree / UTILS).is_file() and (tree / ".patchkit" / "state.json").is_file()
    caches = json.loads(result.stdout)["caches_removed"]
    if variable == "VLLM_CACHE_ROOT":  # '' is relative: refused, with the reason
        assert caches[0]["removed"] is False and "not an absolute path" in caches[0]["reason"]


@pytest.mark.parametrize(
    "where",
    ["user-files", "symlink", "ancestor-of-tree", "home", "inside-tree"],
)
def test_a_cache_variable_pointing_at_user_data_is_left_alone(tmp_path, where):
    work = tmp_path / "work"
    tree = copy_tree("0.26.0", work / "t")
    home = tmp_path / "home"
    (home / "docs").mkdir(parents=True)
    (home / "docs" / "thesis.tex").write_text("years of work\n")
    target = {
        "user-files": home / "docs",
        "symlink": tmp_path / "link",
        "ancestor-of-tree": work,
        "home": home,
        "inside-tree": tree / "vllm" / "lora",
    }[where]
    if where == "symlink":
        target.symlink_to(home / "docs")
    before = snapshot(tmp_path)
    result = clear_caches_in(work, tree, home, TRITON_CACHE_DIR=str(target))
    assert result.returncode == 0, result.stderr
    triton = json.loads(result.stdout)["caches_removed"][1]
    assert triton["removed"] is False and triton["reason"], triton
    after = snapshot(tmp_path)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert all(k.startswith("work/t/vllm/") or k.startswith("work/t/.patchkit") for k in changed)


def test_a_real_cache_is_cleared_and_its_directory_kept(tmp_path):
    work = tmp_path / "work"
    tree = copy_tree("0.26.0", work / "t")
    home = tmp_path / "home"
    kernel = home / ".triton" / "cache" / ("B7" * 26) / "_lora_expand_kernel.cubin"
    graph = home / ".cache" / "vllm" / "torch_compile_cache" / "torch_aot_compile" / ("e" * 64)
    for path in (kernel, graph / "model"):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x" * 7)
    result = clear_caches_in(work, tree, home)
    assert result.returncode == 0, result.stderr
    caches = json.loads(result.stdout)["caches_removed"]
    assert [(c["removed"], c["files"], c["bytes"]) for c in caches] == [(True, 1, 7)] * 2
    assert not kernel.exists() and (home / ".triton" / "cache").is_dir()


# ----- 2-5. hostile state -----


@pytest.mark.parametrize("path", ["../V/a.txt", "ABSOLUTE", "vllm/../../V/a.txt", "setup.py"])
def test_a_state_file_path_outside_vllm_is_never_acted_on(site, path):
    tree, victim = site
    state_file = applied(tree)
    bad = str(victim / "a.txt") if path == "ABSOLUTE" else path
    record = {"path": bad, "pre_sha256": None, "post_sha256": sha(victim / "a.txt"), "backup": None}
    edit_state(state_file, lambda d: d["patches"][0]["files"].append(record))
    before = snapshot(tree.parent)
    for command in ("revert", "apply", "status"):
        line = one_line_failure(run_cli(command, "--target", str(tree)))
        assert str(state_file) in line and "not acted on" in line
    assert snapshot(tree.parent) == before


def test_a_backup_path_of_its_own_choosing_is_refused(site, tmp_path):
    tree, victim = site
    state_file = applied(tree)
    payload = tmp_path / "payload"
    payload.write_text("attacker\n")

    def point_backup_outside(data):
        data["patches"][0]["files"][0]["backup"] = "../../payload"

    edit_state(state_file, point_backup_outside)
    before = snapshot(tree.parent)
    line = one_line_failure(run_cli("revert", "--target", str(tree)))
    assert "is not its own" in line
    assert snapshot(tree.parent) == before


def test_a_journal_path_outside_vllm_is_never_acted_on(site):
    tree, victim = site
    txn = tree / ".patchkit" / "txn"
    txn.mkdir(parents=True)
    entry = {"path": "../V/d.txt", "before": None, "after": sha(victim / "d.txt")}
    (txn / "journal.json").write_text(json.dumps({"state_sha256": "0" * 64, "files": [entry]}))
    before = snapshot(tree.parent)
    for command in ("apply", "revert"):
        line = one_line_failure(run_cli(command, "--target", str(tree)))
        assert "journal" in line and "not acted on" in line
    assert snapshot(tree.parent) == before


@pytest.mark.parametrize("link", [".patchkit", ".patchkit/backups", ".patchkit/lock"])
def test_a_symlink_in_the_state_directory_is_refused(site, link):
    tree, victim = site
    if link != ".patchkit":
        applied(tree)
    target = victim / "a.txt" if link.endswith("lock") else victim
    if link.endswith("backups"):
        shutil.rmtree(tree / link)
    elif link.endswith("lock"):
        (tree / link).unlink()
    (tree / link).symlink_to(target)
    before = snapshot(tree.parent)
    for command in ("apply", "revert"):
        line = one_line_failure(run_cli(command, "--target", str(tree)))
        assert "symbolic link" in line
    assert snapshot(tree.parent) == before
    assert sorted(p.name for p in victim.iterdir()) == ["a.txt", "d.txt"]


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        "null",
        '{"format": 1, "vllm_version": null, "patches": [null]}',
        "PATH_NULL",
        "SHA_NUMBER",
        "{not json",
    ],
)
def test_state_of_the_wrong_shape_is_one_line(tree_0260, content):
    state_file = applied(tree_0260)
    data = json.loads(state_file.read_text())
    if content == "PATH_NULL":
        data["patches"][0]["files"][0]["path"] = None
        content = json.dumps(data)
    elif content == "SHA_NUMBER":
        data["patches"][0]["files"][0]["post_sha256"] = 12
        content = json.dumps(data)
    state_file.write_text(content)
    before = snapshot(tree_0260)
    for command in ("status", "apply", "revert", "doctor"):
        result = run_cli(command, "--target", str(tree_0260))
        if command == "doctor":  # doctor reports the tree error and still runs
            assert "Traceback" not in result.output
            continue
        assert str(state_file) in one_line_failure(result)
    assert snapshot(tree_0260) == before


# ----- 9. symlinked targets, read-only trees, bad arguments -----


def test_a_target_file_that_is_a_symlink_is_refused_and_kept(site):
    tree, victim = site
    real = victim / "utils.py"
    shutil.move(tree / UTILS, real)
    (tree / UTILS).symlink_to(real)
    before, outside = snapshot(tree), sha(real)
    line = one_line_failure(run_cli("apply", "--target", str(tree)))
    assert "symbolic link" in line and UTILS in line
    assert (tree / UTILS).is_symlink() and sha(real) == outside
    assert snapshot(tree) == before and not (tree / ".patchkit").exists()


def test_a_symlinked_directory_on_the_way_is_refused(site):
    tree, victim = site
    moved = victim / "triton_ops"
    shutil.move(tree / "vllm/lora/ops/triton_ops", moved)
    (tree / "vllm/lora/ops/triton_ops").symlink_to(moved)
    before = snapshot(victim)
    assert "symbolic link" in one_line_failure(run_cli("apply", "--target", str(tree)))
    assert snapshot(victim) == before


def read_only_lock(monkeypatch):
    """Make creating .patchkit/lock fail as on a read-only file system."""
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if str(path) == "lock" and "dir_fd" in kwargs and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)


def test_read_only_tree_already_patched_is_a_no_op(tree_0260, monkeypatch):
    applied(tree_0260)
    (tree_0260 / ".patchkit" / "lock").unlink()
    before = snapshot(tree_0260)
    read_only_lock(monkeypatch)
    result = run_cli("apply", "--target", str(tree_0260))
    assert result.exit_code == 0, result.output
    assert "nothing needed writing" in result.output
    assert snapshot(tree_0260) == before


def test_read_only_tree_that_needs_patching_names_the_file_system(tree_0260, monkeypatch):
    before = snapshot(tree_0260)
    read_only_lock(monkeypatch)
    line = one_line_failure(run_cli("apply", "--target", str(tree_0260)))
    assert "read-only" in line and "owns" not in line
    assert snapshot(tree_0260) == before and not (tree_0260 / ".patchkit").exists()
    result = run_cli("revert", "--target", str(tree_0260))  # nothing applied: no-op
    assert result.exit_code == 0, result.output


def test_an_empty_target_is_a_usage_error(tree_0260):
    result = run_cli("status", "--target", "", "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["ok"] is False
    assert "--target" in result.stderr and "empty" in result.stderr


def test_a_version_that_is_not_a_version_is_a_usage_error(tree_0260):
    for args, env in (
        (["--vllm-version", "abc"], None),
        ([], {"PATCHKIT_VLLM_VERSION": "abc"}),
    ):
        result = run_cli("status", "--target", str(tree_0260), "--json", *args, env=env)
        assert result.exit_code == 2, result.output
        assert "'abc' is not a PEP 440 version" in json.loads(result.stdout)["error"]


def test_an_untested_version_warns_once(tree_0260):
    result = run_cli("status", "--target", str(tree_0260), "--vllm-version", "0.40.0")
    assert result.stderr.count("is not a tested release") == 1


def test_usage_errors_print_json_with_json(tree_0260):
    result = run_cli("apply", "--target", str(tree_0260), "--json", "--no-such-option")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["ok"] is False


def test_an_internal_error_exits_3_with_a_hint_and_a_traceback_on_request(tree_0260, monkeypatch):
    import patchkit.patching.operations

    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(patchkit.patching.operations, "status", broken)
    result = run_cli("status", "--target", str(tree_0260))
    line = one_line_failure(result, code=3)
    assert "ZeroDivisionError: boom" in line and "PATCHKIT_DEBUG=1" in line
    result = run_cli("status", "--target", str(tree_0260), env={"PATCHKIT_DEBUG": "1"})
    assert result.exit_code == 3 and "Traceback" in result.stderr


def test_list_shows_why():
    result = run_cli("list")
    assert result.exit_code == 0
    patches = json.loads(run_cli("list", "--json").stdout)["patches"]
    assert result.stdout.count("    why: ") == len(patches)


def test_doctor_without_vllm_says_unknown(tmp_path):
    result = run_cli("doctor", "--json")  # no --target, and this Python has no vLLM
    verdicts = json.loads(result.stdout)["verdicts"]
    assert verdicts and {v["status"] for v in verdicts} == {"unknown"}


# ----- 7. a real full disk and an over-long path -----


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs mount with room for a slim tree plus ~50 KB; skipped where mounting is refused."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_gives_one_line_and_changes_nothing(small_tmpfs):
    from tests.test_write_points import slim_tree

    tree = slim_tree(small_tmpfs / "t")
    filler = small_tmpfs / "filler"
    with open(filler, "wb", buffering=0) as handle:  # fill the disk, then free ~50 KB
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - 50_000))
    before = snapshot(tree)
    line = one_line_failure(run_cli("apply", "--target", str(tree)))
    assert "no space left" in line and "nothing changed" in line
    assert snapshot(tree) == before and not (tree / ".patchkit").exists()


def test_an_over_long_path_is_walked_by_descriptors(tmp_path):
    """A tree whose root path is ~4,020 characters: files below it pass PATH_MAX (4,096).

    patchkit opens the root once and reaches every file from that descriptor
    (issue 18), so the depth of the tree's own path no longer matters: apply
    and revert work there, and revert gives the pristine files back.
    """
    from tests.test_write_points import slim_tree

    tree = slim_tree(tmp_path / "t")
    parts, length = [], len(str(tmp_path))
    while length < 4000:
        parts.append("d" * min(200, 4000 - length))
        length += len(parts[-1]) + 1
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        for part in parts:  # build the deep directories relative to a descriptor
            os.mkdir(part, dir_fd=fd)
            new_fd = os.open(part, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = new_fd
        os.rename(tree, "t", dst_dir_fd=fd)
        deep = Path(tmp_path, *parts, "t")
        applied_deep = run_cli("apply", "--target", str(deep))
        reverted_deep = run_cli("revert", "--target", str(deep))
        os.rename("t", tree, src_dir_fd=fd)
    finally:
        os.close(fd)
    assert applied_deep.exit_code == 0, applied_deep.output
    assert "applied" in applied_deep.stdout
    assert reverted_deep.exit_code == 0, reverted_deep.output
    assert not (tree / ".patchkit").exists()
    assert snapshot(tree) == snapshot(slim_tree(tmp_path / "fresh"))


def test_a_symlinked_pycache_is_not_followed(site):
    tree, victim = site
    target = tree / "vllm/lora/ops/triton_ops/__pycache__"
    (victim / "utils.cpython-312.pyc").write_bytes(b"not ours")
    target.symlink_to(victim)
    result = run_cli("apply", "--target", str(tree), "--json")
    assert result.exit_code == 0, result.output
    assert (victim / "utils.cpython-312.pyc").read_bytes() == b"not ours"
    assert json.loads(result.stdout)["bytecode_removed"] == []


# ----- fetch: progress, JSON, killed fetches -----


def test_fetch_json_and_the_staging_of_a_dead_fetch_is_removed(tmp_path):
    """Staging of a dead fetch goes; a live one stays; so does a directory that only
    looks like one by its name (issue 18: recognised by patchkit's marker, not a pattern)."""
    from patchkit.releases.fetch import MARKER, STAGING_MARKER

    cache = tmp_path / "cache"
    tree = copy_tree("0.26.0", cache / "trees" / "vllm-0.26.0")
    assert (tree / MARKER).is_file()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = cache / "trees" / ".vllm-0.27.0-abc123"
    (stale / "tree" / "vllm").mkdir(parents=True)
    (stale / STAGING_MARKER).write_text(json.dumps({"pid": dead.pid, "start": "1"}))
    alive = cache / "trees" / ".vllm-0.28.0-def456"
    alive.mkdir()
    (alive / STAGING_MARKER).write_text(json.dumps({"pid": os.getpid(), "start": None}))
    lookalike = cache / "trees" / f".vllm-notes-pid{dead.pid}-x"
    lookalike.mkdir()
    (lookalike / "mine.txt").write_text("mine\n")
    result = run_cli("fetch", "0.26.0", "--json", env={"PATCHKIT_CACHE_DIR": str(cache)})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"ok": True, "path": str(tree)}
    assert result.stderr == ""  # quiet in --json and without a terminal
    assert not stale.exists() and alive.is_dir()
    assert (lookalike / "mine.txt").read_text() == "mine\n"


def test_pip_dies_with_a_killed_fetch(tmp_path):
    """The download child gets the parent-death signal: SIGKILL of patchkit ends it too."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "from patchkit.releases.fetch import _die_with_parent\n"
            "child = subprocess.Popen(['sleep', '60'], preexec_fn=_die_with_parent)\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "time.sleep(60)\n",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    for _ in range(100):
        if pid_file.is_file() and pid_file.read_text():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            return  # a zombie waiting for init to reap it: dead
        time.sleep(0.05)
    os.kill(child, 9)
    pytest.fail("the download child outlived the killed fetch")


def test_a_really_read_only_file_system(small_tmpfs):
    """On a tmpfs remounted read-only: a patched tree is a no-op, a pristine one says read-only."""
    from tests.test_write_points import slim_tree

    patched = slim_tree(small_tmpfs / "patched")
    pristine = slim_tree(small_tmpfs / "pristine")
    applied(patched)
    remount = ["mount", "-o", "remount,ro", str(small_tmpfs)]
    assert subprocess.run(remount, capture_output=True).returncode == 0
    before = snapshot(small_tmpfs)
    result = run_cli("apply", "--target", str(patched))
    assert result.exit_code == 0, result.output
    assert "nothing needed writing" in result.output
    line = one_line_failure(run_cli("apply", "--target", str(pristine)))
    assert "read-only" in line and "owns" not in line
    assert snapshot(small_tmpfs) == before
