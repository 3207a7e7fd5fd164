"""docker/Dockerfile's shape, and the rules of the real build check that builds it.

The Dockerfile is built for real by scripts/docker_build_check.py, the last
part of the README's test command (buildah as root with overlay storage,
against stand-ins of the official image; docs/docker.md). These tests run
without a builder: the Dockerfile's stages and build context, when the check
skips, how it reads buildah's output (recorded from real builds), and that
the line it edits for a drifted base is in every tested release's real file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.docker_build_check import Check, Report
from scripts.docker_check.buildah import failed_at, runtime_failure, step_output, why_no_builder
from scripts.docker_check.expect import expected, newest_tested
from tests.conftest import REPO, release_tree

DOCKERFILE = REPO / "docker" / "Dockerfile"
DATA = REPO / "tests" / "data" / "docker"
CHECK = "scripts/docker_build_check.py"


def stages() -> list[tuple[str, str | None, list[tuple[str, str]]]]:
    """(base, name, [(INSTRUCTION, arguments)]) per stage; continuations joined."""
    found: list[tuple[str, str | None, list[tuple[str, str]]]] = []
    for line in re.sub(r"\\\n", " ", DOCKERFILE.read_text()).splitlines():
        instruction, _, args = line.strip().partition(" ")
        if not instruction or instruction.startswith("#"):
            continue
        if instruction.upper() == "FROM":
            words = args.split()
            found.append((words[0], words[2] if len(words) > 2 else None, []))
        elif found:
            found[-1][2].append((instruction.upper(), " ".join(args.split())))
    return found


def test_the_dockerfile_builds_a_wheel_then_patches_the_official_image():
    by_name = {name: (base, steps) for base, name, steps in stages()}
    assert by_name["wheel"][0] == by_name["patched"][0] == "vllm/vllm-openai:${VLLM_TAG}"
    runs = [args for kind, args in by_name["patched"][1] if kind == "RUN"]
    assert "patchkit apply --strict" in runs
    assert any("patchkit status --json > /etc/patchkit/status.json" in r for r in runs)
    assert any("patchkit doctor --kernels --json" in r for r in runs)
    assert ("COPY", "--from=wheel /wheel /tmp/patchkit-wheel") in by_name["patched"][1]
    assert by_name["verify"] == ("patched", [("RUN", "patchkit verify")])
    assert stages()[-1][:2] == ("patched", None)  # the default target is the patched image
    # plain instructions: no builder feature beyond multi-stage builds (no RUN --mount)
    assert not [args for _, _, steps in stages() for _, args in steps if "--mount" in args]


def test_the_build_context_is_what_the_dockerfile_copies_and_no_pip_override_stays():
    """`docker build .` sent the 900 MB .venv the README's first command makes,
    and ENV PIP_BREAK_SYSTEM_PACKAGES=1 stayed set in the runtime image."""
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln and not ln.startswith("#")]  # fmt: skip
    assert lines[0] == "*"  # everything out, then only what is copied back in
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for _, _, steps in stages():
        for kind, args in steps:
            if kind == "COPY" and not args.startswith("--from="):
                copied.update(args.split()[:-1])
            assert not (kind == "ENV" and "PIP_BREAK_SYSTEM_PACKAGES" in args), args
    assert allowed == copied


def test_the_readme_test_command_ends_with_the_real_build():
    [command] = [
        ln for ln in (REPO / "README.md").read_text().splitlines() if "ruff check . &&" in ln
    ]
    assert command.endswith(f"&& .venv/bin/python {CHECK}"), command
    assert command.index('-m "slow or network"') < command.index(CHECK)  # after the tests


@pytest.mark.parametrize(
    ("uid", "filesystems", "why"),
    [
        (1000, "nodev\toverlay\n", "it needs root for buildah's chroot isolation and overlay "
                                   "mounts (uid 1000)"),
        (0, "nodev\ttmpfs\n\text4\n", "the kernel has no overlay file system (not in "
                                      "/proc/filesystems)"),
        (0, "nodev\ttmpfs\nnodev\toverlay\n\text4\n", None),
    ],
)  # fmt: skip
def test_the_check_skips_with_one_line_only_where_no_builder_can_run(uid, filesystems, why):
    assert why_no_builder(uid, filesystems) == why


def test_a_build_that_passed_is_read_step_by_step():
    """buildah's output of a real build of 0.26.0's stand-in base (the check's log)."""
    log = (DATA / "patched-0.26.0.log").read_text()
    said = step_output(log, "RUN patchkit apply --strict")
    assert said[0] == "vLLM 0.26.0 at /usr/local/lib/python3.11/dist-packages (version from " \
                      "dist-info metadata)"  # fmt: skip
    assert said[-1].startswith("apply: 4 applied now; 6 bytecode files removed")
    assert not any(line.startswith(("--> ", "[")) for line in said)
    assert step_output(log, "RUN patchkit verify") == [] and failed_at(log) == ""


def test_a_build_that_failed_names_its_step_and_patchkit_s_one_line():
    """buildah's output of a real build of a drifted base: the step, the line, nothing else."""
    log = (DATA / "drifted-0.26.0.log").read_text()
    [line] = step_output(log, "RUN patchkit apply --strict")
    assert line.startswith("patchkit: error: expand-block-n: conflict:")
    assert failed_at(log) == "RUN patchkit apply --strict"


def test_a_step_the_runtime_failed_to_start_is_told_from_a_step_that_failed():
    """The last lines of a real CI build whose runtime (runc's sealed copy of itself) failed
    before pip ran; the drifted base's failure is patchkit's, and a passed build has none."""
    failed = (DATA / "runtime-failed-0.34.0.log").read_text()
    assert runtime_failure(failed) == "Close_Fd sealing memfd copy: Device or resource busy"
    assert failed_at(failed).startswith("RUN PIP_NO_CACHE_DIR=1 python3 -m pip wheel")
    for recorded in ("drifted-0.26.0.log", "patched-0.26.0.log"):
        assert runtime_failure((DATA / recorded).read_text()) == ""


class RecordedBuilds:
    """A builder that answers each `bud` with the next recorded log and its exit status."""

    def __init__(self, *logs: tuple[int, str]) -> None:
        self.logs, self.buds, self.args = list(logs), 0, []

    def forget_containers(self) -> None:
        pass

    def bud(self, log: Path, *args: str) -> int:
        code, name = self.logs[self.buds]
        self.buds += 1
        self.args.append(args)
        log.write_text((DATA / name).read_text())
        return code


@pytest.mark.parametrize(
    ("builds", "runs", "code"),
    [
        ([(1, "runtime-failed-0.34.0.log"), (0, "patched-0.26.0.log")], 2, 0),
        ([(1, "runtime-failed-0.34.0.log")] * 3, 2, 1),
        ([(1, "drifted-0.26.0.log"), (0, "patched-0.26.0.log")], 1, 1),
        ([(0, "patched-0.26.0.log")] * 2, 1, 0),
    ],
    ids=["runtime-once", "runtime-twice", "patchkit-failed", "passed"],
)
def test_only_a_step_the_runtime_failed_to_start_is_built_again_and_only_once(
    tmp_path, capsys, builds, runs, code
):
    check = Check(tmp_path, Report())
    check.buildah = RecordedBuilds(*builds)
    got, log = check.build("patched-0.34.0", "v0.34.0")
    assert (got, check.buildah.buds) == (code, runs)
    assert log == (DATA / builds[runs - 1][1]).read_text()
    again = [line for line in capsys.readouterr().out.splitlines() if "again" in line]
    assert len(again) == runs - 1
    # the second build runs every step again: CI's first attempt had run apply, failed at
    # the step after it, and the second took apply from the cache, printing nothing
    assert ["--no-cache" in args for args in check.buildah.args] == [False, True][:runs]


@pytest.mark.parametrize("release", ["0.26.0", newest_tested()])
def test_the_drifted_base_edits_a_line_the_release_s_file_has(release):
    """The check makes its drifted base by editing a line the first applied patch removes;
    the line must be in that release's real file, once or more."""
    relpath, line = expected(release).drift
    assert line in Path(release_tree(release), relpath).read_text().splitlines()
