"""The stand-in for the official vLLM image, made locally and kept between runs.

`vllm/vllm-openai:vX` cannot be pulled here (no container registry is
reachable), so the check makes an image with what the Dockerfile relies on:
a Debian 12 minbase root file system (debootstrap, Debian's packages only)
whose system Python 3.11 is marked externally managed (PEP 668) and has
Debian's pip; the release's real PyPI wheel installed by that pip into the
system dist-packages (/usr/local/lib/python3.11/dist-packages, its files,
bytecode and RECORD, as the official image has it); the torch and Triton the
kernel scan runs with, and numpy; no git, no GNU patch, no compiler. vLLM's
other dependencies are left out: patchkit never imports vLLM.

torch: the release's own pin as a CPU build where pip finds one; the CI
machines reach PyPI, whose Linux torch is the CUDA build, and hold only the
CPU build the tests pin, so the stand-in falls back to that one and says so.
Triton: the one the release's torch pin requires on Linux (TRITON_OF_TORCH),
so the scan compiles with the image's own Triton.

Each release's base is tagged with the official name in the check's own store
and labelled with this module's hash: a base made by another recipe is made
again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from scripts.docker_check.buildah import Buildah

DEBIAN = "bookworm"  # Debian 12, the CI machines' own release
MIRROR = "http://deb.debian.org/debian"
PYTHON = "3.11"  # Debian 12's python3
PACKAGES = "python3,python3-pip"  # debootstrap --include: no recommends, so no compiler
SITE = f"usr/local/lib/python{PYTHON}/dist-packages"  # where pip puts what root installs
LABEL = "org.patchkit.check.base"
# torch's own Requires-Dist on Linux, per the torch release a vLLM release pins.
TRITON_OF_TORCH = {"2.11.0": "triton==3.6.0", "2.14.0": "triton~=3.8.0"}
KEY = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


@dataclass
class Base:
    """What one release's stand-in holds (the base's label, as JSON)."""

    image: str
    vllm: str
    torch: str  # installed
    torch_pin: str  # the release's pin
    triton: str
    key: str = KEY

    def describe(self) -> str:
        torch = self.torch
        if not torch.startswith(self.torch_pin):
            torch += f" (the release pins {self.torch_pin}; no CPU build of it here)"
        return (
            f"Debian 12 minbase, Python {PYTHON} (PEP 668), vLLM {self.vllm} wheel in "
            f"dist-packages, torch {torch}, Triton {self.triton}"
        )


def image_name(tag: str) -> str:
    """The official image's name, in the check's own store only."""
    return f"docker.io/vllm/vllm-openai:{tag}"


def cached(buildah: Buildah, release: str) -> Base | None:
    """The release's base if this recipe made it."""
    label = json.loads(buildah.label(image_name(f"v{release}"), LABEL) or "{}")
    if label.get("key") != KEY or label.get("vllm") != release:
        return None
    return Base(**label)


def made(buildah: Buildah) -> set[str]:
    """The names of this recipe's images in the store: each release's base (whichever
    releases a run asks for) and the Debian image they sit on."""
    names = {debian_image()}
    for image in buildah.images():
        for name in image.get("names") or []:
            release = name.removeprefix(image_name("v"))
            if release != name and cached(buildah, release):
                names.add(name)
    return names


def ensure(buildah: Buildah, release: str, work: Path) -> tuple[Base, bool]:
    """This release's base, and whether it came from the cache."""
    base = cached(buildah, release)
    if base:
        return base, True
    debian = ensure_debian(buildah)
    with tempfile.TemporaryDirectory(dir=work, prefix="wheels-") as wheels:
        base = download(release, Path(wheels))
        container = buildah("from", "--pull-never", "-q", debian)
        pip = "python3 -m pip install -q --break-system-packages --no-cache-dir --no-index"
        installs = (
            f"{pip} --find-links /wheels torch=={base.torch}",  # and torch's dependencies
            f"{pip} --no-deps /wheels/vllm-*.whl /wheels/triton-*.whl /wheels/numpy-*.whl",
        )
        buildah.run(container, "sh", "-c", " && ".join(installs), volume=f"{wheels}:/wheels:ro")
        buildah("config", "--label", f"{LABEL}={json.dumps(asdict(base))}", container)
        buildah("commit", "-q", "--rm", container, base.image)
    return base, False


def debian_image() -> str:
    return f"localhost/patchkit-check/debian-{DEBIAN}:{KEY}"


def ensure_debian(buildah: Buildah) -> str:
    """Debian's minbase with python3 and pip, apt's lists and archives emptied."""
    name = debian_image()
    if buildah.exists(name):
        return name
    container = buildah("from", "scratch")
    root = Path(buildah("mount", container))
    command = ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", DEBIAN, str(root)]
    result = subprocess.run([*command, MIRROR], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"debootstrap failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    for leftover in ("var/lib/apt/lists", "var/cache/apt/archives"):
        for path in (root / leftover).glob("*"):
            if path.is_file() and path.name != "lock":
                path.unlink()
    buildah("umount", container)
    path = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    buildah("config", "--env", path, "--cmd", "/bin/bash", container)
    buildah("commit", "-q", "--rm", container, name)
    return name


def download(release: str, wheels: Path) -> Base:
    """The release's wheel, its torch (CPU) with torch's dependencies, its Triton and the
    numpy it asks for (torch warns on every start without one)."""
    pip_download(wheels, "--no-deps", f"vllm=={release}")
    wheel = next(wheels.glob("vllm-*.whl"))
    torch_pin = requirement(wheel, "torch").removeprefix("torch==")
    if torch_pin not in TRITON_OF_TORCH:
        raise RuntimeError(
            f"vLLM {release} pins torch {torch_pin}, whose Triton is not in TRITON_OF_TORCH "
            f"({__file__}): add it from torch's Requires-Dist"
        )
    torch = f"{torch_pin}+cpu"
    if not pip_download(wheels, f"torch=={torch}", check=False):
        torch = f"{test_extra_torch()}+cpu"
        pip_download(wheels, f"torch=={torch}")
    pip_download(wheels, "--no-deps", TRITON_OF_TORCH[torch_pin], requirement(wheel, "numpy"))
    triton = next(wheels.glob("triton-*.whl")).name.split("-")[1]
    return Base(image_name(f"v{release}"), release, torch, torch_pin, triton)


def pip_download(wheels: Path, *args: str, check: bool = True) -> bool:
    """pip download with this machine's index settings, for the image's Python."""
    command = [
        *(sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:"),
        *("--python-version", PYTHON, "--implementation", "cp"),
        *("--platform", "manylinux_2_28_x86_64", "-d", str(wheels), *args),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"pip download {' '.join(args)} failed: {result.stderr[-2000:]}")
    return result.returncode == 0


def requirement(wheel: Path, name: str) -> str:
    """What a vLLM wheel's METADATA requires of ``name`` ("torch==2.11.0", "numpy")."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    match = re.search(rf"^Requires-Dist: ({name}\b[^;\s]*)\s*$", text, re.MULTILINE)
    if not match:
        raise RuntimeError(f"{wheel.name}: its METADATA does not require {name}")
    return match[1]


def test_extra_torch() -> str:
    """The CPU torch the tests pin (the test extra of patchkit-vllm), which CI holds."""
    pins = [
        r for r in importlib.metadata.requires("patchkit-vllm") or [] if r.startswith("torch==")
    ]
    return pins[0].split(";")[0].removeprefix("torch==").strip()
