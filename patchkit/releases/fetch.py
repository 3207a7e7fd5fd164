"""``patchkit fetch VERSION``: a pristine vLLM release tree from its PyPI wheel.

pip (as a subprocess) downloads the x86_64 wheel; its Python files and its
``vllm-VERSION.dist-info/`` (with the RECORD of sha256 hashes) are unpacked
into an install-like directory, so ``--target`` sees exactly what
``pip install`` would have put in site-packages. Compiled extensions are
left out: patches touch Python files only, and the tree stays small. The
wheel is deleted after unpacking; the tree is the cache.

A killed fetch must not leave work behind: pip runs with a parent-death
signal (Linux), so it dies with patchkit, and the staging directory holds a
marker file patchkit writes first (its pid and the process's start time), so
the next fetch removes the staging directories of dead runs, and only
those: a directory is never recognised by its name.
On a terminal pip's progress bar shows on stderr; elsewhere pip is quiet.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from patchkit.errors import PatchkitError
from patchkit.fs.places import cache_root
from patchkit.fs.safepath import Root, UnsafePath, mount_id, remove_entry
from patchkit.fs.signals import held
from patchkit.vllmtree.tree import is_version

MARKER = ".patchkit-fetched"
STAGING_MARKER = ".patchkit-staging"
# vLLM wheels are cp38-abi3 manylinux x86_64; 0.21.0 is tagged manylinux_2_39.
PLATFORMS = ["manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)
]


def fetch(version: str, dest: Path | None = None, progress: bool = False) -> Path:
    """Return a directory holding vllm/ and its dist-info for ``version``."""
    if not is_version(version):
        raise PatchkitError(f"fetch: {version[:40]!r} is not a version (e.g. 0.26.0)")
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
    with held():  # a staging directory is never left without its marker
        tmp = Path(tempfile.mkdtemp(prefix=f".vllm-{version}-", dir=dest.parent))
        (tmp / STAGING_MARKER).write_text(json.dumps(_this_process()))
    try:
        wheel = _download(version, tmp, progress)
        staging = tmp / "tree"
        _unpack(wheel, staging)
        (staging / MARKER).write_text(f"{wheel.name}\n")
        if dest.exists():
            dest.rmdir()
        os.replace(staging, dest)
    finally:
        _remove_staging(dest.parent, tmp.name)
    return dest


def _this_process() -> dict:
    return {"pid": os.getpid(), "start": _start_time(os.getpid())}


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[19]
    except (OSError, IndexError):
        return None


def remove_stale_staging(directory: Path) -> list[Path]:
    """Delete the staging directories of fetches whose process is gone (killed runs).

    A staging directory is one holding patchkit's marker file; its name does
    not matter, so a user's directory that looks like one is never touched.
    The marker is read, and the contents removed, through one descriptor of
    that directory: swapping another directory in under its name cannot
    redirect the removal.
    """
    removed = []
    with Root.open(directory) as fs:
        for name in fs.names("", "fetch"):
            if _remove_if_dead_staging(fs, name):
                removed.append(directory / name)
    return removed


def _remove_if_dead_staging(fs: Root, name: str) -> bool:
    try:
        staging = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fs.fd
        )
    except OSError:
        return False  # not a directory, a link, or gone
    with Root(fs.full(name), staging) as held_open:  # closes the descriptor
        if not _dead_marker(held_open):
            return False
        with held():
            _empty_staging(held_open.fd, held_open.path)
    try:
        os.rmdir(name, dir_fd=fs.fd)  # only an empty directory goes; a swapped-in one is not
    except OSError:
        pass
    return True


def _dead_marker(staging: Root) -> bool:
    try:
        marker = json.loads(staging.read(STAGING_MARKER, "fetch") or b"null")
    except (ValueError, RecursionError, UnsafePath, OSError):
        return False
    if not isinstance(marker, dict) or not isinstance(marker.get("pid"), int):
        return False
    return not _alive(marker["pid"], marker.get("start"))


def _empty_staging(fd: int, path: Path) -> None:
    """Everything in a staging directory, the marker last (an interrupted cleanup stays
    recognisable); never following a link or leaving the mount."""
    mount = mount_id(fd)
    names = sorted(os.listdir(fd), key=lambda n: n == STAGING_MARKER)
    for name in names:
        remove_entry(fd, name, mount, path / name)


def _remove_staging(directory: Path, name: str) -> None:
    """Remove this run's own staging directory (signals held: all of it or the marker stays)."""
    try:
        with held(), Root.open(directory) as fs:
            staging = os.open(
                name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fs.fd
            )
            try:
                _empty_staging(staging, directory / name)
            finally:
                os.close(staging)
            os.rmdir(name, dir_fd=fs.fd)
    except (OSError, UnsafePath):
        pass  # left for the next fetch, which finds it by its marker


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, ValueError):
        return False  # no process can have such a pid
    except PermissionError:
        pass
    return start is None or _start_time(pid) in (None, start)


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
        sys.executable,
        "-m",
        "pip",
        "download",
        *verbosity,
        "--no-deps",
        "--only-binary",
        ":all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *[arg for platform in PLATFORMS for arg in ("--platform", platform)],
        "--dest",
        str(directory),
        f"vllm=={version}",
    ]
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
        raise PatchkitError(f"fetch: {wheel.name} holds no vllm/ package")


def _wanted(name: str) -> bool:
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return True
    return top == "vllm" and name.endswith((".py", ".pyi"))
