"""The command line: the `patchkit` group and its commands.

Each command lives in :mod:`patchkit.cli.commands`; how a command ends
(exit status, its last line, a report stdout cannot take) is
:mod:`patchkit.cli.outcome`'s; the exit statuses are :mod:`patchkit.cli.exits`'s
table, which `patchkit --help` ends with.
"""

from __future__ import annotations

import click

from patchkit.cli import exits
from patchkit.cli.commands import (
    adapter,
    canary,
    catalogue,
    doctor,
    fetch,
    patching,
    probe,
    refresh,
    verify,
)
from patchkit.cli.group import PatchkitGroup

# pyproject's name: the index's `patchkit` is another project (tests/test_advice.py checks)
DISTRIBUTION = "patchkit-vllm"


@click.group(
    cls=PatchkitGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=exits.epilog(),
)
@click.version_option(package_name=DISTRIBUTION)
def main() -> None:
    """Repair installed vLLM trees with versioned, verified, reversible patches."""


for command in (
    catalogue.list_patches,
    catalogue.show_patch,
    patching.status,
    patching.apply,
    patching.revert,
    refresh.refresh_command,
    fetch.fetch_command,
    verify.verify_command,
    doctor.doctor_command,
    canary.canary_command,
    probe.probe,
    adapter.adapter,
):
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    main()
