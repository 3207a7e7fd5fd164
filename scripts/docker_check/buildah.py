"""buildah, the daemonless OCI builder the check builds docker/Dockerfile with.

No Docker engine runs on the CI machines and no container registry is
reachable from them, so the check drives Debian's buildah as root, with
chroot isolation (buildah's OCI isolation needs a runtime that this kernel's
hybrid cgroups refuse) and the kernel's overlay storage, in a store of its own
under the check's cache: the stand-in bases it tags with the official image's
name never reach the machine's own image store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("buildah", "debootstrap")
# The machine's certificate authorities, lent to each RUN step: pip inside the build
# reaches the package index through the same (possibly intercepting) proxy the host does.
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
STEP = re.compile(r"^\[\d+/\d+\] STEP \d+/\d+: (.*)$")
# buildah's own lines inside a step's output: the layer, the exit, its log warnings
BUILDAH_LINE = re.compile(
    r"^(--> |subprocess exited with status |Error: building at STEP |time=\"[^\"]*\" level=)"
)


def why_no_builder(uid: int, filesystems: str) -> str | None:
    """What stops this machine from running buildah's overlay storage, or None."""
    if uid != 0:
        return f"it needs root for buildah's chroot isolation and overlay mounts (uid {uid})"
    if not any(line.split()[-1:] == ["overlay"] for line in filesystems.splitlines()):
        return "the kernel has no overlay file system (not in /proc/filesystems)"
    return None


def machine_filesystems() -> str:
    """/proc/filesystems, after asking for the overlay module where it is missing."""
    text = Path("/proc/filesystems").read_text()
    if "overlay" not in text and shutil.which("modprobe") and os.geteuid() == 0:
        subprocess.run(["modprobe", "overlay"], capture_output=True)
        text = Path("/proc/filesystems").read_text()
    return text


def install() -> str | None:
    """Install buildah and debootstrap with apt-get where missing; None, or why not."""
    if all(shutil.which(name) for name in PACKAGES):
        return None
    if not shutil.which("apt-get"):
        return "buildah and debootstrap are not installed and there is no apt-get to install them"
    print(f"installing {' and '.join(PACKAGES)} with apt-get", flush=True)
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(command, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return None


# The container runtime failing to start a RUN step at all, before the step's command ran:
# runc's copy of its own binary into a sealed memfd ("Close_Fd sealing memfd copy: Device
# or resource busy"; the kernel refuses F_ADD_SEALS while a page of the copy is still
# pinned). Seen once in some thirty CI builds; the same build passed when run again.
RUNTIME_FAILURES = (re.compile(r"sealing memfd copy: .*busy"),)


def runtime_failure(log: str) -> str:
    """The line where the runtime failed to start a step, before the step ran; "" if none."""
    for line in log.splitlines():
        if any(pattern.search(line) for pattern in RUNTIME_FAILURES):
            return line.strip()
    return ""


def step_output(log: str, instruction: str) -> list[str]:
    """The lines one build step printed (not buildah's own); [] if it did not run."""
    lines: list[str] = []
    inside = False
    for line in log.splitlines():
        match = STEP.match(line)
        if match:
            inside = match[1].startswith(instruction)
        elif inside and not BUILDAH_LINE.match(line):
            lines.append(line)
    return lines


def failed_at(log: str) -> str:
    """The instruction a failed build stopped at, as buildah names it; "" if none."""
    match = re.search(r'^Error: building at STEP "(.*)": ', log, re.MULTILINE)
    return match[1] if match else ""


@dataclass
class Buildah:
    """buildah with the check's own storage; every call raises on failure unless told."""

    storage: Path

    @property
    def options(self) -> list[str]:
        # transient state (locks, mounts) on /run's tmpfs, one directory per store
        key = hashlib.sha256(str(self.storage).encode()).hexdigest()[:12]
        runroot = Path("/run") / f"patchkit-docker-{key}"
        return [
            "--root",
            str(self.storage),
            "--runroot",
            str(runroot),
            "--storage-driver",
            "overlay",
        ]

    def __call__(self, *args: str, check: bool = True) -> str:
        result = subprocess.run(["buildah", *self.options, *args], capture_output=True, text=True)
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, ["buildah", *args], result.stdout, result.stderr
            )
        return result.stdout.strip()

    def version(self) -> str:
        return json.loads(self("version", "--json"))["version"]

    def images(self) -> list[dict]:
        """Every image in the store, the layer cache's untagged ones too."""
        return json.loads(self("images", "--all", "--json") or "[]")

    def exists(self, image: str) -> bool:
        return bool(self("images", "-q", image, check=False))

    def label(self, image: str, key: str) -> str | None:
        if not self.exists(image):
            return None
        config = json.loads(self("inspect", "--type", "image", image))
        return (config["OCIv1"].get("config", {}).get("Labels") or {}).get(key)

    def layers(self, image: str) -> list[tuple[str, int]]:
        """Each layer of ``image``, oldest first: the step that made it and its size
        uncompressed (as the overlay store's layers.json records it)."""
        config = json.loads(self("inspect", "--type", "image", image))["OCIv1"]
        history = [h for h in config.get("history", []) if not h.get("empty_layer")]
        steps = [h.get("created_by", "") for h in history]
        known = json.loads((self.storage / "overlay-layers" / "layers.json").read_text())
        sizes = {layer.get("diff-digest"): layer.get("diff-size", 0) for layer in known}
        digests = config["rootfs"]["diff_ids"]
        return [(step, sizes.get(digest, 0)) for step, digest in zip(steps, digests, strict=True)]

    def bud(self, log: Path, *args: str) -> int:
        """`buildah bud` of docker/Dockerfile with the build context ``.``; its output in ``log``.

        RUN steps run chrooted in the host's network with the host's CA bundle.
        """
        volume = ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"] if CA_BUNDLE.is_file() else []
        how = ["--isolation", "chroot", "--pull-never", "--layers", *volume]
        command = ["buildah", *self.options, "bud", *how, "-f", "docker/Dockerfile", *args, "."]
        with log.open("w") as out:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode

    def run(self, container: str, *command: str, volume: str) -> None:
        self("run", "--isolation", "chroot", "-v", volume, container, "--", *command)

    @contextlib.contextmanager
    def mounted(self, image: str) -> Iterator[Path]:
        """A fresh container of ``image``, its root file system mounted for reading."""
        container = self("from", "--pull-never", "-q", image)
        with self.opened(container) as root:
            yield root

    @contextlib.contextmanager
    def opened(self, container: str) -> Iterator[Path]:
        """``container``'s root file system mounted; the container removed afterwards."""
        try:
            yield Path(self("mount", container))
        finally:
            self("umount", container, check=False)
            self("rm", container, check=False)

    def containers(self) -> list[str]:
        return self("containers", "-q", "--all").split()

    def forget_containers(self) -> None:
        for container in self.containers():
            self("rm", container, check=False)

    def forget_builds(self, keep: set[str]) -> None:
        """Every container, then every image but the ``keep`` names (and what they sit on):
        a build whose layers are cached never runs its steps, so each check starts from its
        bases."""
        self.forget_containers()
        for image in self.images():
            if not set(image.get("names") or []) & keep:
                self("rmi", "-f", image["id"], check=False)
