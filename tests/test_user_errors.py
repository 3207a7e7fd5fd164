"""Bad arguments and broken inputs give one line, the right exit code, no traceback.

Usage errors exit 2 (as JSON with --json), a bug exits 3 with a hint and the
traceback only on request, Ctrl-C while starting exits 130; a broken
dist-info, a nested or misshapen config is one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli, run_subprocess, snapshot
from tests.helpers import NESTED, one_error_line, one_line, one_line_failure


def test_an_empty_target_is_a_usage_error():
    result = run_cli("status", "--target", "", "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["ok"] is False
    assert "--target" in result.stderr and "empty" in result.stderr


def test_a_version_that_is_not_a_version_is_a_usage_error(slim_tree_0260):
    for args, env in (
        (["--vllm-version", "abc"], None),
        ([], {"PATCHKIT_VLLM_VERSION": "abc"}),
    ):
        result = run_cli("status", "--target", str(slim_tree_0260), "--json", *args, env=env)
        assert result.exit_code == 2, result.output
        assert "'abc' is not a PEP 440 version" in json.loads(result.stdout)["error"]["message"]


def test_a_5000_digit_version_is_a_usage_error(slim_tree_0260):
    result = run_subprocess(
        "status", "--target", str(slim_tree_0260), "--vllm-version", "1" * 5000, "--json"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert json.loads(result.stdout)["ok"] is False


def test_an_untested_version_warns_once(slim_tree_0260):
    result = run_cli("status", "--target", str(slim_tree_0260), "--vllm-version", "0.40.0")
    assert result.stderr.count("is not a tested release") == 1


def test_usage_errors_print_json_with_json(slim_tree_0260):
    result = run_cli("apply", "--target", str(slim_tree_0260), "--json", "--no-such-option")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["ok"] is False


@pytest.mark.parametrize(
    "args, needles",
    [
        (["show", "nosuch"], ["ID", "'nosuch'"]),
        (["apply", "--only", "nosuch", "--target", "T"], ["--only", "'nosuch'"]),
        (["apply", "--only", "nosuch", "--target", "T", "--json"], ["--only", "'nosuch'"]),
        (["list", "--no-such-option"], ["'--no-such-option'"]),
        (["list", "--json", "--no-such-option"], ["'--no-such-option'"]),
        (["no-such-command"], ["'no-such-command'"]),
        (["show"], ["'ID'"]),
    ],
)
def test_a_usage_error_is_one_line_naming_the_option_and_the_value(args, needles):
    """Not click's three lines (Usage:, Try ... --help, Error:): exit 2 promises one."""
    result = run_cli(*args)
    line = one_line_failure(result, code=2)
    assert "Usage:" not in result.output and "--help" not in result.stderr
    for needle in needles:
        assert needle in line, line
    if "--json" in args:
        assert json.loads(result.stdout)["error"]["message"] in line


def test_a_mistyped_patch_id_names_the_closest_one():
    for args in (["show", "expand-blockn"], ["apply", "--only", "expand-blockn", "--target", "T"]):
        line = one_line_failure(run_cli(*args), code=2)
        assert "unknown patch 'expand-blockn'; did you mean 'expand-block-n'? known: " in line
    line = one_line_failure(run_cli("show", "nosuch"), code=2)  # nothing close: no guess
    assert "did you mean" not in line and "known: expand-block-n, " in line


def test_a_group_without_a_command_prints_its_help_and_exits_2():
    for args in ([], ["probe"]):
        result = run_cli(*args)
        assert result.exit_code == 2 and "Commands:" in result.output, result.output


def test_help_is_still_clicks_help():
    result = run_cli("show", "--help")
    assert result.exit_code == 0 and result.stdout.startswith("Usage: ")
    assert "patchkit: error" not in result.output


def test_an_internal_error_exits_3_with_a_hint_and_a_traceback_on_request(
    slim_tree_0260, monkeypatch
):
    import patchkit.patching.operations

    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(patchkit.patching.operations, "status", broken)
    result = run_cli("status", "--target", str(slim_tree_0260))
    line = one_line_failure(result, code=3)
    assert "ZeroDivisionError: boom" in line and "PATCHKIT_DEBUG=1" in line
    result = run_cli("status", "--target", str(slim_tree_0260), env={"PATCHKIT_DEBUG": "1"})
    assert result.exit_code == 3 and "Traceback" in result.stderr


INTERRUPT_AT_IMPORT = """
import sys
def _hook(event, args):
    if event == "import" and args[0] == "click":
        raise KeyboardInterrupt
sys.addaudithook(_hook)
"""


def test_ctrl_c_while_starting_is_one_line(slim_tree_0260):
    one_line(
        run_subprocess("status", "--target", str(slim_tree_0260), code=INTERRUPT_AT_IMPORT),
        code=130,
    )


