"""The README's synopsis and `--help` agree: every command, every option.

A new user reads the synopsis first; it lacked --branch and --allow-dirty
once. Each line of the block under "## Commands" must name exactly the
options its command has (-h/--help aside), and every command must have a line.
"""

from __future__ import annotations

import re

import click

from patchkit.cli.main import main
from tests.conftest import REPO


def synopsis() -> dict[str, set[str]]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Commands", 1)[1].split("```", 2)[1]
    found: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        match = re.match(r"patchkit (\w+)", line)
        if match:
            command = match.group(1)
            found[command] = set()
        if command:
            found[command] |= set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", line))
    return found


def options(command: click.Command) -> set[str]:
    """A command's options; a group's (`probe report`) are its subcommands'."""
    if isinstance(command, click.Group):
        return set().union(*(options(c) for c in command.commands.values()))
    names = {opt for param in command.params for opt in getattr(param, "opts", [])}
    names |= {opt for param in command.params for opt in getattr(param, "secondary_opts", [])}
    return {n for n in names if n.startswith("-")} - {"-h", "--help"}


def test_every_command_is_in_the_synopsis_with_exactly_its_options():
    written = synopsis()
    assert set(written) == set(main.commands), set(written) ^ set(main.commands)
    for name, command in main.commands.items():
        assert written[name] == options(command), (name, written[name] ^ options(command))


def metavars() -> dict[tuple[str, str], str]:
    """(command, option) -> the metavar the synopsis writes after it (`--keep DIR`)."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Commands", 1)[1].split("```", 2)[1]
    found, command = {}, None
    for line in block.splitlines():
        match = re.match(r"patchkit (\w+)", line)
        if match:
            command = match.group(1)
        for option, metavar in re.findall(r"(--[a-z][a-z0-9-]*) ([A-Z][A-Z=]*)\b", line):
            found[(command, option)] = metavar
    return found


def test_help_names_each_options_value_as_the_synopsis_does():
    """`--help` said `--seed INTEGER`, `--keep DIRECTORY`, `--url TEXT`, `--timeout FLOAT
    RANGE` where the synopsis says N, DIR, URL, S."""
    ctx = click.Context(main)
    for (name, option), metavar in metavars().items():
        command = main.commands[name]
        commands = command.commands.values() if isinstance(command, click.Group) else [command]
        for one in commands:
            for param in one.params:
                if option in getattr(param, "opts", []):
                    shown = param.make_metavar(click.Context(one, parent=ctx))
                    assert shown == metavar, (name, option, shown, metavar)
