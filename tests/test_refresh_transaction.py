"""`patchkit refresh` is a transaction over the catalogue and the tree's record.

A refresh computes and checks everything first, then writes the variant's
diff, its created files and the tree's record all or none. Faults are
injected at every write point (an audit hook in a forked patchkit: SIGKILL,
Ctrl-C, a full disk) and at the syscalls themselves (strace: ENOSPC at every
write to a file, SIGINT at every rename); afterwards, once `refresh --recover`
has run (refresh owns its journal: no other command writes the catalogue),
the catalogue and the tree's record are both as before or both as after, and
nothing of the run is left in ``patches/``. Every test works on a
copy of the catalogue and of real 0.26.0 trees.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    CATALOGUE,
    PATCHKIT,
    REPO,
    normalized,
    release_tree,
    run_cli,
    slim_tree,
    snapshot,
)
from tests.fault_helpers import ENV, HOOK, MARK, STRACE, Zygote, default_dispositions

MATMUL = "matmul-add-lora-linear"
CREATED = "vllm/lora/punica_wrapper/patchkit_lora_matmul.py"
CHANGED = "vllm/lora/punica_wrapper/punica_gpu.py"
ADDED = "vllm/lora/ops/triton_ops/__init__.py"
UTILS = "vllm/lora/ops/triton_ops/utils.py"
JOURNAL_DIR = ".patchkit-refresh"
needs_strace = pytest.mark.skipif(
    STRACE is None or subprocess.run([STRACE, "-o", "/dev/null", "true"]).returncode != 0,
    reason="strace is not installed or cannot trace here (apt-get install strace)",
)


def catalogue_copy(directory: Path) -> Path:
    root = directory / "patches"
    shutil.copytree(CATALOGUE.root, root)
    return root


def env_for(catalogue: Path) -> dict:
    return {"PATCHKIT_PATCHES_DIR": str(catalogue)}


def append(path: Path, data: bytes) -> None:
    path.write_bytes(path.read_bytes() + data)


def applied(tree: Path, patch_id: str, env: dict) -> None:
    result = run_cli("apply", "--target", str(tree), "--only", patch_id, env=env)
    assert result.exit_code == 0, result.output


def state_bytes(tree: Path) -> bytes | None:
    path = tree / ".patchkit" / "state.json"
    return path.read_bytes() if path.exists() else None


# ----- refusals come before any write -----


def test_a_refresh_that_would_leave_nothing_writes_nothing(tmp_path):
    catalogue = catalogue_copy(tmp_path)
    env = env_for(catalogue)
    tree = slim_tree(tmp_path / "site")
    applied(tree, "expand-block-n", env)
    shutil.copy2(release_tree("0.26.0") / UTILS, tree / UTILS)  # the edit undone by hand
    before, record = snapshot(catalogue), state_bytes(tree)
    result = run_cli("refresh", "expand-block-n", "--target", str(tree), env=env)
    assert result.exit_code == 1 and "back to its original" in result.stderr
    assert snapshot(catalogue) == before and state_bytes(tree) == record
    assert run_cli("list", env=env).exit_code == 0  # the diff is not emptied
    other = slim_tree(tmp_path / "other")
    assert run_cli("status", "--target", str(other), env=env).exit_code == 0


def test_a_refused_add_leaves_the_created_files_alone(tmp_path):
    catalogue = catalogue_copy(tmp_path)
    env = env_for(catalogue)
    tree = slim_tree(tmp_path / "site")
    applied(tree, MATMUL, env)
    append(tree / CREATED, b"# edited in the tree\n")
    linked = tree / ADDED
    shutil.copy2(linked, tmp_path / "elsewhere.py")
    linked.unlink()
    linked.symlink_to(tmp_path / "elsewhere.py")
    before, record = snapshot(catalogue), state_bytes(tree)
    result = run_cli("refresh", MATMUL, "--target", str(tree), "--add", ADDED, "--pristine",
                     str(release_tree("0.26.0")), env=env)  # fmt: skip
    assert result.exit_code == 1 and "symbolic link" in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert snapshot(catalogue) == before and state_bytes(tree) == record


def test_an_installed_catalogue_is_refused_before_anything(tmp_path):
    """A wheel's catalogue (site-packages/patchkit/patches) is pip's, not the maintainer's."""
    site = tmp_path / "lib" / "python3" / "site-packages"
    catalogue = catalogue_copy(site / "patchkit")
    env = env_for(catalogue)
    tree = slim_tree(tmp_path / "tree")
    applied(tree, "expand-block-n", env)
    append(tree / UTILS, b"# edited\n")
    before, record = snapshot(catalogue), state_bytes(tree)
    result = run_cli("refresh", "expand-block-n", "--target", str(tree), env=env)
    assert result.exit_code == 1, result.output
    assert "installed with patchkit" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert snapshot(catalogue) == before and state_bytes(tree) == record


