"""No control character from any input reaches a terminal raw: one rule, every command.

A directory or file name, a catalogue's text, a probe record, an adapter's
name or config, an option's value: each may hold ESC (a terminal sequence),
``\\r`` (the line overprinted: "clean"), a newline (a forged line) or a bidi
mark. Every line patchkit prints goes through ``render.out`` or
``render.warn``, which apply ``patchkit.terminal.printable``: the character
is shown as Python writes it (``\\x1b``), whichever command prints it, on
stdout and stderr, in text and in errors. JSON stays valid and gives the
value back exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from patchkit.cli import render
from patchkit.terminal import printable
from tests.conftest import CATALOGUE, applied, run_cli, slim_tree
from tests.helpers import record, write_log

HOSTILE = "x\x1b]0;owned\x07\x1b[2J\rclean\nforged\u202eevil"
SHOWN = r"x\x1b]0;owned\x07\x1b[2J\rclean\nforged\u202eevil"


def raw(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on (a line's own newline aside)."""
    return sorted({c for c in text if not c.isprintable() and c != "\n"})


def clean(result, shown: str | None = SHOWN) -> None:
    """Nothing raw on stdout or stderr, and (``shown``) the hostile text there, escaped."""
    both = result.stdout + result.stderr
    assert raw(both) == [], (raw(both), both[-2000:])
    assert "forged\n" not in both and "\rclean" not in both
    if shown:
        assert shown in both, both[-2000:]


def test_the_rule_escapes_what_acts_on_a_terminal_and_keeps_the_rest():
    assert printable(HOSTILE) == SHOWN
    assert printable("vLLM 0.26.0 … naïve ² ✓") == "vLLM 0.26.0 … naïve ² ✓"
    assert printable("\udcff\u2028\x00\x7f") == r"\udcff\u2028\x00\x7f"
    assert render.printable is printable  # where the other modules import it from


@pytest.fixture(scope="module")
def hostile_tree(tmp_path_factory) -> Path:
    return slim_tree(tmp_path_factory.mktemp("t") / f"site-{HOSTILE}")


@pytest.mark.parametrize("command", ["status", "apply", "revert", "doctor"])
def test_a_tree_path_is_escaped_in_every_command_that_names_it(hostile_tree, command):
    args = [command, "--target", str(hostile_tree)]
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    clean(result)
    if command != "doctor":
        as_json = run_cli(*args, "--json")
        clean(as_json, json.dumps(HOSTILE)[1:-1])  # JSON's own escapes
        assert json.loads(as_json.stdout)["vllm"]["path"] == str(hostile_tree)  # exact


def test_a_catalogues_text_is_escaped_in_list_and_show(tmp_path):
    root = tmp_path / "patches"
    shutil.copytree(CATALOGUE.root, root)
    meta = root / "nan-probe" / "patch.toml"
    text = meta.read_text()
    escaped = json.dumps(HOSTILE)[1:-1]  # TOML's basic strings take JSON's escapes
    meta.write_text(text.replace('title = "Diagnostic:', f'title = "{escaped} Diagnostic:', 1))
    env = {"PATCHKIT_PATCHES_DIR": str(root)}
    for args in (["list"], ["list", "-v"], ["show", "nan-probe"]):
        result = run_cli(*args, env=env)
        assert result.exit_code == 0, result.output
        clean(result, r"x\x1b]0;owned\x07\x1b[2J\rclean")  # a newline in prose is reflowed
    as_json = run_cli("show", "nan-probe", "--json", env=env)
    assert json.loads(as_json.stdout)["patches"][0]["title"].startswith(HOSTILE)


def test_a_probe_log_its_name_and_its_records_are_escaped(tmp_path):
    log = write_log(tmp_path, record(1, 0, "self_attn.o_proj", "lora", [HOSTILE]))
    named = log.rename(tmp_path / f"probe-{HOSTILE}.jsonl")
    result = run_cli("probe", "report", str(named))
    assert result.exit_code == 0, result.output
    clean(result)
    broken = tmp_path / f"bad-{HOSTILE}.jsonl"
    broken.write_text(json.dumps({"probe": HOSTILE}) + "\n")
    failed = run_cli("probe", "report", str(broken))
    assert failed.exit_code == 1
    clean(failed)
    assert len(failed.stderr.strip().splitlines()) == 1


def test_an_adapters_directory_name_is_escaped(tmp_path):
    adapter = tmp_path / f"adapter-{HOSTILE}"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    result = run_cli("adapter", "check", str(adapter))
    assert result.exit_code in (0, 1), result.output
    clean(result)


@pytest.mark.parametrize(
    "args",
    [
        ["fetch", f"0.26.0{HOSTILE}"],
        ["status", "--vllm-version", HOSTILE],
        ["status", "--target", f"/nowhere/{HOSTILE}"],
        ["show", HOSTILE],
        ["refresh", HOSTILE],
        ["verify", "--model", f"/nowhere/{HOSTILE}", "--lora", "a=/nowhere"],
        ["canary", "--url", f"http://127.0.0.1:1/{HOSTILE}", "--timeout", "1"],
        ["probe", "report", f"/nowhere/{HOSTILE}"],
    ],
)
def test_an_error_that_quotes_its_input_is_one_escaped_line(args):
    result = run_cli(*args)
    assert result.exit_code in (1, 2), result.output
    clean(result, shown=None)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "\\x1b" in result.stderr or "\\\\x1b" in result.stderr, result.stderr


def json_messages(value) -> list[str]:
    """Every message's words in a JSON document, nested ones too."""
    if isinstance(value, list):
        return [m for item in value for m in json_messages(item)]
    if not isinstance(value, dict):
        return []
    own = [value["message"]] if "code" in value and isinstance(value.get("message"), str) else []
    return own + [m for item in value.values() for m in json_messages(item)]


def test_a_json_message_is_its_line_as_printed_and_its_facts_are_exact(tmp_path):
    """docs/json.md: a message is the words the text output prints, and a reader shows it.
    A warning's and a refusal's quoted entry held the tree's path raw (ESC, a forged
    line), while the error's own message was escaped. The real 0.26.0 tree under a
    hostile name, applied, its state altered to name a patch this patchkit lacks."""
    tree = slim_tree(tmp_path / f"site-{HOSTILE}")
    state_file = applied(tree)
    state = json.loads(state_file.read_text())
    ghost = json.loads(json.dumps(state["patches"][0])) | {"id": "ghost"}
    ghost["files"][0]["backup"] = "backups/ghost/" + ghost["files"][0]["path"]
    state_file.write_text(json.dumps(state | {"patches": [*state["patches"], ghost]}))
    for command in ("status", "revert"):
        result = run_cli(command, "--target", str(tree), "--json")
        document = json.loads(result.stdout)
        messages = json_messages(document)
        assert any(SHOWN in m for m in messages), messages
        assert [m for m in messages if raw(m) or "\n" in m] == []
    status = json.loads(run_cli("status", "--target", str(tree), "--json").stdout)
    assert status["vllm"]["path"] == str(tree)  # a fact stays exact
