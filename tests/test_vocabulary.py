"""One vocabulary, short output, and each command's own words.

A patch's state has one name in status, apply, revert and JSON; apply and
revert say what they did and end with one summary line; a known issue shows
once, under the patch it concerns, and not on revert; a release older than
the catalogue is said to be; Ctrl-C prints the message of the command it
stopped. (The rows, the wrapping and `list`'s length: test_report_layout.py.)
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import release_tree, run_cli, run_subprocess
from tests.helpers import one_line

SPLIT = "split-in-proj-qkvz"
PARTIAL = "partial-gdn-adapter"
PARTIAL_MOE = "partial-moe-adapter"


def patch_json(result, patch_id: str) -> dict:
    assert result.exit_code == 0, result.output
    return next(p for p in json.loads(result.stdout)["patches"] if p["id"] == patch_id)


def test_a_state_has_one_name_in_every_command(slim_tree_0260):
    target = ["--target", str(slim_tree_0260), "--json"]
    assert patch_json(run_cli("status", *target), SPLIT)["state"] == "not-applicable"
    applied = patch_json(run_cli("apply", *target), SPLIT)
    assert (applied["state"], applied["state_before"], applied["action"]) == (
        "not-applicable", "not-applicable", "none"
    )  # fmt: skip
    again = patch_json(run_cli("apply", *target), "expand-block-n")
    assert (again["state"], again["action"]) == ("applied", "none")
    reverted = patch_json(run_cli("revert", *target), SPLIT)
    assert (reverted["state"], reverted["action"]) == ("not-applicable", "none")
    block_n = patch_json(run_cli("status", *target), "expand-block-n")
    assert block_n["state"] == "needed"
    words = {"needed", "applied", "upstream", "not-applicable", "conflict", "opt-in"}
    for command in ("status", "apply", "revert"):
        text = run_cli(command, "--target", str(slim_tree_0260)).stdout
        for line in text.splitlines():
            if line.startswith("  ") and not line.startswith("   "):  # a row, not its wrap
                assert line.split()[1] in words, line


def test_apply_and_revert_end_with_one_summary_line(slim_tree_0260):
    applied = run_cli("apply", "--target", str(slim_tree_0260)).stdout.splitlines()
    assert applied[-1] == "apply: 4 applied now; now 4 applied, 1 not-applicable, 1 opt-in"
    again = run_cli("apply", "--target", str(slim_tree_0260)).stdout.splitlines()
    assert again[-1] == "apply: nothing to do; now 4 applied, 1 not-applicable, 1 opt-in"
    reverted = run_cli("revert", "--target", str(slim_tree_0260)).stdout.splitlines()
    assert reverted[-1] == "revert: 4 reverted now; now 4 needed, 1 not-applicable, 1 opt-in"
    dry = run_cli("apply", "--target", str(slim_tree_0260), "--dry-run").stdout.splitlines()
    # states a dry run would leave, not "now" (the tree is unpatched)
    assert dry[-1] == (
        "apply: 4 would apply; nothing was written; it would leave 4 applied, 1 not-applicable, "
        "1 opt-in"
    )


def test_a_notice_shows_once_under_its_patch_and_not_on_revert(slim_tree_0260):
    status = run_cli("status", "--target", str(slim_tree_0260))
    lines = status.stdout.splitlines()
    notice = [i for i, line in enumerate(lines) if "known issue:" in line]
    assert [lines[i - 1].split()[0] for i in notice] == [PARTIAL, PARTIAL_MOE]
    assert "known issue" not in status.stderr
    applied = run_cli("apply", "--target", str(slim_tree_0260))
    assert "known issue" not in applied.output  # the patch that fixes it is applied now
    for patch_id in (PARTIAL, PARTIAL_MOE):
        status = run_cli("status", "--target", str(slim_tree_0260), "--json")
        assert patch_json(status, patch_id)["notices"] == []
    assert run_cli("revert", "--target", str(slim_tree_0260), "--only", PARTIAL).exit_code == 0
    reverted = run_cli("revert", "--target", str(slim_tree_0260))
    assert "known issue" not in reverted.output


def test_a_release_older_than_the_catalogue_is_said_to_be(tmp_path):
    result = run_cli("status", "--target", str(release_tree("0.10.0")), "--json")
    assert result.exit_code == 0, result.output
    states = {
        p["id"]: (p["state"], p["reason"]["message"]) for p in json.loads(result.stdout)["patches"]
    }
    assert {s for s, _ in states.values()} == {"not-applicable"}
    assert "predates the releases this catalogue covers" in states["expand-block-n"][1]
    assert "conflict" not in result.stdout


INTERRUPT_AT = """
import sys
def _hook(event, args):
    if event == {event!r} and {test}:
        raise KeyboardInterrupt
sys.addaudithook(_hook)
"""


@pytest.mark.parametrize(
    "args,event,test,words",
    [
        (["fetch", "0.26.0", "--dest", "DEST"], "urllib.Request", "True",
         "the destination is complete or untouched"),
        (["doctor"], "import", "args[0] == 'patchkit.doctor.doctor'",
         "`patchkit doctor` changes nothing"),
        (["apply", "--target", "TREE"], "os.rename", "True",
         "each patch is fully applied or not at all"),
        (["status", "--target", "TREE"], "open", "'RECORD' in str(args[0])",
         "`patchkit status` changes nothing"),
    ],
)  # fmt: skip
def test_ctrl_c_prints_the_message_of_its_command(
    tmp_path, slim_tree_0260, args, event, test, words
):
    args = [str(tmp_path / "dest") if a == "DEST" else str(slim_tree_0260) if a == "TREE" else a
            for a in args]  # fmt: skip
    result = run_subprocess(*args, code=INTERRUPT_AT.format(event=event, test=test))
    line = one_line(result, code=130)
    assert words in line, line
    assert "rolled back" not in line or args[0] == "apply"
