"""``patchkit fetch VERSION``: a pristine vLLM release tree from its PyPI wheel.

pip (as a subprocess) downloads the x86_64 wheel; its Python files and its
``vllm-VERSION.dist-info/`` (with the RECORD of sha256 hashes) are unpacked
into an install-like directory, so ``--target`` sees exactly what
``pip install`` would have put in site-packages. Compiled extensions are
left out: patches touch Python files only, and the tree stays small. The
wheel is deleted after unpacking; the tree is the cache.

A killed fetch must not leave work behind: pip runs with a parent-death
signal (Linux), so it dies with patchkit, and the staging directory carries
patchkit's pid in its name, so the next fetch removes those of dead runs.
On a terminal pip's progress bar shows on stderr; elsewhere pip is quiet.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from patchkit.errors import PatchkitError
from patchkit.tree import is_version

CACHE_ENV = "PATCHKIT_CACHE_DIR"
MARKER = ".patchkit-fetched"
# vLLM wheels are cp38-abi3 manylinux x86_64; 0.21.0 is tagged manylinux_2_39.
PLATFORMS = ["manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)
]


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "patchkit"


def fetch(version: str, dest: Path | None = None, progress: bool = False) -> Path:
    """Return a directory holding vllm/ and its dist-info for ``version``."""
    if not is_version(version):
        raise PatchkitError(f"fetch: {version!r} is not a version (e.g. 0.26.0)")
    dest = Path(dest) if dest else cache_root() / "trees" / f"vllm-{version}"
    if dest.parent.is_dir():
        remove_stale_staging(dest.parent)
    if (dest / MARKER).is_file():
        if (dest / ".patchkit").exists():
            print(
                f"note: {dest} has patchkit changes applied "
                f"(`patchkit revert --target {dest}` undoes them)",
                file=sys.stderr,
            )
        return dest
    if dest.exists() and any(dest.iterdir()):
        raise PatchkitError(
            f"fetch: {dest} exists and is not a patchkit tree; pass an empty --dest"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".vllm-{version}-pid{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=dest.parent) as tmp:
        wheel = _download(version, Path(tmp), progress)
        staging = Path(tmp) / "tree"
        _unpack(wheel, staging)
        (staging / MARKER).write_text(f"{wheel.name}\n")
        if dest.exists():
            dest.rmdir()
        os.replace(staging, dest)
    return dest


STAGING = re.compile(r"\.vllm-.+-pid(\d+)-[^/]+")


def remove_stale_staging(directory: Path) -> list[Path]:
    """Delete staging directories of fetches whose process is gone (killed runs)."""
    removed = []
    for entry in directory.iterdir():
        match = STAGING.fullmatch(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and not _alive(int(match[1])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> None:
    """In the pip child: get SIGKILL when patchkit dies (prctl PR_SET_PDEATHSIG, Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: a killed fetch may leave pip running until its download ends


def _download(version: str, directory: Path, progress: bool = False) -> Path:
    if progress:
        print(f"downloading vllm=={version} with pip (about 300 MB)...", file=sys.stderr)
    verbosity = ["--progress-bar", "on"] if progress else ["--quiet"]
    command = [
        sys.executable, "-m", "pip", "download", *verbosity, "--no-deps",
        "--only-binary", ":all:", "--python-version", "3.12", "--implementation", "cp",
        *[arg for platform in PLATFORMS for arg in ("--platform", platform)],
        "--dest", str(directory), f"vllm=={version}",
    ]  # fmt: skip
    result = subprocess.run(
        command,
        stdout=sys.stderr if progress else subprocess.PIPE,
        stderr=None if progress else subprocess.PIPE,
        text=True,
        preexec_fn=_die_with_parent,
    )
    wheels = sorted(directory.glob("vllm-*.whl"))
    if result.returncode != 0 or not wheels:
        stderr = result.stderr or ""
        lines = [ln for ln in stderr.splitlines() if ln.strip() and "is ignored" not in ln]
        detail = lines[-1].strip() if lines else f"pip exited {result.returncode}"
        raise PatchkitError(f"fetch: pip could not download vllm=={version}: {detail}")
    return wheels[0]


def _unpack(wheel: Path, staging: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.infolist():
                if _wanted(member.filename):
                    archive.extract(member, staging)
    except zipfile.BadZipFile:
        raise PatchkitError(f"fetch: {wheel.name} is not a valid wheel") from None
    if not (staging / "vllm" / "__init__.py").is_file():
        shutil.rmtree(staging, ignore_errors=True)
        raise PatchkitError(f"fetch: {wheel.name} holds no vllm/ package")


def _wanted(name: str) -> bool:
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return True
    return top == "vllm" and name.endswith((".py", ".pyi"))
