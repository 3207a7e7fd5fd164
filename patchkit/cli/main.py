"""The command line: list, status, apply, revert, refresh, fetch, verify, doctor, canary.

Exit status: 0 success (including "nothing to do"), 1 failure (and then
nothing changed on disk), 2 usage error, 3 an unexpected internal error (a
bug: one line and a hint; PATCHKIT_DEBUG=1 shows the traceback), 130
interrupted (Ctrl-C). Every failure prints one line on stderr, and with
``--json`` also ``{"ok": false, "error": ...}`` on stdout.

A report never contradicts the disk (the line dpkg and git hold: never say
nothing was done when something was, never do something silently):

- Once a command has changed the tree, the catalogue or a cache, it says so
  to :class:`Outcome` (``outcome().done(lines)``). From then on no failure to
  print its report (a full disk, a reader that left the pipe) or to tidy up
  can exit 1: the command exits 0, and what it did and what failed go to
  stderr. ``--json`` then prints no JSON and never a traceback.
- A report lost before anything changed is a failure: exit 1, one line on
  stderr naming the command.
- A stdout that is closed when patchkit starts (``>&-``) could never carry a
  report: every command refuses before doing anything, exit 1, one line on
  stderr. (Left closed, the descriptor would go to the first file patchkit
  opens, and a child's output into that file.) A closed stdin or stderr is
  pointed at /dev/null for the same reason; the command runs.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
import traceback

import click

from patchkit.catalogue.load import load_catalogue
from patchkit.cli import render
from patchkit.errors import PatchkitError, os_error_line
from patchkit.forks import forkmode
from patchkit.fs import signals
from patchkit.patching import operations
from patchkit.patching.decide import RunOptions, select
from patchkit.vllmtree.tree import is_version, locate

TARGET_HELP = (
    "Directory that contains vllm/ (site-packages, dist-packages or a vLLM checkout). "
    "Default: the vLLM importable by this Python (found without importing it)."
)


DEBUG_ENV = "PATCHKIT_DEBUG"
EXIT_FAILURE, EXIT_USAGE, EXIT_BUG, EXIT_INTERRUPTED = 1, 2, 3, 130


class Outcome:
    """What the running command has done that stands, whatever happens to its report.

    The one place that knows whether the disk changed: a command calls
    :meth:`done` as soon as its engine has committed (and only then), with
    the lines that say what it did. :func:`user_errors` reads it to choose
    the exit status and what to say when the command cannot finish its
    report.
    """

    def __init__(self, command: str):
        self.command = command
        self.lines: list[str] = []

    def done(self, lines: list[str]) -> None:
        self.lines.extend(lines)

    @property
    def changed(self) -> bool:
        return bool(self.lines)


OUTCOME = "patchkit.outcome"


def outcome() -> Outcome:
    """The running command's :class:`Outcome` (made by :func:`user_errors`)."""
    return click.get_current_context().meta[OUTCOME]


def fail(message: str, code: int, as_json: bool, done: Outcome | None = None) -> None:
    """One line on stderr (and the JSON error object on stdout), then exit ``code``.

    A path read from disk may hold a newline or another control character
    (a forged state entry); it is written escaped, so the error stays one line.
    After the command changed something (``done``), a failure is a warning
    followed by what it did, and exit 1 becomes 0: 1 says nothing changed.
    """
    message = render.printable(message)
    changed = done is not None and done.changed
    if changed and code == EXIT_FAILURE:
        code = 0
    with signals.swallowed():  # the error is the last word: no second signal cuts it
        if as_json and not changed:
            try:
                render.emit_json({"ok": False, "error": message, "exit_code": code})
            except render.ReportLost:
                silence_stdout()
        render.warn(f"patchkit: {'warning' if code == 0 else 'error'}: {message}")
        if changed:
            render.warn(f"patchkit: what `patchkit {done.command}` did stands:")
            for line in done.lines:
                render.warn(f"patchkit:   {render.printable(line)}")
    sys.exit(code)


