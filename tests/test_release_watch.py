"""scripts/release_watch.py: the releases the index has and the catalogue has not tested,
each with every patch's state as `patchkit status --target TREE --json` decides it.

Against a package index on the loopback (tests/wheelserver_helpers.py) serving real
wheels: 0.33.0 and 0.34.0 (slim: the files the catalogue reads, and the dist-info),
and a "0.35.0" made from the real 0.34.0 tree (its dist-info renamed, METADATA and
RECORD changed): the slim file set in the fast test, the whole tree (3,600 files)
in the slow one. The script runs as a child process with its own HOME, TMPDIR,
working directory and PATCHKIT_CACHE_DIR, so that what it writes can be seen.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, SLIM, release_tree, run_cli, snapshot
from tests.release_drill_helpers import MOE_ASSERT_REWRITTEN, next_release
from tests.wheelserver_helpers import (
    PIP_ENV,
    Index,
    build_wheel,
    only_this_index,
    serving,
    wheel_name,
)

SCRIPT = REPO / "scripts" / "release_watch.py"


def places_under(tmp_path: Path) -> dict[str, Path]:
    places = {name: tmp_path / name for name in ("home", "tmp", "cwd", "cache")}
    for path in places.values():
        path.mkdir(parents=True, exist_ok=True)
    return places


def watch(tmp_path: Path, index_url: str, *args: str) -> subprocess.CompletedProcess:
    """The script in a child Python: only ``index_url`` from pip's settings, and every
    place it could write of its own (HOME, TMPDIR, the working directory, the cache)
    under ``tmp_path``."""
    places = places_under(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in PIP_ENV and k != "XDG_CACHE_HOME"}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=index_url,
        HOME=str(places["home"]),
        TMPDIR=str(places["tmp"]),
        PATCHKIT_CACHE_DIR=str(places["cache"]),
        PYTHONDONTWRITEBYTECODE="1",  # Python's own bytecode of patchkit is not the script's
    )
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=places["cwd"],
        timeout=300,
    )


def watch_here(tmp_path: Path, index_url: str, monkeypatch, capsys, *args: str):
    """The script's main() in this process, with the child's settings (a child Python's
    start costs more than the fast subset's second per test)."""
    places = places_under(tmp_path)
    with monkeypatch.context() as patched:
        only_this_index(patched, index_url, places["home"])
        patched.delenv("XDG_CACHE_HOME", raising=False)
        patched.setenv("TMPDIR", str(places["tmp"]))
        patched.setattr(tempfile, "tempdir", None)  # read TMPDIR again
        patched.setenv("PATCHKIT_CACHE_DIR", str(places["cache"]))
        patched.chdir(places["cwd"])
        spec = importlib.util.spec_from_file_location("release_watch", SCRIPT)
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        capsys.readouterr()
        try:
            script.main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def slim_wheel(version: str, work: Path) -> bytes:
    """A real release's wheel, of its slim file set."""
    tree = next_release(release_tree(version), work / f"tree-{version}", version, SLIM)
    return build_wheel(tree, work / wheel_name(version)).read_bytes()


def next_wheel(work: Path, whole: bool, moved: bool = False) -> bytes:
    """0.34.0 as 0.35.0; ``moved``: with the code partial-moe-adapter patches rewritten."""
    tree = next_release(
        release_tree("0.34.0"),
        work / "tree-0.35.0",
        "0.35.0",
        None if whole else SLIM,
        rewrite=MOE_ASSERT_REWRITTEN if moved else None,
    )
    return build_wheel(tree, work / wheel_name("0.35.0")).read_bytes()


def one_line(result: subprocess.CompletedProcess) -> str:
    """The single line on stderr of a failed run (no traceback)."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "whole, moved",
    [(False, False), (False, True), pytest.param(True, False, marks=pytest.mark.slow)],
)
def test_lists_only_the_untested_release_with_status_s_states(
    tmp_path, whole, moved, monkeypatch, capsys
):
    """0.33.0 and 0.34.0 are tested; 0.35.0 is listed, fetched into the cache, and each
    patch's state, reason, warnings and notices are exactly status's on that tree. The
    tested releases' wheels are never downloaded; nothing is written outside the cache.
    The slim 0.35.0 runs in this process, the whole one as a child process."""
    work = tmp_path / "wheels"
    work.mkdir()
    wheels = {wheel_name(v): slim_wheel(v, work) for v in ("0.33.0", "0.34.0")}
    wheels[wheel_name("0.35.0")] = next_wheel(work, whole, moved)
    catalogue = snapshot(REPO / "patches")
    run = tmp_path / "run"
    with serving(Index(wheels=wheels)) as index:
        url = f"{index.url}/simple"
        if whole:
            result = watch(run, url, "--json")
            text = watch(run, url)  # the tree is in the cache now
        else:
            result = watch_here(run, url, monkeypatch, capsys, "--json")
            text = watch_here(run, url, monkeypatch, capsys)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert (report["newest_tested"], report["newest_on_index"]) == ("0.34.0", "0.35.0")
    [release] = report["releases"]
    tree = run / "cache" / "trees" / "vllm-0.35.0"
    assert (release["version"], release["tree"]) == ("0.35.0", str(tree))
    status = run_cli("status", "--target", str(tree), "--json")
    assert status.exit_code == 0, status.output
    assert release["status"] == json.loads(status.stdout)
    states = [p["state"] for p in release["status"]["patches"]]
    moe = [p["state"] for p in release["status"]["patches"] if p["id"] == "partial-moe-adapter"]
    assert moe == ["changed-upstream" if moved else "needed"]
    assert sum(release["states"].values()) == len(states)
    assert release["states"] == {s: states.count(s) for s in release["states"]}
    assert any(
        "0.35.0" in w["message"] for w in release["status"]["warnings"]
    )  # not a tested release
    downloaded = {r["path"].rsplit("/", 1)[-1] for r in index.seen if "/files/" in r["path"]}
    assert downloaded == {wheel_name("0.35.0")}
    # nothing written outside the cache: the cache holds the one tree, the rest is empty
    assert sorted(p.name for p in (run / "cache").iterdir()) == ["trees"]
    assert sorted(p.name for p in (run / "cache" / "trees").iterdir()) == ["vllm-0.35.0"]
    for place in ("home", "tmp", "cwd"):
        assert list((run / place).iterdir()) == [], place
    assert snapshot(REPO / "patches") == catalogue

    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"vLLM 0.35.0 at {tree} (not in tested_releases)"
    for patch in release["status"]["patches"]:
        [row] = [line for line in lines if line.startswith(f"  {patch['id']} ")]
        assert row.split()[1] == patch["state"]
        if patch["reason"]:
            assert " ".join(patch["reason"]["message"].split()[:3]) in " ".join(row.split()[2:])
    counts = ", ".join(f"{n} {s}" for s, n in release["states"].items())
    assert f"  0.35.0: {counts}" in lines
    summary = "release_watch: 1 release newer than 0.34.0, the newest tested: 0.35.0: " + counts
    assert summary in lines
    assert report["summary"] == summary
    after = "\n".join(lines[lines.index(summary) + 1 :])
    assert after.startswith('next (CONTRIBUTING.md, "A new vLLM release"), for 0.35.0')
    assert "tested_releases" in after and "pytest -k 0.35.0" in " ".join(after.split())


def test_nothing_newer_and_a_pre_release_is_skipped(tmp_path, monkeypatch, capsys):
    """The index's newest release is the catalogue's newest tested one; a 0.35.0rc1 counts
    only with --pre. Nothing is downloaded or written."""
    wheels = {wheel_name(v): slim_wheel(v, tmp_path) for v in ("0.33.0", "0.34.0")}
    wheels[wheel_name("0.35.0rc1")] = b"never read"
    with serving(Index(wheels=wheels)) as index:
        url = f"{index.url}/simple"
        result = watch_here(tmp_path / "run", url, monkeypatch, capsys)
        as_json = watch_here(tmp_path / "run", url, monkeypatch, capsys, "--json")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "release_watch: the catalogue covers every release on the index up to 0.34.0\n"
    )
    assert result.stderr == ""
    assert json.loads(as_json.stdout)["releases"] == []
    assert not [r for r in index.seen if "/files/" in r["path"]]
    for place in ("home", "tmp", "cwd", "cache"):
        assert list((tmp_path / "run" / place).iterdir()) == [], place


def test_an_index_that_fails_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    """A page that is not the simple API, an index that refuses connections, and an index
    without vLLM: one line on stderr each, exit 1, no traceback; --json says so too; a bad
    option is one line and exit 2. In this process: main() ends every way with SystemExit."""

    def watch(where, url, *args):
        return watch_here(where, url, monkeypatch, capsys, *args)

    with serving(Index(hostile={"page": b"<html>not json</html>"})) as index:
        bad = watch(tmp_path / "bad", f"{index.url}/simple")
        bad_json = watch(tmp_path / "bad", f"{index.url}/simple", "--json")
    assert bad.returncode == 1
    assert one_line(bad) == (
        "release_watch: error: fetch: 127.0.0.1's page for vllm is not the JSON simple API"
    )
    assert json.loads(bad_json.stdout) == {
        "ok": False,
        "error": "fetch: 127.0.0.1's page for vllm is not the JSON simple API",
        "exit_code": 1,
    }
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    down = watch(tmp_path / "down", f"http://127.0.0.1:{port}/simple")
    assert down.returncode == 1
    assert one_line(down).startswith("release_watch: error: fetch: cannot reach 127.0.0.1: ")
    with serving(Index(wheels={})) as index:
        empty = watch(tmp_path / "empty", f"{index.url}/simple")
    assert empty.returncode == 1
    assert one_line(empty) == (
        "release_watch: error: no wheel of vllm for CPython 3.12 on x86_64 "
        f"Linux at {index.url}/simple"
    )
    bad_option = watch(tmp_path / "usage", "http://127.0.0.1:9/simple", "--bogus")
    assert bad_option.returncode == 2
    assert "unrecognized arguments: --bogus" in one_line(bad_option)


@pytest.mark.network
def test_the_real_index(tmp_path):
    """Against the index this machine's pip is configured with: exit 0, and either the
    catalogue covers the index or each newer release has its block (fetched into a
    temporary cache)."""
    env = {**os.environ, "PATCHKIT_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    newest = max(report["newest_tested"], report["newest_on_index"], key=_version)
    if report["releases"]:
        assert _version(newest) > _version(report["newest_tested"])
        for release in report["releases"]:
            assert _version(release["version"]) > _version(report["newest_tested"])
            assert release["status"]["patches"]
    else:
        assert report["summary"].endswith(f"covers every release on the index up to {newest}")


def _version(text: str):
    from packaging.version import Version

    return Version(text)
