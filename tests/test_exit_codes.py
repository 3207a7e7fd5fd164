"""One exit-code table: the code's (patchkit/cli/exits.py), the README's and `--help`'s agree,
every exit of the CLI names its status from it, and each status is produced by its path.

Exit codes were once spread over README sections while the code kept its own
numbers; a new meaning (verify's inconclusive) would have landed in one place
and not the others. Each code below is produced by a real child process: the
status its shell sees, not a value read back from click.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from patchkit.cli import exits
from patchkit.errors import UsageProblem
from patchkit.signals import Terminated
from tests.conftest import REPO, run_cli, run_subprocess

ROW = re.compile(r"^\| (\d+) \| (.+) \|$")
ENV = {"PYTHONPATH": str(REPO), "PATCHKIT_DEBUG": "0"}
BUG = (
    "import patchkit.probe.report\n"
    "def broken(path):\n"
    "    raise ZeroDivisionError('boom')\n"
    "patchkit.probe.report.report = broken\n"
)


def readme_table() -> list[tuple[int, str]]:
    """(code, meaning cell) of the table under README's `## Exit codes`, in order."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    rows = [ROW.match(line) for line in section.splitlines()]
    return [(int(m[1]), m[2].replace("`", "").replace("\\|", "|")) for m in rows if m]


def help_table() -> list[tuple[int, str]]:
    """(code, meaning) as `patchkit --help` prints them, after its "Exit status:" line."""
    result = run_cli("--help")
    assert result.exit_code == exits.OK
    after = result.stdout.split(exits.EPILOG_TITLE, 1)[1]
    rows = [re.match(r"^\s+(\d+)\s+(.+)$", line) for line in after.splitlines()]
    return [(int(m[1]), m[2]) for m in rows if m]


def test_the_readme_has_the_codes_table_and_only_there():
    readme = readme_table()
    assert [code for code, _ in readme] == [code for code, _ in exits.TABLE]
    for (code, cell), (_, meaning) in zip(readme, exits.TABLE, strict=True):
        assert cell.startswith(meaning), (code, cell, meaning)
    assert (REPO / "README.md").read_text().count("Exit codes\n") == 1


def test_help_ends_with_the_codes_table():
    assert help_table() == list(exits.TABLE)


def test_the_signal_codes_are_128_plus_the_signal():
    assert exits.HANGUP == 128 + signal.SIGHUP == Terminated(signal.SIGHUP).exit_code
    assert exits.INTERRUPTED == 128 + signal.SIGINT
    assert exits.TERMINATED == 128 + signal.SIGTERM == Terminated(signal.SIGTERM).exit_code


def test_usage_problems_found_late_exit_as_usage_errors():
    """UsageProblem lives below the CLI (layer 0) and carries its status itself."""
    assert UsageProblem.exit_code == exits.USAGE


EXITS = {"exit", "SystemExit", "fail"}  # sys.exit(...), SystemExit(...), outcome.fail(...)


def numbers_in(node: ast.AST) -> list[int]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and type(n.value) is int]  # fmt: skip


def test_every_exit_of_the_cli_names_its_status():
    """A bare number in sys.exit, SystemExit, fail or an "exit_code" of the JSON error
    would be a status the table does not govern."""
    found = []
    for path in (REPO / "patchkit" / "cli").rglob("*.py"):
        if path.name == "exits.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in EXITS and numbers_in(ast.Tuple([*node.args], ast.Load())):
                    found.append(f"{path.name}:{node.lineno} {name}(...)")
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "exit_code":
                        found += [f"{path.name}:{node.lineno} exit_code"] * bool(numbers_in(value))
    assert not found, found


def code_users(name: str) -> list[str]:
    """The modules of patchkit, exits.py aside, that use ``exits.<name>``."""
    users = []
    for path in (REPO / "patchkit").rglob("*.py"):
        tree = ast.parse(path.read_text())
        if path.name != "exits.py" and any(
            isinstance(n, ast.Attribute) and n.attr == name for n in ast.walk(tree)
        ):
            users.append(str(path.relative_to(REPO)))
    return users


def test_a_reserved_code_is_reserved_until_a_command_returns_it():
    """4 says "no command returns it yet": the day verify returns it, the table must say so."""
    meanings = dict(exits.TABLE)
    for name in ("INCONCLUSIVE",):
        reserved = "reserved" in meanings[getattr(exits, name)]
        assert reserved == (not code_users(name)), (name, code_users(name))


# ----- each code from the path the table gives it, in a child process -----


def probe_report(tmp_path: Path, lines: str | None, code: str = "", **env: str):
    """`patchkit probe report LOG` in a child: a log with ``lines``, or none (None)."""
    log = tmp_path / "probe.jsonl"
    if lines is not None:
        log.write_text(lines)
    return run_subprocess("probe", "report", str(log), env={**ENV, **env}, code=code)


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_0_done(tmp_path):
    assert probe_report(tmp_path, "").returncode == exits.OK
    assert run_subprocess("list", env=ENV).returncode == exits.OK


def test_1_nothing_changed(tmp_path):
    result = probe_report(tmp_path, "[1, 2]\n")
    assert result.returncode == exits.FAILURE
    assert one_line(result).endswith("probe.jsonl:1: a JSON object expected, got list")


