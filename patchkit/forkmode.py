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

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from patchkit.catalogue import Patch
from patchkit.errors import PatchkitError
from patchkit.state import STATE_DIR
from patchkit.tree import VllmTree

TRAILER_PATCH = "Patchkit-Patch"
TRAILER_ACTION = "Patchkit-Action"


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

    # -- checks -------------------------------------------------------------
    def check_clean(self, allow_dirty: bool) -> None:
        if allow_dirty or not self.repo.is_dirty(untracked_files=False):
            return
        changed = [d.a_path for d in self.repo.index.diff(None)] + [
            d.a_path for d in self.repo.index.diff("HEAD")
        ]
        raise PatchkitError(
            f"{self.tree.root}: the checkout has uncommitted changes ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}); commit or stash them, or pass --allow-dirty"
        )

    def exclude_state_dir(self) -> None:
        exclude = Path(self.repo.git_dir) / "info" / "exclude"
        exclude.parent.mkdir(parents=True, exist_ok=True)
        line = f"/{STATE_DIR}/"
        existing = exclude.read_text().splitlines() if exclude.exists() else []
        if line not in existing:
            with open(exclude, "a", encoding="utf-8") as handle:
                handle.write(f"{line}\n")

    # -- branch -------------------------------------------------------------
    def current_branch(self) -> str | None:
        return None if self.repo.head.is_detached else self.repo.active_branch.name

    @contextmanager
    def on_branch(self, name: str):
        """Switch to ``name`` (created from HEAD if new); switch back if the body fails."""
        start_branch = self.current_branch()
        start_commit = self.repo.head.commit.hexsha
        created = name not in [h.name for h in self.repo.heads]
        if created:
            self.repo.git.checkout("-b", name)
        elif start_branch != name:
            self.repo.git.checkout(name)
        try:
            yield
        except BaseException:
            self.repo.git.checkout(start_branch or start_commit)
            if created:
                self.repo.git.branch("-D", name)
            raise

    # -- commits ------------------------------------------------------------
    def commit(self, patch: Patch, files: list[str], action: str) -> str:
        self.repo.git.add("--", *files)
        message = commit_message(patch, action)
        self.repo.git.commit("-m", message, *self._identity_args(), "--", *files)
        return self.repo.head.commit.hexsha

    def _identity_args(self) -> list[str]:
        reader = self.repo.config_reader()
        if reader.has_option("user", "name") and reader.has_option("user", "email"):
            return []
        return ["--author", "patchkit <patchkit@localhost>"]

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


def default_branch(tree: VllmTree) -> str:
    """patchkit/vllm-0.26.0 for a checkout of v0.26.0 with or without local commits."""
    version = tree.parsed_version
    return f"patchkit/vllm-{version if version is not None else 'unknown'}"


def apply(tree, catalogue, only, dry_run, strict, clear_caches, branch, allow_dirty):
    """operations.apply on a checkout: on a branch, one commit per applied patch."""
    from patchkit import operations

    plan = operations.apply(tree, catalogue, only, dry_run=True, strict=strict)
    if dry_run:
        return plan
    if not any(o.action == "would-apply" for o in plan.outcomes):
        return operations.apply(tree, catalogue, only, False, strict, clear_caches)
    checkout = Checkout(tree)
    checkout.check_clean(allow_dirty)
    checkout.exclude_state_dir()
    name = branch or default_branch(tree)
    with checkout.on_branch(name):
        report = operations.apply(tree, catalogue, only, False, strict, clear_caches)
        applied = [o.assessment for o in report.outcomes if o.action == "applied"]
        try:
            for assessment in applied:
                sha = checkout.commit(assessment.patch, list(assessment.files), "apply")
                report.notes.append(f"committed {assessment.patch.id} as {sha[:12]} on {name}")
        except Exception as exc:
            ids = tuple(a.patch.id for a in applied)
            operations.revert(tree, catalogue, ids, force=True)
            raise PatchkitError(
                f"git commit failed ({str(exc).splitlines()[0]}); the patches were "
                "reverted and the branch removed, nothing changed"
            ) from None
    return report


def revert(tree, catalogue, only, force, clear_caches, allow_dirty):
    """operations.revert on a checkout, then one revert commit per patch."""
    from patchkit import operations

    checkout = Checkout(tree)
    checkout.check_clean(allow_dirty)
    checkout.exclude_state_dir()
    report = operations.revert(tree, catalogue, only, force, clear_caches)
    for outcome in report.outcomes:
        if outcome.action == "reverted":
            patch = outcome.assessment.patch
            sha = checkout.commit(patch, list(outcome.assessment.files), "revert")
            report.notes.append(f"committed the revert of {patch.id} as {sha[:12]}")
    return report


def annotate_status(tree, report) -> None:
    """Add the commit that applied each patch, read from the git history."""
    commits = Checkout(tree).patch_commits()
    for outcome in report.outcomes:
        action, sha = commits.get(outcome.assessment.patch.id, (None, None))
        if action == "apply" and outcome.assessment.state == "applied":
            outcome.assessment.reason = f"applied in commit {sha[:12]} (git history)"
