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

from tests.conftest import REPO

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
