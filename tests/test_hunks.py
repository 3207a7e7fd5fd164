"""Unit tests for the hunk engine: offsets, CRLF, mismatches, creation and deletion."""

from __future__ import annotations

import pytest

from patchkit.diffs.hunks import apply_file_patch, parse_diff
from patchkit.errors import HunkMismatch, PatchkitError

ORIGINAL = "".join(f"line {i}\n" for i in range(1, 21))
DIFF = """--- a/vllm/x.py
+++ b/vllm/x.py
@@ -4,3 +4,4 @@
 line 4
-line 5
+line five
+line 5b
 line 6
@@ -15,3 +16,3 @@
 line 15
-line 16
+line sixteen
 line 17
"""


def one(diff: str = DIFF):
    (file_patch,) = parse_diff(diff, "test.diff")
    return file_patch


def test_applies_at_stated_lines():
    text, placements = apply_file_patch(ORIGINAL, one())
    assert "line five\nline 5b\nline 6\n" in text and "line sixteen\n" in text
    assert [(p.line, p.offset) for p in placements] == [(4, 0), (16, 0)]


def test_offsets_are_found_and_reported():
    shifted = "extra a\nextra b\nextra c\n" + ORIGINAL
    text, placements = apply_file_patch(shifted, one())
    assert text.startswith("extra a\n") and "line sixteen\n" in text
    assert [p.offset for p in placements] == [3, 3]


def test_nearest_match_wins_when_context_repeats():
    diff = "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -5,2 +5,2 @@\n a\n-b\n+B\n"
    text, placements = apply_file_patch("a\nb\nx\nx\na\nb\nx\nx\na\nb\n", one(diff))
    assert text == "a\nb\nx\nx\na\nB\nx\nx\na\nb\n"
    assert placements[0].line == 5


def test_a_later_hunk_is_sought_where_the_one_before_it_moved():
    """Hunk 2's context (``)`` and a blank line) occurs all over the file; hunk 1's is
    distinctive and moved 40 lines up. Hunk 2 goes beside hunk 1, as GNU patch carries
    the offset, not at its header's line, where another ``)`` sits (nan-probe's V1 hook
    landed in another method of vLLM 0.19.0 and 0.33.0's runner that way)."""
    diff = (
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n"
        "@@ -50,2 +50,2 @@\n doc\n-return call(\n+out = call(\n"
        "@@ -53,2 +53,3 @@\n )\n+after(out)\n \n"
    )
    filler = "".join(f"x{i}\n)\n\n" for i in range(30))  # a ")" then a blank, many times
    text = "doc\nreturn call(\n  arg,\n)\n\n" + filler
    new, placements = apply_file_patch(text, one(diff))
    assert new.startswith("doc\nout = call(\n  arg,\n)\nafter(out)\n\n")
    assert [(p.line, p.offset) for p in placements] == [(1, -49), (4, -49)]


def test_crlf_file_keeps_crlf_and_crlf_diff_parses():
    crlf = ORIGINAL.replace("\n", "\r\n")
    text, _ = apply_file_patch(crlf, one(DIFF.replace("\n", "\r\n")))
    assert "line five\r\nline 5b\r\n" in text
    assert "\n" not in text.replace("\r\n", "")


def test_context_mismatch_names_hunk_and_line():
    broken = ORIGINAL.replace("line 16\n", "line XVI\n")
    with pytest.raises(HunkMismatch) as caught:
        apply_file_patch(broken, one())
    message = str(caught.value)
    assert message.startswith("vllm/x.py: hunk #2 (@@ -15,3 +16,3 @@)")
    assert "line 16 should be 'line 16' but is 'line XVI'" in message


def test_zero_fuzz_one_wrong_context_line_fails():
    broken = ORIGINAL.replace("line 6\n", "line 6 \n")
    with pytest.raises(HunkMismatch):
        apply_file_patch(broken, one())


def test_reverse_restores_original_exactly():
    patched, _ = apply_file_patch(ORIGINAL, one())
    restored, _ = apply_file_patch(patched, one().reversed())
    assert restored == ORIGINAL
    with pytest.raises(HunkMismatch):
        apply_file_patch(ORIGINAL, one().reversed())


def test_create_and_delete_files():
    create = "--- /dev/null\n+++ b/vllm/new.py\n@@ -0,0 +1,2 @@\n+x = 1\n+y = 2\n"
    file_patch = one(create)
    assert file_patch.creates and file_patch.path == "vllm/new.py"
    text, _ = apply_file_patch(None, file_patch)
    assert text == "x = 1\ny = 2\n"
    with pytest.raises(HunkMismatch, match="creates the file, but it exists"):
        apply_file_patch("x = 1\n", file_patch)
    deleted, _ = apply_file_patch(text, file_patch.reversed())
    assert deleted is None
    with pytest.raises(HunkMismatch, match="expects the file, but it is missing"):
        apply_file_patch(None, one())


def test_no_newline_at_end_of_file():
    diff = (
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,2 +1,2 @@\n a\n-b\n"
        "\\ No newline at end of file\n+B\n"
    )
    text, _ = apply_file_patch("a\nb", one(diff))
    assert text == "a\nB\n"
    with pytest.raises(HunkMismatch, match="without a newline"):
        apply_file_patch("a\nb\n", one(diff))


@pytest.mark.parametrize(
    "diff, message",
    [
        ("--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n", "malformed unified diff"),
        ("just text\n", "no file changes"),
        ("--- a/../etc/passwd\n+++ b/../etc/passwd\n@@ -1 +1 @@\n-a\n+b\n", "leaves the vLLM tree"),
        ("--- a/vllm/../x\n+++ b/vllm/../x\n@@ -1 +1 @@\n-a\n+b\n", "leaves the vLLM tree"),
        ("--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-a\n+b\n", "is not under vllm/"),
        ("--- x.py\n+++ x.py\n@@ -1 +1 @@\n-a\n+b\n", "not of the form a/vllm"),
        ("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,0 +1,1 @@\n+b\n", "no context lines"),
    ],
)
def test_bad_diffs_are_rejected_with_the_file_name(diff, message):
    with pytest.raises(PatchkitError, match=message) as caught:
        parse_diff(diff, "patches/p/bad.diff")
    assert str(caught.value).startswith("patches/p/bad.diff")


def test_a_file_mixing_line_endings_keeps_the_bytes_of_every_untouched_line():
    """Lines a hunk does not touch come back byte for byte; added lines take \\r\\n."""
    lines = ORIGINAL.splitlines(keepends=True)
    mixed = "".join(line.replace("\n", "\r\n") if i % 3 == 0 else line
                    for i, line in enumerate(lines))  # fmt: skip
    text, _ = apply_file_patch(mixed, one())
    kept = [line for line in mixed.splitlines(keepends=True)
            if not line.startswith(("line 5", "line 16"))]  # fmt: skip
    out = text.splitlines(keepends=True)
    assert [line for line in out if line in kept] == kept
    assert "line five\r\nline 5b\r\n" in text and "line sixteen\r\n" in text
    back, _ = apply_file_patch(text, one().reversed())
    assert back == mixed.replace("line 5\n", "line 5\r\n").replace("line 16\n", "line 16\r\n")


def test_a_last_line_without_newline_keeps_its_carriage_return():
    diff = "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,2 +1,2 @@\n-a\n+A\n b\n"
    text, _ = apply_file_patch("a\nb\n", one(diff))
    assert text == "A\nb\n"
    text, _ = apply_file_patch("a\r\nb\r\nc\r", one(diff))
    assert text == "A\r\nb\r\nc\r"