def test_2_usage_from_click_and_from_a_command(tmp_path):
    result = run_subprocess("list", "--no-such-option", env=ENV)
    assert result.returncode == exits.USAGE and "No such option" in one_line(result)
    result = probe_report(tmp_path, None)  # UsageProblem: the file is missing
    assert result.returncode == exits.USAGE and "no such file" in one_line(result)


def test_2_no_command_prints_the_help_and_the_table_says_so():
    """`patchkit` alone asked for nothing: the help, and exit 2 as the table's row says."""
    result = run_subprocess(env=ENV)
    assert result.returncode == exits.USAGE and "Commands:" in result.stderr
    assert "no command given" in dict(exits.TABLE)[exits.USAGE]


def test_3_a_bug_is_one_line_and_its_traceback_on_request(tmp_path):
    result = probe_report(tmp_path, "", code=BUG)
    assert result.returncode == exits.BUG
    assert one_line(result) == (
        "patchkit: error: internal error ZeroDivisionError: boom (a bug in patchkit; rerun "
        f"with {exits.DEBUG_ENV}=1 for the traceback and report it)"
    )
    result = probe_report(tmp_path, "", code=BUG, **{exits.DEBUG_ENV: "1"})
    assert result.returncode == exits.BUG
    assert "Traceback" in result.stderr and "ZeroDivisionError: boom" in result.stderr


# verify's run replaced by one that returns a report of the given verdict for its one
# adapter (the judgement itself is tested in test_verify_verdicts.py): how each verdict
# leaves the CLI, text and JSON.
VERDICT = """
import patchkit.verify.runner as runner
from patchkit.codes import Code, Reason
from patchkit.verify import checks, rule
def run(catalogue, request, say=None):
    check = checks.Check("eager: a0 600 tokens vs merged", VERDICT == "PASSED", "d",
                         "a0", decided=VERDICT != "INCONCLUSIVE")
    why = Reason.of(Code.VERIFY_CHECK_OPEN, check=check.name, detail="d")
    adapter = checks.AdapterVerdict("a0", VERDICT, "merged", None, why,
                                    Reason.of(Code.VERIFY_DECIDES_PEFT))
    env = {"gpu": "H200", "compute_capability": "9.0", "torch": "2", "triton": "3",
           "vllm": "0.26.0", "vllm_path": "/v", "lora_backend": "torch", "seed": 1}
    return runner.VerifyReport(env, [], model=rule.ModelResult([check], [adapter]))
runner.run = run
"""


@pytest.mark.parametrize(
    "verdict,code",
    [("PASSED", exits.OK), ("FAILED", exits.FAILURE), ("INCONCLUSIVE", exits.INCONCLUSIVE)],
)
def test_verify_exits_by_its_verdict(verdict, code):
    fake = f"VERDICT = {verdict!r}\n" + VERDICT
    result = run_subprocess("verify", env=ENV, code=fake)
    assert result.returncode == code, result.stderr
    assert f"verify {verdict}" in result.stdout.splitlines()[-1]
    assert "adapter a0: " + verdict in result.stdout
    as_json = run_subprocess("verify", "--json", env=ENV, code=fake)
    assert as_json.returncode == code, as_json.stderr
    assert json.loads(as_json.stdout)["verdict"] == verdict


WAITING = (
    "import sys, time\n"
    "import patchkit.probe.report\n"
    "def waiting(path):\n"
    "    sys.stderr.write('ready\\n')\n"
    "    sys.stderr.flush()\n"
    "    time.sleep(120)\n"
    "patchkit.probe.report.report = waiting\n"
    "from patchkit.cli.main import main\n"
    "main()\n"
)


def default_dispositions() -> None:
    """In the child: the three signals acted on, whoever started the tests (a shell
    without job control ignores SIGINT for `pytest &`, nohup SIGHUP; children inherit it)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize(
    "signum,code",
    [(signal.SIGHUP, exits.HANGUP), (signal.SIGINT, exits.INTERRUPTED),
     (signal.SIGTERM, exits.TERMINATED)],
)  # fmt: skip
def test_a_signal_while_a_command_runs(tmp_path, signum, code):
    """The signal comes from outside (this process), once the command is running."""
    log = tmp_path / "probe.jsonl"
    log.write_text("")
    child = subprocess.Popen(
        [sys.executable, "-c", WAITING, "probe", "report", str(log)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **ENV}, preexec_fn=default_dispositions,
    )  # fmt: skip
    try:
        assert child.stderr.readline() == "ready\n"
        child.send_signal(signum)
        _, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == code, stderr
    result = subprocess.CompletedProcess(child.args, child.returncode, "", stderr)
    assert one_line(result).endswith("interrupted; `patchkit probe report` changes nothing")


RUNS = {
    exits.OK: test_0_done,
    exits.FAILURE: test_1_nothing_changed,
    exits.USAGE: test_2_usage_from_click_and_from_a_command,
    exits.BUG: test_3_a_bug_is_one_line_and_its_traceback_on_request,
    exits.INCONCLUSIVE: test_verify_exits_by_its_verdict,
    exits.HANGUP: test_a_signal_while_a_command_runs,
    exits.INTERRUPTED: test_a_signal_while_a_command_runs,
    exits.TERMINATED: test_a_signal_while_a_command_runs,
}


def test_every_code_the_table_gives_is_run_here():
    """A code added to the table gets a run above, or says it is reserved."""
    missing = [code for code, meaning in exits.TABLE
               if code not in RUNS and "reserved" not in meaning]  # fmt: skip
    assert not missing, missing
