"""Shared fixtures: pristine vLLM release trees from the real PyPI wheels.

Trees come from ``patchkit fetch`` into a cache of the tests' own
(PATCHKIT_TEST_CACHE, default ~/.cache/patchkit-tests), kept apart from the
cache that `patchkit fetch` fills for people, whose trees may be patched by
hand; each test gets its own copy, so the cache stays pristine. A missing
tree is fetched as `patchkit fetch` fetches it: only the wheel's Python files
and dist-info, by range requests (about 8 MB of a 300 MB wheel), each checked
against the wheel's RECORD.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from packaging.version import Version

from patchkit.catalogue.load import load_catalogue
from patchkit.catalogue.model import Variant
from patchkit.cli.main import main
from patchkit.diffs.hunks import apply_file_patch
from patchkit.releases.fetch import fetch

REPO = Path(__file__).resolve().parent.parent
CATALOGUE = load_catalogue()
RELEASES = CATALOGUE.tested_releases


TEST_CACHE = Path(os.environ.get("PATCHKIT_TEST_CACHE", Path.home() / ".cache/patchkit-tests"))

# Reports wrap at COLUMNS, else at 100 where stdout is no terminal. The tests read
# them as a pipe or a log gets them, whatever the shell exported or pytest-xdist
# sets in its workers (80); a test of the wrapping sets COLUMNS itself.
os.environ.pop("COLUMNS", None)


@contextlib.contextmanager
def cache_lock(name: str):
    """Hold TEST_CACHE's lock for one entry while a test process fills or reads it.

    The suite runs in several pytest processes (pytest-xdist): two that need the
    same missing release would both fetch it, and the second would find the
    first's tree in its way. The lock is one file per entry, so different
    releases are fetched side by side.
    """
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with open(TEST_CACHE / f".lock-{name}", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def release_tree(version: str) -> Path:
    """The cached pristine tree of a release (fetched from its wheel on first use, by range
    requests: ``trust_ranges`` keeps the cold suite fast, and trusts PyPI's host)."""
    with cache_lock(f"vllm-{version}"):
        tree = fetch(version, TEST_CACHE / f"vllm-{version}", trust_ranges=True)
    assert not (tree / ".patchkit").exists(), f"{tree} has been patched; delete it"
    return tree


def copy_tree(version: str, dest: Path) -> Path:
    shutil.copytree(release_tree(version), dest, symlinks=True)
    return dest


def patched_text(version: str, patch_id: str, relpath: str) -> str:
    """One file of a release as the catalogue's variant for it would leave it.

    Applied in memory with patchkit's own engine, so a test can read (or import)
    the patched code of every release without copying whole trees.
    """
    variant = CATALOGUE.get(patch_id).expected_for(Version(version))
    assert isinstance(variant, Variant), f"{patch_id} has no variant for {version}"
    if relpath in variant.created:  # a real source file of the catalogue: no wheel needed
        return created_source(patch_id, relpath)
    file_patch = variant.file_patch(relpath)
    source = release_tree(version) / relpath
    text = None if file_patch.creates else source.read_text()
    new_text, _ = apply_file_patch(text, file_patch)
    return new_text


def releases_with_variant(patch_id: str, name: str | None = None) -> list[str]:
    """The tested releases where the catalogue gives ``patch_id`` a variant (``name``: that
    one), in order: a test of the patched code runs on each, so a new release is data."""
    patch = CATALOGUE.get(patch_id)
    return [
        release
        for release in RELEASES
        if isinstance(entry := patch.expected_for(Version(release)), Variant)
        and name in (None, entry.name)
    ]


def family_releases(patch_id: str, name: str | None = None) -> list[str]:
    """One tested release per code family of each of ``patch_id``'s variants (``name``:
    that one), as the catalogue declares them (``families``; every release of a variant
    that declares none), in order: the tests that run the patched code take these."""
    patch = CATALOGUE.get(patch_id)
    declared = {r for v in patch.variants if name in (None, v.name) for r in v.families}
    undeclared = [v.name for v in patch.variants if not v.families and name in (None, v.name)]
    chosen = declared | {r for n in undeclared for r in releases_with_variant(patch_id, n)}
    return [release for release in RELEASES if release in chosen]


def releases_decided(patch_id: str, state: str) -> list[str]:
    """The tested releases where the catalogue decides ``patch_id`` ``state`` (``upstream``,
    ``not-applicable``), in order."""
    patch = CATALOGUE.get(patch_id)
    return [
        release
        for release in RELEASES
        if getattr(patch.expected_for(Version(release)), "state", None) == state
    ]


def created_source(patch_id: str, relpath: str) -> str:
    """A file a patch creates, read from patches/<id>/files/ (no vLLM wheel involved)."""
    variant = next(v for v in CATALOGUE.get(patch_id).variants if relpath in v.created)
    return (variant.files_dir / relpath).read_text()


def module_from_source(name: str, text: str, directory: Path):
    """Import Python source as a standalone module (files that import only torch)."""
    path = directory / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # torch.compile looks functions' modules up by name
    spec.loader.exec_module(module)
    return module


LORA_TOLERANCE = {"torch.bfloat16": 2e-2, "torch.float16": 3e-3}  # max error / max |ref|


def assert_close_to(result, expected, dtype) -> None:
    """Max error within LORA_TOLERANCE[dtype] of the largest expected magnitude."""
    error = (result.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= LORA_TOLERANCE[str(dtype)] * scale, (error, scale)


def same_bits(a, b) -> bool:
    """Equal bit for bit (16-bit tensors), -0.0 and NaN payloads included."""
    import torch

    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under root, to prove a tree is byte-identical."""
    digests = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            digests[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def run_cli(*args: str, env: dict | None = None):
    """Run patchkit in-process; result has exit_code, stdout and stderr."""
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def applied(tree: Path) -> Path:
    """Apply the default set to ``tree`` in-process; the path of its state file."""
    assert run_cli("apply", "--target", str(tree)).exit_code == 0
    return tree / ".patchkit" / "state.json"


ENTRY = "\nfrom patchkit.cli.entry import main\nmain()\n"
PATCHKIT = [sys.executable, "-c", ENTRY]  # the console script's start, for strace and friends


# Root without the powers that pass permission bits: files another user owns are as
# unwritable to it as to a user who is not root (setpriv, util-linux; needs root).
WITHOUT_ROOTS_POWERS = (
    "setpriv",
    "--bounding-set=-dac_override,-dac_read_search,-fowner",
    "--inh-caps=-all",
)


def run_subprocess(
    *args: str,
    env: dict | None = None,
    code: str | None = None,
    cwd: Path | None = None,
    timeout: float = 120,
    prefix: tuple[str, ...] = (),
):
    """Run patchkit in a child Python, started as the console script starts it.

    ``code`` runs first (to inject faults); ``env`` is laid over this process's
    environment, a None value unsetting a variable; the child imports this
    checkout's patchkit; ``prefix`` is a command that starts it (``WITHOUT_ROOTS_POWERS``).
    A hang fails the test after ``timeout`` seconds instead of stopping the suite.
    """
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    full_env = {name: value for name, value in full_env.items() if value is not None}
    return subprocess.run(
        [*prefix, sys.executable, "-c", (code or "") + ENTRY, *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )


MEMORY_FS = Path("/dev/shm")


def on_tmpfs(path: Path, mounts: str | None = None) -> bool:
    """Whether ``path`` is the mount point of a tmpfs (``mounts``: /proc/self/mounts' text)."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return False
    return any(
        fields[1:3] == [str(path), "tmpfs"]
        for fields in (line.split() for line in mounts.splitlines())
        if len(fields) > 2
    )


# The most a test's trees take at once (the release matrix's largest release, 57 MB,
# copied twice), times two workers, with room to spare: a container's /dev/shm is
# 64 MB unless it was given more, and a tree that does not fit is a false failure.
MEMORY_FS_NEEDED = 1 << 30


def memory_fs_fits(path: Path, needed: int = MEMORY_FS_NEEDED) -> bool:
    """Whether ``path`` is a writable tmpfs with ``needed`` bytes free."""
    if not (on_tmpfs(path) and os.access(path, os.W_OK)):
        return False
    found = os.statvfs(path)
    return found.f_bavail * found.f_frsize >= needed


@pytest.fixture
def scratch_path(tmp_path: Path):
    """A fresh directory on a tmpfs with room (else tmp_path), removed after the test.

    For the fault walks, which copy a tree, run patchkit on it and delete it
    hundreds of times, and the release matrix, which copies every release's
    whole tree (2,000-3,000 files each): on a disk each of patchkit's fsyncs
    waits for the device, and on this machine's ext4 each file created passes
    over the inodes deleted lately. What they check is the process's (the
    syscalls patchkit makes, its exit status, the tree's bytes after the next
    command), the same on any file system (a full or read-only one is tested
    apart: tests/test_file_system_faults.py).
    """
    if not memory_fs_fits(MEMORY_FS):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="patchkit-tests-", dir=MEMORY_FS))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tree_0260(tmp_path: Path) -> Path:
    """A copy of the whole 0.26.0 tree (2,241 files): for what reads beyond the patched files."""
    return copy_tree("0.26.0", tmp_path / "site-packages")


# The real 0.26.0 files that apply, revert, status and the decisions read (every
# catalogue patch's, nan-probe's runner too: every command assesses every patch),
# with the wheel's dist-info (its RECORD and METADATA name the release): a tree
# of ~300 files instead of ~2,250, for tests that copy a tree many times or need
# one on a small file system.
SLIM = (
    "vllm/__init__.py",
    "vllm/lora",
    "vllm/model_executor/models/qwen3_5.py",
    "vllm/model_executor/models/registry.py",  # adapter check: which model file is served
    "vllm/model_executor/layers/mamba/gdn_linear_attn.py",
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm/v1/worker/gpu/model_runner.py",  # nan-probe's Model Runner V2 hooks
    "vllm/v1/worker/gpu_worker.py",  # nan-probe's check that the serving runner is hooked
)


def slim_tree(dest: Path) -> Path:
    """SLIM of the real 0.26.0 wheel, copied to ``dest``."""
    source = release_tree("0.26.0")
    for relpath in SLIM:
        if not (source / relpath).exists():
            continue  # gdn_linear_attn.py: only in some releases
        (dest / relpath).parent.mkdir(parents=True, exist_ok=True)
        if (source / relpath).is_dir():
            shutil.copytree(source / relpath, dest / relpath)
        else:
            shutil.copy2(source / relpath, dest / relpath)
    for dist_info in source.glob("vllm-*.dist-info"):
        shutil.copytree(dist_info, dest / dist_info.name)
    return dest


@pytest.fixture
def slim_tree_0260(tmp_path: Path) -> Path:
    """A slim real 0.26.0 tree: every file the default set patches or reads, and the dist-info."""
    return slim_tree(tmp_path / "t")


def normalized(root: Path) -> dict[str, str]:
    """snapshot(), with state.json's timestamps left out (a re-apply writes its own)."""
    digests = snapshot(root)
    state = root / ".patchkit" / "state.json"
    if state.is_file():
        data = json.loads(state.read_text())
        for patch in data["patches"]:
            patch.pop("applied_at")
        text = json.dumps(data, sort_keys=True).encode()
        digests[".patchkit/state.json"] = hashlib.sha256(text).hexdigest()
    return digests


@pytest.fixture
def site(tmp_path: Path) -> tuple[Path, Path]:
    """(T, V): a slim 0.26.0 tree and a victim directory beside it, with two files in V."""
    tree = slim_tree(tmp_path / "T")
    victim = tmp_path / "V"
    victim.mkdir()
    (victim / "a.txt").write_text("precious a\n")
    (victim / "d.txt").write_text("precious d\n")
    return tree, victim


@pytest.fixture
def bind_mount(tmp_path):
    """mount(source, target): a bind mount, undone after the test; skips where refused."""
    mounts = []

    def mount(source: Path, target: Path) -> None:
        done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot bind-mount here (needs root): {done.stderr.decode().strip()}")
        mounts.append(target)

    yield mount
    for target in mounts:
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def two_file_catalogue(tmp_path: Path) -> Path:
    """A catalogue with a test patch that touches two real vLLM 0.26.0 files.

    The real patches each touch one file; crash and rollback tests need a run
    that writes two. The diff is made here from the real files.
    """
    from tests.helpers import make_catalogue

    return make_catalogue(tmp_path / "catalogue", release_tree("0.26.0"))


GIT_IDENTITY = ["-c", "user.name=Fork Dev", "-c", "user.email=dev@example.invalid"]


def git(root: Path, *args: str) -> str:
    result = subprocess.run(["git", *GIT_IDENTITY, *args], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """vllm/ of the real 0.26.0 wheel (its slim part), committed, tagged v0.26.0, plus one
    local commit: fork mode reads and commits only the files the patches touch."""
    root = tmp_path / "vllm-fork"
    slim_tree(root)
    for dist_info in root.glob("vllm-*.dist-info"):  # a checkout has no dist-info
        shutil.rmtree(dist_info)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "vLLM 0.26.0")
    git(root, "tag", "v0.26.0")
    (root / "FORK.md").write_text("our fork\n")
    git(root, "add", "FORK.md")
    git(root, "commit", "-qm", "fork: unrelated local change")
    return root


# The releases the torch LoRA path's real-code tests run on: one per family of punica_gpu.py
# (the catalogue's `families` of matmul-add-lora-linear).
TORCH_PATH_FAMILIES = family_releases("matmul-add-lora-linear")
