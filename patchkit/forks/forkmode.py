"""Fork mode: when --target is the top of a vLLM git checkout, patches become commits.

A team that carries its own vLLM fork wants the fixes in its history, not as
silent edits. So on a checkout patchkit

* refuses tracked-but-uncommitted changes (``--allow-dirty`` overrides), so a
  patch commit never sweeps up someone's work in progress;
* switches to a branch (``--branch``; default ``patchkit/vllm-<version>``),
  created from HEAD if it does not exist;
* makes one commit per applied patch whose message carries the patch's title,
  Why, Upstream links and Remove-When, plus ``Patchkit-Patch`` /
  ``Patchkit-Action`` trailers;
* on ``revert`` adds one revert commit per patch (history is kept, nothing is
  rewritten, so a pushed branch stays valid);
* reads those trailers back, so ``status`` knows which commit applied a patch
  even in a fresh clone without ``.patchkit/``.

``.patchkit/`` is added to ``.git/info/exclude`` so it never makes the tree dirty.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, replace
from pathlib import Path

from patchkit.catalogue.model import Patch
from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError, Refused, UsageProblem
from patchkit.fs.files import MAX_SETTINGS_BYTES, read_regular
from patchkit.fs.safepath import Root, UnsafePath, kind_of
from patchkit.patching.state import STATE_DIR
from patchkit.signals import Terminated, held
from patchkit.vllmtree.tree import VllmTree
from patchkit.vocabulary import Action, PatchState

INDEX, EXCLUDE = "index", "info/exclude"  # relative to the git directory
TRAILER_PATCH = "Patchkit-Patch"
TRAILER_ACTION = "Patchkit-Action"
# The variables by which git works on another repository than the one it runs in (`git
# rev-parse --local-env-vars`, less GIT_CONFIG*: those carry the user's own -c settings);
# git drops them itself before it works in a submodule.
REPOSITORY_ENV = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_IMPLICIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_GRAFT_FILE",
    "GIT_SHALLOW_FILE",
    "GIT_NO_REPLACE_OBJECTS",
    "GIT_REPLACE_REF_BASE",
    "GIT_PREFIX",
    "GIT_INTERNAL_SUPER_PREFIX",
)


def forget_other_repositories() -> None:
    """Drop :data:`REPOSITORY_ENV` from this process, before any git runs.

    patchkit runs git only on the checkout --target names. Started by a git hook of
    another repository, it inherits that one's GIT_DIR, GIT_WORK_TREE and
    GIT_INDEX_FILE; left set, fork mode's `git add` and `git commit` read that
    repository's index (exit 3) or wrote the checkout's index into the file it names,
    outside the tree.
    """
    for name in REPOSITORY_ENV:
        os.environ.pop(name, None)


def is_fork(tree: VllmTree) -> bool:
    """A git checkout with commits whose top is the target (not a site-packages in a repo)."""
    if tree.git_root is None or tree.git_root != tree.root:
        return False
    import git

    return git.Repo(tree.root).head.is_valid()


@dataclass
class Checkout:
    tree: VllmTree

    def __post_init__(self) -> None:
        import git  # gitpython, only needed here

        self.repo = git.Repo(self.tree.root)
        # .git's own files patchkit reads and writes (index, info/exclude) go through
        # a descriptor of the git directory: never through a link, never a FIFO.
        self.git_fs = Root.open(Path(self.repo.git_dir))
        for relpath in (INDEX, EXCLUDE):
            found = self.git_fs.lstat(relpath, "git")
            if found is not None and not stat.S_ISREG(found.st_mode):
                raise UnsafePath(
                    f"{self.git_fs.full(relpath)} is {kind_of(found.st_mode)}, not a regular "
                    "file; fork mode reads and restores it, so it must be one"
                )

    # -- checks -------------------------------------------------------------
    def check_own_repository(self) -> None:
        """The repository is the checkout's own: its .git a directory in the tree, or a git
        file naming a repository whose work tree is this checkout (a linked worktree names
        it back in its ``gitdir`` file, a submodule in ``core.worktree``). A .git file or
        link naming another repository made fork mode commit there and switch its HEAD."""
        dot_git = self.tree.root / ".git"
        if dot_git.is_dir() and not dot_git.is_symlink():
            return
        git_dir = Path(self.repo.git_dir)
        if _work_tree_of(git_dir, self.repo) == self.tree.root.resolve():
            return
        raise UnsafePath(
            f"{dot_git} names the repository {git_dir}, whose work tree is not "
            f"{self.tree.root}; fork mode commits only into the checkout's own repository",
            path=dot_git,
            kind="a git file naming another repository",
            target=str(git_dir),
        )

    def check_clean(self, allow_dirty: bool) -> None:
        if allow_dirty or not self.repo.is_dirty(untracked_files=False):
            return
        changed = [d.a_path for d in self.repo.index.diff(None)] + [
            d.a_path for d in self.repo.index.diff("HEAD")
        ]
        raise Refused(Reason.of(Code.CHECKOUT_DIRTY, checkout=str(self.tree.root), changed=changed))

    def check_identity(self) -> None:
        """Commits need a name and an email; say how to set them before anything changes."""
        for who in ("GIT_AUTHOR_IDENT", "GIT_COMMITTER_IDENT"):
            try:
                self.repo.git.var(who)
            except Exception as exc:  # GitCommandError: git cannot tell who commits
                raise Refused(Reason.of(Code.NO_GIT_IDENTITY, git=_git_message(exc))) from None

    def check_branch_name(self, name: str) -> None:
        try:
            self.repo.git.check_ref_format("--branch", name)
        except Exception:
            raise UsageProblem(
                f"--branch {name!r} is not a valid git branch name (git check-ref-format)"
            ) from None

    def exclude_state_dir(self) -> None:
        """Add ``/.patchkit/`` to .git/info/exclude (atomically, never through a link)."""
        line = f"/{STATE_DIR}/"
        existing = self.git_fs.read(EXCLUDE, "git") or b""
        if line.encode() not in existing.splitlines():
            separator = b"" if not existing or existing.endswith(b"\n") else b"\n"
            self.git_fs.write(EXCLUDE, existing + separator + line.encode() + b"\n", "git")

    # -- branch -------------------------------------------------------------
    def switch_to(self, name: str) -> None:
        """Make ``name`` the current branch without touching the work tree.

        A new branch starts at HEAD; an existing one is used only if it is the
        current branch or points at HEAD's commit (switching to another commit
        would change the files under the plan that was just checked).
        """
        head = self.repo.head.commit.hexsha
        existing = next((h for h in self.repo.heads if h.name == name), None)
        if existing is None:
            self.repo.git.branch(name, head)
        elif existing.commit.hexsha != head:
            if self.current_branch() == name:
                return
            raise Refused(Reason.of(Code.BRANCH_ELSEWHERE, branch=name))
        self.repo.git.symbolic_ref("HEAD", f"refs/heads/{name}")

    def current_branch(self) -> str | None:
        return None if self.repo.head.is_detached else self.repo.active_branch.name

    # -- commits ------------------------------------------------------------
    def commit(self, patch: Patch, files: list[str], action: str) -> str:
        self.repo.git.add("--", *files)
        self.repo.git.commit("-m", commit_message(patch, action), "--", *files)
        return self.repo.head.commit.hexsha

    def patch_commits(self) -> dict[str, tuple[str, str]]:
        """For each patch id: (action, commit sha) of the latest patchkit commit."""
        latest: dict[str, tuple[str, str]] = {}
        log = self.repo.git.log("--format=%H%x00%B%x01", f"--grep={TRAILER_PATCH}:")
        for entry in log.split("\x01"):
            if "\x00" not in entry:
                continue
            sha, body = entry.strip().split("\x00", 1)
            patch_id = _trailer(body, TRAILER_PATCH)
            action = _trailer(body, TRAILER_ACTION)
            if patch_id and action and patch_id not in latest:
                latest[patch_id] = (action, sha)
        return latest


@dataclass
class Snapshot:
    """Everything fork mode may change, as it was: refs, index, exclude file, tree files.

    On any failure after the first change, :meth:`restore` puts each back
    byte for byte (patchkit's own ``.patchkit/`` included), so the checkout
    is exactly as before: the branch, the index and the work tree.
    """

    checkout: Checkout
    head_ref: str | None  # refs/heads/main, or None when HEAD is detached
    head_sha: str
    refs: dict[str, str | None]  # branch ref -> sha before (None: did not exist)
    index: bytes | None
    exclude: bytes | None
    files: dict[str, bytes | None]  # tree-relative path -> bytes before (None: absent)

    @classmethod
    def take(cls, checkout: Checkout, branch: str, paths: list[str]) -> Snapshot:
        repo, fs = checkout.repo, checkout.tree.fs
        head_ref = None if repo.head.is_detached else repo.head.ref.path
        refs = {}
        for name in {branch, *([checkout.current_branch()] if head_ref else [])}:
            head = next((h for h in repo.heads if h.name == name), None)
            refs[f"refs/heads/{name}"] = head.commit.hexsha if head is not None else None
        files = {path: fs.read(path, "fork mode") for path in [*paths, *_state_files(fs)]}
        git_fs = checkout.git_fs
        return cls(
            checkout,
            head_ref,
            repo.head.commit.hexsha,
            refs,
            git_fs.read(INDEX, "git"),
            git_fs.read(EXCLUDE, "git"),
            files,
        )

    def restore(self) -> None:
        repo, fs = self.checkout.repo, self.checkout.tree.fs
        if self.head_ref:
            repo.git.symbolic_ref("HEAD", self.head_ref)
        else:
            repo.git.update_ref("--no-deref", "HEAD", self.head_sha)
        for ref, sha in self.refs.items():
            if sha is None:
                repo.git.update_ref("-d", ref)
            else:
                repo.git.update_ref(ref, sha)
        git_fs = self.checkout.git_fs
        for relpath, data in ((INDEX, self.index), (EXCLUDE, self.exclude)):
            if data is None:
                git_fs.unlink(relpath, "git")
            else:
                git_fs.write(relpath, data, "git")
        for path in _state_files(fs):
            if path not in self.files:
                fs.unlink(path, "fork mode")
        for path, data in self.files.items():
            if data is None:
                fs.unlink(path, "fork mode")
            else:
                fs.write(path, data, "fork mode")
        if not any(p.startswith(f"{STATE_DIR}/") for p in self.files):
            fs.remove_tree(STATE_DIR, "fork mode")


def _state_files(fs: Root, relpath: str = STATE_DIR) -> list[str]:
    """Every file under .patchkit/ but the lock (which belongs to whichever run holds it)."""
    found = []
    for name in fs.names(relpath, "fork mode"):
        child = f"{relpath}/{name}"
        info = fs.lstat(child, "fork mode")
        if info is not None and stat.S_ISDIR(info.st_mode):
            found += _state_files(fs, child)
        elif child != f"{STATE_DIR}/lock":
            found.append(child)
    return found


def _work_tree_of(git_dir: Path, repo) -> Path | None:
    """The work tree a git directory names back: a linked worktree's ``gitdir`` file (the
    path of the worktree's .git file), else ``core.worktree`` (a submodule's, relative to
    the git directory); None where it names none."""
    try:
        back = read_regular(git_dir / "gitdir", MAX_SETTINGS_BYTES).decode().strip()
    except FileNotFoundError:
        back = None
    except (OSError, ValueError):
        return None
    if back:
        return Path(back).parent.resolve()
    try:
        worktree = repo.config_reader("repository").get_value("core", "worktree", "")
    except Exception:  # a config git itself would refuse
        return None
    return (git_dir / str(worktree)).resolve() if worktree else None


def _git_message(exc: Exception) -> str:
    """The useful line of a git failure (its stderr), not gitpython's whole repr."""
    stderr = getattr(exc, "stderr", "") or str(exc)
    lines = [ln.strip().strip("'") for ln in str(stderr).splitlines() if ln.strip()]
    lines = [ln.removeprefix("stderr: ").strip("'").strip() for ln in lines]
    useful = [ln for ln in lines if ln and not ln.startswith("hint:")]
    return (useful[-1] if useful else type(exc).__name__)[:300]


