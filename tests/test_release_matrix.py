"""Every tested release, from its real PyPI wheel: decision, apply, compile, re-apply, revert.

What a release expects is read from the catalogue (its variants' and
decisions' ranges, its notices), so a release is added by editing patches/
only. Two things keep that from checking the catalogue against itself:

- ``status`` decides by content, not by number: a variant is needed only where
  its hunks fit the release's real files, a decision holds only where its
  evidence matches, and a range that disagrees with the content is a warning.
  test_release requires the content's decision to be the catalogue's, with no
  warning, and apply to change exactly the expected variants' files.
- SURVEY: what the survey of every release 0.17.0-0.33.0 found (shared
  VLLM-RELEASES.md, re-checked against the wheels), written by hand as ranges
  once. Content cannot catch a wrong decision whose diff still fits
  (block-k-32 and torch-ops apply cleanly on 0.33.0, which has the upstream
  fix; single-parameter on 0.32.0, which needs the patterns variant); inside
  the survey the catalogue must agree with it, and every surveyed release must
  stay tested. A release after 0.33.0 is checked by content alone until its
  facts are surveyed.
"""

from __future__ import annotations

import ast
import json
import py_compile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from patchkit.catalogue.model import Decision, Notice, Variant
from tests.conftest import CATALOGUE, RELEASES, copy_tree, run_cli, snapshot

# ----- the survey: facts written by hand, never derived -----

SURVEYED_RELEASES = (
    "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2",
    "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
    "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
)  # fmt: skip
# Per patch, what each surveyed release gets: a variant's name or a decision's
# state, by range ("" = every surveyed release).
SURVEY = {
    "expand-block-n": {
        "block-k-16": "<0.18.0",
        "block-k-32": ">=0.18.0,<0.33.0",
        "upstream": ">=0.33.0",  # lora_expand forces num_stages=1 on sm_90
    },
    "matmul-add-lora-linear": {"torch-ops": "<0.33.0", "upstream": ">=0.33.0"},
    "split-in-proj-qkvz": {
        "backport-36976": "<0.19.0",
        "upstream": ">=0.19.0,<0.21.0",  # PR #36976
        "not-applicable": ">=0.21.0",  # fused again, expand_packed_lora
    },
    # 0.17-0.20 have no expand_packed_lora (separate in_proj_qkv / in_proj_z modules);
    # 0.21-0.28 fail on any partial adapter (#47639); 0.29-0.33 carry #47640, which
    # still sends an in_proj_z-only adapter to the wrong slices (#57851).
    "partial-gdn-adapter": {
        "not-applicable": "<0.21.0",
        "backport-47640": ">=0.21.0,<0.29.0",
        "coverage-after": ">=0.29.0",
    },
    # Every _stack_moe_lora_weights asserts both expert parameters; from 0.32
    # PEFTHelper matches rank/alpha patterns against <experts> as down_proj.
    "partial-moe-adapter": {"single-parameter": "<0.32.0", "single-parameter-patterns": ">=0.32.0"},
    # Opt-in. Model Runner V2 ships in every surveyed release; its execute_model takes
    # today's shape from 0.19.0 (hooked there with V1's, both-runners); before, V1 only.
    "nan-probe": {"runner-hooks": "<0.19.0", "both-runners": ">=0.19.0"},
}
# The known upstream bugs status names (notices, not warnings), by range.
SURVEYED_NOTICES = {
    "#38927": ">=0.19.0,<0.20.0",
    "#47639": ">=0.21.0,<0.29.0",
    "#57851": ">=0.29.0",
    "#48460": "",
}


def surveyed(table: dict[str, str], version: str) -> list[str]:
    """The keys of a survey table whose range holds ``version``."""
    return [key for key, span in table.items() if SpecifierSet(span).contains(version)]


def test_every_surveyed_release_is_still_tested():
    assert [r for r in RELEASES if r in SURVEYED_RELEASES] == list(SURVEYED_RELEASES)
    assert set(SURVEY) == set(CATALOGUE.ids), "a new patch writes its surveyed facts here"


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

    stack_nan_probe(root, scratch_path, after_apply, expected_files(version, "nan-probe"))
    reverted = run_cli("revert", "--target", str(root))
    assert reverted.exit_code == 0, reverted.output
    assert snapshot(root) == pristine


def assert_notices(notices: list[str], numbers: list[str]) -> None:
    """One notice per expected bug number, in order."""
    assert len(notices) == len(numbers), notices
    for notice, number in zip(notices, numbers, strict=True):
        assert number in notice, (number, notice)


def assert_listed(shown: list[str], listed: list[Notice]) -> None:
    """Status shows the catalogue's notices, in order, each with what to do after it."""
    assert len(shown) == len(listed), shown
    for line, notice in zip(shown, listed, strict=True):
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


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.17.0", "0.26.0", "0.32.0"])
def test_patched_block_n_is_32_on_sm90_only(version: str, tmp_path: Path):
    """Evaluate the patched expression from the real patched file on fake platforms."""
    root = copy_tree(version, tmp_path / "site-packages")
    relpath = "vllm/lora/ops/triton_ops/utils.py"
    before = expand_block_n_expression((root / relpath).read_text())
    assert run_cli("apply", "--target", str(root)).exit_code == 0
    after = compile(
        ast.Expression(expand_block_n_expression((root / relpath).read_text())), "", "eval"
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
