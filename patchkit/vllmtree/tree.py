"""Find the vLLM tree to work on and tell which version it is, without importing it.

A *tree* is the directory that contains the ``vllm/`` package: a
site-packages / dist-packages directory, or the root of a vLLM source
checkout. Importing vllm would pull in torch and CUDA (seconds, and it may
fail on a build machine), so everything here reads files only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass, field
from email.parser import HeaderParser
from functools import cached_property
from pathlib import Path

from packaging.version import InvalidVersion, Version

from patchkit.codes import Code
from patchkit.errors import FileProblem, PatchkitError, UsageProblem
from patchkit.fs.safepath import Root, TooLarge
from patchkit.identity import is_version
from patchkit.vllmtree import reinstall
from patchkit.vllmtree.record import RecordRow, RecordUnreadable, WheelRecord, read_rows

VERSION_ENV = "PATCHKIT_VLLM_VERSION"
_GIT_DISTANCE = re.compile(r"\+\d+\.g[0-9a-f]+$")  # what _git_version adds to a tag
MAX_METADATA_BYTES = 64 << 20


class VllmNotFound(PatchkitError):
    """No --target, and this Python (``python``) imports no vLLM."""

    code = Code.VLLM_NOT_FOUND


class VllmInstallInvalid(FileProblem):
    """vLLM's dist-info (METADATA, RECORD) or the tree holding it says nothing patchkit
    can trust: ``path`` and ``detail``; reinstalling vLLM mends it."""

    code = Code.VLLM_INSTALL_INVALID


@dataclass
class VllmTree:
    """A directory holding ``vllm/``, its version and its wheel RECORD if any."""

    root: Path
    version: str  # as reported, local label kept ("0.26.0+cu130")
    source: str  # metadata | git | file | override | unknown
    # relpath -> sha256 hex of the wheel's file; empty without a RECORD
    record: WheelRecord = field(default_factory=WheelRecord.empty)
    git_root: Path | None = None
    # vllm/ is tracked by the commit checked out at git_root (a checkout: git, not pip,
    # gives its files back; an --vllm-version override keeps it)
    checkout: bool = False
    fs: Root | None = field(default=None, repr=False, compare=False)  # root, held open
    # what pip installs it from again (patchkit.vllmtree.reinstall); "" until detected
    requirement: str = ""

    @cached_property
    def reinstall(self) -> str:
        """The command that makes vLLM's files its own again, for a refusal to name; once
        per tree (it stats the environment's bin/, and a run names it in every conflict's
        reason). In a git checkout, git's: its version is no release pip could install."""
        if self.reinstall_by == "git":
            return reinstall.git_command(self.root)
        return reinstall.command(self.root, self.requirement or f"vllm=={self.version}")

    @property
    def reinstall_by(self) -> str:
        """``git`` for a checkout (vllm/ tracked at HEAD, no dist-info), else ``pip``. Not
        the version's source: an untracked vllm/ in a repository (a vendored copy) is not
        HEAD's to give back, and `git stash push --include-untracked -- vllm` there took
        the whole package away."""
        return "git" if self.checkout else "pip"

    @property
    def reinstall_facts(self) -> dict[str, str]:
        """The facts of a reason that names the way back to vLLM's own files."""
        return {"reinstall_command": self.reinstall, "reinstall_by": self.reinstall_by}

    def same_release(self, recorded: str | None) -> bool:
        """Whether a state recorded on version ``recorded`` was made on this release. In a
        git checkout the release is the tag: ``git describe`` adds the commits since it
        (0.26.0+4.gabc1234), and fork mode's own patch commits move that count."""
        if recorded is None or recorded == self.version:
            return True
        if self.source != "git":
            return False
        return _GIT_DISTANCE.sub("", recorded) == _GIT_DISTANCE.sub("", self.version)

    def at_head(self, relpath: str) -> str | None:
        """The sha256 of ``relpath`` as a checkout's HEAD has it, None where HEAD has no such
        file: in a checkout the commit, not a RECORD, says what the release's file is."""
        return _head_sha256(self.git_root, self.root, relpath) if self.checkout else None

    @property
    def parsed_version(self) -> Version | None:
        """The version without its local label, for range matching; None if unparsable."""
        try:
            return Version(Version(self.version).public)
        except InvalidVersion:
            return None

    def path(self, relpath: str) -> Path:
        return self.root / relpath

    def describe(self) -> dict:
        return {"version": self.version, "path": str(self.root), "source": self.source}