def commit_message(patch: Patch, action: str) -> str:
    """Title, Why, Upstream, Remove-When, and the trailers status reads back."""
    subject = patch.title if action == "apply" else f"Revert patchkit {patch.id}: {patch.title}"
    upstream = "\n".join(f"  {link}" for link in patch.upstream)
    return (
        f"{subject}\n\n"
        f"Why:\n{patch.why}\n\n"
        f"Upstream:\n{upstream}\n\n"
        f"Remove-When: {' '.join(patch.remove_when.split())}\n\n"
        f"{TRAILER_PATCH}: {patch.id}\n"
        f"{TRAILER_ACTION}: {action}\n"
    )


def _trailer(body: str, key: str) -> str | None:
    match = re.search(rf"^{key}:\s*(\S+)\s*$", body, re.MULTILINE)
    return match.group(1) if match else None


def apply(tree, catalogue, options, branch: str | None, allow_dirty: bool):
    """operations.apply on a checkout: on a branch, one commit per applied patch.

    The run is planned once, under the tree's lock; only when it will write
    does fork mode check the checkout, snapshot it and switch branch (the
    ``prepare`` hook, between the plan and the commit). If anything fails
    after that (a commit refused by a hook, a Ctrl-C), the snapshot puts
    refs, index, work tree and ``.patchkit/`` back exactly, and the error
    says what git said.
    """
    from patchkit.patching import operations

    checkout = Checkout(tree)
    name = branch or default_branch(tree)
    checkout.check_branch_name(name)
    if options.dry_run:
        return operations.apply(tree, catalogue, options)
    guard = _Guard(checkout, allow_dirty, "apply", branch=name)
    with guard:
        report = operations.apply(tree, catalogue, options, prepare=guard.prepare)
        with held():  # a signal never leaves git committing on its own after a restore
            _commit_steps(checkout, report, Action.APPLIED, name)
    return report


