"""The evidence ledger (docs/evidence.md) stays honest, and readable.

Every measured number patchkit's documentation relies on lives there, each
with the date, commit, host and command that produced it. A number whose
script was renamed, whose archive was dropped or whose commit was mistyped
would be a claim without its evidence; a dated prose folder beside the ledger
would be a second place for the same numbers to drift apart in.

Readable: an entry opens with its claim in one sentence, then a small table of
its numbers, its command and its archive; the reasoning that led there lives in
the entry's notes (docs/evidence/NAME.md beside the archive NAME.tar.xz, under
the entry's own heading), so no line of the ledger is a wall of text.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO

LEDGER = REPO / "docs" / "evidence.md"
THIS = Path(__file__).resolve()
ARCHIVES = REPO / "docs" / "evidence"
REQUIRED = ("date", "commit", "host", "command")
FORM = ("claim", "data", "notes")  # what a converted `###` entry has besides
NOTES = re.compile(r"^`(docs/evidence/[a-z0-9][a-z0-9.-]*\.md)`")
# A line a reader takes in at once: 400 characters is four lines of a 100-column
# screen, room for a field that quotes a sitting's whole `GS_...` command line; the
# old ledger's walls (up to 3,198 characters) were paragraphs of reasoning, which
# belong in the notes. Fenced code blocks are exempt (a command is copied, not read).
LONGEST_LINE = 400
# A table row is read cell by cell: seven cells of about 90 characters.
LONGEST_ROW = 650
LONGEST_CLAIM = 300
# `###` entries (and `##`/`###` prose) not yet in the claim/table/notes form, by the
# start of their heading: each is exempt from FORM and LONGEST_LINE until converted,
# then must leave this list.
NOT_YET_CONVERTED: tuple[str, ...] = ()
NOT_RECORDED = "not recorded"
NOT_GROUPS = ("Index", "Reading this ledger", "The archives")
HOWTO = "How a GPU sitting is run"
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
SHORT_HASH = re.compile(r"\b[0-9a-f]{7}\b")  # how this house writes a commit in prose
FIELD = re.compile(r"^- ([a-z]+): (.*)$")
SCRIPT = re.compile(r"(?<![\w/.:-])((?:scripts|tests)/[\w./-]+\.(?:py|sh))\b")
AT_COMMIT = re.compile(r"git show ([0-9a-f]{7,40}):([\w./-]+\.\w+)")
TEST_DATA = re.compile(r"tests/data/[\w.*/-]*[\w*]")
ARCHIVE = re.compile(r"docs/evidence/[a-z0-9][a-z0-9.-]*\.tar\.xz")
ISSUE = re.compile(r"\bissues?\s+\d", re.IGNORECASE)
DATED_FOLDER = re.compile(r"^[a-z0-9]+-\d{4}-\d{2}-\d{2}[a-z]?$")
# where the old homes of the numbers must no longer be named
OLD_HOMES = re.compile(r"BENCHMARKS\.md|next-gpu-session|docs/[a-z0-9]+-\d{4}-\d{2}-\d{2}")
POINTING_FILES = ("README.md", "CONTRIBUTING.md", "scripts", "patches", "patchkit", "tests")


@dataclass
class Entry:
    group: str  # the `##` section
    sub: str  # for a table row, the `###` heading above its table
    where: str  # "line N" of the ledger, for the failure message
    fields: dict[str, str]
    heading: str = ""  # for a `###` entry, its title


def cells(line: str) -> list[str]:
    """A markdown table row's cells; a `|` inside backticks stays in its cell."""
    out, cell, code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            code = not code
        if char == "|" and not code:
            out.append(cell.strip())
            cell = ""
        else:
            cell += char
    return [*out, cell.strip()]


@cache
def ledger() -> tuple[list[str], list[Entry]]:
    """The ledger's `##` groups in order, and its entries: `###` sections with their
    `- field: value` lines (anywhere in the section: the claim opens it, the numbers'
    table and the other fields follow), and the rows of tables whose header names
    date and commit. A `###` heading with no fields over such a table is the table's
    title, not an entry."""
    groups: list[str] = []
    entries: list[Entry] = []
    group = sub = ""
    header: list[str] | None = None
    section: Entry | None = None
    for number, line in enumerate(LEDGER.read_text().splitlines(), 1):
        if line.startswith("|"):
            row = cells(line)
            if header is None:
                header = [c.lower() for c in row]
            elif {"date", "commit"} <= set(header) and not set("".join(row)) <= set("-: "):
                fields = dict(zip(header, row, strict=True)) if len(row) == len(header) else {}
                entries.append(Entry(group, sub, f"line {number}", fields))  # {}: a broken row
            continue
        header = None
        if line.startswith("## "):
            group, sub, section = line[3:].strip(), "", None
            groups.append(group)
        elif line.startswith("### "):
            sub = line[4:].strip()
            section = Entry(group, "", f"line {number}", {}, heading=sub)
            entries.append(section)
        elif section is not None and (match := FIELD.match(line)):
            section.fields.setdefault(match[1], match[2].strip())
    titles = {(e.group, e.sub) for e in entries if e.sub}
    return groups, [e for e in entries if e.fields or (e.group, e.heading) not in titles]


