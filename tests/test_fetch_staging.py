"""fetch removes only its own dead staging directories, the marker last.

A staging directory is patchkit's by its marker, not its name; it is dead
when the marker's process is gone (or could never have existed); a live
one, a look-alike, or a user's directory swapped in under the staging name
is kept. The download child dies with a killed fetch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.conftest import PATCHKIT, REPO, copy_tree, run_cli, slim_tree
from tests.fault_helpers import default_dispositions
from tests.wheelserver_helpers import PIP_ENV, WHEEL, Index, build_wheel, only_this_index, serving


@pytest.mark.slow
def test_fetch_json_and_the_staging_of_a_dead_fetch_is_removed(tmp_path):
    """Staging of a dead fetch goes; a live one stays; so does a directory that only
    looks like one by its name (recognised by patchkit's marker, not a pattern)."""
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
    assert json.loads(result.stdout) == {
        "format": 1, "command": "fetch", "ok": True, "path": str(tree)
    }  # fmt: skip
    assert result.stderr == ""  # quiet in --json and without a terminal
    assert not stale.exists() and alive.is_dir()
    assert (lookalike / "mine.txt").read_text() == "mine\n"


@pytest.mark.slow
def test_ctrl_c_during_the_range_reads_removes_the_staging_at_once(tmp_path):
    """The member reads hang (the server stopped answering); Ctrl-C ends the fetch with
    exit 130 and its one line, without waiting for the reading threads, and the staging
    directory goes with it."""
    tree = slim_tree(tmp_path / "tree")
    wheel = build_wheel(tree, tmp_path / WHEEL)
    index = Index(wheel.read_bytes(), hold=threading.Event())
    cache = tmp_path / "cache"
    cache.mkdir()
    with serving(index):
        env = {**os.environ, "PYTHONPATH": str(REPO), "PIP_CONFIG_FILE": os.devnull,
               "PIP_INDEX_URL": f"{index.url}/simple", "HOME": str(tmp_path)}  # fmt: skip
        for name in PIP_ENV[1:]:
            env.pop(name, None)
        child = subprocess.Popen(
            [*PATCHKIT, "fetch", "0.26.0", "--dest", str(cache / "vllm-0.26.0"), "--trust-ranges"],
            env=env, stderr=subprocess.PIPE, text=True, preexec_fn=default_dispositions,
        )  # fmt: skip
        try:
            assert index.holding.wait(120), "no member read reached the server"
            assert [p.name for p in cache.iterdir()], "no staging directory while reading"
            child.send_signal(signal.SIGINT)
            _, stderr = child.communicate(timeout=30)  # a hang fails here, not the suite
        finally:
            index.hold.set()
            if child.poll() is None:
                child.kill()
    assert child.returncode == 130, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert list(cache.iterdir()) == []


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


@pytest.mark.slow
def test_a_marker_with_an_impossible_pid_is_a_dead_fetch(tmp_path):
    cache = tmp_path / "cache"
    tree = copy_tree("0.26.0", cache / "trees" / "vllm-0.26.0")
    stale = cache / "trees" / ".vllm-x"
    stale.mkdir()
    (stale / ".patchkit-staging").write_text('{"pid": 4294967296}')
    result = run_cli("fetch", "0.26.0", "--json", env={"PATCHKIT_CACHE_DIR": str(cache)})
    assert result.exit_code == 0, result.output
    assert not stale.exists() and tree.is_dir()


def test_a_directory_swapped_in_under_a_staging_name_is_never_removed(tmp_path, monkeypatch):
    """The staging directory is exchanged (renameat2) with a
    user's directory between the marker read and the removal."""
    import ctypes

    from patchkit.releases import fetch

    parent = tmp_path / "fr"
    staging, user = parent / ".vllm-0.27.0-stg", parent / "userdir"
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
    assert (staging / "thesis.tex").read_text() == "precious\n"  # swapped in, kept
    assert not (parent / "userdir" / fetch.STAGING_MARKER).exists()  # the real staging, emptied


def test_a_version_tagged_like_docker_is_the_same_release_and_the_same_tree(tmp_path):
    """`fetch v0.26.0` (vLLM's Docker tags carry the v) finds the 0.26.0 tree, rather
    than fetching a second copy under vllm-v0.26.0."""
    cache = tmp_path / "cache"
    tree = copy_tree("0.26.0", cache / "trees" / "vllm-0.26.0")
    result = run_cli("fetch", "v0.26.0", "--json", env={"PATCHKIT_CACHE_DIR": str(cache)})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "format": 1, "command": "fetch", "ok": True, "path": str(tree)
    }  # fmt: skip
    assert sorted(p.name for p in (cache / "trees").iterdir()) == ["vllm-0.26.0"]


def test_a_fetch_with_dest_never_sweeps_the_directories_beside_it(tmp_path):
    """A marker with a dead pid in a user's directory beside --dest (an unpacked
    archive, a copied cache) does not get it removed: only patchkit's own cache is
    swept, and only directories named as its staging ones are."""
    from patchkit.releases.fetch import STAGING_MARKER

    home = tmp_path / "home"
    mine = home / "mydata"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("precious\n")
    (mine / STAGING_MARKER).write_text('{"pid": 2147483646}')
    env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_CONFIG_FILE": "/dev/null",
           "PATCHKIT_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    result = run_cli("fetch", "0.26.0", "--dest", str(home / "newtree"), env=env)
    assert result.exit_code == 1  # nothing listens there
    assert (mine / "notes.txt").read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["dotdot", "link"])
def test_dest_is_taken_as_given(tmp_path, kind):
    """--dest D/sub/../sub deleted the user's empty D/sub and left a staging tree in D;
    a --dest that is a link got a confusing error. Both are one line, before anything is
    read or written: D/sub stays, D holds nothing new."""
    home = tmp_path / "D"
    (home / "sub").mkdir(parents=True)
    (home / "elsewhere").mkdir()
    if kind == "dotdot":
        dest = f"{home}/sub/../sub"
        words = f"fetch: --dest {dest} holds '..'; give the directory itself"
    else:
        (home / "link").symlink_to(home / "elsewhere")
        dest = str(home / "link")
        words = f"fetch: --dest {dest} is a symbolic link; give the directory it points to"
    before = sorted(os.listdir(home))
    env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_CONFIG_FILE": "/dev/null"}
    result = run_cli("fetch", "0.26.0", "--dest", dest, env=env)
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == f"patchkit: error: {words}"
    assert sorted(os.listdir(home)) == before and (home / "sub").is_dir()
    assert os.listdir(home / "elsewhere") == []


def test_an_empty_dest_is_replaced_by_the_tree_and_staging_is_swept(tmp_path, monkeypatch):
    """An empty --dest is the tree afterwards (one rename, never removed first); a failed
    fetch into it leaves it as it was, with no staging beside it."""
    tree = slim_tree(tmp_path / "tree")
    index = Index(build_wheel(tree, tmp_path / WHEEL).read_bytes())
    dest = tmp_path / "D" / "sub"
    dest.mkdir(parents=True)
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        index.page_sha256 = "0" * 64
        assert run_cli("fetch", "0.26.0", "--dest", str(dest)).exit_code == 1
        assert os.listdir(tmp_path / "D") == ["sub"] and os.listdir(dest) == []
        index.page_sha256 = None
        assert run_cli("fetch", "0.26.0", "--dest", str(dest)).exit_code == 0
    assert (dest / "vllm" / "__init__.py").is_file() and os.listdir(tmp_path / "D") == ["sub"]