def _commit_steps(checkout: Checkout, report, action: Action, branch: str | None = None) -> None:
    """One commit per patch the run applied or reverted, in the order it did them; each
    one's note names the commit (and ``branch``, the branch apply committed on)."""
    verb = "apply" if action == Action.APPLIED else "revert"
    code = Code.COMMITTED if verb == "apply" else Code.COMMITTED_REVERT
    for step in report.plan.acting(action):
        patch = step.assessment.patch
        sha = checkout.commit(patch, list(step.assessment.files), verb)
        report.notes.append(Reason.of(code, patch=patch.id, commit=sha[:12], branch=branch))


def revert(tree, catalogue, options, allow_dirty: bool):
    """operations.revert on a checkout, then one revert commit per patch (undone on failure)."""
    from patchkit.patching import operations

    checkout = Checkout(tree)
    guard = _Guard(checkout, allow_dirty, "revert")
    with guard:
        report = operations.revert(tree, catalogue, options, prepare=guard.prepare)
        with held():
            _commit_steps(checkout, report, Action.REVERTED)
    return report


@dataclass
class _Guard:
    """Checks and snapshots the checkout once a plan will write; restores it if the run fails."""

    checkout: Checkout
    allow_dirty: bool
    command: str
    branch: str | None = None  # apply: the branch to commit on
    snapshot: Snapshot | None = None

    def prepare(self, plan) -> None:
        """Called under the tree's lock with the plan, before anything is written."""
        writes = plan.writes()
        if not writes and not plan.acting(Action.REVERTED):
            return
        self.checkout.check_own_repository()
        self.checkout.check_clean(self.allow_dirty)
        self.checkout.check_identity()
        branch = self.branch or self.checkout.current_branch() or "HEAD"
        self.snapshot = Snapshot.take(self.checkout, branch, [c.path for c in writes])
        self.checkout.exclude_state_dir()
        if self.branch:
            self.checkout.switch_to(self.branch)

    def __enter__(self) -> _Guard:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or self.snapshot is None:
            return False
        with held():
            self.snapshot.restore()
        if isinstance(exc, (KeyboardInterrupt, Terminated, PatchkitError)):
            return False
        raise Refused(
            Reason.of(Code.GIT_FAILED, command=self.command, git=_git_message(exc))
        ) from None


def default_branch(tree: VllmTree) -> str:
    """patchkit/vllm-0.26.0 for a checkout of v0.26.0 with or without local commits."""
    version = tree.parsed_version
    return f"patchkit/vllm-{version if version is not None else 'unknown'}"


def annotate_status(tree, report):
    """The status report with the commit that applied each patch, read from the git history
    (a new report: the plan's steps are values)."""
    commits = Checkout(tree).patch_commits()
    steps = []
    for step in report.steps:
        action, sha = commits.get(step.assessment.patch.id, (None, None))
        if action == "apply" and step.assessment.state == PatchState.APPLIED:
            why = Reason.of(Code.APPLIED_IN_COMMIT, commit=sha[:12])
            step = replace(step, assessment=replace(step.assessment, reason=why))
        steps.append(step)
    return replace(report, plan=replace(report.plan, steps=tuple(steps)))
