#!/usr/bin/env python3
"""Build docker/Dockerfile for real, as shipped, and check what the image holds.

    python scripts/docker_build_check.py [--releases 0.26.0,0.34.0] [--cache DIR]

The README's test command ends with this (CI runs it after the tests). It
needs root and the kernel's overlay file system, installs buildah and
debootstrap with apt-get where they are missing, and builds the Dockerfile
with buildah (chroot isolation, overlay storage, no daemon) against a locally
made stand-in of the official image for each release (scripts/docker_check/
base.py: Debian's system Python marked externally managed, the real vLLM
wheel in dist-packages, no git, no patch, no compiler), kept between runs in
the cache (PATCHKIT_DOCKER_CACHE, else ~/.cache/patchkit-docker). By default
the releases are 0.26.0 and the catalogue's newest tested release.

Each check prints one line, PASS or FAIL with what it saw. Per release: the
base is image-like; `apply --strict` succeeds; /etc/patchkit/status.json read
from the image lists every patch in the state the catalogue gives that
release; the files changed in vLLM are exactly the patch set's (and the stale
bytecode of those modules is gone); the image adds to its base nothing but
patchkit, its dependencies, the patched files, their backups and the records
(measured file by file and layer by layer); a base with one drifted line
fails the build at `RUN patchkit apply --strict` with one line and nothing
changed. For the first release: a build over the patched image is a no-op
that leaves vLLM's tree, patchkit's state and status.json byte-identical, and
`--target verify` fails with one line without a GPU.

Exit 0 when every check passed, 1 when one failed. Where the machine cannot
run the builder (no root, no overlay, no buildah and no apt-get) it prints
one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.docker_check import base as bases  # noqa: E402
from scripts.docker_check import buildah as builder  # noqa: E402
from scripts.docker_check import trees  # noqa: E402
from scripts.docker_check.expect import expected, newest_tested  # noqa: E402

NAME = "docker build check"
APPLY = "RUN patchkit apply --strict"
VERIFY = "RUN patchkit verify"
ERROR = "patchkit: error:"


class Report:
    """One line per check, and notes between them; the exit status is whether all passed."""

    def __init__(self) -> None:
        self.failed = 0

    def check(self, what: str, ok: bool, detail: str) -> bool:
        print(f"{'PASS' if ok else 'FAIL'} {what}: {detail}", flush=True)
        self.failed += not ok
        return ok

    def note(self, line: str) -> None:
        print(f"     {line}", flush=True)


class Check:
    """The builds and their checks, in the check's own buildah store under ``cache``."""

    def __init__(self, cache: Path, report: Report) -> None:
        self.cache, self.report = cache, report
        self.buildah = builder.Buildah(cache / "storage")
        self.logs = cache / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def build(self, name: str, tag: str, *args: str) -> tuple[int, str]:
        """`buildah bud` with VLLM_TAG=``tag``: its exit status and its output.

        A build the container runtime failed to start a step of runs once more, said in a
        note: that failure is the runtime's, before any of patchkit's code ran. A second
        one is the build's result, so a runtime that always fails still fails the check.
        The second build takes no layer from the first: a step the first one ran (apply,
        before the runtime failed at a later step) would be cached and print nothing, and
        the checks read what the steps print.
        """
        code, log = self.bud_once(name, tag, *args)
        failure = builder.runtime_failure(log) if code else ""
        if failure:
            self.report.note(f"{name}: the runtime failed to start a step ({failure}); again")
            code, log = self.bud_once(name, tag, "--no-cache", *args)
        return code, log

    def bud_once(self, name: str, tag: str, *args: str) -> tuple[int, str]:
        self.buildah.forget_containers()  # a failed step's container, from an earlier build
        log = self.logs / f"{name}.log"
        started = time.monotonic()
        code = self.buildah.bud(log, "--build-arg", f"VLLM_TAG={tag}", *args)
        seconds = time.monotonic() - started
        self.report.note(f"{name}: VLLM_TAG={tag} {' '.join(args)}: exit {code} in {seconds:.0f} s")
        return code, log.read_text()

    def base(self, release: str) -> bases.Base:
        started = time.monotonic()
        base, hit = bases.ensure(self.buildah, release, self.cache)
        how = "cached" if hit else f"made in {time.monotonic() - started:.0f} s"
        self.report.note(f"base {base.image}, {how}")
        with self.buildah.mounted(base.image) as root:
            problems = trees.not_image_like(root, release)
        detail = "; ".join(problems) or base.describe()
        self.report.check(f"{release} base is image-like", not problems, detail)
        return base

    def patched(self, base: bases.Base) -> str | None:
        """The patched image's name, once its build and checks ran; None if it failed."""
        release, want = base.vllm, expected(base.vllm)
        image = f"localhost/patchkit-check/patched:{release}"
        code, log = self.build(f"patched-{release}", f"v{release}", "-t", image)
        said = builder.step_output(log, APPLY)
        summary = next((line for line in said if line.startswith("apply: ")), "")
        ok = code == 0 and bool(summary) and not any(ERROR in line for line in said)
        if not self.report.check(f"{release} apply --strict", ok, summary or tail(log)):
            return None
        with self.buildah.mounted(base.image) as before, self.buildah.mounted(image) as after:
            self.status(release, after, want.states)
            changes = trees.differences(before, after)
            self.changed_files(release, before, after, want.files)
            self.clean(release, changes, after, want.files)
        below = len(self.buildah.layers(base.image))
        for step, size in self.buildah.layers(image)[below:]:
            step = re.sub(r"\s+", " ", step.removeprefix("/bin/sh -c "))
            self.report.note(f"layer {size / 1e6:7.3f} MB  {step[:100]}")
        return image

    def status(self, release: str, root: Path, states: dict[str, str]) -> None:
        status = json.loads((root / "etc/patchkit/status.json").read_text())
        found = {p["id"]: p["state"] for p in status["patches"]}
        where = {"version": release, "path": f"/{bases.SITE}", "source": "metadata"}
        ok = found == states and status["vllm"] == where
        detail = ", ".join(f"{k} {v}" for k, v in found.items())
        if not ok:
            detail += f"; expected {states} and {where}, read vllm {status['vllm']}"
        self.report.check(f"{release} /etc/patchkit/status.json", ok, detail)

    def changed_files(self, release: str, base: Path, image: Path, files: set[str]) -> None:
        changed, bytecode, removed = trees.vllm_changes(base, image)
        stale = {p for p in bytecode if trees.stale_bytecode(p, files)}
        ok = changed == files and stale == removed == bytecode
        listed = ", ".join(sorted(changed))
        detail = f"{len(changed)}, the patch set's: {listed}; {len(removed)} stale .pyc removed"
        if not ok:
            detail += f"; the patch set's: {sorted(files)}; bytecode changed: {sorted(bytecode)}"
        self.report.check(f"{release} files changed in vLLM", ok, detail)

    def clean(self, release: str, changes: trees.Changes, root: Path, files: set[str]) -> None:
        parts = trees.classify(changes, root, files)
        other = parts.pop("other", trees.Part())
        detail = "; ".join(f"{n} {p.files} files {p.size / 1e6:.3f} MB" for n, p in parts.items())
        if other.files:
            under = Counter("/".join(p.split("/")[:3]) for p in other.paths)
            places = ", ".join(f"/{place} ({n})" for place, n in under.most_common(10))
            detail = f"{other.files} paths nothing should leave, under {places}"
        self.report.check(f"{release} the image adds only patchkit's own", not other.files, detail)
        dists = sorted(p.split("/")[-1] for p in changes.added if p.endswith(".dist-info"))
        self.report.note(f"installed: {', '.join(dists)}")

    def rebuild(self, base: bases.Base, patched: str) -> None:
        """The Dockerfile over its own result: patchkit reinstalled, apply with nothing to
        do, and vLLM's tree, patchkit's state and status.json as the first build left them."""
        release, site = base.vllm, bases.SITE
        tag = f"v{release}-patchkit"
        self.buildah("tag", patched, bases.image_name(tag))
        image = f"localhost/patchkit-check/rebuilt:{release}"
        code, log = self.build(f"rebuilt-{release}", tag, "-t", image)
        said = builder.step_output(log, APPLY)
        if code != 0:
            self.report.check(f"{release} build over the patched image", False, tail(log))
            return
        kept = (f"{site}/vllm", f"{site}/.patchkit", "etc/patchkit/status.json")
        with self.buildah.mounted(patched) as first, self.buildah.mounted(image) as second:
            differ = [p for p in kept if trees.digest(first, p) != trees.digest(second, p)]
        nothing = [line for line in said if line.startswith("apply: nothing to do")]
        ok = bool(nothing) and not differ
        detail = f"{nothing[0]}; vllm/, .patchkit/ and status.json byte-identical"
        if not ok:
            detail = f"apply printed {said}; not byte-identical: {differ}"
        self.report.check(f"{release} build over the patched image is a no-op", ok, detail)

    def drifted(self, base: bases.Base) -> None:
        release, drift = base.vllm, expected(base.vllm).drift
        if drift is None:
            self.report.check(f"{release} drifted base", False, "no patch applies there")
            return
        relpath, line = drift
        image = self.drifted_base(base, relpath, line)
        code, log = self.build(f"drifted-{release}", f"v{release}-drifted")
        said = builder.step_output(log, APPLY)
        one_line = len(said) == 1 and said[0].startswith(ERROR) and relpath in said[0]
        stopped = builder.failed_at(log)
        untouched = stopped == APPLY and self.untouched(image)
        ok = code != 0 and stopped == APPLY and one_line and untouched
        detail = f"{said[0] if one_line else said}; vLLM's tree as it was, no .patchkit/"
        if not ok:
            detail = f"stopped at {stopped!r}, said {said}, tree and state untouched: {untouched}"
        self.report.check(f"{release} drifted base fails at apply --strict", ok, detail)

    def drifted_base(self, base: bases.Base, relpath: str, line: str) -> str:
        """The base with ``line`` of one vLLM file edited by hand, under a tag of its own."""
        name = bases.image_name(f"v{base.vllm}-drifted")
        container = self.buildah("from", "--pull-never", "-q", base.image)
        path = Path(self.buildah("mount", container)) / bases.SITE / relpath
        text = path.read_text()
        path.write_text(text.replace(line, f"{line}  # edited", 1))
        self.buildah("umount", container)
        self.buildah("commit", "-q", "--rm", container, name)
        return name

    def untouched(self, drifted_image: str) -> bool:
        """Whether the failed step's container (buildah keeps it) holds the drifted base's
        vLLM tree as it was, and no patchkit state."""
        containers = self.buildah.containers()
        if len(containers) != 1:
            return False
        site = f"{bases.SITE}/vllm"
        with (
            self.buildah.opened(containers[0]) as after,
            self.buildah.mounted(drifted_image) as before,
        ):
            same = trees.digest(before, site) == trees.digest(after, site)
            return same and not (after / bases.SITE / ".patchkit").exists()

    def verify_target(self, base: bases.Base) -> None:
        release = base.vllm
        code, log = self.build(f"verify-{release}", f"v{release}", "--target", "verify")
        said = builder.step_output(log, VERIFY)
        one_line = len(said) == 1 and said[0].startswith(ERROR)
        ok = code != 0 and builder.failed_at(log) == VERIFY and one_line
        detail = said[0] if one_line else f"{said} ({tail(log)})"
        self.report.check(f"{release} --target verify without a GPU", ok, detail)


