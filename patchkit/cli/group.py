"""The `patchkit` group's own endings: before any command runs, or when click refuses one.

A command's own failures are :func:`patchkit.cli.outcome.user_errors`'s; this
class handles what comes before it: a stdout closed at start, a usage error
(with ``--json``, the JSON error object too), Ctrl-C, SIGTERM or SIGHUP while
click still parses.

A usage error is one line, ``patchkit: error: ...`` as every other error, not
click's three (``Usage:``, ``Try ... --help``, ``Error:``): exit 2 promises one
line. Only a group called without a command still prints its help (and exits 2).
"""

from __future__ import annotations

import sys

import click

from patchkit import signals
from patchkit.cli import exits, render
from patchkit.cli.outcome import command_name, fail, standard_streams
from patchkit.forks import forkmode


class PatchkitGroup(click.Group):
    """A click group whose usage errors honour --json and whose Ctrl-C exits 130."""

    def main(self, args=None, prog_name=None, **extra):
        args = list(sys.argv[1:] if args is None else args)
        if not standard_streams():
            render.warn(
                "patchkit: error: stdout is closed, so patchkit could not report what it does; "
                "nothing was done (send it to a file, a pipe or /dev/null instead)"
            )
            sys.exit(exits.FAILURE)
        signals.install()
        forkmode.forget_other_repositories()
        try:
            extra.pop("standalone_mode", None)
            result = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()  # `patchkit` alone (or `patchkit probe`): the help, as asked for
            sys.exit(exits.USAGE)
        except click.UsageError as exc:
            named = command_name(exc.ctx) if exc.ctx is not None else "patchkit"
            fail(exc.format_message(), exits.USAGE, "--json" in args, command=named)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code, "--json" in args, command="patchkit")
        except (click.Abort, KeyboardInterrupt):
            render.warn("patchkit: error: interrupted; nothing was done")
            sys.exit(exits.INTERRUPTED)
        except signals.Terminated as exc:
            render.warn(f"patchkit: error: {exc} received; nothing was done")
            sys.exit(exc.exit_code)
        sys.exit(result if isinstance(result, int) else exits.OK)
