"""Fork mode: a vLLM checkout in git is patched by commits on a branch, or not at all.

On a real vLLM 0.26.0 tree committed to git, tagged v0.26.0, with local
commits: one commit per patch on patchkit's branch, conflicts with local
commits named; and on any git failure (no identity, a rejecting hook, a bad
branch name, a link or FIFO in .git, a signal during the commit) the
checkout is exactly as before: same HEAD, branch, index and files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from patchkit.vllmtree.tree import locate
from tests.conftest import git, release_tree, run_cli, run_subprocess, slim_tree, snapshot
from tests.helpers import UTILS, one_line, wait_for_exit


@pytest.mark.slow
def test_status_apply_status_revert_on_a_fork(checkout: Path):
    start = git(checkout, "rev-parse", "HEAD")
    status = json.loads(run_cli("status", "--target", str(checkout), "--json").stdout)
    assert status["vllm"]["source"] == "git"
    assert status["vllm"]["version"].startswith("0.26.0+1.g")
    assert status["patches"][0]["state"] == "needed"

    applied = run_cli("apply", "--target", str(checkout))
    assert applied.exit_code == 0, applied.output
    assert git(checkout, "branch", "--show-current") == "patchkit/vllm-0.26.0"
    # One commit per applied patch, in series order.
    assert git(checkout, "rev-parse", "HEAD~4") == start
    message = git(checkout, "log", "-1", "--format=%B", "HEAD~3")
    for part in ("block_n 32", "Why:", "https://github.com/vllm-project/vllm/issues/48590",
                 "Remove-When:", "Patchkit-Patch: expand-block-n"):  # fmt: skip
        assert part in message
    assert git(checkout, "show", "--name-only", "--format=", "HEAD~3") == UTILS
    assert "Patchkit-Patch: matmul-add-lora-linear" in git(
        checkout, "log", "-1", "--format=%B", "HEAD~2"
    )
    assert git(checkout, "show", "--name-only", "--format=", "HEAD~2").splitlines() == [
        "vllm/lora/layers/base.py",
        "vllm/lora/punica_wrapper/patchkit_lora_matmul.py",
        "vllm/lora/punica_wrapper/punica_gpu.py",
        "vllm/lora/worker_manager.py",
    ]
    assert "Patchkit-Patch: partial-gdn-adapter" in git(
        checkout, "log", "-1", "--format=%B", "HEAD~1"
    )
    assert "Patchkit-Patch: partial-moe-adapter" in git(checkout, "log", "-1", "--format=%B")
    assert git(checkout, "show", "--name-only", "--format=", "HEAD") == "vllm/lora/model_manager.py"
    assert git(checkout, "status", "--porcelain") == ""  # .patchkit/ is excluded

    again = run_cli("apply", "--target", str(checkout))
    assert again.exit_code == 0 and "apply: nothing to do" in again.stdout
    assert git(checkout, "rev-list", "--count", "HEAD") == "6"

    shutil.rmtree(checkout / ".patchkit")  # a fresh clone of the fork branch has no state
    from_git = json.loads(run_cli("status", "--target", str(checkout), "--json").stdout)
    block_n_commit = git(checkout, "rev-parse", "HEAD~3")
    assert from_git["patches"][0]["state"] == "applied"
    assert from_git["patches"][0]["reason"]["message"] == (
        f"applied in commit {block_n_commit[:12]} (git history)"
    )

    reverted = run_cli("revert", "--target", str(checkout))
    assert reverted.exit_code == 0, reverted.output
    reverts = [s.split(":")[0] for s in git(checkout, "log", "-4", "--format=%s").splitlines()]
    assert reverts == [
        "Revert patchkit expand-block-n",
        "Revert patchkit matmul-add-lora-linear",
        "Revert patchkit partial-gdn-adapter",
        "Revert patchkit partial-moe-adapter",
    ]
    assert git(checkout, "diff", start, "HEAD") == ""  # content back to the starting commit
    assert git(checkout, "status", "--porcelain") == ""


def test_local_commit_in_the_patched_region_is_a_conflict(checkout: Path):
    path = checkout / UTILS
    path.write_text(path.read_text().replace("else 128,", "else 256,  # fork tuning", 1))
    git(checkout, "commit", "-qam", "fork: tune expand block_n")
    head = git(checkout, "rev-parse", "HEAD")
    result = run_cli("apply", "--target", str(checkout))
    assert result.exit_code == 1
    assert "conflict" in result.stderr and "hunk #1" in result.stderr
    assert git(checkout, "rev-parse", "HEAD") == head
    assert git(checkout, "branch", "--list") == "* main"
    assert git(checkout, "status", "--porcelain") == ""


def test_dirty_checkout_is_refused_unless_allowed(checkout: Path):
    (checkout / "FORK.md").write_text("work in progress\n")
    head = git(checkout, "rev-parse", "HEAD")
    refused = run_cli("apply", "--target", str(checkout))
    assert refused.exit_code == 1
    assert "uncommitted changes (FORK.md)" in refused.stderr and "--allow-dirty" in refused.stderr
    assert git(checkout, "rev-parse", "HEAD") == head and not (checkout / ".patchkit").exists()

    allowed = run_cli("apply", "--target", str(checkout), "--allow-dirty", "--branch", "fixes")
    assert allowed.exit_code == 0, allowed.output
    assert git(checkout, "branch", "--show-current") == "fixes"
    for commit in ("HEAD", "HEAD~1"):  # the WIP file is not swept into a patch commit
        assert "FORK.md" not in git(checkout, "show", "--name-only", "--format=", commit)
    assert git(checkout, "status", "--porcelain") == "M FORK.md"


@pytest.mark.slow
def test_version_from_version_file_without_tags(tmp_path: Path):
    root = tmp_path / "untagged"
    root.mkdir()
    shutil.copytree(release_tree("0.26.0") / "vllm", root / "vllm")
    git(root, "init", "-q")
    status = json.loads(run_cli("status", "--target", str(root), "--json").stdout)
    assert status["vllm"] == {"version": "0.26.0", "path": str(root), "source": "file"}


GIT_ENV = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}


IDENTITY = {
    **GIT_ENV,
    **{f"GIT_{who}_NAME": "Fork Dev" for who in ("AUTHOR", "COMMITTER")},
    **{f"GIT_{who}_EMAIL": "dev@example.invalid" for who in ("AUTHOR", "COMMITTER")},
}


NO_IDENTITY = {
    **GIT_ENV,
    "GIT_CONFIG_COUNT": "1",
    "GIT_CONFIG_KEY_0": "user.useConfigOnly",
    "GIT_CONFIG_VALUE_0": "true",
}


def git_state(root: Path) -> tuple:
    return (
        git(root, "rev-parse", "HEAD"),
        git(root, "branch", "--show-current"),
        git(root, "branch", "--list"),
        git(root, "status", "--porcelain", "--ignored"),
        snapshot(root / "vllm"),
        git(
            root, "ls-files", "--stage"
        ),  # the index's entries (git status refreshes its stat data)
    )


@pytest.mark.slow
def test_fork_mode_without_a_git_identity_changes_nothing(checkout):
    before = git_state(checkout)
    line = one_line(run_subprocess("apply", "--target", str(checkout), env=NO_IDENTITY))
    assert "user.name" in line and "user.email" in line and "nothing was changed" in line
    assert git_state(checkout) == before and not (checkout / ".patchkit").exists()


def reject_commits(root: Path) -> None:
    hook = root / ".git" / "hooks" / "pre-commit"
    hook.write_text("#!/bin/sh\necho 'policy: no commits on Fridays' >&2\nexit 1\n")
    hook.chmod(0o755)


@pytest.mark.slow
def test_a_rejecting_pre_commit_hook_leaves_the_checkout_as_before(checkout):
    reject_commits(checkout)
    before = git_state(checkout)
    line = one_line(run_subprocess("apply", "--target", str(checkout), env=IDENTITY))
    assert "no commits on Fridays" in line and "as before" in line
    assert git_state(checkout) == before and not (checkout / ".patchkit").exists()


@pytest.mark.slow
def test_a_rejecting_hook_during_revert_leaves_the_checkout_as_before(checkout):
    assert run_subprocess("apply", "--target", str(checkout), env=IDENTITY).returncode == 0
    reject_commits(checkout)
    before = git_state(checkout)
    state = (checkout / ".patchkit" / "state.json").read_bytes()
    line = one_line(run_subprocess("revert", "--target", str(checkout), env=IDENTITY))
    assert "no commits on Fridays" in line
    assert git_state(checkout) == before
    assert (checkout / ".patchkit" / "state.json").read_bytes() == state


@pytest.mark.slow
def test_an_invalid_branch_name_is_a_usage_error(checkout):
    before = git_state(checkout)
    line = one_line(
        run_subprocess("apply", "--target", str(checkout), "--branch", "bad..name", env=IDENTITY),
        code=2,
    )
    assert "bad..name" in line
    assert git_state(checkout) == before


@pytest.mark.slow
def test_fork_mode_never_writes_through_links_in_dot_git(tmp_path, checkout):
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    exclude = checkout / ".git" / "info" / "exclude"
    exclude.unlink(missing_ok=True)
    exclude.symlink_to(victim)
    line = one_line(run_subprocess("apply", "--target", str(checkout), env=IDENTITY))
    assert "symbolic link" in line
    assert victim.read_text() == "mine\n"


@pytest.mark.slow
@pytest.mark.parametrize("index", ["its index", "a new file"])
def test_a_git_hooks_repository_variables_never_reach_the_checkouts_git(tmp_path, checkout, index):
    """patchkit run from a git hook of another repository inherits GIT_DIR, GIT_WORK_TREE
    and GIT_INDEX_FILE for that one: git add and commit read and wrote the index they
    name (its index: exit 3; a new file: written there, outside the tree). The checkout
    is the real 0.26.0 tree; the other repository is a fresh one beside it."""
    outer = tmp_path / "outer"
    outer.mkdir()
    (outer / "notes.txt").write_text("someone's work\n")
    git(outer, "init", "-q")
    git(outer, "add", "notes.txt")
    git(outer, "commit", "-qm", "notes")
    new_index = outer / ".git" / "next-index-4242.lock"
    named = outer / ".git" / "index" if index == "its index" else new_index
    hook_env = {
        "GIT_DIR": str(outer / ".git"),
        "GIT_WORK_TREE": str(outer),
        "GIT_INDEX_FILE": str(named),
        "GIT_OBJECT_DIRECTORY": str(tmp_path / "objects"),
    }
    before = snapshot(outer)
    done = run_subprocess("apply", "--target", str(checkout), env=IDENTITY | hook_env)
    assert done.returncode == 0, done.stderr
    assert git(checkout, "rev-list", "--count", "HEAD") == "6"  # its 2 and the 4 patches
    assert snapshot(outer) == before and not (tmp_path / "objects").exists()


@pytest.mark.slow
def test_a_git_file_naming_another_repository_is_refused(tmp_path, checkout):
    """The tree's .git a git file naming someone else's repository (the real 0.26.0 tree,
    its own .git removed): apply --allow-dirty committed the patches there and switched
    its HEAD to patchkit's branch. Now it is one line, and that repository is as before."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("someone's work\n")
    git(other, "init", "-q", "-b", "main")
    git(other, "add", "notes.txt")
    git(other, "commit", "-qm", "notes")
    git(other, "tag", "v0.26.0")
    shutil.rmtree(checkout / ".git")
    (checkout / ".git").write_text(f"gitdir: {other / '.git'}\n")
    before = other_state(other)
    done = run_subprocess("apply", "--allow-dirty", "--target", str(checkout), env=IDENTITY)
    line = one_line(done)
    assert f"names the repository {other / '.git'}" in line, line
    assert other_state(other) == before


