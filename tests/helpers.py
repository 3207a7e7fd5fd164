"""Build small test catalogues whose diffs are made from real vLLM files."""

from __future__ import annotations

import difflib
from pathlib import Path

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