def test_the_pristine_download_runs_with_signals_acted_on(tmp_path):
    """--add without --pristine fetches the release; Ctrl-C must not wait for pip."""
    catalogue = catalogue_copy(tmp_path)
    tree = slim_tree(tmp_path / "site")
    env = env_for(catalogue)
    applied(tree, "expand-block-n", env)
    append(tree / ADDED, b"# added\n")
    log = tmp_path / "mask.json"
    prelude = f"""
import json, signal
import patchkit.releases.fetch as fetching
def fetch(version, dest=None):  # the download itself: the cached wheel tree, no network
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    open({str(log)!r}, "w").write(json.dumps(sorted(int(s) for s in blocked)))
    return fetching.Path({str(release_tree("0.26.0"))!r})
fetching.fetch = fetch
"""
    result = subprocess.run(
        [sys.executable, "-c", prelude + "\nfrom patchkit.cli.main import main\nmain()\n",
         "refresh", "expand-block-n", "--target", str(tree), "--add", ADDED],
        capture_output=True, text=True, env={**os.environ, **env, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    blocked = set(json.loads(log.read_text()))
    assert not blocked & {2, 15, 1}, f"signals blocked during the download: {blocked}"
    assert "+# added" in (catalogue / "expand-block-n" / "block-k-32.diff").read_text()


# ----- bytes and modes -----

EDITS = {
    "form feed": b"x = 1  # \x0c page\n",
    "vertical tab and separators": b"y = 2  # \x0b\x1c\x1d\x1e\n",
    "not UTF-8": b"z = 3  # \xff\xfe\n",
    "NEL and LINE SEPARATOR": "w = 4  # \x85 \u2028\n".encode(),
    "a lone carriage return": b"v = 5  # a\rb\n",
}


def test_a_refreshed_diff_gives_back_the_edited_bytes(tmp_path):
    catalogue = catalogue_copy(tmp_path)
    env = env_for(catalogue)
    tree = slim_tree(tmp_path / "site")
    applied(tree, MATMUL, env)
    lines = (tree / CHANGED).read_bytes().split(b"\n")
    for n, line in enumerate(EDITS.values()):  # spread out: each its own hunk
        lines.insert(40 + 30 * n, line.rstrip(b"\n"))
    (tree / CHANGED).write_bytes(b"\n".join(lines))
    append(tree / CREATED, b"# created \x0c \xff\xfe\n")
    result = run_cli("refresh", MATMUL, "--target", str(tree), env=env)
    assert result.exit_code == 0, result.output
    fresh = slim_tree(tmp_path / "fresh")
    applied(fresh, MATMUL, env)
    for relpath in (CHANGED, CREATED):
        assert (fresh / relpath).read_bytes() == (tree / relpath).read_bytes(), relpath
    status = json.loads(run_cli("status", "--target", str(tree), "--json", env=env).stdout)
    assert next(p for p in status["patches"] if p["id"] == MATMUL)["state"] == "applied"


def test_a_file_with_mixed_line_endings_is_refused_with_one_line(tmp_path):
    catalogue = catalogue_copy(tmp_path)
    env = env_for(catalogue)
    tree = slim_tree(tmp_path / "site")
    applied(tree, "expand-block-n", env)
    data = (tree / UTILS).read_bytes()
    (tree / UTILS).write_bytes(data.replace(b"\n", b"\r\n", 3))
    before, record = snapshot(catalogue), state_bytes(tree)
    result = run_cli("refresh", "expand-block-n", "--target", str(tree), env=env)
    assert result.exit_code == 1, result.output
    line = result.stderr.strip().splitlines()
    assert len(line) == 1 and UTILS in line[0] and "mixes" in line[0], result.stderr
    assert snapshot(catalogue) == before and state_bytes(tree) == record


def test_modes_of_diffs_and_created_files_are_kept(tmp_path):
    catalogue = catalogue_copy(tmp_path)
    env = env_for(catalogue)
    diff = catalogue / MATMUL / "torch-ops.diff"
    created = catalogue / MATMUL / "files" / CREATED
    diff.chmod(0o664)
    created.chmod(0o640)
    tree = slim_tree(tmp_path / "site")
    applied(tree, MATMUL, env)
    append(tree / CREATED, b"# edited\n")
    append(tree / CHANGED, b"# edited\n")
    result = run_cli("refresh", MATMUL, "--target", str(tree), env=env)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(diff.stat().st_mode) == 0o664
    assert stat.S_IMODE(created.stat().st_mode) == 0o640
    assert created.read_bytes().endswith(b"# edited\n")
    assert not list(catalogue.rglob("*tmp*")) and not (catalogue / JOURNAL_DIR).exists()


# ----- a variant declared with creates, not made yet -----

NEW_FILE = "vllm/lora/patchkit_test_new.py"


def declared_catalogue(directory: Path, creates: bool) -> Path:
    from tests.helpers import make_catalogue

    catalogue = make_catalogue(directory, release_tree("0.26.0"), diff_text="")
    (catalogue / "two-files" / "two-files.diff").unlink()  # declared, not made yet
    if creates:
        meta = catalogue / "two-files" / "patch.toml"
        meta.write_text(meta.read_text() + f'creates = ["{NEW_FILE}"]\n')
    return catalogue


@pytest.mark.parametrize("creates", [False, True], ids=["plain", "with-creates"])
def test_a_declared_variant_is_not_made_yet_with_or_without_creates(tmp_path, creates):
    catalogue = declared_catalogue(tmp_path / "catalogue", creates)
    env = env_for(catalogue)
    tree = slim_tree(tmp_path / "site")
    assert run_cli("list", env=env).exit_code == 0
    result = run_cli("status", "--target", str(tree), "--json", env=env)
    assert "cannot read" not in result.output
    reason = json.loads(result.stdout)["patches"][0]["reason"]["message"]
    assert "not made yet" in reason and "patchkit refresh" in reason


def test_a_variant_with_creates_is_made_by_refresh(tmp_path):
    catalogue = declared_catalogue(tmp_path / "catalogue", creates=True)
    env = env_for(catalogue)
    tree = slim_tree(tmp_path / "site")
    (tree / NEW_FILE).write_bytes(b"# a file the patch adds\n")
    append(tree / UTILS, b"# a new patch\n")
    made = run_cli("refresh", "two-files", "--variant", "only", "--add", UTILS, "--add",
                   NEW_FILE, "--target", str(tree), "--pristine", str(release_tree("0.26.0")),
                   env=env)  # fmt: skip
    assert made.exit_code == 0, made.output
    source = catalogue / "two-files" / "files" / NEW_FILE
    assert source.read_bytes() == b"# a file the patch adds\n"
    status = json.loads(run_cli("status", "--target", str(tree), "--json", env=env).stdout)
    assert status["patches"][0]["state"] == "applied"
    assert run_cli("revert", "--target", str(tree), env=env).exit_code == 0
    assert not (tree / NEW_FILE).exists()
    fresh = slim_tree(tmp_path / "fresh")
    assert run_cli("apply", "--target", str(fresh), env=env).exit_code == 0
    assert (fresh / NEW_FILE).read_bytes() == b"# a file the patch adds\n"


# ----- a forged journal -----


def forged(catalogue: Path, tree: Path, path: str) -> Path:
    journal = catalogue / JOURNAL_DIR / "journal.json"
    journal.parent.mkdir()
    entry = {"path": path, "before": None, "after": "0" * 64}
    journal.write_text(json.dumps({"tree": str(tree), "state_after": "1" * 64, "files": [entry]}))
    return journal


@pytest.mark.parametrize(
    "path", ["/etc/passwd", "../../etc/passwd", "expand-block-n/../../x.diff", "series.toml",
             "expand-block-n/files/vllm/linked/x.py", "unknown-patch/x.diff"],
)  # fmt: skip
def test_a_forged_journal_is_refused_and_never_acted_on(tmp_path, path):
    catalogue = catalogue_copy(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x.py").write_text("mine\n")
    (catalogue / "expand-block-n" / "files" / "vllm").mkdir(parents=True)
    (catalogue / "expand-block-n" / "files" / "vllm" / "linked").symlink_to(victim)
    forged(catalogue, tmp_path, path)
    before = snapshot(catalogue)
    result = run_cli("refresh", "--recover", env=env_for(catalogue))
    assert result.exit_code == 1, result.output
    assert "not acted on" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert snapshot(catalogue) == before and (victim / "x.py").read_text() == "mine\n"


def test_a_journal_whose_tree_path_holds_a_link_is_refused(tmp_path):
    catalogue = catalogue_copy(tmp_path)
    tree = slim_tree(tmp_path / "site")
    (tmp_path / "link").symlink_to(tree)
    diff = "expand-block-n/block-k-32.diff"
    forged(catalogue, tmp_path / "link", diff)
    before = (catalogue / diff).read_bytes()
    result = run_cli("refresh", "--recover", env=env_for(catalogue))
    assert result.exit_code == 1 and "not acted on" in result.stderr, result.output
    assert (catalogue / diff).read_bytes() == before


def test_the_journal_reads_the_state_file_the_engine_writes():
    from patchkit.catalogue.journal import TREE_STATE
    from patchkit.patching.state import STATE_FILE

    assert TREE_STATE == STATE_FILE


# ----- faults at every write point -----


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> dict:
    """A slim 0.26.0 tree with matmul-add-lora-linear applied and edited, a catalogue copy,
    and what a refresh leaves (catalogue, record, tree after revert) when it runs or not."""
    base = tmp_path_factory.mktemp("refresh-walk")
    start = base / "start"
    tree = slim_tree(start / "site")
    catalogue = catalogue_copy(start)
    env = env_for(catalogue)
    applied(tree, MATMUL, env)
    append(tree / CREATED, b"# edited in the tree\n")
    append(tree / CHANGED, b"# edited in the tree\n")
    append(tree / ADDED, b"# added to the patch\n")
    ends = {}
    for name in ("before", "after"):
        work = base / name
        shutil.copytree(start, work, symlinks=True)
        if name == "after":
            done = run_cli(*refresh_args(work), env=env_for(work / "patches"))
            assert done.exit_code == 0, done.output
        ends[name] = outcome(work, revert=True)
    assert ends["before"]["catalogue"] != ends["after"]["catalogue"]
    assert ends["before"]["record"] != ends["after"]["record"]
    return {"start": start, **ends}


def refresh_args(work: Path) -> list[str]:
    return ["refresh", MATMUL, "--target", str(work / "site"), "--add", ADDED,
            "--pristine", str(release_tree("0.26.0"))]  # fmt: skip


def outcome(work: Path, revert: bool = False) -> dict:
    """The catalogue, the tree's record, and (``revert``) the tree once reverted."""
    found = {"catalogue": snapshot(work / "patches"), "record": state_bytes(work / "site")}
    if revert:
        site, env = str(work / "site"), env_for(work / "patches")
        done = run_cli("revert", "--force", "--target", site, env=env)  # before: edits stay
        assert done.exit_code == 0, done.output
        found["reverted"] = normalized(work / "site")
    return found


def settled(scenario: dict, work: Path, where: str) -> str:
    """After `refresh --recover` and the next commands: 'before' or 'after', all of it;
    fails on anything else."""
    env = env_for(work / "patches")
    left = (work / "patches" / JOURNAL_DIR).exists()
    recovered = run_cli("refresh", "--recover", env=env)
    assert recovered.exit_code == 0, f"{where}: refresh --recover after the fault: {recovered}"
    said = recovered.stdout.strip().splitlines()
    assert said and all(line.startswith("refresh: ") for line in said), (where, said)
    assert ("nothing to do" in said[0]) == (not left), (where, said)
    listed = run_cli("list", env=env)
    assert listed.exit_code == 0, f"{where}: list after the fault: {listed.output}"
    assert not (work / "patches" / JOURNAL_DIR).exists(), f"{where}: staging left"
    status = run_cli("status", "--target", str(work / "site"), env=env)
    assert status.exit_code == 0, f"{where}: status: {status.output}"
    found = outcome(work, revert=True)
    for name in ("before", "after"):
        if found == scenario[name]:
            return name
    raise AssertionError(f"{where}: neither before nor after ({found['record'] is None})")


@pytest.fixture(scope="module")
def zygote():
    warm = Zygote()
    yield warm
    warm.close()


def walk_points(scenario, zygote, directory: Path, mode: str):
    """Yield (N, work dir, result) for the N-th write point of refresh, until there is none."""
    at = 1
    while True:
        work = directory / f"w{at}"
        shutil.copytree(scenario["start"], work, symlinks=True)
        hook = HOOK.format(root=str(work), mode=mode, at=at)
        request = {"args": refresh_args(work), "code": hook, "env": env_for(work / "patches")}
        zygote.process.stdin.write(json.dumps(request) + "\n")
        zygote.process.stdin.flush()
        result = json.loads(zygote.process.stdout.readline())
        if MARK not in result["stderr"]:
            assert result["returncode"] == 0, result["stderr"]
            assert at > 10, f"refresh made only {at - 1} writes: is the hook counting?"
            return
        result["stderr"] = result["stderr"].replace(MARK, "")
        yield at, work, result
        shutil.rmtree(work)
        at += 1


@pytest.mark.slow
def test_sigkill_at_every_write_point_is_recovered_by_the_next_command(
    scenario, zygote, scratch_path
):
    seen = set()
    for at, work, result in walk_points(scenario, zygote, scratch_path, "kill"):
        assert result["returncode"] == -9, (at, result["stderr"])
        seen.add(settled(scenario, work, f"SIGKILL at write {at}"))
    assert seen == {"before", "after"}


@pytest.mark.slow
def test_ctrl_c_at_every_write_point_says_what_it_left(scenario, zygote, scratch_path):
    seen = set()
    for at, work, result in walk_points(scenario, zygote, scratch_path, "interrupt"):
        assert result["returncode"] == 130 and "Traceback" not in result["stderr"], at
        line = result["stderr"].strip().splitlines()[-1]
        end = settled(scenario, work, f"Ctrl-C at write {at}")
        expected = "changes nothing" if end == "before" else "had written everything"
        assert expected in line, (at, end, line)
        seen.add(end)
    assert "before" in seen


@pytest.mark.slow
def test_a_full_disk_at_every_write_point_changes_nothing(scenario, zygote, scratch_path):
    failures = 0
    for at, work, result in walk_points(scenario, zygote, scratch_path, "enospc"):
        if result["returncode"] == 0:  # a rename or a removal: ENOSPC comes on writes only
            assert settled(scenario, work, f"ENOSPC at {at}") == "after"
            continue
        assert result["returncode"] == 1, (at, result["stderr"])
        line = result["stderr"].strip().splitlines()
        assert len(line) == 1 and "no space left" in line[0], (at, result["stderr"])
        assert "nothing" in line[0] and "changed" in line[0], line[0]
        assert settled(scenario, work, f"ENOSPC at write {at}") == "before", line[0]
        failures += 1
    assert failures > 3


# ----- the same at the syscalls (strace) -----


def traced_refresh(scenario, work: Path, strace_args: list[str], zygote: Zygote | None = None):
    """refresh on a copy of the scenario under strace (test_signals' way, this catalogue):
    the console script's run, or (``zygote``) a fork of a warm patchkit with strace attached."""
    shutil.copytree(scenario["start"], work, symlinks=True)
    if zygote is not None:
        env = env_for(work / "patches")
        return zygote.run(*refresh_args(work), env=env, strace=strace_args)
    return subprocess.run(
        [STRACE, "-qq", *strace_args, *PATCHKIT, *refresh_args(work)],
        capture_output=True, text=True, timeout=120, preexec_fn=default_dispositions,
        env={**ENV, **env_for(work / "patches")},
    )  # fmt: skip


def syscall_names(log: Path, names: tuple[str, ...]) -> list[str]:
    return [line.split("(", 1)[0] for line in log.read_text().splitlines()
            if line.split("(", 1)[0] in names]  # fmt: skip


def counted(scenario, zygote: Zygote, directory: Path, names: tuple[str, ...]) -> list[str]:
    """The calls of ``names`` refresh makes, in order; the same in a fork as in the script's run.

    The faults below are injected into forks of a warm patchkit: this is the
    check that a fork makes the console script's syscalls, no more, no fewer.
    """
    found = []
    for how in (None, zygote):
        log = directory / f"calls-{len(found)}.log"
        trace = ["-o", str(log), "-e", f"trace={','.join(names)}"]
        done = traced_refresh(scenario, directory / f"count-{len(found)}", trace, how)
        assert done.returncode == 0, done.stderr
        found.append(syscall_names(log, names))
    assert found[0] == found[1], "the fork makes other syscalls than the console script"
    return found[0]


def file_writes(scenario, zygote: Zygote, directory: Path) -> list[int]:
    """The numbers of refresh's write(2) calls that go to files (not to stdout or stderr)."""
    counted(scenario, zygote, directory, ("write",))
    log = directory / "calls-1.log"  # the fork's: its file descriptors
    calls = [line for line in log.read_text().splitlines() if line.startswith("write(")]
    return [n for n, line in enumerate(calls, 1) if not line.startswith(("write(1,", "write(2,"))]


@pytest.mark.slow
@needs_strace
def test_enospc_at_every_write_syscall_changes_nothing_and_says_so(scenario, zygote, scratch_path):
    points = file_writes(scenario, zygote, scratch_path)
    assert len(points) > 5
    for n in points:
        work = scratch_path / f"enospc-{n}"
        inject = ["-o", "/dev/null", "-e", "trace=write", "-e",
                  f"inject=write:error=ENOSPC:when={n}"]  # fmt: skip
        result = traced_refresh(scenario, work, inject, zygote)
        line = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(line) == 1, (n, result.stderr)
        assert "no space left" in line[0] and "nothing was changed" in line[0], (n, line)
        assert settled(scenario, work, f"ENOSPC at write(2) #{n}") == "before"


RENAMES = ("rename", "renameat", "renameat2")


@pytest.mark.slow
@needs_strace
def test_sigint_at_every_rename_leaves_before_or_after_and_says_which(
    scenario, zygote, scratch_path
):
    trace = ["-e", f"trace={','.join(RENAMES)}"]
    calls = counted(scenario, zygote, scratch_path, RENAMES)
    assert len(calls) > 3
    ends = {}
    for name in sorted(set(calls)):  # strace counts each syscall on its own
        for n in range(1, calls.count(name) + 1):
            work = scratch_path / f"int-{name}-{n}"
            inject = ["-o", "/dev/null", *trace, "-e", f"inject={name}:signal=SIGINT:when={n}"]
            result = traced_refresh(scenario, work, inject, zygote)
            where = f"SIGINT at {name} #{n}"
            assert result.returncode == 130 and "Traceback" not in result.stderr, (where, result)
            end = settled(scenario, work, where)
            expected = "changes nothing" if end == "before" else "had written everything"
            assert expected in result.stderr, (where, end, result.stderr)
            ends[name, n] = end
    assert ends[calls[0], 1] == "before"  # the first rename: everything is put back


@pytest.mark.slow
@needs_strace
@pytest.mark.parametrize("syscall", ["write", "renameat", "unlinkat"])
def test_sigkill_at_every_syscall_of_a_kind_is_recovered(scenario, zygote, scratch_path, syscall):
    total = len(counted(scenario, zygote, scratch_path, (syscall,)))
    assert total > 5
    seen = set()
    for n in range(1, total + 1):
        work = scratch_path / f"kill-{n}"
        inject = ["-o", "/dev/null", "-e", f"trace={syscall}", "-e",
                  f"inject={syscall}:signal=SIGKILL:when={n}"]  # fmt: skip
        result = traced_refresh(scenario, work, inject, zygote)
        assert result.returncode == -9, (n, result.stderr)
        seen.add(settled(scenario, work, f"SIGKILL at {syscall} #{n}"))
        shutil.rmtree(work)
    assert "before" in seen


@pytest.mark.slow
@needs_strace
def test_an_io_error_at_every_fsync_leaves_before_or_after_and_says_which(
    scenario, zygote, scratch_path
):
    """EIO at the directory fsync after state.json's rename was reported as "nothing was
    changed" while the tree's record kept the new entry (and status then advised an apply
    that threw the maintainer's edit away)."""
    count = len(counted(scenario, zygote, scratch_path, ("fsync",)))
    assert count > 5
    for n in range(1, count + 1):
        work = scratch_path / f"eio-{n}"
        inject = ["-o", "/dev/null", "-e", "trace=fsync", "-e", f"inject=fsync:error=EIO:when={n}"]
        result = traced_refresh(scenario, work, inject, zygote)
        end = settled(scenario, work, f"EIO at fsync #{n}")
        if result.returncode == 1:
            assert "nothing was changed" in result.stderr and end == "before", (n, result.stderr)
        else:
            assert result.returncode == 0 and end == "after", (n, result.stderr)