def other_state(root: Path) -> tuple:
    """A repository's HEAD, branches, every commit and its exclude file."""
    exclude = root / ".git" / "info" / "exclude"
    return (
        (root / ".git" / "HEAD").read_text(),
        git(root, "branch", "--list"),
        git(root, "rev-list", "--all"),
        exclude.read_text() if exclude.exists() else None,
    )


@pytest.mark.slow
def test_a_linked_worktree_of_the_checkout_is_its_own_repository(tmp_path, checkout):
    """A linked worktree's .git is a git file too; its repository names it back."""
    linked = tmp_path / "linked"
    git(checkout, "worktree", "add", "-q", "--detach", str(linked))
    done = run_subprocess("apply", "--target", str(linked), env=IDENTITY)
    assert done.returncode == 0, done.stderr
    assert git(linked, "branch", "--show-current") == "patchkit/vllm-0.26.0"
    assert git(checkout, "branch", "--show-current") == "main"


@pytest.mark.slow
def test_a_fifo_in_dot_git_is_refused_not_waited_on(checkout):
    exclude = checkout / ".git" / "info" / "exclude"
    exclude.unlink(missing_ok=True)
    os.mkfifo(exclude)
    line = one_line(run_subprocess("apply", "--target", str(checkout), "--allow-dirty",
                             env=IDENTITY, timeout=30))  # fmt: skip
    assert "a FIFO" in line


