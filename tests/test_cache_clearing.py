"""`--clear-caches` removes Triton's and vLLM's own caches and nothing else.

Whatever TRITON_CACHE_DIR, VLLM_CACHE_ROOT or HOME say (empty, relative,
pointing at user files, at the tree, through a link above the last component,
across a bind mount, at a directory of another program's layout, too long),
patchkit removes only what is laid out as that cache, keeps the cache's own
directory, and says why it left a cache alone; the patches are applied
either way.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli, run_subprocess, slim_tree, snapshot
from tests.helpers import UTILS


def clear_caches_in(cwd: Path, tree: Path, home: Path, **env: str) -> subprocess.CompletedProcess:
    """apply --clear-caches in a child run from ``cwd``, with HOME=home and no XDG_CACHE_HOME."""
    args = ["apply", "--target", str(tree), "--clear-caches", "--json"]
    return run_subprocess(*args, cwd=cwd, env={"XDG_CACHE_HOME": None, "HOME": str(home), **env})


@pytest.mark.parametrize("variable", ["TRITON_CACHE_DIR", "VLLM_CACHE_ROOT"])
def test_an_empty_cache_variable_never_deletes_the_working_directory(tmp_path, variable):
    work = tmp_path / "work"
    tree = slim_tree(work / "t")
    (work / "notes.txt").write_text("mine\n")
    home = tmp_path / "home"
    home.mkdir()
    result = clear_caches_in(work, tree, home, **{variable: ""})
    assert result.returncode == 0, result.stderr
    assert (work / "notes.txt").read_text() == "mine\n"
    assert (tree / UTILS).is_file() and (tree / ".patchkit" / "state.json").is_file()
    caches = json.loads(result.stdout)["caches_removed"]
    if variable == "VLLM_CACHE_ROOT":  # '' is relative: refused, with the reason
        assert (
            caches[0]["removed"] is False
            and "not an absolute path" in caches[0]["reason"]["message"]
        )
        assert caches[0]["reason"]["source"] == "VLLM_CACHE_ROOT=''"  # its code's fact


@pytest.mark.slow
@pytest.mark.parametrize(
    "where",
    ["user-files", "symlink", "ancestor-of-tree", "home", "inside-tree"],
)
def test_a_cache_variable_pointing_at_user_data_is_left_alone(tmp_path, where):
    work = tmp_path / "work"
    tree = slim_tree(work / "t")
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


@pytest.mark.slow
def test_a_real_cache_is_cleared_and_its_directory_kept(tmp_path):
    work = tmp_path / "work"
    tree = slim_tree(work / "t")
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


def clear(tree: Path, home: Path, **env: str) -> dict:
    full = {"HOME": str(home), "XDG_CACHE_HOME": "", **env}
    result = run_subprocess("apply", "--target", str(tree), "--clear-caches", "--json", env=full)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is True
    return {c["name"].split()[0]: c for c in data["caches_removed"]}


@pytest.mark.slow
def test_clear_caches_never_crosses_a_bind_mount(tmp_path, slim_tree_0260, bind_mount):
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
    triton = clear(slim_tree_0260, home, TRITON_CACHE_DIR=str(cache))["Triton"]
    assert triton["removed"] is False and "mount point" in triton["reason"]["message"], triton
    assert (triton["reason"]["code"], triton["reason"]["mount"]) == (
        "cache-mount-inside",
        str(hashed),
    )
    assert (victim / "thesis.tex").read_text() == "years of work\n"
    assert (cache / ("B" * 52)).is_dir()  # refused as a whole: nothing was removed


def test_cache_links_above_the_last_component_are_not_followed(tmp_path, slim_tree_0260):
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
        slim_tree_0260,
        home,
        TRITON_CACHE_DIR=str(tmp_path / "up" / "cache"),
        VLLM_CACHE_ROOT=str(tmp_path / "vllm-link"),
    )
    for name in ("Triton", "vLLM"):
        assert (
            found[name]["removed"] is False and "symbolic link" in found[name]["reason"]["message"]
        )
    assert kernel.read_bytes() == b"k" and (vllm_real / "graph").read_bytes() == b"g"


@pytest.mark.slow
def test_an_absent_cache_is_not_reported_as_cleared(tmp_path, slim_tree_0260):
    home = tmp_path / "home"
    home.mkdir()
    found = clear(slim_tree_0260, home, TRITON_CACHE_DIR=str(tmp_path / "nowhere"))
    assert found["Triton"]["removed"] is False and found["Triton"]["state"] == "absent"
    assert found["vLLM"]["state"] == "absent"


def test_a_directory_of_docker_containers_is_not_a_triton_cache(tmp_path, slim_tree_0260):
    containers = tmp_path / "containers"
    secret = containers / ("c" * 64) / "mounts" / "secrets"
    secret.parent.mkdir(parents=True)
    secret.write_text("pw\n")
    project = tmp_path / "proj" / "torch_compile_cache" / "deadbeef00" / "src"
    project.mkdir(parents=True)
    (project / "main.py").write_text("print('mine')\n")
    home = tmp_path / "home"
    home.mkdir()
    found = clear(slim_tree_0260, home, TRITON_CACHE_DIR=str(containers),
                  VLLM_CACHE_ROOT=str(tmp_path / "proj"))  # fmt: skip
    assert found["Triton"]["state"] == "left-alone" and found["vLLM"]["state"] == "left-alone"
    assert secret.read_text() == "pw\n" and (project / "main.py").is_file()


def test_an_over_long_cache_name_names_the_variable(tmp_path, slim_tree_0260):
    home = tmp_path / "home"
    home.mkdir()
    found = clear(slim_tree_0260, home, TRITON_CACHE_DIR=str(tmp_path / ("x" * 300)))
    assert found["Triton"]["removed"] is False
    assert "TRITON_CACHE_DIR" in found["Triton"]["reason"]["message"]
    assert "--target" not in found["Triton"]["reason"]["message"]
    assert (
        json.loads(run_cli("status", "--target", str(slim_tree_0260), "--json").stdout)["patches"][
            0
        ]["state"]
        == "applied"
    )
