"""patchkit's exit statuses, written once: the CLI exits with these names, `patchkit --help`
shows :data:`TABLE` as its epilog, and the README's "Exit codes" table must say the same
(tests/test_exit_codes.py reads both and runs each code's path).

Imports nothing: the console script (:mod:`patchkit.cli.entry`) reads it before click.
"""

OK = 0
FAILURE = 1
USAGE = 2
BUG = 3
INCONCLUSIVE = 4
HANGUP = 129  # 128 + SIGHUP
INTERRUPTED = 130  # 128 + SIGINT
TERMINATED = 143  # 128 + SIGTERM

DEBUG_ENV = "PATCHKIT_DEBUG"

# (code, meaning): one line each, as `patchkit --help` prints it and the README's table begins
TABLE = (
    (OK, "done, or nothing to do"),
    (FAILURE, "nothing changed: a refusal, a failed check or a finding"),
    (USAGE, "usage error: no command given, a bad option or argument; nothing was done"),
    (BUG, f"a bug in patchkit: one line; {DEBUG_ENV}=1 shows the traceback"),
    (INCONCLUSIVE, "verify: inconclusive, an adapter its reference could not decide"),
    (HANGUP, "interrupted by SIGHUP"),
    (INTERRUPTED, "interrupted by Ctrl-C (SIGINT)"),
    (TERMINATED, "interrupted by SIGTERM"),
)

EPILOG_TITLE = "Exit status:"


def epilog() -> str:
    """The table for click's epilog; ``\\b`` keeps click from rewrapping its lines."""
    rows = "\n".join(f"{code:<5}{meaning}" for code, meaning in TABLE)
    return f"{EPILOG_TITLE}\n\n\b\n{rows}"
