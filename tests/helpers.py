"""Helpers shared by test modules (no test module imports from another).

Small test catalogues whose diffs are made from real vLLM files; the checks
every "one line, no traceback" test makes; digests; probe log records.
Fixtures, real trees and the ways to run patchkit are in conftest.py.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import json
import os
import select
from pathlib import Path

# The files the default set patches (and creates) in a 0.26.0 tree.
UTILS = "vllm/lora/ops/triton_ops/utils.py"
PUNICA = "vllm/lora/punica_wrapper/punica_gpu.py"
CREATED = "vllm/lora/punica_wrapper/patchkit_lora_matmul.py"

NESTED = "[" * 100_000 + "]" * 100_000  # JSON nested deeper than any parser's recursion

# For a child patchkit: which heavy modules it imported, printed at exit.
REPORT_IMPORTS = """
import atexit, sys
atexit.register(lambda: print("IMPORTED:", sorted(
    m for m in ("vllm", "torch", "git", "triton") if m in sys.modules), file=sys.stderr))
"""


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def report_row(text: str, patch_id: str) -> str:
    """A patch's row in a status, apply or revert text report, its wrapped lines joined.

    A row's detail continues on lines indented 8 or more; a hunk, a known issue, the
    next row and the summary are indented less.
    """
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {patch_id} "))
    row = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" " * 8):
            break
        row.append(line.strip())
    return " ".join(row)


def failing_lock(monkeypatch, error: int = errno.EROFS) -> None:
    """Make creating .patchkit/lock fail with ``error`` (as on a read-only file system, by
    default), in an in-process run (run_cli)."""
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if str(path) == "lock" and "dir_fd" in kwargs and flags & os.O_CREAT:
            raise OSError(error, os.strerror(error), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)


def one_line_failure(result, code: int = 1) -> str:
    """An in-process run (run_cli) that failed with exactly one error line, no traceback."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("patchkit: error:"), result.stderr
    return lines[0]


def one_line(result, code: int = 1) -> str:
    """A child run (run_subprocess) that failed with one error line ("known issue" notes aside)."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.strip().splitlines() if not ln.startswith("known issue")]
    assert len(lines) == 1 and lines[0].startswith("patchkit: error:"), result.stderr
    return lines[0]


def one_error_line(done, code: int, *needles: str) -> None:
    """A child run with exit ``code`` and one error line among others, naming each needle."""
    assert done.returncode == code, done.stderr
    lines = [x for x in done.stderr.strip().splitlines() if x.startswith("patchkit: error: ")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def failing(checks) -> list[str]:
    """The names of the verify checks that did not pass."""
    return [c.name for c in checks if not c.ok]


def record(step, layer, module, kind, bad, order=-1, requests=("a", "b"), adapters=None):
    """One probe line as the module writes it (rows counted as Inf)."""
    return {
        "step": step, "rank": 0, "layer": layer, "module": module, "kind": kind,
        "order": order, "nan_rows": 0, "inf_rows": len(bad), "absmax": 1.0, "tokens": 8,
        "requests": list(requests), "adapters": adapters or {}, "time": 0.0,
        "bad_requests": list(bad),
    }  # fmt: skip


def write_log(tmp_path: Path, *lines) -> Path:
    """A probe log of ``lines`` (records or raw text), one per line."""
    path = tmp_path / "probe.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


FILES = (
    "vllm/lora/ops/triton_ops/utils.py",
    "vllm/lora/punica_wrapper/punica_gpu.py",
)
MARK = "# patchkit test patch: touched\n"


def diff_for(root: Path, relpath: str, mark: str = MARK) -> str:
    """A unified diff that inserts ``mark`` after the first import line of a real file."""
    old = (root / relpath).read_text().splitlines(keepends=True)
    index = next(i for i, line in enumerate(old) if line.startswith("import "))
    new = old[: index + 1] + [mark] + old[index + 1 :]
    return "".join(difflib.unified_diff(old, new, f"a/{relpath}", f"b/{relpath}"))


def make_catalogue(directory: Path, root: Path, diff_text: str | None = None) -> Path:
    """series.toml + patches/two-files/ with one diff over FILES (or ``diff_text``)."""
    patch_dir = directory / "two-files"
    patch_dir.mkdir(parents=True)
    (directory / "series.toml").write_text('series = ["two-files"]\ntested_releases = ["0.26.0"]\n')
    (patch_dir / "patch.toml").write_text(
        """id = "two-files"
title = "test patch over two real files"
why = "exercise multi-file transactions"
upstream = ["https://example.invalid/none"]
remove_when = "never; test only"

[[variants]]
name = "only"
diff = "two-files.diff"
versions = ">=0.26.0,<0.27.0"
made_on = "0.26.0"
"""
    )
    text = diff_text if diff_text is not None else "".join(diff_for(root, f) for f in FILES)
    (patch_dir / "two-files.diff").write_text(text)
    return directory


LOWER, UPPER = "# patchkit test patch: lower\n", "# patchkit test patch: upper\n"
STACKED_FILE = FILES[0]


def stacked_catalogue(directory: Path, root: Path, independent: bool = False) -> Path:
    """Two patches on one real file, in series order ``lower``, ``upper``.

    ``lower`` inserts a line after the first import. ``upper`` inserts its line
    right after ``lower``'s, so its diff (made on lower's result, as quilt's
    next patch is) needs ``lower`` underneath; with ``independent`` it inserts
    at the end of the file instead and applies with or without ``lower``.
    """
    old = (root / STACKED_FILE).read_text().splitlines(keepends=True)
    index = next(i for i, line in enumerate(old) if line.startswith("import "))
    lowered = old[: index + 1] + [LOWER] + old[index + 1 :]
    upper = (
        lowered + [UPPER] if independent else lowered[: index + 2] + [UPPER] + lowered[index + 2 :]
    )
    diffs = {
        "lower": difflib.unified_diff(old, lowered, f"a/{STACKED_FILE}", f"b/{STACKED_FILE}"),
        "upper": difflib.unified_diff(lowered, upper, f"a/{STACKED_FILE}", f"b/{STACKED_FILE}"),
    }
    (directory).mkdir(parents=True)
    (directory / "series.toml").write_text(
        'series = ["lower", "upper"]\ntested_releases = ["0.26.0"]\n'
    )
    for patch_id, diff in diffs.items():
        (directory / patch_id).mkdir()
        (directory / patch_id / "patch.toml").write_text(
            f"""id = "{patch_id}"
title = "test patch {patch_id}"
why = "exercise stacked patches on one file"
upstream = ["https://example.invalid/none"]
remove_when = "never; test only"

[[variants]]
name = "only"
diff = "{patch_id}.diff"
versions = ">=0.26.0,<0.27.0"
made_on = "0.26.0"
"""
        )
        (directory / patch_id / f"{patch_id}.diff").write_text("".join(diff))
    return directory


def wait_for_exit(pid: int, timeout: float = 120) -> None:
    """Until process ``pid`` (ours or not) has ended: its pidfd turns readable then. A test
    waits for the event itself, never for a while; ``timeout`` only ends a hang."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # ended (and reaped) already
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"process {pid} still runs after {timeout} s"
    finally:
        os.close(fd)
