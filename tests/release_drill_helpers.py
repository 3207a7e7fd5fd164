"""A release the catalogue has not seen, made from a real one: the release drill.

``next_release`` copies a real release tree (from the PyPI wheel) and changes it as
the next vLLM release might: some files removed, some code rewritten, and the
dist-info renamed, its METADATA version and its RECORD rows updated to match, so
that the tree is exactly what pip would install from such a wheel. Every test that
uses it says which real tree it alters and how.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import shutil
from pathlib import Path

from packaging.version import Version

MANAGER = "vllm/lora/model_manager.py"


def next_version(releases) -> str:
    """The version a drill's release takes: the minor after the newest of ``releases``
    (the catalogue's tested ones), so a release added to the catalogue never makes the
    drill's release a tested one. The drills alter real trees of tested releases
    (0.33.0, 0.34.0), which stay in the cache whatever is added after them."""
    newest = max(Version(v) for v in releases)
    return f"{newest.major}.{newest.minor + 1}.0"


# 0.34.0's _stack_moe_lora_weights as a next release might rewrite it: a raise instead
# of the assert that partial-moe-adapter's hunks are made on.
MOE_ASSERT_REWRITTEN = {
    MANAGER: (
        "            # FIXME Edge case where LoRA is not added to gate_up_proj\n"
        "            # or down_proj\n"
        "            assert gate_up_proj_lora is not None\n",
        "            if gate_up_proj_lora is None:\n"
        "                raise ValueError('one parameter')\n",
    )
}


def record_hash(data: bytes) -> str:
    """A RECORD row's hash field: urlsafe base64 of the sha256, unpadded."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def next_release(
    source: Path,
    dest: Path,
    version: str,
    relpaths: tuple[str, ...] | list[str] | None = None,
    remove: tuple[str, ...] = (),
    rewrite: dict[str, tuple[str, str]] | None = None,
    add: dict[str, str] | None = None,
) -> Path:
    """``source`` (a real release tree) as release ``version`` at ``dest``: only
    ``relpaths`` (files or folders) and the dist-info when given (a slim release, as the
    wheel server's tests serve), ``remove`` deleted, each ``rewrite`` path's ``old`` text
    replaced by ``new`` (once, and it must be there), ``add`` written (path -> text), the
    dist-info renamed and its METADATA and RECORD made to match."""
    _copy(source, dest, relpaths)
    [dist_info] = [p for p in dest.iterdir() if p.name.endswith(".dist-info")]
    for relpath in remove:
        (dest / relpath).unlink()
    for relpath, (old, new) in (rewrite or {}).items():
        text = (dest / relpath).read_text()
        assert text.count(old) == 1, (relpath, old)
        (dest / relpath).write_text(text.replace(old, new))
    for relpath, text in (add or {}).items():
        (dest / relpath).parent.mkdir(parents=True, exist_ok=True)
        (dest / relpath).write_text(text)
    renamed = dest / f"vllm-{version}.dist-info"
    dist_info.rename(renamed)
    metadata = renamed / "METADATA"
    lines = metadata.read_text().splitlines(keepends=True)
    metadata.write_text(
        "".join(f"Version: {version}\n" if line.startswith("Version:") else line for line in lines)
    )
    _rewrite_record(dest, renamed, dist_info.name, set(remove), set(rewrite or {}), set(add or {}))
    return dest


def _copy(source: Path, dest: Path, relpaths) -> None:
    if relpaths is None:
        shutil.copytree(source, dest, symlinks=True, ignore=shutil.ignore_patterns(".patchkit*"))
        return
    [dist_info] = [p.name for p in source.iterdir() if p.name.endswith(".dist-info")]
    for relpath in [*relpaths, dist_info]:
        if not (source / relpath).exists():
            continue
        (dest / relpath).parent.mkdir(parents=True, exist_ok=True)
        if (source / relpath).is_dir():
            shutil.copytree(source / relpath, dest / relpath, symlinks=True)
        else:
            shutil.copy2(source / relpath, dest / relpath)


def _rewrite_record(
    root: Path,
    dist_info: Path,
    old_name: str,
    removed: set[str],
    rewritten: set[str],
    added: set[str],
) -> None:
    rows = list(csv.reader(io.StringIO((dist_info / "RECORD").read_text())))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        path = row[0]
        if path in removed:
            continue
        if path.startswith(old_name + "/"):
            path = dist_info.name + path[len(old_name) :]
        if path == f"{dist_info.name}/RECORD":
            for new in sorted(added):
                data = (root / new).read_bytes()
                writer.writerow([new, record_hash(data), str(len(data))])
            writer.writerow([path, "", ""])
            continue
        if path in rewritten or path.startswith(dist_info.name + "/"):
            data = (root / path).read_bytes()
            writer.writerow([path, record_hash(data), str(len(data))])
            continue
        writer.writerow([path, *row[1:]])
    (dist_info / "RECORD").write_text(out.getvalue())
