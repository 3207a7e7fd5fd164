"""One reader of a wheel's RECORD: every hash RECORD may name, sha256 rows as before.

Read on the real RECORD files of the release trees in the test cache. The
trees whose RECORD is rewritten in another algorithm are real trees altered
for the test (said where it happens): the wheels on PyPI all use sha256.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest

from patchkit.catalogue.load import load_catalogue
from patchkit.errors import PatchkitError
from patchkit.releases.record import RecordMismatch, check_member, parse_record
from patchkit.vllmtree.record import read_rows
from patchkit.vllmtree.tree import locate
from tests.conftest import release_tree, run_cli
from tests.helpers import UTILS

# the oldest, the slim tree's and the newest tested (0.35.0 was a release drill's tree,
# made in one machine's cache: on PyPI there is none, so a fresh machine failed here)
READ_ON = ["0.17.0", "0.26.0", load_catalogue().newest_tested]


def record_of(tree: Path) -> Path:
    [dist_info] = tree.glob("vllm-*.dist-info")
    return dist_info / "RECORD"


def sha256_rows_as_before(text: str) -> dict[str, str]:
    """How tree.py read RECORD until one reader replaced it (kept here as the oracle):
    csv over the text, sha256 rows only, the digest as hex."""
    hashes = {}
    for row in csv.reader(io.StringIO(text, newline="")):
        if len(row) >= 2 and row[1].startswith("sha256="):
            digest = row[1][len("sha256=") :]
            hashes[row[0]] = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return hashes


@pytest.mark.parametrize("version", READ_ON)
def test_sha256_rows_of_a_real_record_read_as_before(version):
    text = record_of(release_tree(version)).read_text()
    rows = read_rows(text)
    before = sha256_rows_as_before(text)
    assert before and {p: r.digest().hex() for p, r in rows.items() if r.known} == before
    unhashed = [p for p, r in rows.items() if not r.hash]
    assert f"vllm-{version}.dist-info/RECORD" in unhashed  # RECORD cannot hash itself
    assert not [p for p in unhashed if p.endswith(".py")]


def test_a_tree_record_vouches_for_the_real_files(slim_tree_0260):
    tree = locate(str(slim_tree_0260))
    files = [p for p in slim_tree_0260.rglob("*.py") if p.is_file()]
    assert len(files) > 10
    for path in files:
        relpath = path.relative_to(slim_tree_0260).as_posix()
        assert tree.record[relpath] == hashlib.sha256(path.read_bytes()).hexdigest(), relpath
    assert not any(p.endswith("/RECORD") for p in tree.record)  # a row without a hash


def rewrite_record(tree: Path, algorithm: str) -> None:
    """Alter a real tree: every hashed row of its RECORD in ``algorithm``, over the same
    bytes the wheel holds (the tree is pristine, so those are its files)."""
    record = record_of(tree)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in csv.reader(io.StringIO(record.read_text(), newline="")):
        if len(row) >= 2 and row[1] and (tree / row[0]).is_file():
            digest = hashlib.new(algorithm, (tree / row[0]).read_bytes()).digest()
            row[1] = f"{algorithm}=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        elif len(row) >= 2 and row[1]:
            row[1] = ""  # a file the slim tree left out: no bytes to hash it by
        writer.writerow(row)
    record.write_text(out.getvalue())


@pytest.mark.parametrize("algorithm", ["sha384", "sha512", "sha3_256", "blake2b"])
def test_a_record_in_another_algorithm_decides_as_sha256_does(tmp_path, slim_tree_0260, algorithm):
    """The same tree with its RECORD in sha256 and in ``algorithm``: status says the same,
    pristine and with a file edited (a conflict: not the wheel's file)."""
    other = tmp_path / "other"
    shutil.copytree(slim_tree_0260, other)
    rewrite_record(other, algorithm)
    tree = locate(str(other))
    assert tree.record[UTILS] == hashlib.sha256((other / UTILS).read_bytes()).hexdigest()
    for root in (slim_tree_0260, other):
        (root / UTILS).write_bytes((root / UTILS).read_bytes() + b"# edited\n")

    def status(root: Path) -> list:
        done = run_cli("status", "--target", str(root), "--json")
        patches = json.loads(done.stdout)["patches"]
        return [(p["id"], p["state"], p["reason"] and p["reason"]["message"]) for p in patches]

    found = status(other)
    assert found == status(slim_tree_0260)
    assert any(state == "conflict" and UTILS in reason for _, state, reason in found), found


def test_a_record_hash_that_is_none_of_its_algorithm_is_refused(slim_tree_0260):
    record = record_of(slim_tree_0260)
    record.write_text(record.read_text() + "vllm/extra.py,sha384=abc,3\n")
    with pytest.raises(PatchkitError, match=r"vllm/extra.py: 'sha384=abc' is not a sha384; "):
        locate(str(slim_tree_0260))


def test_fetch_checks_a_member_by_any_hash_the_wheel_format_allows():
    """A real file of the 0.26.0 wheel against RECORD rows in each algorithm; md5 and sha1,
    which the wheel format forbids, are refused as before."""
    tree = release_tree("0.26.0")
    content = (tree / UTILS).read_bytes()
    for algorithm in ("sha256", "sha384", "sha512", "sha3_512"):
        digest = base64.urlsafe_b64encode(hashlib.new(algorithm, content).digest()).rstrip(b"=")
        record = parse_record(f"{UTILS},{algorithm}={digest.decode()},\n".encode(), "w")
        check_member(UTILS, content, record, "w")
        with pytest.raises(RecordMismatch, match="does not match its hash in RECORD"):
            check_member(UTILS, content + b"\n", record, "w")
    for algorithm in ("md5", "sha1"):
        digest = base64.urlsafe_b64encode(hashlib.new(algorithm, content).digest()).rstrip(b"=")
        row = f"{UTILS},{algorithm}={digest.decode()},\n".encode()
        with pytest.raises(RecordMismatch, match=f"with '{algorithm}', not sha256"):
            check_member(UTILS, content, parse_record(row, "w"), "w")
