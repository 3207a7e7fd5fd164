"""Below the command line a message is a value: adapter check's findings, notes and checks
skipped, adapter_config.json's problems, probe report's verdicts, a cache's reason, the
locks' and the catalogue journal's refusals, doctor's stale bytecode, the canary's
evidence, notes, verdict and next steps are reasons (patchkit.codes.Reason), and their
words are made only in patchkit/cli/.

Two guards: the dataclasses that hold a reason refuse a str, and no module of these
areas hands a sentence (a str or an f-string) to a list of messages, to a finding, to a
reason's keyword or to a PatchkitError.
"""

from __future__ import annotations

import ast

import pytest

from patchkit.adapters.adapterconfig import Problem
from patchkit.adapters.report import AdapterFinding, Kind, Report
from patchkit.codes import Code, Reason
from patchkit.probe.report import RequestFinding
from tests.conftest import REPO

PACKAGE = REPO / "patchkit"
# the areas whose messages are reasons (verify's: its verdicts' and references' why)
TYPED = [
    PACKAGE / "verify" / "rule.py",
    PACKAGE / "verify" / "references.py",
    PACKAGE / "verify" / "usermodel.py",
    *sorted((PACKAGE / "adapters").glob("*.py")),
    *sorted((PACKAGE / "probe").glob("*.py")),
    *sorted((PACKAGE / "caches").glob("*.py")),
    PACKAGE / "catalogue" / "journal.py",
    PACKAGE / "fs" / "locks.py",
    PACKAGE / "patching" / "bytecode.py",
    *sorted((PACKAGE / "canary").glob("*.py")),
]
# where an error raised for the user is a reason too (elsewhere in these areas an error is
# its kind, a code and its facts, with its line made where it is raised: a malformed probe
# log, a vLLM file patchkit cannot read; tests/test_errors_are_typed.py)
TYPED_ERRORS = {PACKAGE / "catalogue" / "journal.py", PACKAGE / "fs" / "locks.py"}
MESSAGE_LISTS = {"notes", "skipped", "warnings", "notices", "findings", "problems", "evidence"}
# calls whose every argument is a code or a fact (a command to run is one, not words): a
# model's evidence, a reason's facts
FACT_CALLS = {"mark", "mark_reason", "of"}
MESSAGE_KEYWORDS = {"reason", "message", "verdict", "look_at", "warning", "note"}


def test_a_finding_refuses_a_sentence_for_its_message():
    with pytest.raises(TypeError, match="Reason, not str"):
        AdapterFinding(Kind.FILE, "adapter_model.safetensors", "", "missing")
    with pytest.raises(TypeError, match="Reason, not str"):
        Report("a", None, None).add(Kind.CONFIG, "adapter_config.json", "r", "is '4'")
    said = Reason.of(Code.ADAPTER_NO_WEIGHTS)
    assert AdapterFinding(Kind.FILE, "adapter_model.safetensors", "", said).message is said


def test_a_request_finding_refuses_a_sentence_for_its_reason():
    where = dict(request="a", adapter=None, step=1, layer=0, module="input")
    with pytest.raises(TypeError, match="Reason, not str"):
        RequestFinding(**where, reason="hidden state already bad at the layer's input")
    assert RequestFinding(**where, reason=Reason.of(Code.PROBE_INPUT_BAD)).reason.code == (
        Code.PROBE_INPUT_BAD
    )


def test_a_verdict_refuses_a_sentence_for_its_why():
    from patchkit.verify.checks import AdapterVerdict

    why = Reason.of(Code.VERIFY_DECIDES_PEFT)
    with pytest.raises(TypeError, match="why is a Reason, not str"):
        AdapterVerdict("a0", "PASSED", "peft", None, "within the peft reference's bound")
    with pytest.raises(TypeError, match="reference_why is a Reason, not str"):
        AdapterVerdict("a0", "PASSED", "peft", "--reference peft", why)
    assert AdapterVerdict("a0", "INCONCLUSIVE", "merged", None, why, why).decides_instead is why


