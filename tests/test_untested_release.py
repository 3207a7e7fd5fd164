"""The truth about a release the catalogue has not seen: `changed-upstream`, never advice
to reinstall a pristine vLLM, and only commands that would run on that tree.

Each "next release" here is a real release tree from its PyPI wheel, altered as the
next vLLM release might be (tests/release_drill_helpers.py): one patched function
rewritten, or one patched file removed, with the dist-info, METADATA and RECORD made
to match, so the tree is what pip would install from such a wheel.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from packaging.version import Version

from tests.conftest import CATALOGUE, RELEASES, release_tree, run_cli, snapshot
from tests.release_drill_helpers import MANAGER, MOE_ASSERT_REWRITTEN, next_release, next_version

NEXT = next_version(RELEASES)  # the drills' release: one the catalogue has not seen
NEWEST = max(RELEASES, key=Version)

COLUMN = "vllm/lora/layers/column_parallel_linear.py"
# 0.33.0's expand_packed_lora with one line written another way: the hunks of
# partial-gdn-adapter's coverage-after no longer fit.
EXPAND = (
    "expanded_a: list[torch.Tensor | None] = []",
    "expanded_a: list[torch.Tensor | None] = list()",
)


def status(root: Path) -> dict:
    result = run_cli("status", "--target", str(root), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def states(report: dict) -> dict[str, tuple[str, str]]:
    return {
        p["id"]: (p["state"], (p["reason"] or {}).get("message", "")) for p in report["patches"]
    }


def rewritten_0340(tmp_path: Path) -> Path:
    """0.34.0 with the assert partial-moe-adapter patches rewritten, as NEXT."""
    return next_release(
        release_tree("0.34.0"), tmp_path / "site", NEXT, rewrite=MOE_ASSERT_REWRITTEN
    )


def test_a_rewritten_function_is_changed_upstream_not_a_conflict(tmp_path):
    root = rewritten_0340(tmp_path)
    state, reason = states(status(root))["partial-moe-adapter"]
    assert state == "changed-upstream"
    assert reason.startswith(
        f"vLLM {NEXT} changed the lines partial-moe-adapter changes in {MANAGER} (hunk #"
    )
    assert "whether the bug is fixed there is not known to this catalogue" in reason
    assert "reinstall" not in reason and "pip install" not in reason


def test_a_removed_file_is_said_in_one_line(tmp_path):
    root = next_release(release_tree("0.34.0"), tmp_path / "site", NEXT, remove=(MANAGER,))
    state, reason = states(status(root))["partial-moe-adapter"]
    assert state == "changed-upstream"
    assert reason.startswith(f"vLLM {NEXT} no longer ships {MANAGER} (moved or removed);")
    assert "neither the pristine text" not in reason


def test_plain_apply_applies_nothing_and_names_the_apply_only_that_runs(tmp_path):
    """0.33.0 as NEXT with expand_packed_lora rewritten: partial-gdn-adapter moved,
    partial-moe-adapter still fits. Plain apply (and --dry-run) refuse and change nothing;
    the command they name runs and applies exactly the patch that fits."""
    root = next_release(release_tree("0.33.0"), tmp_path / "site", NEXT, rewrite={COLUMN: EXPAND})
    pristine = snapshot(root)
    assert states(status(root))["partial-gdn-adapter"][0] == "changed-upstream"
    for args in ((), ("--dry-run",), ("--strict",)):
        refused = run_cli("apply", "--target", str(root), *args)
        assert refused.exit_code == 1, refused.output
        assert snapshot(root) == pristine
    refused = run_cli("apply", "--target", str(root))
    [line] = [x for x in refused.stderr.splitlines() if x.startswith("patchkit: error:")]
    assert f"partial-gdn-adapter: changed-upstream: vLLM {NEXT} changed" in line
    command = line.split("`")[-2]
    assert command == f"patchkit apply --only partial-moe-adapter --target {shlex.quote(str(root))}"
    applied = run_cli(*shlex.split(command)[1:], "--json")
    assert applied.exit_code == 0, applied.output
    acted = {p["id"]: p["action"] for p in json.loads(applied.stdout)["patches"]}
    assert [i for i, action in acted.items() if action == "applied"] == ["partial-moe-adapter"]
    changed = {k for k, v in snapshot(root).items() if pristine.get(k) != v}
    assert {c for c in changed if not c.startswith(".patchkit/")} == {
        MANAGER,
        "vllm/lora/peft_helper.py",
    }


def test_known_issues_are_unknown_there_and_their_command_runs(tmp_path):
    root = next_release(release_tree("0.33.0"), tmp_path / "site", NEXT, rewrite={COLUMN: EXPAND})
    [shown] = [p for p in status(root)["patches"] if p["id"] == "partial-moe-adapter"][0]["notices"]
    assert shown["code"] == "known-issue-undecided" and shown["remedy"]["code"] == "still-fits"
    notice = shown["message"]
    assert notice.startswith(f"unknown on vLLM {NEXT}, which this catalogue has not decided")
    [moe_notice] = CATALOGUE.get("partial-moe-adapter").notices
    seen = max((r for r in RELEASES if moe_notice.versions.contains(r)), key=Version)
    assert f"seen up to {seen}" in notice
    assert notice.endswith("`patchkit apply --only partial-moe-adapter` applies it")
    gdn = [p for p in status(root)["patches"] if p["id"] == "partial-gdn-adapter"][0]
    assert gdn["notices"] == []  # its evidence is the old code's; nothing asserted


def test_doctor_never_asserts_a_bug_on_an_undecided_release(tmp_path):
    root = next_release(release_tree("0.33.0"), tmp_path / "site", NEXT, rewrite={COLUMN: EXPAND})
    result = run_cli("doctor", "--target", str(root), "--json")
    verdicts = {v["bug"].split(":")[0]: v for v in json.loads(result.stdout)["verdicts"]}
    gdn = verdicts["vLLM #47639 / #57851"]
    assert gdn["status"] == "unknown" and f"unknown on vLLM {NEXT}" in gdn["reason"]["message"]
    assert (
        "partial-gdn-adapter does not fit its code (changed-upstream)" in gdn["reason"]["message"]
    )
    moe = verdicts["vLLM #48460"]
    assert moe["status"] == "unknown"
    target = shlex.quote(str(root))
    assert moe["fix"]["message"] == f"patchkit apply --only partial-moe-adapter --target {target}"
    assert run_cli(*shlex.split(moe["fix"]["message"])[1:]).exit_code == 0
    # the NaN's fix is in the code (its evidence), whatever the release: not affected
    assert verdicts["vLLM #48590"]["status"] == "not-affected"


def test_an_edited_file_on_an_untested_release_is_still_a_conflict(tmp_path):
    """The RECORD tells vLLM's change from an edit: a file that is not the wheel's own is
    a conflict, with the reinstall that gives it back."""
    root = rewritten_0340(tmp_path)
    path = root / MANAGER
    path.write_text(path.read_text().replace("raise ValueError('one parameter')", "pass"))
    state, reason = states(status(root))["partial-moe-adapter"]
    assert state == "conflict"
    assert f"differs from the sha256 in vLLM {NEXT}'s RECORD" in reason or "neither" in reason


def test_a_missing_file_on_a_tested_release_is_not_a_contradiction(tmp_path):
    """0.26.0 (tested) with model_manager.py deleted by hand: a conflict that says the
    file is missing, not that it is 'neither the pristine text nor its patched text'."""
    root = tmp_path / "site"
    shutil.copytree(release_tree("0.26.0"), root, symlinks=True)
    (root / MANAGER).unlink()
    state, reason = states(status(root))["partial-moe-adapter"]
    assert state == "conflict"
    assert f"{MANAGER} is missing" in reason and "neither" not in reason


def test_on_a_newer_release_the_newest_variant_that_fits_is_tried_first(tmp_path):
    """0.34.0's code as NEXT fits both partial-moe-adapter variants (the pre-0.32 one
    changes model_manager.py alone); with no variant listed for the release, a release
    newer than the catalogue gets the newest that fits, not the oldest (which would leave
    PEFTHelper's rank and alpha patterns unfixed): the release drill's finding."""
    from patchkit.patching.assess import TreeFiles, _from_variants
    from patchkit.patching.state import State
    from patchkit.vllmtree.tree import locate

    root = next_release(release_tree("0.34.0"), tmp_path / "site", NEXT)
    tree = locate(str(root))
    patch = CATALOGUE.get("partial-moe-adapter")
    files = TreeFiles(tree, State(tree.fs), CATALOGUE.ids)
    newest = _from_variants(patch, None, tree, files, newer=True)
    oldest = _from_variants(patch, None, tree, files, newer=False)
    assert (newest.state, newest.variant.name) == ("needed", "single-parameter-patterns")
    assert (oldest.state, oldest.variant.name) == ("needed", "single-parameter")


# The release drill of 2026-12-06's next release (docs/evidence.md, "the release drill"):
# peft_helper.py renamed peft_config.py, and the assert partial-moe-adapter's hunk #2
# anchors on given a message, a comment now ending the line before it.
HELPER, RENAMED = "vllm/lora/peft_helper.py", "vllm/lora/peft_config.py"
MOE_ASSERT_COMMENTED = {
    MANAGER: (
        "            down_proj_lora = module_lora\n"
        "            # FIXME Edge case where LoRA is not added to gate_up_proj\n"
        "            # or down_proj\n"
        "            assert gate_up_proj_lora is not None\n",
        "            down_proj_lora = module_lora  # PEFT: <experts> is down_proj\n"
        "            assert gate_up_proj_lora is not None, (\n"
        '                f"{module_name}: no gate_up_proj LoRA (experts.base_layer)"\n'
        "            )\n",
    )
}


def test_the_known_issue_and_changed_upstream_agree_where_the_failing_code_stays(tmp_path):
    """0.34.0 altered as the release drill's next release was (its imports of the renamed
    module left as they were: patchkit reads them not): status said "changed the code
    partial-moe-adapter changes" beside "the code it was seen in is still there"; each
    now names what it read: the line that differs, and the file where the failing code
    still matches."""
    source = release_tree("0.34.0")
    tree = next_release(
        source,
        tmp_path / "site",
        NEXT,
        remove=(HELPER,),
        rewrite=MOE_ASSERT_COMMENTED,
        add={RENAMED: (source / HELPER).read_text()},
    )
    lines = (tree / MANAGER).read_text().splitlines()
    [number] = [n for n, line in enumerate(lines, 1) if "down_proj_lora = module_lora" in line]
    assert "assert gate_up_proj_lora is not None" in lines[number]  # the failing code, kept
    row = next(p for p in status(tree)["patches"] if p["id"] == "partial-moe-adapter")
    assert row["state"] == "changed-upstream"
    reason = row["reason"]
    assert (reason["gone"], reason["changed"], reason["hunk"]) == (
        HELPER,
        MANAGER,
        2,
    )
    assert (
        f"where line {number} should be 'down_proj_lora = module_lora' but is "
        in (reason["detail"])
    )
    (issue,) = row["notices"]
    assert issue["code"] == "known-issue-undecided" and issue["evidence"] == [MANAGER]
    assert (
        f"(seen up to {NEWEST}, and the code it was seen failing in still matches in "
        f"{MANAGER})" in issue["message"]
    )
    assert "the code it was seen in is still there" not in issue["message"]