def notes_files() -> list[Path]:
    return sorted(ARCHIVES.glob("*.md"))


def evidence_text() -> str:
    """The ledger and its notes: what either cites must exist."""
    return "\n".join([LEDGER.read_text(), *(p.read_text() for p in notes_files())])


def entries_in(groups: set[str] | None = None, heading: str | None = None) -> list[Entry]:
    return [
        e
        for e in ledger()[1]
        if (groups is None or e.group in groups) and (heading is None or e.heading == heading)
    ]


@cache
def unknown_commits(names: tuple[str, ...]) -> set[str]:
    """The names among these that this repository's git does not know as commits."""
    try:
        subprocess.run(["git", "-C", REPO, "rev-parse", "--git-dir"], check=True,
                       capture_output=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the ledger's commits cannot be looked up")
    query = "".join(f"{name}\n" for name in names)
    answer = subprocess.run(["git", "-C", REPO, "cat-file", "--batch-check"], input=query,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    found = zip(names, answer.splitlines(), strict=True)
    return {name for name, line in found if line.endswith("missing")}


@cache
def members(archive: Path) -> frozenset[str]:
    with tarfile.open(archive, "r:xz") as tar:
        return frozenset(tar.getnames())


def test_the_ledger_has_its_groups_with_entries_and_ends_with_the_howto():
    groups, entries = ledger()
    claims = [g for g in groups if g not in (*NOT_GROUPS, HOWTO)]
    assert len(claims) >= 5, groups
    empty = [g for g in claims if not any(e.group == g for e in entries)]
    assert empty == [], f"groups without an entry: {empty}"
    assert groups[-1] == HOWTO, f"the last section is {groups[-1]!r}, not {HOWTO!r}"


def test_every_entry_has_date_commit_host_and_command():
    problems = []
    for entry in entries_in():
        for name in REQUIRED:
            value = entry.fields.get(name, "").strip()
            if not value:
                problems.append(f"{entry.where}: no {name}")
        date = entry.fields.get("date", "")
        if date and not (re.match(r"\d{4}-\d{2}-\d{2}\b", date) or date.startswith(NOT_RECORDED)):
            problems.append(f"{entry.where}: date {date!r} is neither YYYY-MM-DD nor not recorded")
        commit = entry.fields.get("commit", "")
        if commit and not (HASH.match(commit) or commit.startswith(NOT_RECORDED)):
            problems.append(f"{entry.where}: commit {commit!r} is neither a hash nor not recorded")
        command = entry.fields.get("command", "")
        if command and "`" not in command and not command.startswith(NOT_RECORDED):
            problems.append(f"{entry.where}: command {command!r} quotes no command")
    assert entries_in(), "no entries found in the ledger"
    assert problems == [], "\n".join(problems)


def test_every_commit_the_ledger_names_is_one_git_knows():
    """Commit fields, and every short hash in the text (`written up in X`, `git show
    X:path`, the archives' table): a mistyped hash is a claim nobody can check out."""
    named = {h for e in entries_in() for h in HASH.findall(e.fields.get("commit", ""))}
    named |= {h for h in SHORT_HASH.findall(evidence_text()) if not h.isdigit()}
    assert len(named) > 20, sorted(named)
    names = tuple(sorted(f"{h}^{{commit}}" for h in named))
    assert unknown_commits(names) == set()


RESEARCH = "scripts/research/"  # the one-off prototypes, kept in their archive since
RESEARCH_ARCHIVE = ARCHIVES / "research-prototypes.tar.xz"


def archived(path: str) -> bool:
    """A research prototype the ledger cites as it ran (scripts/research/X) is a member of
    the archive it went to (research-prototypes/X)."""
    top = RESEARCH_ARCHIVE.name.removesuffix(".tar.xz")
    return path.startswith(RESEARCH) and (
        f"{top}/{path.removeprefix(RESEARCH)}" in members(RESEARCH_ARCHIVE)
    )


def test_every_script_and_test_the_ledger_cites_exists():
    text = evidence_text()
    cited = set(SCRIPT.findall(text))
    assert cited, "the ledger cites no script"
    missing = sorted(p for p in cited if not (REPO / p).is_file() and not archived(p))
    assert missing == [], f"cited, not in the repository: {missing}"
    gone = tuple(f"{commit}:{path}" for commit, path in AT_COMMIT.findall(text))
    assert unknown_commits(gone) == set(), "a `git show X:path` names no file of X"


def test_every_test_data_file_and_archive_the_ledger_cites_exists():
    text = evidence_text()
    data = set(TEST_DATA.findall(text))
    archives = set(ARCHIVE.findall(text))
    assert data and archives
    missing = sorted(p for p in data if not list(REPO.glob(p)))
    missing += sorted(p for p in archives if not (REPO / p).is_file())
    assert missing == [], f"cited, not in the repository: {missing}"


def test_every_archive_member_an_entry_cites_is_in_its_archive():
    """`docs/evidence/X.tar.xz`: `a`, `b` in a data field names X/a and X/b."""
    problems, checked = [], 0
    for entry in entries_in():
        for part in entry.fields.get("data", "").split(";"):
            quoted = re.findall(r"`([^`]+)`", part)
            if not quoted or not ARCHIVE.fullmatch(quoted[0]):
                continue
            archive = REPO / quoted[0]
            if not archive.is_file():
                continue  # the test above names it
            top = archive.name.removesuffix(".tar.xz")
            for member in quoted[1:]:
                checked += 1
                if f"{top}/{member}" not in members(archive):
                    problems.append(f"{entry.where}: {quoted[0]} has no {member}")
    assert checked > 50, checked
    assert problems == [], "\n".join(problems)


def test_every_archive_under_docs_evidence_is_cited_by_the_ledger():
    """The archives, and the notes beside them: nothing else lives there."""
    cited = set(ARCHIVE.findall(LEDGER.read_text()))
    present = {str(p.relative_to(REPO)) for p in ARCHIVES.iterdir() if p.name.endswith(".tar.xz")}
    assert present, "docs/evidence holds no archive"
    assert present <= cited, f"raw data no entry relies on: {sorted(present - cited)}"
    others = sorted(p.name for p in ARCHIVES.iterdir() if not p.name.endswith((".tar.xz", ".md")))
    assert others == [], f"neither an archive nor notes: {others}"


def test_no_dated_folder_is_left_beside_the_ledger():
    dated = sorted(p.name for p in (REPO / "docs").iterdir() if DATED_FOLDER.match(p.name))
    assert dated == [], f"dated folders under docs/ (their numbers belong in the ledger): {dated}"
    for gone in ("BENCHMARKS.md", "docs/next-gpu-session.md"):
        assert not (REPO / gone).exists(), f"{gone} is back: its content lives in the ledger"


def test_nothing_points_at_the_numbers_old_homes():
    hits = []
    for name in POINTING_FILES:
        root = REPO / name
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in paths:
            if path == THIS or path.suffix == ".pyc" or path.is_relative_to(REPO / "tests/data"):
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if OLD_HOMES.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert hits == [], "point these at docs/evidence.md:\n" + "\n".join(hits)


def test_the_ledger_names_no_issue_numbers():
    """The ledger says what is claimed; an issue number says nothing to a reader
    without the tracker (upstream vLLM's #48590 and the like are fine). Its notes too."""
    found = [
        f"{path.name} line {n}: {line.strip()}"
        for path in (LEDGER, *notes_files())
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ISSUE.search(line)
    ]
    assert found == [], "\n".join(found)


def test_each_group_lists_its_entries_newest_first():
    """Within a group (and within each table of it), a later entry is not newer."""
    problems = []
    for group in ledger()[0]:
        lists: dict[str, list[Entry]] = {}
        for entry in entries_in({group}):
            if re.match(r"\d{4}-\d{2}-\d{2}", entry.fields.get("date", "")):
                lists.setdefault(entry.sub, []).append(entry)
        for dated in lists.values():
            for newer, older in zip(dated, dated[1:], strict=False):
                if older.fields["date"][:10] > newer.fields["date"][:10]:
                    problems.append(f"{group}: {older.where} is newer than {newer.where} above it")
    assert problems == [], "\n".join(problems)


def converted(entry: Entry) -> bool:
    return entry.heading != "" and not entry.heading.startswith(NOT_YET_CONVERTED)


def test_every_entry_opens_with_a_one_sentence_claim_and_names_its_data_and_notes():
    """A converted `###` entry: `- claim:` first under its heading, one sentence a
    reader takes in at once; `- data:` (the archive and its members, or what else
    holds the output, or "not kept"); `- notes:` naming its notes file."""
    problems = []
    lines = LEDGER.read_text().splitlines()
    for entry in [e for e in entries_in() if converted(e)]:
        for name in FORM:
            if not entry.fields.get(name, "").strip():
                problems.append(f"{entry.where}: no {name}")
        number = int(entry.where.split()[1])
        first = next((line for line in lines[number:] if line.strip()), "")
        if not first.startswith("- claim: "):
            problems.append(f"{entry.where}: the first line under the heading is not its claim")
        claim = entry.fields.get("claim", "")
        if len(claim) > LONGEST_CLAIM:
            problems.append(f"{entry.where}: a claim of {len(claim)} characters")
        if claim and (not claim.endswith(".") or re.search(r"[.;] [A-Z]", claim)):
            problems.append(f"{entry.where}: the claim is not one sentence: {claim!r}")
    assert problems == [], "\n".join(problems)


def test_every_notes_file_an_entry_names_holds_that_entry():
    """`- notes: `docs/evidence/X.md`` names a file beside the archives with a `##`
    heading equal to the entry's; every notes file is named by an entry, and each
    of its headings is a `###` heading of the ledger (an entry's, or the title of a
    table of entries) or a group's title (a group's prose and its table of entries):
    no reasoning left behind for a removed entry."""
    problems, named = [], set()
    lines = LEDGER.read_text().splitlines()
    headings = {line.split(" ", 1)[1] for line in lines if line.startswith(("## ", "### "))}
    for entry in [e for e in entries_in() if "notes" in e.fields]:
        match = NOTES.match(entry.fields["notes"])
        if not match:
            problems.append(f"{entry.where}: notes {entry.fields['notes']!r} names no notes file")
            continue
        path = REPO / match[1]
        named.add(path)
        if not path.is_file():
            problems.append(f"{entry.where}: {match[1]} does not exist")
        elif f"## {entry.heading}" not in path.read_text().splitlines():
            problems.append(f"{entry.where}: {match[1]} has no heading '## {entry.heading}'")
    for path in notes_files():
        if path not in named:
            problems.append(f"{path.name}: no entry names it")
        for line in path.read_text().splitlines():
            if line.startswith("## ") and line[3:] not in headings:
                problems.append(f"{path.name}: '{line}' is no entry of the ledger")
    assert problems == [], "\n".join(problems)


def test_no_line_of_the_ledger_is_a_wall_of_text():
    """Outside fenced code blocks and the parts not yet converted, no line is longer
    than LONGEST_LINE, no table row than LONGEST_ROW; the list of those parts only
    shrinks."""
    problems, code, exempt, titles = [], False, False, []
    for number, line in enumerate(LEDGER.read_text().splitlines(), 1):
        if line.startswith("```"):
            code = not code
        if line.startswith(("## ", "### ")):
            titles.append(line.split(" ", 1)[1])
            exempt = titles[-1].startswith(NOT_YET_CONVERTED)
        limit = LONGEST_ROW if line.startswith("|") else LONGEST_LINE
        if not code and not exempt and len(line) > limit:
            problems.append(f"line {number}: {len(line)} characters: {line[:80]}...")
    for start in NOT_YET_CONVERTED:
        matches = [t for t in titles if t.startswith(start)]
        if len(matches) != 1:
            problems.append(f"NOT_YET_CONVERTED {start!r} matches {len(matches)} headings")
        elif any(all(e.fields.get(f) for f in FORM) for e in entries_in(heading=matches[0])):
            problems.append(f"{start!r} is converted: remove it from NOT_YET_CONVERTED")
    assert problems == [], "\n".join(problems)


def test_the_index_names_every_group():
    """The index at the top leads to each group of claims by its anchor."""
    groups = [g for g in ledger()[0] if g != "Index"]
    index = LEDGER.read_text().split("## Index", 1)[-1].split("\n## ", 1)[0]
    missing = [g for g in groups if f"(#{anchor(g)})" not in index]
    assert missing == [], f"groups the index does not link: {missing}"


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