def test_list_shows_why():
    result = run_cli("list", "-v")
    assert result.exit_code == 0
    patches = json.loads(run_cli("list", "--json").stdout)["patches"]
    assert result.stdout.count("    why: ") == len(patches)


def test_doctor_without_vllm_says_unknown(tmp_path):
    result = run_cli("doctor", "--json")  # no --target, and this Python has no vLLM
    verdicts = json.loads(result.stdout)["verdicts"]
    assert verdicts and {v["status"] for v in verdicts} == {"unknown"}


def break_dist_info(tree: Path, how: str) -> None:
    dist_info = next(tree.glob("vllm-*.dist-info"))
    record, metadata = dist_info / "RECORD", dist_info / "METADATA"
    if how == "short-hash":
        lines = record.read_text().splitlines()
        lines[0] = lines[0].split(",")[0] + ",sha256=a,1"
        record.write_text("\n".join(lines) + "\n")
    elif how == "record-not-utf8":
        record.write_bytes(record.read_bytes() + b"vllm/\xff\xfe.py,sha256=x,1\n")
    elif how == "metadata-not-utf8":
        metadata.write_bytes(b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\nSummary: \xff\n")
    elif how == "huge-field":
        record.write_text(record.read_text() + "vllm/" + "x" * (128 * 1024 + 10) + ",,\n")
    elif how == "long-version":
        text = metadata.read_text().replace("Version: 0.26.0", "Version: " + "1" * 5000, 1)
        metadata.write_text(text)


@pytest.mark.parametrize(
    "how", ["short-hash", "record-not-utf8", "metadata-not-utf8", "huge-field", "long-version"]
)
def test_a_broken_dist_info_is_one_line_naming_it(slim_tree_0260, how):
    break_dist_info(slim_tree_0260, how)
    before = snapshot(slim_tree_0260)
    for command in ("status", "apply", "revert"):
        line = one_line(run_subprocess(command, "--target", str(slim_tree_0260)))
        assert "dist-info" in line, line
    assert snapshot(slim_tree_0260) == before


def test_a_deeply_nested_tuned_config_is_a_finding(tmp_path, slim_tree_0260):
    folder = tmp_path / "tuned"
    folder.mkdir()
    (folder / "NVIDIA_H200_EXPAND_TRUE.json").write_text(NESTED)
    result = run_subprocess("doctor", "--target", str(slim_tree_0260), "--json",
                      env={"VLLM_TUNED_CONFIG_FOLDER": str(folder)})  # fmt: skip
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "nested too deeply" in result.stdout


@pytest.mark.parametrize("key", ["block_n", "num_stages"])
def test_a_tuned_config_whose_numbers_are_text_is_a_finding(tmp_path, slim_tree_0260, key):
    """A block_n or num_stages of "64" was compared with 32: TypeError, exit 3."""
    folder = tmp_path / "tuned"
    folder.mkdir()
    config = {"block_n": 64, "num_stages": 2} | {key: "64"}
    (folder / "NVIDIA_H200_EXPAND_TRUE.json").write_text(json.dumps({"1": {"1": config}}))
    result = run_subprocess("doctor", "--target", str(slim_tree_0260), "--json",
                      env={"VLLM_TUNED_CONFIG_FOLDER": str(folder)})  # fmt: skip
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    [finding] = json.loads(result.stdout)["tuned_configs"]
    assert finding["problem"]["code"] == "tuned-unreadable"
    assert "block_n or num_stages is no number" in finding["problem"]["message"]


def test_doctor_kernels_model_config_of_the_wrong_shape_is_one_line(tmp_path):
    """{} as config.json, a string hidden_size, a list as an adapter's rank_pattern:
    KeyError / ValueError / AttributeError, exit 3, before."""
    from patchkit.doctor import configs
    from patchkit.errors import PatchkitError

    model, adapter = tmp_path / "model", tmp_path / "adapter"
    model.mkdir()
    adapter.mkdir()
    for text in ("{}", '{"hidden_size": "x"}', "[1]", '{"text_config": 7}'):
        (model / "config.json").write_text(text)
        with pytest.raises(PatchkitError, match="config.json") as err:
            configs.model_from_dir(model)
        assert "\n" not in str(err.value)
    for text in ('{"rank_pattern": {}}', '{"r": 8, "rank_pattern": [1]}', '{"r": "x"}'):
        (adapter / "adapter_config.json").write_text(text)
        with pytest.raises(PatchkitError, match="adapter_config.json"):
            configs.adapter_ranks(adapter)
    from tests.conftest import release_tree

    (model / "config.json").write_text("{}")
    done = run_subprocess("doctor", "--kernels", "--model", str(model), "--target",
                     str(release_tree("0.26.0")))  # fmt: skip
    one_error_line(done, 1, "config.json")
