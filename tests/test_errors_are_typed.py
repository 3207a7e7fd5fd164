"""Every error patchkit ends a command with is a value: a kind with its code, and its facts.

A PatchkitError subclass names its code (``code = Code.X``, or a property, as Refused
reads its reason's); the base class is never raised itself, so no failure reaches
``--json`` as the bare ``"error"``. Both are checked here on patchkit/'s source with
``ast``, so a new ``raise PatchkitError(...)`` or an error kind without a code fails
the suite; the guard's own test shows it sees what it looks for.
"""

from __future__ import annotations

from patchkit.codes import Code, Line, Reason
from patchkit.errors import FileProblem, OsFailure, PatchkitError
from tests.conftest import REPO
from tests.error_helpers import PACKAGE, bare_raises, classes_of, error_kinds


def test_no_module_raises_the_base_class():
    made = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in bare_raises(path.read_text())
    ]
    assert not made, "raise an error of its kind (a PatchkitError subclass with a code):\n" + (
        "\n".join(made)
    )


def test_every_error_kind_names_its_code():
    kinds = error_kinds()
    assert len(kinds) > 30  # the scan finds the kinds (a guard that finds none proves nothing)
    missing = sorted(name for name, code in kinds.items() if code is None)
    assert not missing, f"these PatchkitError kinds name no code (code = Code.X): {missing}"
    unknown = sorted(
        f"{name}: Code.{code}"
        for name, code in kinds.items()
        if code not in ("property", None) and code not in Code.__members__
    )
    assert not unknown, unknown


def test_the_guards_see_what_they_look_for():
    source = """
class Fine(PatchkitError):
    code = Code.UNSAFE_PATH
class Inherits(Fine):
    pass
class Uncoded(PatchkitError):
    pass
class Other(Exception):
    pass
def later(line):
    return PatchkitError(line)
raise PatchkitError("a line")
"""
    classes = classes_of(source)
    assert classes["Fine"] == (["PatchkitError"], "UNSAFE_PATH")
    assert classes["Uncoded"] == (["PatchkitError"], None)
    assert sorted(bare_raises(source)) == [11, 12]


def test_an_error_is_its_code_its_facts_and_its_line():
    """The reason an error hands the command line: its kind's code, its facts (a path as
    text, a lower error as its own reason), and its line as its words."""
    lower = FileProblem(REPO / "adapter_model.safetensors", "truncated at byte 8")
    error = OsFailure(OSError(28, "No space left on device"), "writing", path=REPO / "x")
    reworded = lower.reworded(f"--model: {lower}", option="--model")
    assert isinstance(error.reason, Line) and error.reason.code == Code.OS_ERROR
    assert error.reason["errno"] == "ENOSPC" and error.reason["path"] == str(REPO / "x")
    assert error.reason["text"] == str(error)
    assert str(reworded) == f"--model: {lower}" and reworded.code == Code.FILE_UNUSABLE
    assert reworded.reason["option"] == "--model" and reworded.path == lower.path
    nested = _Kind("outer", cause=lower).reason
    assert isinstance(nested["cause"], Reason) and nested["cause"].code == Code.FILE_UNUSABLE


class _Kind(PatchkitError):
    """An error kind of the test's own (a code any kind may name)."""

    code = Code.FILE_UNUSABLE
