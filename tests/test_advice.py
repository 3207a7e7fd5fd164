"""The advice patchkit prints is right: every command it suggests does what it says.

Tried as a new user and as a maintainer would, on real release trees: install
lines that name real packages, a conflict that points at the real site, a
stale-cache verdict that is not about doctor's own scan and keeps `--target`,
known issues that follow the patch's state, a release newer than the
catalogue, and a file edited after apply.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO, run_cli

# ----- install lines name the packages (the index's `patchkit` is another project) -----

INSTALL = re.compile(r"\bpip3?\s+install\b([^\n`\"]*)")
INDEX_PATCHKIT = re.compile(r"patchkit(\[[^\]]*\])?([<>=!~].*)?")
EXTRA = re.compile(r"(?<![\w/.-])patchkit\[")  # "install patchkit[gpu]", pip or not


def user_texts() -> dict[str, str]:
    """Every string constant of the package, and the pages and scripts a user reads."""
    texts = {}
    for path in sorted((REPO / "patchkit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str)]  # fmt: skip
        texts[str(path.relative_to(REPO))] = "\n".join(strings)
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", *REPO.glob("docker/*")]
    pages += [p for p in REPO.glob("docs/**/*.md") if "research" not in p.parts]
    pages += [p for p in REPO.glob("scripts/*") if p.is_file()]
    for path in pages:
        texts[str(path.relative_to(REPO))] = path.read_text(errors="replace")
    return texts


def index_installs(text: str) -> list[str]:
    """The install lines of ``text`` that fetch `patchkit` from the package index."""
    found = [m.group(0) for m in EXTRA.finditer(text)]
    for match in INSTALL.finditer(text):
        words = [w.strip("'\"") for w in match.group(1).split()]
        found += [match.group(0) for w in words if INDEX_PATCHKIT.fullmatch(w)]
    return found


def test_the_detector_finds_what_the_old_lines_said():
    """The scan below would have caught each line these commands printed before."""
    old = [
        "patchkit canary needs httpx and prometheus-client: pip install 'patchkit[canary]'",
        "verify needs torch with CUDA (install patchkit[gpu] next to vLLM)",
        "`--e2e` transformers >= 5.17 and peft: `pip install 'patchkit[gpu]'`",
        "pip install patchkit",
        "python3 -m pip install -U patchkit==0.1.0",
    ]
    assert all(index_installs(line) for line in old)
    fine = [
        "pip install -e '/path/to/checkout[gpu]'",
        "python3 -m pip install --quiet /opt/patchkit",
        ".venv/bin/pip install -q -e '.[test]'",
        "pip install 'httpx>=0.27' 'prometheus-client>=0.20'",
    ]
    assert not any(index_installs(line) for line in fine)


def test_no_install_line_names_patchkit_from_the_index():
    found = {name: hits for name, text in user_texts().items() if (hits := index_installs(text))}
    assert found == {}


def test_canary_names_its_packages():
    from patchkit.live.canary import MISSING_DEPS

    assert "pip install 'httpx>=0.27' 'prometheus-client>=0.20'" in MISSING_DEPS


# ----- a conflict points at the real site -----

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
COLUMN = "vllm/lora/layers/column_parallel_linear.py"


def line_of(path: Path, text: str, after: str = "") -> int:
    """The 1-based number of the first line that is ``text`` (stripped), after the first
    line that starts with ``after``."""
    lines = path.read_text().split("\n")
    first = next(i for i, line in enumerate(lines) if line.strip().startswith(after))
    return next(i for i in range(first, len(lines)) if lines[i].strip() == text) + 1


def insert_after(path: Path, number: int, line: str) -> None:
    lines = path.read_text().split("\n")
    lines.insert(number, line)
    path.write_text("\n".join(lines))


def patch_line(root: Path, patch_id: str) -> str:
    result = run_cli("status", "--target", str(root))
    return next(line for line in result.output.splitlines() if line.strip().startswith(patch_id))


def test_a_line_inserted_in_load_model_is_named_where_it_is(tree_0260: Path):
    """nan-probe's third hunk sits ~1000 lines below its 0.17.0 header on 0.26.0; one line
    added between its two context lines (a `)` and the drafter check in load_model) is
    named there, not at the first `)` 800 lines away."""
    runner = tree_0260 / RUNNER
    drafter = line_of(runner, 'if hasattr(self, "drafter"):', after="def load_model(")
    insert_after(runner, drafter - 1, "                pass")
    line = patch_line(tree_0260, "nan-probe")
    assert (
        f"closest at line {drafter - 1}, where line {drafter} should be "
        "'if hasattr(self, \"drafter\"):' but is 'pass'"
    ) in line, line
    applied = run_cli("apply", "--only", "nan-probe", "--target", str(tree_0260))
    assert applied.exit_code == 1 and f"closest at line {drafter - 1}," in applied.stderr


def test_partial_gdn_adapter_conflicts_are_named_exactly(tree_0260: Path):
    """The hunk at expand_packed_lora's loop: a line inserted, then a line changed."""
    column = tree_0260 / COLUMN
    pristine = column.read_text()
    loop = line_of(column, "for a_i, b_i in zip(lora_a, lora_b):")
    insert_after(column, loop - 1, "        # a local note")
    assert (
        f"closest at line {loop - 3}, where line {loop} should be "
        "'for a_i, b_i in zip(lora_a, lora_b):' but is '# a local note'"
    ) in patch_line(tree_0260, "partial-gdn-adapter")
    column.write_text(pristine.replace("        start_idx = 0\n", "        start_idx = 1\n", 1))
    assert (
        f"closest at line {loop - 3}, where line {loop - 1} should be 'start_idx = 0' "
        "but is 'start_idx = 1'"
    ) in patch_line(tree_0260, "partial-gdn-adapter")
