"""The code patchkit installs into vLLM is treated as code: documented, tested, linted.

docs/installed-code.md has a row for every Python file under patches/*/files/;
each test the row names exists and reaches that file (names its module, or runs
it through tests/punica_harness.py, which loads the torch LoRA path's module);
and ruff checks the file under the project's settings, nothing excluding it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "installed-code.md"
INSTALLED = sorted(REPO.glob("patches/*/files/**/*.py"))
HARNESS = "tests.punica_harness"  # loads patchkit_lora_matmul.py from the catalogue


def rows() -> dict[str, list[str]]:
    """{file under files/: the tests its row names}."""
    found = {}
    for line in PAGE.read_text().splitlines():
        cells = line.split(" | ")
        if line.startswith("| `vllm/") and len(cells) >= 5:
            found[cells[0].strip("| `")] = re.findall(r"`(tests/[\w/]+\.py)`", cells[4])
    return found


def test_the_installed_code_is_there():
    assert [p.name for p in INSTALLED] == ["patchkit_lora_matmul.py", "patchkit_nan_probe.py"]


@pytest.mark.parametrize("path", INSTALLED, ids=lambda p: p.name)
def test_each_installed_file_has_its_row_and_tests_that_reach_it(path):
    relpath = Path(*path.relative_to(REPO).parts[3:]).as_posix()  # patches/ID/files/...
    tests = rows().get(relpath)
    assert tests, f"docs/installed-code.md has no row for {relpath}"
    for test in tests:
        text = (REPO / test).read_text()
        assert path.stem in text or HARNESS in text, f"{test} does not reach {path.name}"


def test_ruff_checks_the_installed_code():
    listed = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "patches"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for path in INSTALLED:
        assert str(path) in listed or path.relative_to(REPO).as_posix() in listed, path
