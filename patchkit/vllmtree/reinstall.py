"""The command that puts a tree's vLLM back as it was installed, for the refusals to name.

"reinstall vLLM (pip install --force-reinstall --no-deps 'vllm==X')" named whatever pip
is first on PATH, which may belong to another environment than the tree's, and the
package index, where the tree may have come from a wheel file or a URL. The command
here is the tree's own environment's pip (``<env>/bin/python -m pip`` for a tree at
``<env>/lib/pythonX.Y/site-packages``) and what pip itself recorded it was installed
from (PEP 610's ``direct_url.json`` in the dist-info: an archive's URL, or a VCS URL at
its commit), else ``vllm==VERSION``. It is only printed, never run; every part of it
is shell-quoted, since the directory names and the URL come from disk.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from patchkit.fs.safepath import Root, TooLarge, UnsafePath

MAX_DIRECT_URL_BYTES = 64 << 10
# What pip may be given from direct_url.json: a URL with a scheme, printable ASCII without
# a space. The file is the tree's: '-rhttps://...' there is pip's option to fetch a
# requirements file, 'URL ; marker' an install pip skips, an ESC one the terminal shows
# escaped, so not the URL pasted.
_PLAIN_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[!-~]+")
_VCS = ("git", "hg", "svn", "bzr")  # PEP 610's registered VCS, pip's VCS+URL prefixes


def environment_python(site_packages: Path) -> str | None:
    """``<env>/bin/python`` for ``<env>/lib/pythonX.Y/site-packages``; None otherwise, or
    where ``<env>/bin`` cannot be searched (another user's, 0700): it is only advice, and
    its stat once ended every command that named a reinstall."""
    if site_packages.name not in ("site-packages", "dist-packages"):
        return None
    lib = site_packages.parent
    env = lib.parent.parent if lib.name.startswith("python") else None
    if env is None:
        return None
    for name in (lib.name, "python3", "python"):
        candidate = env / "bin" / name
        try:
            if candidate.is_file():
                return str(candidate)
        except OSError:  # EACCES, EIO: is_file passes only ENOENT, ENOTDIR, EBADF, ELOOP
            return None
    return None


def installed_from(fs: Root, dist_info: str, version: str) -> str:
    """What pip installs this vLLM from again: direct_url.json's archive URL, or its VCS
    URL at the commit it recorded; ``vllm==VERSION`` where there is none, it is an
    editable or local directory install, or it cannot be read as PEP 610 says."""
    fallback = f"vllm=={version}"
    try:
        data = fs.read(f"{dist_info}/direct_url.json", "dist-info", MAX_DIRECT_URL_BYTES)
        record = json.loads(data) if data is not None else None
    except (OSError, UnsafePath, TooLarge, ValueError, RecursionError):
        return fallback  # only advice: a link, a FIFO or garbage there names the index
    if not isinstance(record, dict) or not isinstance(record.get("url"), str):
        return fallback
    requirement = _recorded(record)
    return requirement if requirement and _PLAIN_URL.fullmatch(requirement) else fallback


def _recorded(record: dict) -> str | None:
    """The archive's URL, or the VCS URL at its commit; None for a local directory (editable
    or not: no archive to reinstall) or a VCS install without its commit."""
    url = record["url"]
    vcs = record.get("vcs_info")
    if isinstance(vcs, dict) and vcs.get("vcs") in _VCS:
        commit = vcs.get("commit_id")
        return f"{vcs['vcs']}+{url}@{commit}" if isinstance(commit, str) else None
    return url if isinstance(record.get("archive_info"), dict) else None


def git_command(checkout: Path) -> str:
    """For a vLLM git checkout (no dist-info: pip has nothing of it to reinstall, and
    `pip install vllm==X` in its environment would replace an editable install with
    PyPI's wheel): vLLM's files as the checkout's HEAD has them, every change to them,
    tracked or not, kept in a stash rather than lost. Fork mode commits its patches, so
    HEAD may hold them: the state then says what HEAD says."""
    stash = ["stash", "push", "--include-untracked", "--", "vllm"]
    return shlex.join(["git", "-C", str(checkout), *stash])


def command(root: Path, requirement: str) -> str:
    """The pip command, with the tree's environment's Python where it has one."""
    python = environment_python(root)
    pip = f"{shlex.quote(python)} -m pip" if python else "pip"
    return f"{pip} install --force-reinstall --no-deps {shlex.quote(requirement)}"