def report_lost(done: Outcome, cause: OSError, as_json: bool) -> None:
    """stdout could not take the report: say so on stderr; exit 0 if the command changed
    anything (its work stands), else 1."""
    silence_stdout()
    why = {errno.EPIPE: "broken pipe: its reader left", errno.ENOSPC: "no space left on the "
           "device"}.get(cause.errno, (cause.strerror or str(cause)).lower())  # fmt: skip
    if done.changed:
        fail(f"stdout could not take the report ({why})", EXIT_FAILURE, as_json, done)
    fail(
        f"stdout could not take the report of `patchkit {done.command}` ({why}); "
        "nothing was changed",
        EXIT_FAILURE,
        False,  # no JSON either: stdout is gone
    )


def silence_stdout() -> None:
    """Point stdout's descriptor at /dev/null: what the failed stream still buffers goes
    there at exit, instead of failing again (Python's exit status 120 and a traceback)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a descriptor (tests): nothing to do
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


# What an interrupted command leaves behind, by command. Writes happen with
# Ctrl-C and SIGTERM held (patchkit.fs.signals), so a write step is never split.
INTERRUPTED = {
    "apply": "interrupted; patchkit finished the step it was in, so each patch is fully "
    "applied or not at all (`patchkit status` shows which; `patchkit revert` undoes them)",
    "revert": "interrupted; patchkit finished the step it was in, so each patch is fully "
    "reverted or still applied (`patchkit status` shows which; run `patchkit revert` again)",
    "fetch": "interrupted; the destination is complete or untouched, never half unpacked (the "
    "staging directory is removed now or by the next `patchkit fetch`; fetch again to be sure)",
    "verify": "interrupted; verify writes nothing into the vLLM tree",
    "canary": "interrupted; the canary only reads from the server: nothing to undo",
}


def interrupted_message(command: str) -> str:
    return INTERRUPTED.get(command, f"interrupted; `patchkit {command}` changes nothing")


def command_name(ctx: click.Context) -> str:
    """The command as typed after `patchkit`: "probe report", not only "report"."""
    names = []
    while ctx.parent is not None:
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    return " ".join(names) or str(ctx.info_name)


def user_errors(func):
    """Map every way a command can end badly onto one line and an exit status.

    PatchkitError and OSError (full disk, permissions, path too long) are the
    user's to act on: exit 1. Ctrl-C: exit 130, SIGTERM 143, SIGHUP 129, with
    this command's own message (what it left behind). Anything else is a bug
    in patchkit: exit 3, with the traceback only when PATCHKIT_DEBUG=1.
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("as_json"))
        ctx = click.get_current_context()
        command = command_name(ctx)
        done = ctx.meta[OUTCOME] = Outcome(command)
        try:
            return func(*args, **kwargs)
        except render.ReportLost as exc:
            report_lost(done, exc.cause, as_json)
        except BrokenPipeError as exc:  # stdout written past render.out
            report_lost(done, exc, as_json)
        except PatchkitError as exc:
            fail(str(exc), getattr(exc, "exit_code", EXIT_FAILURE), as_json, done)
        except OSError as exc:
            shorter = "--dest path" if command == "fetch" else "--target path"
            fail(os_error_line(exc, "accessing", too_long=shorter), EXIT_FAILURE, as_json, done)
        except (click.ClickException, click.exceptions.Exit):
            raise  # usage errors: PatchkitGroup prints them, exit 2
        except KeyboardInterrupt:
            fail(interrupted_message(command), EXIT_INTERRUPTED, as_json, done)
        except signals.Terminated as exc:
            fail(f"{exc} received; {interrupted_message(command)}", exc.exit_code, as_json, done)
        except Exception as exc:
            if os.environ.get(DEBUG_ENV) == "1":
                traceback.print_exc()
            detail = str(exc).splitlines()[0] if str(exc) else ""
            fail(
                f"internal error {type(exc).__name__}: {detail} (a bug in patchkit; rerun with "
                f"{DEBUG_ENV}=1 for the traceback and report it)",
                EXIT_BUG,
                as_json,
                done,
            )

    return wrapper


