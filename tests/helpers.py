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
"""
    )
    text = diff_text if diff_text is not None else "".join(diff_for(root, f) for f in FILES)
    (patch_dir / "two-files.diff").write_text(text)
    return directory
