"""How a command ends: its exit status and its last words, whatever went wrong.

Every failure prints one line on stderr, and with ``--json`` also the
command's error document on stdout (``{"format": 1, "command": ..., "ok": false,
"error": {"code": ..., "message": ...}}``); the statuses are :mod:`patchkit.cli.exits`'s.
Every error is a reason (:attr:`patchkit.errors.PatchkitError.reason`): its kind's code
and facts go into the JSON, and its words are its line (a refusal's are made here, by
:mod:`patchkit.cli.words`).

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

from patchkit import signals
from patchkit.cli import exits, render
from patchkit.cli.words import say
from patchkit.codes import Code, Reason
from patchkit.errors import OsFailure, PatchkitError


class Outcome:
    """What the running command has done that stands, whatever happens to its report.

    The one place that knows whether the disk changed: a command calls
    :meth:`done` as soon as its writes have committed (patchkit.patching.operations,
    and only then), with the lines that say what it did. :func:`user_errors` reads it to choose
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


# The code of a line the command line makes itself (an interruption, a bug, a usage
# error click found, a report lost), by its exit status
ERROR_CODES = {
    exits.FAILURE: Code.ERROR,
    exits.USAGE: Code.USAGE,
    exits.BUG: Code.INTERNAL_ERROR,
}


def fail(
    error: str | Reason,
    code: int,
    as_json: bool,
    done: Outcome | None = None,
    command: str | None = None,
) -> None:
    """One line on stderr (and the JSON error document on stdout), then exit ``code``.

    ``error`` is a line or a reason (a refusal's: its words are made here). A path
    read from disk may hold a newline or another control character (a forged state
    entry); it is written escaped, so the error stays one line. After the command
    changed something (``done``), a failure is a warning followed by what it did, and
    exit 1 becomes 0: 1 says nothing changed. ``command``: the command's name where no
    command ran yet (a usage error).
    """
    if not isinstance(error, Reason):
        error = Reason.of(ERROR_CODES.get(code, Code.INTERRUPTED), text=error)
    message = render.printable(say(error))
    changed = done is not None and done.changed
    if changed and code == exits.FAILURE:
        code = exits.OK
    with signals.swallowed():  # the error is the last word: no second signal cuts it
        if as_json and not changed:
            document = {"ok": False, "error": render.message(error) | {"message": message}}
            try:
                name = command or _command(done)
                render.emit_json(name, document | {"exit_code": code})
            except render.ReportLost:
                silence_stdout()
        render.warn(f"patchkit: {'warning' if code == exits.OK else 'error'}: {message}")
        if changed:
            render.warn(f"patchkit: what `patchkit {done.command}` did stands:")
            for line in done.lines:
                render.warn(f"patchkit:   {render.printable(line)}")
    sys.exit(code)


def _command(done: Outcome | None) -> str:
    """The failing command's name as typed, for its error document."""
    if done is not None:
        return done.command
    ctx = click.get_current_context(silent=True)
    return command_name(ctx) if ctx is not None else "patchkit"


def report_lost(done: Outcome, cause: OSError, as_json: bool) -> None:
    """stdout could not take the report: say so on stderr; exit 0 if the command changed
    anything (its work stands), else 1."""
    silence_stdout()
    why = {
        errno.EPIPE: "broken pipe: its reader left",
        errno.ENOSPC: "no space left on the device",
    }.get(cause.errno, (cause.strerror or str(cause)).lower())
    if done.changed:
        fail(f"stdout could not take the report ({why})", exits.FAILURE, as_json, done)
    fail(
        f"stdout could not take the report of `patchkit {done.command}` ({why}); "
        "nothing was changed",
        exits.FAILURE,
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
# Ctrl-C and SIGTERM held (patchkit.signals), so a write step is never split.
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
        except PatchkitError as exc:  # a refusal or an error: its kind's code and facts
            fail(exc.reason, exc.exit_code, as_json, done)
        except OSError as exc:
            shorter = "--dest path" if command == "fetch" else "--target path"
            fail(OsFailure(exc, "accessing", too_long=shorter).reason, exits.FAILURE, as_json, done)
        except (click.ClickException, click.exceptions.Exit):
            raise  # usage errors: PatchkitGroup prints them, exit 2
        except KeyboardInterrupt:
            fail(interrupted_message(command), exits.INTERRUPTED, as_json, done)
        except signals.Terminated as exc:
            fail(f"{exc} received; {interrupted_message(command)}", exc.exit_code, as_json, done)
        except Exception as exc:
            bug(exc, as_json, done)

    return wrapper


def bug(exc: Exception, as_json: bool, done: Outcome) -> None:
    """An exception patchkit did not expect: one line and exit 3; the traceback on request."""
    if os.environ.get(exits.DEBUG_ENV) == "1":
        traceback.print_exc()
    detail = str(exc).splitlines()[0] if str(exc) else ""
    fail(
        f"internal error {type(exc).__name__}: {detail} (a bug in patchkit; rerun with "
        f"{exits.DEBUG_ENV}=1 for the traceback and report it)",
        exits.BUG,
        as_json,
        done,
    )


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