def locate(target: str | None, version_override: str | None = None) -> VllmTree:
    """The tree at ``target``, or the vLLM importable by this interpreter."""
    root = _target_root(Path(target)) if target else _importable_root()
    override = version_override or os.environ.get(VERSION_ENV)
    fs = Root.open(root)
    tree = _detect(root, fs)
    tree.fs = fs
    if override:
        tree.version, tree.source = override, "override"
    return tree


TARGET_ADVICE = (
    "pass the directory that contains vllm/ (site-packages, dist-packages or the root of a "
    "vLLM checkout), or leave --target out to use the vLLM this Python imports"
)


def _target_root(target: Path) -> Path:
    """The tree root named by --target; the same usage error (exit 2) in every command."""
    if not target.is_dir():
        raise UsageProblem(
            f"--target {target}: no such directory; {TARGET_ADVICE}", option="--target", path=target
        )
    if target.name == "vllm" and (target / "__init__.py").is_file():
        target = target.parent  # accept the package directory itself too
    if not (target / "vllm" / "__init__.py").is_file():
        raise UsageProblem(
            f"--target {target}: no vllm/ package there; {TARGET_ADVICE}",
            option="--target",
            path=target,
        )
    return target.resolve()


def _importable_root() -> Path:
    # find_spec on a top-level name locates the package without executing it.
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        import sys

        raise VllmNotFound(
            f"vLLM is not installed for this Python ({sys.executable}); pass "
            "--target DIR (the directory that contains vllm/), or run "
            "`patchkit fetch VERSION` to get a release tree",
            python=sys.executable,
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return package_dir.parent.resolve()


def _detect(root: Path, fs: Root) -> VllmTree:
    dist_info = _dist_info(root, fs)
    if dist_info is not None:
        version = _metadata_version(fs, dist_info)
        requirement = reinstall.installed_from(fs, dist_info, version)
        return VllmTree(root, version, "metadata", _read_record(fs, dist_info),
                        requirement=requirement)  # fmt: skip
    git_root = _git_root(root)
    checkout = git_root is not None and _tracks_vllm(git_root, root)
    if checkout:
        described = _git_version(git_root)
        if described:
            return VllmTree(root, described, "git", git_root=git_root, checkout=True)
    from_file = _version_file(fs)
    version, source = (from_file, "file") if from_file else ("unknown", "unknown")
    return VllmTree(root, version, source, git_root=git_root, checkout=checkout)


def _dist_info(root: Path, fs: Root) -> str | None:
    """The vllm-*.dist-info whose RECORD lists vllm/__init__.py."""
    candidates = [n for n in fs.names("", "dist-info") if re.fullmatch(r"vllm-.*\.dist-info", n)]
    owning = [name for name in candidates if _lists_vllm(fs, name)]
    if len(owning) > 1:
        raise VllmInstallInvalid(
            root,
            f"several vLLM installs claim vllm/ ({', '.join(owning)}); remove the "
            "stale dist-info or reinstall vLLM",
            dist_infos=owning,
        )
    return owning[0] if owning else None


def _metadata_text(fs: Root, relpath: str) -> str | None:
    """A dist-info file as text; VllmInstallInvalid naming it when it is not sane text."""
    try:
        data = fs.read(relpath, "dist-info", MAX_METADATA_BYTES)
    except TooLarge:
        raise VllmInstallInvalid(
            fs.full(relpath), f"larger than {MAX_METADATA_BYTES} bytes"
        ) from None
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise VllmInstallInvalid(
            fs.full(relpath),
            f"not UTF-8 (byte {exc.start}); {_reinstall(fs, relpath.split('/')[0])}",
        ) from None


def _reinstall(fs: Root, dist_info: str) -> str:
    """'reinstall vLLM (COMMAND)' where the dist-info cannot be read: the command every
    refusal names (patchkit.vllmtree.reinstall), for the release the dist-info is named
    after (vllm-X.dist-info), as METADATA may be what is unreadable; plain 'vllm' (the
    newest release) only where the name holds no version."""
    version = dist_info.removeprefix("vllm-").removesuffix(".dist-info")
    found = is_version(version)
    requirement = reinstall.installed_from(fs, dist_info, version) if found else "vllm"
    return f"reinstall vLLM (`{reinstall.command(fs.path, requirement)}`)"


def _lists_vllm(fs: Root, dist_info: str) -> bool:
    text = _metadata_text(fs, f"{dist_info}/RECORD")
    if text is None:
        return fs.lstat(f"{dist_info}/METADATA", "dist-info") is not None
    return "vllm/__init__.py" in _record_rows(fs, dist_info, text)


def _record_rows(fs: Root, dist_info: str, text: str) -> dict[str, RecordRow]:
    try:
        return read_rows(text)
    except RecordUnreadable as exc:
        raise VllmInstallInvalid(
            f"{fs.full(dist_info)}/RECORD",
            f"not a valid RECORD ({exc}); {_reinstall(fs, dist_info)}",
        ) from None


def _metadata_version(fs: Root, dist_info: str) -> str:
    relpath = f"{dist_info}/METADATA"
    text = _metadata_text(fs, relpath)
    version = HeaderParser().parsestr(text).get("Version") if text is not None else None
    if not version:
        raise VllmInstallInvalid(fs.full(relpath), "no Version header")
    version = version.strip()
    if not is_version(version):
        raise VllmInstallInvalid(
            fs.full(relpath),
            f"Version {version[:40]!r} is not a PEP 440 version; pass --vllm-version",
        )
    return version


def _read_record(fs: Root, dist_info: str) -> WheelRecord:
    """RECORD as each file's sha256 (patchkit.vllmtree.record); a row whose hash is not
    one of its algorithm is refused, naming the row."""
    text = _metadata_text(fs, f"{dist_info}/RECORD")
    rows = {} if text is None else _record_rows(fs, dist_info, text)
    for row in rows.values():
        if row.known and row.digest() is None:
            raise VllmInstallInvalid(
                f"{fs.full(dist_info)}/RECORD",
                f"{row.path[:80]}: {row.hash[:60]!r} is not a "
                f"{row.algorithm}; {_reinstall(fs, dist_info)}",
            )
    return WheelRecord(rows, lambda relpath: fs.read(relpath, "RECORD"))


def _git_root(root: Path) -> Path | None:
    for directory in (root, *root.parents):
        if (directory / ".git").exists():
            return directory
    return None


def _tracks_vllm(git_root: Path, root: Path) -> bool:
    """Whether the commit checked out at ``git_root`` holds ``root``'s vllm/__init__.py: the
    repository's tags are then vLLM's. A vllm/ the repository does not track (a vendored
    copy, an environment inside a project) takes no version from the project's tags."""
    relpath = (root.relative_to(git_root) / "vllm" / "__init__.py").as_posix()
    try:
        import git  # gitpython, as _git_version

        git.Repo(git_root).git.cat_file("-e", f"HEAD:{relpath}")
    except Exception:  # not tracked, no commit yet, not a repository, git missing
        return False
    return True


def _head_sha256(git_root: Path, root: Path, relpath: str) -> str | None:
    """sha256 of the blob HEAD holds at ``root``/``relpath``; None where it holds none or
    git cannot read it (a damaged object store): no file of HEAD's to vouch for a backup,
    so --force is refused, never a traceback."""
    import git  # gitpython, as _git_version

    path = (root.relative_to(git_root) / relpath).as_posix()
    try:
        blob = git.Repo(git_root).head.commit.tree / path
        return hashlib.sha256(blob.data_stream.read()).hexdigest()
    except Exception:  # KeyError: no such path; ValueError, GitError, OSError: unreadable
        return None


def _git_version(git_root: Path) -> str | None:
    """``git describe --tags``: v0.26.0 -> 0.26.0, v0.26.0-3-gabc -> 0.26.0+3.gabc."""
    try:
        import git  # gitpython; imported here so status stays fast elsewhere

        described = git.Repo(git_root).git.describe("--tags", "--long", "--match", "v[0-9]*")
    except Exception:  # no tags, not a repository, git missing: fall back to files
        return None
    match = re.fullmatch(r"v(.+)-(\d+)-g([0-9a-f]+)", described.strip())
    if not match:
        return None
    base, distance, sha = match.groups()
    return base if distance == "0" else f"{base}+{distance}.g{sha}"


def _version_file(fs: Root) -> str | None:
    text = _metadata_text(fs, "vllm/_version.py")
    if text is None:
        return None
    match = re.search(
        r"^(?:__version__|version)\s*=\s*(?:\w+\s*=\s*)?['\"]([^'\"]+)['\"]",
        text,
        re.MULTILINE,
    )
    return match.group(1) if match and is_version(match.group(1)) else None