SIGNAL_PARENT_HOOK = """#!/bin/sh
# SIGTERM to patchkit (git's parent) while this commit runs; the commit then succeeds.
# git's own pid goes to the test first, which waits for that git to end.
echo $PPID > {pidfile}
kill -TERM $(ps -o ppid= -p $PPID)
exit 0
"""


@pytest.mark.slow
def test_a_signal_during_git_commit_leaves_no_commit_behind(checkout, tmp_path):
    """patchkit holds the signal until git is done, then puts everything back. The test
    waits for that git process itself to end, not for a while: had patchkit died and
    left git committing on its own, the commit is there once git has ended."""
    pidfile = tmp_path / "git.pid"
    hook = checkout / ".git" / "hooks" / "pre-commit"
    hook.write_text(SIGNAL_PARENT_HOOK.format(pidfile=pidfile))
    hook.chmod(0o755)
    before = git_state(checkout)
    result = run_subprocess("apply", "--target", str(checkout), env=IDENTITY, timeout=60)
    assert result.returncode == 143, result.stderr
    wait_for_exit(int(pidfile.read_text()))
    assert git_state(checkout) == before and not (checkout / ".patchkit").exists()


MODEL_MANAGER = "vllm/lora/model_manager.py"


def edited_after_apply(
    checkout: Path, state_version: str | None = None, allow_dirty: bool = True
) -> str:
    """apply on the fork, then a line added to a file a patch changed and a new file under
    vllm/ (uncommitted); ``state_version`` stands for a state left by another tag's apply.
    What apply (--allow-dirty on a fork) then refuses with, nothing changed."""
    assert run_cli("apply", "--target", str(checkout)).exit_code == 0
    if state_version:
        state = checkout / ".patchkit" / "state.json"
        state.write_text(
            json.dumps({**json.loads(state.read_text()), "vllm_version": state_version})
        )
    with (checkout / MODEL_MANAGER).open("a") as handle:
        handle.write("# a local note\n")
    (checkout / "vllm" / "local_notes.py").write_text("# ours\n")
    before = snapshot(checkout)
    dirty = ["--allow-dirty"] if allow_dirty else []
    refused = run_cli("apply", "--target", str(checkout), *dirty)
    assert refused.exit_code == 1 and snapshot(checkout) == before
    [line] = refused.stderr.splitlines()
    return line


