"""Every tested release, from its real PyPI wheel: decision, apply, compile, re-apply, revert.

What a release expects is read from the catalogue (its variants' and
decisions' ranges, its notices), so a release is added by editing patches/
only. Two things keep that from checking the catalogue against itself:

- ``status`` decides by content, not by number: a variant is needed only where
  its hunks fit the release's real files, a decision holds only where its
  evidence matches, and a range that disagrees with the content is a warning.
  test_release requires the content's decision to be the catalogue's, with no
  warning, and apply to change exactly the expected variants' files.
- The survey (patches/survey.toml): what reading every surveyed release's
  real files found, written by hand as ranges, never derived from the
  catalogue. Content cannot catch a wrong decision whose diff still fits
  (block-k-32 and torch-ops apply cleanly on 0.33.0, which has the upstream
  fix; single-parameter on 0.32.0, which needs the patterns variant); inside
  the survey the catalogue must agree with it, and every surveyed release must
  stay tested. A release not yet in the survey is checked by content alone
  until its facts are surveyed.
"""

from __future__ import annotations

import ast
import json
import py_compile
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from patchkit.catalogue.model import Decision, Notice, Variant
from tests.conftest import (
    CATALOGUE,
    RELEASES,
    REPO,
    copy_tree,
    patched_text,
    release_tree,
    releases_decided,
    releases_with_variant,
    run_cli,
    snapshot,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# Each patch the catalogue decides not-applicable somewhere, at its newest such release.
NOT_APPLICABLE = [
    (patch.id, decided[-1])
    for patch in CATALOGUE.patches
    if (decided := releases_decided(patch.id, "not-applicable"))
]


# ----- the survey: facts written by hand, never derived -----

# patches/survey.toml: beside the catalogue, read only here, written by hand.
SURVEY_FILE = REPO / "patches" / "survey.toml"
_SURVEY = tomllib.loads(SURVEY_FILE.read_text())
SURVEYED_RELEASES = tuple(_SURVEY["releases"])
# Per patch, what each surveyed release gets: a variant's name or a decision's
# state, by range ("" = every surveyed release).
SURVEY: dict[str, dict[str, str]] = _SURVEY["patches"]
# The known upstream bugs status names (notices, not warnings), by range.
SURVEYED_NOTICES: dict[str, str] = _SURVEY["notices"]


def surveyed(table: dict[str, str], version: str) -> list[str]:
    """The keys of a survey table whose range holds ``version``."""
    return [key for key, span in table.items() if SpecifierSet(span).contains(version)]


def test_every_surveyed_release_is_still_tested():
    assert [r for r in RELEASES if r in SURVEYED_RELEASES] == list(SURVEYED_RELEASES)
    assert set(SURVEY) == set(CATALOGUE.ids), (
        f"a new patch writes its surveyed facts in {SURVEY_FILE}"
    )


@pytest.mark.parametrize("version", SURVEYED_RELEASES)
def test_the_survey_decides_each_release_once_per_patch(version: str):
    for patch_id, table in SURVEY.items():
        assert len(surveyed(table, version)) == 1, (patch_id, version, table)


@pytest.mark.parametrize("version", [r for r in RELEASES if r in SURVEYED_RELEASES])
def test_the_catalogue_keeps_the_surveyed_facts(version: str):
    listed = expected_states(version)
    for patch_id, table in SURVEY.items():
        state, variant = listed[patch_id]
        [fact] = surveyed(table, version)
        assert (variant or state) == fact, (patch_id, version, listed[patch_id])
    numbers = surveyed(SURVEYED_NOTICES, version)
    assert_notices([n.message for n in listed_notices(version)], numbers)


# ----- what the catalogue lists for a release -----


def expected_states(version: str) -> dict[str, tuple[str, str | None]]:
    """(state, variant) status must find on the pristine release, per patch: the
    catalogue's variant for it (``needed``, or ``opt-in`` for a diagnostic) or its
    decision's state. The loader has checked each tested release is decided once."""
    found = {}
    for patch in CATALOGUE.patches:
        entry = patch.expected_for(Version(version))
        if isinstance(entry, Variant):
            found[patch.id] = ("opt-in" if patch.opt_in else "needed", entry.name)
        else:
            assert isinstance(entry, Decision), (patch.id, version)
            found[patch.id] = (entry.state, None)
    return found


def listed_notices(version: str) -> list[Notice]:
    """The catalogue's notices for a release, in series order."""
    return [
        notice
        for patch in CATALOGUE.patches
        for notice in patch.notices
        if notice.versions.contains(Version(version), prereleases=True)
    ]


def expected_files(version: str, patch_id: str) -> list[str]:
    return sorted(CATALOGUE.get(patch_id).expected_for(Version(version)).paths)


# ----- each release: status, apply, re-apply, the opt-in stacked, revert -----


def status_json(root: Path) -> dict:
    result = run_cli("status", "--target", str(root), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_release(version: str, scratch_path: Path):
    root = copy_tree(version, scratch_path / "site-packages")
    pristine = snapshot(root)
    states = expected_states(version)
    notices = listed_notices(version)

    status = status_json(root)
    assert status["vllm"] == {"version": version, "path": str(root), "source": "metadata"}
    assert {p["id"]: (p["state"], p["variant"]) for p in status["patches"]} == states
    assert status["warnings"] == []
    assert_listed(status["notices"], notices)

    dry = run_cli("apply", "--target", str(root), "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert snapshot(root) == pristine

    applied = run_cli("apply", "--target", str(root), "--json")
    assert applied.exit_code == 0, applied.output
    report = json.loads(applied.stdout)
    changed = sorted(k for k, v in snapshot(root).items() if pristine.get(k) != v)
    touched = sorted(f for p in report["patches"] if p["action"] == "applied" for f in p["files"])
    needed = sorted(i for i, (state, _) in states.items() if state == "needed")
    assert sorted(p["id"] for p in report["patches"] if p["action"] == "applied") == needed
    assert touched == sorted(f for i in needed for f in expected_files(version, i))
    assert [c for c in changed if not c.startswith(".patchkit/")] == touched
    for relpath in touched:
        py_compile.compile(str(root / relpath), doraise=True, cfile=str(scratch_path / "check.pyc"))

    after_apply = snapshot(root)
    again = run_cli("apply", "--target", str(root), "--json")
    assert again.exit_code == 0, again.output
    assert {p["action"] for p in json.loads(again.stdout)["patches"]} == {"none"}
    assert snapshot(root) == after_apply
    patched = status_json(root)
    assert {p["id"]: (p["state"], p["variant"]) for p in patched["patches"]} == {
        i: ("applied" if state == "needed" else state, v) for i, (state, v) in states.items()
    }
    assert_listed(patched["notices"], [n for n in notices if n.fixed_by not in needed])

    if states["nan-probe"][0] == "opt-in":  # a variant; where none, apply --only does nothing
        stack_nan_probe(root, scratch_path, after_apply, expected_files(version, "nan-probe"))
    reverted = run_cli("revert", "--target", str(root))
    assert reverted.exit_code == 0, reverted.output
    assert snapshot(root) == pristine


def assert_notices(notices: list[str], numbers: list[str]) -> None:
    """One notice per expected bug number, in order."""
    assert len(notices) == len(numbers), notices
    for notice, number in zip(notices, numbers, strict=True):
        assert number in notice, (number, notice)


def assert_listed(shown: list[dict], listed: list[Notice]) -> None:
    """Status shows the catalogue's notices, in order, each with what to do after it."""
    assert len(shown) == len(listed), shown
    for shown_notice, notice in zip(shown, listed, strict=True):
        line = shown_notice["message"]
        assert line.startswith(notice.message), (line, notice.message)


def stack_nan_probe(root: Path, tmp_path: Path, default_set: dict, files: list[str]) -> None:
    """`apply --only nan-probe` on the default set: its files, compiled; then
    `revert --only nan-probe` gives the default set back byte for byte, and the probe
    goes on again for the plain revert after it."""
    probe = run_cli("apply", "--target", str(root), "--only", "nan-probe", "--json")
    assert probe.exit_code == 0, probe.output
    [step] = [p for p in json.loads(probe.stdout)["patches"] if p["action"] != "none"]
    assert (step["id"], step["action"], sorted(step["files"])) == ("nan-probe", "applied", files)
    changed = sorted(k for k, v in snapshot(root).items() if default_set.get(k) != v)
    assert [c for c in changed if not c.startswith(".patchkit/")] == files
    for relpath in files:
        py_compile.compile(str(root / relpath), doraise=True, cfile=str(tmp_path / "check.pyc"))
    assert {p["id"]: p["state"] for p in status_json(root)["patches"]}["nan-probe"] == "applied"
    assert run_cli("revert", "--target", str(root), "--only", "nan-probe").exit_code == 0
    assert snapshot(root) == default_set
    assert run_cli("apply", "--target", str(root), "--only", "nan-probe").exit_code == 0


def expand_block_n_expression(source: str) -> ast.expr:
    """The "block_n" value of the single/multi-slice expand default config."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "block_n"
                    and "num_slices" in ast.unparse(value)
                ):
                    return value
    raise AssertionError("no expand block_n entry found")


class FakePlatform:
    def __init__(self, cuda: bool, capability: int | None):
        self.cuda, self.capability = cuda, capability

    def is_cuda(self) -> bool:
        return self.cuda

    def is_device_capability(self, capability: int) -> bool:
        return self.capability == capability


@pytest.mark.parametrize("version", releases_with_variant("expand-block-n"))
def test_patched_block_n_is_32_on_sm90_only(version: str):
    """Evaluate the patched expression from the real file, as the variant leaves it, on
    fake platforms: every release the catalogue gives a variant."""
    relpath = "vllm/lora/ops/triton_ops/utils.py"
    before = expand_block_n_expression((release_tree(version) / relpath).read_text())
    after = compile(
        ast.Expression(expand_block_n_expression(patched_text(version, "expand-block-n", relpath))),
        "",
        "eval",
    )
    cases = {
        (True, 90): (32, 64),  # Hopper: single slice 32, several slices unchanged
        (True, 100): (128, 64),  # Blackwell
        (True, 80): (128, 64),  # Ampere
        (False, 90): (128, 64),  # ROCm gfx90a reports 9.0 too
        (False, None): (128, 64),  # CPU
    }
    for (cuda, capability), (single, multi) in cases.items():
        scope = {"current_platform": FakePlatform(cuda, capability)}
        assert eval(after, {**scope, "num_slices": 1}) == single
        assert eval(after, {**scope, "num_slices": 2}) == multi
    unpatched = compile(ast.Expression(before), "", "eval")
    assert eval(unpatched, {"num_slices": 1}) == 128


def test_some_patch_is_not_applicable_somewhere():
    """The next test's cases: a catalogue with no not-applicable decision would leave it
    with none, and pytest skips an empty parameter set without failing."""
    assert {patch for patch, _ in NOT_APPLICABLE} >= {"split-in-proj-qkvz", "partial-gdn-adapter"}


@pytest.mark.parametrize(("patch", "version"), NOT_APPLICABLE)
def test_apply_only_a_not_applicable_patch_says_why_in_one_line_and_changes_nothing(
    patch, version, scratch_path
):
    """Where the catalogue decides a patch not-applicable, status says so, and `apply
    --only` of it warns in one line with the catalogue's reason and does nothing."""
    root = copy_tree(version, scratch_path / "site")
    pristine = snapshot(root)
    reason = CATALOGUE.get(patch).expected_for(Version(version)).reason
    status = run_cli("status", "--target", str(root), "--json")
    states = {p["id"]: p["state"] for p in json.loads(status.stdout)["patches"]}
    assert states[patch] == "not-applicable"
    result = run_cli("apply", "--target", str(root), "--only", patch)
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if patch in line]
    assert said == [
        f"warning: {patch} was asked for with --only but is not applied; it is not-applicable "
        f"here: {reason}"
    ]
    assert result.stdout.splitlines()[-1].startswith("apply: nothing to do; ")
    assert snapshot(root) == pristine