def tail(log: str, lines: int = 8) -> str:
    return " | ".join(log.splitlines()[-lines:])


@contextlib.contextmanager
def locked(cache: Path):
    """One check at a time per cache: the store and the bases are shared."""
    with (cache / "lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{NAME}: waiting for another run's lock ({cache / 'lock'})", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def run(releases: list[str], cache: Path) -> int:
    """Every check; how many failed."""
    report = Report()
    check = Check(cache, report)
    check.buildah.forget_builds(keep=bases.made(check.buildah))
    store = cache / "storage"
    print(f"{NAME}: buildah {check.buildah.version()}, chroot isolation, overlay store {store}")
    made = [check.base(release) for release in releases]
    patched = [check.patched(base) for base in made]
    if patched[0]:
        check.rebuild(made[0], patched[0])
        check.verify_target(made[0])
    for base in made:
        check.drifted(base)
    check.buildah.forget_containers()
    return report.failed


def checked(releases: list[str], cache: Path) -> int | None:
    """How many checks failed; None when this machine cannot run the builder (one line)."""
    why = builder.why_no_builder(os.geteuid(), builder.machine_filesystems()) or builder.install()
    if why:
        print(f"{NAME}: skipped: {why}")
        return None
    cache.mkdir(parents=True, exist_ok=True)
    with locked(cache):
        return run(releases, cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    releases = f"0.26.0,{newest_tested()}"
    parser.add_argument("--releases", default=releases, help="default: %(default)s")
    cache = os.environ.get("PATCHKIT_DOCKER_CACHE") or Path.home() / ".cache/patchkit-docker"
    parser.add_argument("--cache", type=Path, default=Path(cache), help="default: %(default)s")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        failed = checked(args.releases.split(","), args.cache)
    except subprocess.CalledProcessError as error:  # buildah, apt-get
        words = " ".join(str(w) for w in error.cmd[:4])
        print(f"FAIL {words}: exit {error.returncode}: {tail(str(error.stderr or ''), 4)}")
        failed = 1
    except RuntimeError as error:  # the stand-in base: debootstrap, pip download
        print(f"FAIL making a base: {error}")
        failed = 1
    if failed is None:
        return 0
    minutes, seconds = divmod(round(time.monotonic() - started), 60)
    verdict = f"{failed} checks FAILED" if failed else "every check passed"
    print(f"{NAME}: {verdict} in {minutes} min {seconds} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