def test_the_forks_own_patch_commits_are_not_another_release(checkout: Path):
    """git describe counts the commits since the tag: fork mode's four patch commits moved
    0.26.0+1.g... to 0.26.0+5.g..., which an edited file's refusal read as another release
    (its backup "may be another release's file") with `pip install vllm==0.26.0+5.g...`,
    a version no index has. The release is the tag: the edit is an edit, with its ways out."""
    said = edited_after_apply(checkout)
    assert f"{MODEL_MANAGER} was edited after patchkit applied partial-moe-adapter" in said
    assert "another release" not in said and "pip" not in said
    assert "`patchkit revert --only partial-moe-adapter --force --target" in said


def test_a_checkout_is_put_back_by_git_not_by_pip(checkout: Path):
    """A state from another tag: the refusal names git's way back to the checkout's files,
    not pip (nothing of a checkout is pip's to reinstall; in its environment `pip install
    vllm==X` replaces an editable install). Run as printed, it keeps the changes in a
    stash; with .patchkit/ deleted, as it says, status reads the patches from git and
    revert takes them out."""
    said = edited_after_apply(checkout, state_version="0.25.0")
    assert "applied to vLLM 0.25.0 and this tree reports 0.26.0+5.g" in said
    assert "pip" not in said
    command = re.search(r"put vLLM's files back as the checkout's HEAD has them \(`([^`]*)`", said)
    assert command, said
    assert shlex.split(command[1]) == [
        "git", "-C", str(checkout), "stash", "push", "--include-untracked", "--", "vllm"
    ]  # fmt: skip
    subprocess.run(shlex.split(command[1]), check=True, capture_output=True)
    assert git(checkout, "status", "--porcelain") == ""
    stashed = git(checkout, "stash", "show", "--include-untracked", "--name-only", "stash@{0}")
    assert sorted(stashed.splitlines()) == ["vllm/local_notes.py", MODEL_MANAGER]
    shutil.rmtree(checkout / ".patchkit")
    status = json.loads(run_cli("status", "--target", str(checkout), "--json").stdout)
    assert {p["state"] for p in status["patches"] if p["id"] != "nan-probe"} == {
        "applied", "not-applicable"
    }  # fmt: skip
    assert run_cli("revert", "--target", str(checkout)).exit_code == 0
    assert git(checkout, "diff", "HEAD~8", "HEAD") == ""  # the patches and their reverts