def _sentence(node: ast.AST) -> bool:
    """A str constant with words in it, or an f-string."""
    if isinstance(node, ast.JoinedStr):
        return True
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and " " in node.value


def _sentences_handed_on(call: ast.Call, errors: bool = True) -> list[ast.AST]:
    """The arguments of ``call`` that would carry a sentence where a reason belongs
    (``errors``: an error's too)."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    owner = func.value if isinstance(func, ast.Attribute) else None
    owner_name = getattr(owner, "attr", None) or getattr(owner, "id", "")
    found = [k.value for k in call.keywords if k.arg in MESSAGE_KEYWORDS]
    if name in ("append", "extend") and owner_name in MESSAGE_LISTS:
        found += call.args
    if name == "add" and owner_name == "report":
        found += call.args[3:4]  # report.add(kind, file, tensor, message)
    if name in ("Problem", "AdapterFinding", "RequestFinding"):
        found += call.args
    if name in FACT_CALLS or (name == "add" and owner_name == "verdict"):
        found += call.args + [k.value for k in call.keywords if k.arg != "command"]
    if errors and name in ("PatchkitError", "Refused"):
        found += call.args
    return [node for node in found if _sentence(node)]


def test_no_sentence_is_made_where_a_reason_belongs():
    made = [
        f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:100]}"
        for path in TYPED
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and _sentences_handed_on(node, path in TYPED_ERRORS)
    ]
    assert not made, "words are made in patchkit/cli/ (a code and its facts here):\n" + "\n".join(
        made
    )


def test_the_guard_sees_a_sentence_handed_on():
    """The scan above finds what it looks for (a guard that finds nothing proves nothing)."""
    calls = [
        'report.notes.append(f"{key}: a full embedding copy")',
        'report.add(Kind.FILE, "f", "", "missing: the adapter has no weights")',
        'Problem("r", f"is {value}; a whole number expected")',
        'raise PatchkitError(f"{path}: more than {limit} bytes")',
        'result("absent", reason=f"{path} does not exist")',
        'verdict.mark("bad", Code.CANARY_ZERO_RUN, f"{run} tokens of id 0 in a row")',
        'verdict.add(Code.CANARY_RETRY_FAILED, f"without logprobs too: HTTP {status}")',
        'Reason.of(Code.CANARY_NO_MODELS, text="the server lists no models")',
        'report.notes.append(f"{count} more models not checked")',
    ]
    for source in calls:
        call = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call))
        assert _sentences_handed_on(call), source
    fine = 'report.add(Kind.FILE, "adapter_model.safetensors", "", said)'
    call = next(n for n in ast.walk(ast.parse(fine)) if isinstance(n, ast.Call))
    assert not _sentences_handed_on(call)


def test_a_config_problem_is_a_reason():
    assert Problem("r", Reason.of(Code.ADAPTER_CONFIG_BAD_R, value="'4'")).message.code == (
        Code.ADAPTER_CONFIG_BAD_R
    )


def test_doctor_hands_up_stale_bytecode_as_reasons():
    """Why a .pyc is stale is a code and its facts: _pyc_problem returns no sentence."""
    tree = ast.parse((PACKAGE / "doctor" / "doctor.py").read_text())
    function = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_pyc_problem"
    )
    returns = [n for n in ast.walk(function) if isinstance(n, ast.Return)]
    said = [n for n in returns if any(_sentence(part) for part in ast.walk(n))]
    assert returns and not said, [ast.unparse(n) for n in said]


def test_the_canary_makes_no_words():
    """Below the command line the canary makes no words: its messages module (say(), a
    reason that carried its text) is gone, and every canary code has words in
    patchkit/cli/canary_words.py, none of them a TEXT code whose words are a fact."""
    from patchkit.cli import canary_words
    from patchkit.cli.words import TEXT

    assert not (PACKAGE / "canary" / "messages.py").exists()
    canary = {code for code in Code if code.value.startswith("canary-")}
    assert canary <= set(canary_words.WORDS)
    assert not canary & set(TEXT)