def standard_streams() -> bool:
    """Whether stdout is open; a closed stdin, stdout or stderr now holds /dev/null.

    Python sets sys.stdout to None when descriptor 1 was closed at start;
    the first file opened would then get descriptor 1 (and print() or a
    child process would write into it).
    """
    closed = {0: sys.stdin, 1: sys.stdout, 2: sys.stderr}
    for fd, stream in closed.items():
        if stream is None:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    return sys.stdout is not None


class PatchkitGroup(click.Group):
    """A click group whose usage errors honour --json and whose Ctrl-C exits 130."""

    def main(self, args=None, prog_name=None, **extra):
        args = list(sys.argv[1:] if args is None else args)
        if not standard_streams():
            render.warn(
                "patchkit: error: stdout is closed, so patchkit could not report what it does; "
                "nothing was done (send it to a file, a pipe or /dev/null instead)"
            )
            sys.exit(EXIT_FAILURE)
        signals.install()
        try:
            extra.pop("standalone_mode", None)
            result = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.UsageError as exc:
            if "--json" in args:
                try:
                    render.emit_json({"ok": False, "error": exc.format_message(), "exit_code": 2})
                except render.ReportLost:
                    silence_stdout()
            exc.show()
            sys.exit(EXIT_USAGE)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except (click.Abort, KeyboardInterrupt):
            click.echo("patchkit: error: interrupted; nothing was done", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except signals.Terminated as exc:
            click.echo(f"patchkit: error: {exc} received; nothing was done", err=True)
            sys.exit(exc.exit_code)
        sys.exit(result if isinstance(result, int) else 0)


def check_target(ctx, param, value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise click.BadParameter("is empty; pass the directory that contains vllm/", ctx, param)
    return value


def check_version(ctx, param, value: str | None) -> str | None:
    if value is not None and not is_version(value):
        raise click.BadParameter(f"{value!r} is not a PEP 440 version (e.g. 0.26.0)")
    return value


def check_add(ctx, param, value: tuple[str, ...]) -> tuple[str, ...]:
    """A --add path that is absolute, climbs out or is not under vllm/ is a usage error
    (exit 2), caught before any work."""
    from patchkit.fs.safepath import checked_relpath

    for relpath in value:
        try:
            checked_relpath(relpath, "--add")
        except PatchkitError as exc:
            raise click.BadParameter(str(exc).removeprefix("--add: "), ctx, param) from None
    return value


def check_only(only: tuple[str, ...], catalogue) -> tuple[str, ...]:
    """An unknown --only id is a usage error (exit 2), caught before any work."""
    try:
        select(catalogue, only)
    except PatchkitError as exc:
        raise click.BadParameter(str(exc), param_hint="--only") from None
    return only


def target_options(func):
    func = click.option(
        "--target",
        metavar="PATH",
        type=click.Path(file_okay=False),
        callback=check_target,
        help=TARGET_HELP,
    )(func)
    func = click.option(
        "--vllm-version",
        metavar="V",
        envvar="PATCHKIT_VLLM_VERSION",
        callback=check_version,
        help="Override the detected vLLM version (odd builds); also PATCHKIT_VLLM_VERSION.",
    )(func)
    return func


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
only_option = click.option(
    "--only", multiple=True, metavar="ID", help="Limit to this patch (repeatable)."
)
allow_dirty_option = click.option(
    "--allow-dirty", is_flag=True, help="Fork mode: work on a checkout with uncommitted changes."
)
caches_option = click.option(
    "--clear-caches",
    is_flag=True,
    help="Also clear vLLM's torch.compile cache and Triton's kernel cache.",
)


@click.group(cls=PatchkitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="patchkit")
def main() -> None:
    """Repair installed vLLM trees with versioned, verified, reversible patches."""


@main.command("list")
@json_option
@user_errors
def list_patches(as_json: bool) -> None:
    """Print the patch catalogue: ids, version ranges, why, upstream, remove-when."""
    catalogue = load_catalogue()
    if as_json:
        render.emit_json(render.catalogue_json(catalogue))
    else:
        render.render_catalogue(catalogue)


@main.command()
@target_options
@json_option
@user_errors
def status(target: str | None, vllm_version: str | None, as_json: bool) -> None:
    """Show each patch's state on the tree (reads files only)."""
    tree = locate(target, vllm_version)
    result = operations.status(tree, load_catalogue())
    if forkmode.is_fork(tree):
        forkmode.annotate_status(tree, result)
    show(result, as_json)


def show(result: operations.RunReport, as_json: bool) -> None:
    """The report of a finished run, written whole: a signal now would only cut it short."""
    if result.changed:
        outcome().done(render.run_changes(result))
    with signals.swallowed():
        render.emit_json(render.run_json(result)) if as_json else render.render_run(result)


@main.command()
@target_options
@only_option
@click.option("--dry-run", is_flag=True, help="Check everything, write nothing.")
@click.option("--strict", is_flag=True, help="Treat every warning as a failure.")
@caches_option
@click.option(
    "--branch",
    metavar="NAME",
    help="Fork mode: branch for the patch commits (patchkit/vllm-VERSION).",
)
@allow_dirty_option
@json_option
@user_errors
def apply(
    target, vllm_version, only, dry_run, strict, clear_caches, branch, allow_dirty, as_json
) -> None:
    """Apply the patches this vLLM needs (idempotent; all or nothing).

    On a vLLM git checkout each applied patch becomes a commit on a branch.
    """
    catalogue = load_catalogue()
    options = RunOptions(check_only(only, catalogue), dry_run, strict, False, clear_caches)
    tree = locate(target, vllm_version)
    if forkmode.is_fork(tree):
        result = forkmode.apply(tree, catalogue, options, branch, allow_dirty)
    else:
        result = operations.apply(tree, catalogue, options)
    show(result, as_json)


@main.command()
@target_options
@only_option
@click.option("--force", is_flag=True, help="Restore originals even over later edits.")
@caches_option
@allow_dirty_option
@json_option
@user_errors
def revert(target, vllm_version, only, force, clear_caches, allow_dirty, as_json) -> None:
    """Undo applied patches; the tree becomes byte-identical to before.

    On a vLLM git checkout each reverted patch gets a revert commit.
    """
    catalogue = load_catalogue()
    options = RunOptions(check_only(only, catalogue), force=force, clear_caches=clear_caches)
    tree = locate(target, vllm_version)
    if forkmode.is_fork(tree):
        result = forkmode.revert(tree, catalogue, options, allow_dirty)
    else:
        result = operations.revert(tree, catalogue, options)
    show(result, as_json)


@main.command("refresh")
@click.argument("patch_id", metavar="ID")
@target_options
@click.option("--variant", metavar="NAME", help="The variant to write (default: the one applied).")
@click.option(
    "--add",
    multiple=True,
    metavar="PATH",
    callback=check_add,
    help="Also put this file (vllm/...) into the patch; its original comes from --pristine.",
)
@click.option(
    "--pristine",
    metavar="DIR",
    type=click.Path(file_okay=False, exists=True),
    help="A pristine tree of the same release, for --add (default: `patchkit fetch VERSION`).",
)
@json_option
@user_errors
def refresh_command(patch_id, target, vllm_version, variant, add, pristine, as_json) -> None:
    """Rewrite patch ID's diff from the tree it is applied to (maintainers; like quilt refresh).

    Apply the patch, edit the patched files in the tree, then refresh: the
    variant's diff is made from the originals patchkit keeps to the files as
    they are, files the patch creates are copied back to patches/ID/files/,
    and the tree's record follows, so status still says applied.
    """
    from pathlib import Path

    from patchkit.fs.safepath import checked_relpath
    from patchkit.patching.refresh import refresh

    catalogue = load_catalogue()
    check_only((patch_id,), catalogue)
    for relpath in add:
        checked_relpath(relpath, "--add")
    tree = locate(target, vllm_version)
    result = refresh(
        tree, catalogue, patch_id, variant, tuple(add), Path(pristine) if pristine else None
    )
    outcome().done([render.refresh_summary(result)])
    if as_json:
        render.emit_json(render.refresh_json(result))
    else:
        render.render_refresh(result)


@main.command("fetch")
@click.argument("version")
@click.option(
    "--dest",
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Unpack here instead of the cache.",
)
@json_option
@user_errors
def fetch_command(version: str, dest: str | None, as_json: bool) -> None:
    """Download vLLM VERSION's wheel and print the directory of its unpacked tree.

    Shows pip's progress on a terminal; quiet with --json or when stderr is not one.
    """
    from patchkit.releases.fetch import fetch

    progress = not as_json and sys.stderr.isatty()
    path = fetch(version, dest, progress=progress)
    outcome().done([f"fetch: vLLM {version} is at {path}"])
    render.emit_json({"ok": True, "path": str(path)}) if as_json else render.out(str(path))


@main.command("verify")
@click.option(
    "--e2e",
    is_flag=True,
    help="Also serve a tiny Qwen3.5 and a Qwen3.5-MoE with LoRA in vLLM (~5 min).",
)
@click.option(
    "--model",
    metavar="DIR",
    help="Also serve this model with each --lora adapter and compare it against the adapter "
    "merged into a copy of the weights (served without LoRA).",
)
@click.option(
    "--lora",
    "loras",
    multiple=True,
    metavar="NAME=DIR",
    help="With --model: a PEFT LoRA adapter to check (repeatable).",
)
@click.option(
    "--tensor-parallel-size",
    type=int,
    default=1,
    show_default=True,
    metavar="N",
    help="Serve every engine of --e2e and --model on N GPUs (at most the GPUs visible).",
)
@click.option(
    "--max-model-len",
    type=int,
    metavar="L",
    help="With --model: vLLM's max_model_len; the longest prompt is L - 16, at most 16384 "
    "(default: 16400, or the model's max_position_embeddings when smaller).",
)
@click.option(
    "--workdir",
    metavar="DIR",
    help="Where the merged references and vLLM's logs go (default: the system temp dir); "
    "removed afterwards.",
)
@click.option(
    "--seed",
    metavar="N",
    type=int,
    envvar="PATCHKIT_VERIFY_SEED",
    help="Seed for the random inputs (default: a fresh one each run).",
)
@click.option(
    "--keep",
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Work in this new or empty directory and keep it: the e2e models, the merged "
    "references, the served results and vLLM's logs.",
)
@json_option
@user_errors
def verify_command(
    e2e, model, loras, tensor_parallel_size, max_model_len, workdir, seed, keep, as_json
) -> None:
    """Prove on this GPU that the installed vLLM's LoRA path gives sound numbers.

    Needs an NVIDIA GPU, torch and the vLLM that this Python imports. Exit 1
    on any failed check.
    """
    from patchkit.verify import runner

    request = verify_request(
        e2e, model, loras, tensor_parallel_size, max_model_len, workdir, seed, keep
    )
    if as_json:  # vLLM logs to stdout by default; keep stdout for the JSON
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    say = functools.partial(click.echo, err=True)
    result = runner.run(load_catalogue(), request, say)
    render.emit_json(render.verify_json(result)) if as_json else render.render_verify(result)
    sys.exit(0 if result.ok else 1)


def verify_request(e2e, model, loras, tp, max_model_len, workdir, seed, keep):
    """verify's options checked together: each problem is one line, exit 2, nothing done."""
    from pathlib import Path

    from patchkit.errors import UsageProblem
    from patchkit.verify import runner
    from patchkit.verify.usermodel import parse_lora

    if loras and model is None:
        raise UsageProblem("--lora needs --model DIR (the base model the adapters belong to)")
    if model is not None and not loras:
        raise UsageProblem("--model needs at least one --lora NAME=DIR")
    if max_model_len is not None and model is None:
        raise UsageProblem("--max-model-len goes with --model")
    if model is not None and not Path(model).is_dir():
        raise UsageProblem(f"--model {model}: not a directory")
    if workdir is not None and not Path(workdir).is_dir():
        raise UsageProblem(f"--workdir {workdir}: not a directory")
    if workdir is not None and keep is not None:
        raise UsageProblem("--workdir and --keep: give one (--keep works in its directory)")
    if tp < 1:
        raise UsageProblem(f"--tensor-parallel-size {tp}: must be 1 or more")
    if keep is not None:
        _check_keep(Path(keep))
    return runner.Request(
        e2e=e2e, seed=seed, keep=Path(keep) if keep else None,
        model=Path(model) if model else None, loras=[parse_lora(v) for v in loras],
        tensor_parallel_size=tp, max_model_len=max_model_len,
        workdir=Path(workdir) if workdir else None,
    )  # fmt: skip


def _check_keep(keep) -> None:
    """--keep DIR must be new or empty: verify writes model/, adapter/, served.json, vLLM's
    logs and caches there by fixed names, and would overwrite a user's files of those names
    (a --keep pointing at a folder that holds their own model, the vLLM tree, or /)."""
    from patchkit.errors import UsageProblem

    try:
        occupied = keep.exists() and any(keep.iterdir())
    except OSError as exc:
        raise UsageProblem(f"--keep {keep}: cannot read it ({exc.strerror})") from None
    if occupied:
        raise UsageProblem(
            f"--keep {keep}: not empty; give a new or empty directory (verify writes its "
            "models, references and logs there by fixed names)"
        )


@main.command("doctor")
@target_options
@click.option(
    "--kernels",
    is_flag=True,
    help="Also compile every LoRA Triton kernel vLLM launches for sm_90 (no GPU needed) and "
    "scan their SASS for the wgmma register race. Needs torch and Triton.",
)
@click.option(
    "--model",
    metavar="DIR",
    type=click.Path(exists=True, file_okay=False),
    help="With --kernels: call the kernels with this model's shapes (its config.json: "
    "hidden size, experts, top-k, dtype) instead of Qwen3.5-27B and Qwen3.5-35B-A3B.",
)
@click.option(
    "--adapter",
    "adapters",
    metavar="DIR",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    help="With --kernels: a LoRA adapter directory whose adapter_config.json ranks to scan "
    "(repeatable; default ranks 16 and 64).",
)
@click.option("-v", "--verbose", is_flag=True, help="With --kernels: one line per config.")
@json_option
@user_errors
def doctor_command(
    target: str | None,
    vllm_version: str | None,
    kernels: bool,
    model: str | None,
    adapters: tuple[str, ...],
    verbose: bool,
    as_json: bool,
) -> None:
    """Report GPU, Triton/ptxas, vLLM patch states, tuned configs and stale caches.

    Needs no GPU and imports no vLLM. Ends with a verdict per known bug.
    """
    from pathlib import Path

    from patchkit.doctor import doctor

    if (model or adapters) and not kernels:
        raise click.UsageError("--model and --adapter go with --kernels")
    try:
        tree, tree_error = locate(target, vllm_version), ""
    except PatchkitError as exc:
        if target is not None:  # a --target that is wrong fails as in every other command
            raise
        tree, tree_error = None, str(exc)
    request = None
    if kernels:
        request = doctor.ScanRequest(
            Path(model) if model else None, tuple(Path(a) for a in adapters)
        )
    result = doctor.run(tree, tree_error, load_catalogue(), kernels=request)
    if as_json:
        render.emit_json(render.doctor_json(result))
    else:
        render.render_doctor(result, verbose)


def check_url(ctx, param, value: str) -> str:
    """http(s), a host and a valid port: a malformed URL ('http://[::1') raised
    httpx.InvalidURL inside the run (exit 3), a port past 65535 read as 'refused'."""
    from urllib.parse import urlsplit

    if not value.strip().lower().startswith(("http://", "https://")):
        raise click.BadParameter(f"{value!r} must start with http:// or https://")
    try:
        parts = urlsplit(value.strip())
        parts.port  # noqa: B018 -- raises ValueError when out of range or not a number
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is not a URL ({exc})") from None
    if not parts.hostname:
        raise click.BadParameter(f"{value!r} names no host")
    return value


def check_finite(ctx, param, value: float) -> float:
    """FloatRange lets NaN through (every comparison is false): a deadline never reached."""
    import math

    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number of seconds")
    return value


@main.command("canary")
@click.option(
    "--url",
    metavar="URL",
    required=True,
    callback=check_url,
    help="Server root, e.g. http://localhost:8000 (a trailing /v1 is accepted).",
)
@click.option(
    "--api-key",
    metavar="KEY",
    envvar="VLLM_API_KEY",
    help="The server's API key (or VLLM_API_KEY).",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="ID",
    help="Check only this model or adapter (repeatable). Default: all that GET /v1/models lists.",
)
@click.option(
    "--prompt-tokens",
    metavar="N",
    type=click.IntRange(16, 100_000),
    default=2000,
    show_default=True,
    help="About this many prompt tokens per model (16-100000).",
)
@click.option(
    "--timeout",
    metavar="S",
    type=click.FloatRange(1, 600),
    default=60.0,
    show_default=True,
    callback=check_finite,
    help="Seconds for the whole run.",
)
@click.option(
    "--record",
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Save every HTTP exchange (path, bodies, status; no headers) as JSON files here.",
)
@json_option
@user_errors
def canary_command(url, api_key, models, prompt_tokens, timeout, record, as_json) -> None:
    """Ask a running vLLM server whether each model and LoRA adapter answers sanely.

    One long greedy prompt per model; NaN log-probabilities, runs of token id 0
    ('!!!!') or a rise of vllm:corrupted_requests_total fail it. Exit 0 when all
    are sane, 1 otherwise or when the server cannot be reached.
    """
    from pathlib import Path

    from patchkit.canary import check  # httpx, prometheus_client: only here

    result = check.run(
        url, api_key, models, prompt_tokens, timeout, Path(record) if record else None
    )
    render.emit_canary(result, as_json, api_key)
    if not result.ok:
        fail(check.scrub(result.summary(), api_key), EXIT_FAILURE, False)


@main.group(cls=click.Group)
def probe() -> None:
    """Read what the nan-probe patch logged (patchkit apply --only nan-probe)."""


@probe.command("report")
@click.argument("log_file", metavar="FILE", type=click.Path(dir_okay=False))
@json_option
@user_errors
def probe_report(log_file: str, as_json: bool) -> None:
    """Per affected request: the first layer and module where a NaN/Inf appeared, and why.

    FILE is the PATCHKIT_PROBE_LOG the probed server wrote (JSON lines). Reads
    only; no vLLM, no torch. Exit 0 with the report (a last line cut short is
    skipped with a warning), 1 on a line that is not a probe record, 2 when
    FILE does not exist.
    """
    from pathlib import Path

    from patchkit.probe import report

    result = report.report(Path(log_file))
    render.render_probe_warnings(result)
    if as_json:
        render.emit_json(render.probe_json(result))
    else:
        render.render_probe_report(result)


if __name__ == "__main__":  # pragma: no cover
    main()
