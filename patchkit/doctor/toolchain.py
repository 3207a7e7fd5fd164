"""Which Triton, ptxas and disassembler: worked out once, for doctor and the kernel scan.

Found without importing Triton (doctor must work where importing it would
fail), from the Python that runs patchkit, and, separately, from the
``triton-*.dist-info`` installed next to the vLLM tree being examined: the
two differ when patchkit runs in another environment than vLLM, and then
the scan's evidence is about a Triton vLLM does not run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from patchkit.fs.files import MAX_SETTINGS_BYTES, read_regular
from patchkit.vllmtree.reinstall import environment_python

PTXAS_ENV = "TRITON_PTXAS_PATH"


class ScanUnavailable(Exception):
    """Triton (or its disassembler) is missing: the scan cannot run here."""


@dataclass(frozen=True)
class Toolchain:
    """The Triton importable here and the ptxas it compiles sm_90 with."""

    triton: str | None = None  # version
    location: str | None = None  # the triton package directory
    ptxas: str | None = None
    ptxas_source: str | None = None  # TRITON_PTXAS_PATH | bundled
    ptxas_version: str | None = None

    def describe(self) -> str:
        """'Triton 3.7.1 (/x/triton), ptxas 12.8.93 (bundled: /x/ptxas)'."""
        if not self.triton:
            return "no Triton importable here"
        ptxas = f"ptxas {self.ptxas_version or 'unknown'} ({self.ptxas_source}: {self.ptxas})"
        return f"Triton {self.triton} ({self.location}), {ptxas}"


def toolchain() -> Toolchain:
    """This Python's Triton and its sm_90 ptxas (TRITON_PTXAS_PATH, else the bundled one)."""
    spec = importlib.util.find_spec("triton")
    location = next(iter(spec.submodule_search_locations or []), None) if spec else None
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        version = None
    ptxas, source = os.environ.get(PTXAS_ENV) or None, PTXAS_ENV
    if ptxas is None and location:
        ptxas, source = str(Path(location) / "backends" / "nvidia" / "bin" / "ptxas"), "bundled"
    return Toolchain(
        triton=version,
        location=location,
        ptxas=ptxas,
        ptxas_source=source if ptxas else None,
        ptxas_version=ptxas_version(ptxas) if ptxas else None,
    )


def ptxas_version(path: str) -> str | None:
    """'12.8.93' from ``ptxas --version``; None if it does not run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+), V([\d.]+)", out.stdout)
    return match.group(2) if match else None


# ptxas spells its version in its own bytes ("Cuda compilation tools, release 12.8,
# V12.8.93"), as --version prints it; the 12.8 binary is 32 MB.
_PTXAS_RELEASE = re.compile(rb"release (\d+\.\d+), V([\d.]+)")
MAX_PTXAS_BYTES = 256 << 20


def ptxas_version_read(path: str) -> str | None:
    """The version ``ptxas --version`` would print, read from the binary, never run; None
    if it is no regular file of at most MAX_PTXAS_BYTES or spells no version.

    For the ptxas beside a vLLM tree: it is one of the tree's files, and doctor only
    reads a tree. Running it ran whatever the tree put there, with patchkit's rights
    (root's, under sudo), free to write anywhere.
    """
    try:
        data = read_regular(path, MAX_PTXAS_BYTES)
    except (OSError, ValueError):
        return None
    match = _PTXAS_RELEASE.search(data)
    return match.group(2).decode() if match else None


def disassembler(location: str) -> list[str]:
    """cuobjdump (or nvdisasm) from Triton's wheel, else nvidia-cuda-nvdisasm's, else PATH's."""
    bin_dir = Path(location) / "backends" / "nvidia" / "bin"
    if (bin_dir / "cuobjdump").is_file():
        return [str(bin_dir / "cuobjdump"), "-sass"]
    if (bin_dir / "nvdisasm").is_file():
        return [str(bin_dir / "nvdisasm"), "-c"]
    spec = importlib.util.find_spec("nvidia")
    for place in spec.submodule_search_locations if spec else []:
        candidate = Path(place) / "cuda_nvdisasm" / "bin" / "nvdisasm"
        if candidate.is_file():
            return [str(candidate), "-c"]
    found = shutil.which("nvdisasm")
    if found:
        return [found, "-c"]
    raise ScanUnavailable(
        "no SASS disassembler: Triton's wheel has no cuobjdump/nvdisasm; "
        "`pip install nvidia-cuda-nvdisasm` provides one"
    )


@dataclass(frozen=True)
class TreeTriton:
    """The Triton installed next to a vLLM tree (its dist-info, read without importing)."""

    version: str | None  # None: no triton-*.dist-info beside the tree
    location: str | None
    python: str | None  # the environment's Python, when the tree is a venv's site-packages
    ptxas_version: str | None = None  # of its bundled ptxas


def tree_triton(root: Path) -> TreeTriton:
    """The Triton whose dist-info sits in the same site-packages as the tree's ``vllm/``."""
    root = Path(root)
    infos = sorted(root.glob("triton-*.dist-info"))
    version = None
    for info in infos:
        match = re.search(r"^Version:\s*(\S+)", _read(info / "METADATA"), re.MULTILINE)
        if match:
            version = match.group(1)
            break
    package = root / "triton"
    location = str(package) if version and package.is_dir() else None
    bundled = package / "backends" / "nvidia" / "bin" / "ptxas"
    return TreeTriton(
        version=version,
        location=location,
        python=environment_python(root),
        ptxas_version=ptxas_version_read(str(bundled)) if location else None,
    )


def _read(path: Path) -> str:
    """A dist-info file beside the tree as text; '' where it is no regular file of at most
    1 MiB (a FIFO there hung doctor; a link to /dev/zero took all its memory)."""
    try:
        return read_regular(path, MAX_SETTINGS_BYTES).decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return ""


def same_triton(ours: Toolchain, theirs: TreeTriton) -> bool:
    """Whether the scan's Triton is the release installed next to the tree.

    The same release installed elsewhere counts as the same: its compiler
    and bundled ptxas are the same files.
    """
    return theirs.version is not None and ours.triton == theirs.version