def test_the_json_says_the_way_back_is_git(checkout: Path):
    """--json consumers read the command and which tool it is, not the words."""
    assert run_cli("apply", "--target", str(checkout)).exit_code == 0
    state = checkout / ".patchkit" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "vllm_version": "0.25.0"}))
    (checkout / MODEL_MANAGER).write_text((checkout / MODEL_MANAGER).read_text() + "# x\n")
    refused = run_cli("revert", "--force", "--allow-dirty", "--target", str(checkout), "--json")
    assert refused.exit_code == 1
    error = json.loads(refused.stdout)["error"]
    found = [e for e in walk(error) if "reinstall_by" in e]
    assert found and {(e["reinstall_by"], e["reinstall_command"].split()[0]) for e in found} == {
        ("git", "git")
    }


def walk(value):
    """Every dict inside a JSON value, itself included."""
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)


def test_a_vllm_the_repository_does_not_track_is_no_checkout(tmp_path: Path):
    """The real 0.26.0 tree, untracked, in a project repository tagged v0.26.0: the tag is
    the project's, and HEAD has no vLLM to give back. `git stash push --include-untracked
    -- vllm`, named there before, moved the whole package into a stash."""
    project = tmp_path / "project"
    project.mkdir()
    git(project, "init", "-q", "-b", "main")
    (project / "README").write_text("a project\n")
    git(project, "add", "README")
    git(project, "commit", "-qm", "project")
    git(project, "tag", "v0.26.0")
    vendored = slim_tree(project / "vendored")
    for dist_info in vendored.glob("vllm-*.dist-info"):
        shutil.rmtree(dist_info)
    tree = locate(str(vendored))
    assert (tree.source, tree.reinstall_by) == ("unknown", "pip")
    assert not tree.reinstall.startswith("git")


def test_a_checkout_named_another_version_is_still_put_back_by_git(checkout: Path):
    """--vllm-version (or PATCHKIT_VLLM_VERSION) says which release the code is, not how
    its files came: a checkout's are still git's to give back, not pip's."""
    tree = locate(str(checkout), "0.26.0")
    assert (tree.source, tree.reinstall_by) == ("override", "git")
    assert shlex.split(tree.reinstall)[:3] == ["git", "-C", str(checkout)]


def test_the_way_back_in_a_subdirectory_of_a_bigger_repository(tmp_path: Path):
    """vLLM at `third_party/vllm src` of a repository whose path has a space, a '$', a
    backquote and quotes, on a detached HEAD (no fork mode: the patches are plain edits).
    The printed command, run by a shell, puts vllm/ back as HEAD has it, keeps every
    change under it in the stash, and leaves the rest of the repository as it was."""
    repo = tmp_path / "mono $ `x` 'q\""  # no $NAME: gitpython expands those in a path
    tree = slim_tree(repo / "third_party" / "vllm src")
    for dist_info in tree.glob("vllm-*.dist-info"):
        shutil.rmtree(dist_info)
    (repo / "other.txt").write_text("ours\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "vendor vLLM 0.26.0")
    git(repo, "tag", "v0.26.0")
    git(repo, "checkout", "-q", "--detach")
    said = edited_after_apply(tree, state_version="0.25.0", allow_dirty=False)
    (repo / "other.txt").write_text("work in progress\n")
    command = re.search(r"HEAD has them \(`(.*)`; the changes are kept", said)
    assert command, said
    subprocess.run(["bash", "-c", command[1]], check=True, capture_output=True)
    assert git(repo, "status", "--porcelain", "--untracked-files=no") == "M other.txt"
    assert git(repo, "status", "--porcelain", "--", "third_party/vllm src/vllm") == ""
    stashed = git(repo, "stash", "show", "--include-untracked", "--name-only", "stash@{0}")
    assert f"third_party/vllm src/{MODEL_MANAGER}" in stashed.splitlines()
    assert "third_party/vllm src/vllm/local_notes.py" in stashed.splitlines()


def test_revert_force_never_undoes_a_commit_since_the_apply(checkout: Path):
    """Applied on the fork's branch, then back on main, where a commit (upstream's, a
    colleague's) changed a patched file: the tag is the same, 0.26.0+1.g... became
    0.26.0+2.g..., but the backup is another commit's file. `revert --force` wrote it over
    the file and committed that as "Revert patchkit ...", undoing the commit's change; it
    is refused, naming git's way back, and nothing changes."""
    assert run_cli("apply", "--target", str(checkout)).exit_code == 0
    git(checkout, "checkout", "-q", "main")
    with (checkout / MODEL_MANAGER).open("a") as handle:
        handle.write("# a fix after the tag\n")
    git(checkout, "commit", "-qam", "upstream: a fix to the LoRA model manager")
    status = run_cli("status", "--target", str(checkout))
    assert "--force" not in status.stdout and "another commit's file" in status.stdout
    before, head = snapshot(checkout), git(checkout, "rev-parse", "HEAD")
    force = ["--only", "partial-moe-adapter", "--force", "--target", str(checkout)]
    refused = run_cli("revert", *force)
    assert refused.exit_code == 1, refused.output
    assert snapshot(checkout) == before and git(checkout, "rev-parse", "HEAD") == head
    assert f"a commit changed {MODEL_MANAGER} since the patch was applied" in refused.stderr
    assert "stash push --include-untracked -- vllm" in refused.stderr


def test_a_head_git_cannot_read_refuses_force_in_one_line(checkout: Path):
    """HEAD's blob of the edited file is gone from the object store (a damaged clone):
    nothing vouches for the backup, so --force is refused in one line, not a traceback."""
    assert run_cli("apply", "--target", str(checkout)).exit_code == 0
    blob = git(checkout, "rev-parse", f"HEAD:{MODEL_MANAGER}")
    (checkout / ".git" / "objects" / blob[:2] / blob[2:]).unlink()  # loose: a fresh repo
    with (checkout / MODEL_MANAGER).open("a") as handle:
        handle.write("# a local note\n")
    before = snapshot(checkout)
    force = ["--only", "partial-moe-adapter", "--force", "--allow-dirty"]
    refused = run_cli("revert", *force, "--target", str(checkout))
    assert refused.exit_code == 1 and snapshot(checkout) == before
    [line] = refused.stderr.splitlines()
    assert f"a commit changed {MODEL_MANAGER} since the patch was applied" in line


def test_a_damaged_journal_copy_in_a_checkout_names_git(checkout: Path):
    """An interrupted run whose copy of the file it was writing is gone: the refusal said
    "reinstall vLLM" with no command, in a checkout where pip has nothing to reinstall;
    it names git's way back, in the words and in --json."""
    after = hashlib.sha256((checkout / MODEL_MANAGER).read_bytes()).hexdigest()
    entry = {"path": MODEL_MANAGER, "before": "1" * 64, "after": after,
             "patches": ["partial-moe-adapter"]}  # fmt: skip
    txn = checkout / ".patchkit" / "txn"
    txn.mkdir(parents=True)
    (txn / "journal.json").write_text(json.dumps({"state_sha256": "0" * 64, "files": [entry]}))
    before = snapshot(checkout)
    refused = run_cli("apply", "--target", str(checkout))
    assert refused.exit_code == 1 and snapshot(checkout) == before
    assert "the journal's copy of vllm/lora/model_manager.py is missing" in refused.stderr
    wanted = f"`git -C {shlex.quote(str(checkout))} stash push --include-untracked -- vllm`"
    assert wanted in refused.stderr
    error = json.loads(run_cli("apply", "--json", "--target", str(checkout)).stdout)["error"]
    assert error["reinstall_by"] == "git"
