#!/usr/bin/env python3
"""Know the week a vLLM release ships: what the index has that the catalogue has not tested,
and what `patchkit status` decides on each such release's pristine tree.

    python scripts/release_watch.py [--pre] [--json]

Lists the vLLM releases on the package index (the one pip is configured with, as
`patchkit fetch` reads it: pip.conf, PIP_* variables, netrc; find-links too) that
are newer than the newest release in `tested_releases` (patches/series.toml),
skipping pre-releases (and .dev ones) unless --pre, and releases whose every
wheel is yanked. Only wheels fetch could take count (CPython 3.12 on x86_64
Linux). Each is fetched with patchkit's own fetch into patchkit's cache
($PATCHKIT_CACHE_DIR, else ~/.cache/patchkit: trees/vllm-VERSION; nothing is
written anywhere else) and assessed by content exactly as `patchkit status
--target TREE --json` assesses it (the library's status, rendered by the same
run_json): one block per release with each patch's state and reason, the
release's warnings and known issues, and one summary line that counts whatever
states status gave. The text output ends with what the maintainer does next
(CONTRIBUTING.md, "A new vLLM release").

Exit 0 when nothing is newer ("the catalogue covers every release on the index
up to X") and when it printed releases; 1 with one line on stderr (and
{"ok": false, ...} with --json) when the index cannot be read, has no vLLM
wheel, or a fetched tree is not pristine; 2 for a bad option; 3 for a bug
(PATCHKIT_DEBUG=1 shows the traceback); 130/143/129 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from packaging.version import Version  # noqa: E402

from patchkit import signals  # noqa: E402
from patchkit.catalogue.load import load_catalogue  # noqa: E402
from patchkit.cli import exits, render  # noqa: E402
from patchkit.cli.commands import patching  # noqa: E402
from patchkit.errors import PatchkitError, os_error_line  # noqa: E402
from patchkit.patching import operations  # noqa: E402
from patchkit.releases.fetch import fetch  # noqa: E402
from patchkit.releases.index import wheels, where  # noqa: E402
from patchkit.releases.pipconfig import pip_settings  # noqa: E402
from patchkit.releases.transport import FetchError, Transport  # noqa: E402
from patchkit.vllmtree.tree import locate  # noqa: E402
from patchkit.vocabulary import PatchState  # noqa: E402

NAME = "release_watch"
STATE_ORDER = [str(s) for s in PatchState]  # a state status gives that is not here goes last
NEXT = (
    'next (CONTRIBUTING.md, "A new vLLM release"), for {version}: its pristine tree is '
    'P={tree}; work on a copy (cp -a "$P" /tmp/vllm-{version}-work); add "{version}" to '
    "tested_releases in patches/series.toml and widen the versions of each entry status "
    "matched above; read each needed patch's remove_when against {version}'s code; any state "
    "but needed, upstream, not-applicable and opt-in gets a new variant (patchkit refresh ID "
    '--variant NEW --pristine "$P") or an upstream decision with its evidence; then pytest -k '
    "{version}, the whole suite, and the README's ranges."
)


class Usage(argparse.ArgumentParser):
    """A bad option is one line and exit 2, like patchkit's own commands."""

    def error(self, message: str) -> None:  # argparse's hook
        sys.stderr.write(f"{NAME}: error: {message} (--help lists the options)\n")
        raise SystemExit(exits.USAGE)


def newer_releases(newest_tested: Version, pre: bool, settings, transport):
    """(the releases newer than ``newest_tested``, the newest release the index has), each
    release a Version without its local label; yanked-only and (without ``pre``)
    pre-releases left out."""
    links = wheels(settings, transport)
    if not links:
        raise FetchError(f"no wheel of vllm for CPython 3.12 on x86_64 Linux at {where(settings)}")
    found = {Version(link.version.public) for link in links if link.version and not link.yanked}
    found = {v for v in found if pre or not v.is_prerelease}
    newer = sorted(v for v in found if v > newest_tested)
    return newer, max(found, default=None)


def assess(version: Version, catalogue, progress: bool) -> dict:
    """The release's pristine tree from patchkit's cache (fetched there if missing) and what
    status decides on it, as `patchkit status --target TREE --json` prints it."""
    path = fetch(str(version), progress=progress)
    if (path / ".patchkit").exists():
        raise PatchkitError(
            f"{path} has patchkit changes applied, so status would not judge the "
            f"release's own files; `patchkit revert --target {path}` undoes them"
        )
    report = operations.status(locate(str(path)), catalogue)
    status = render.document("status", patching.run_json(report))
    return {
        "version": str(version),
        "tree": str(path),
        "states": counted_states(p["state"] for p in status["patches"]),
        "status": status,
    }


def counted_states(states) -> dict[str, int]:
    """How many patches are in each state, in the vocabulary's order; any other state
    status gives (one added after this script) after those, in the order first seen."""
    counts = Counter(states)
    order = {state: n for n, state in enumerate(STATE_ORDER)}
    return dict(sorted(counts.items(), key=lambda kv: order.get(kv[0], len(order))))


def states_line(states: dict[str, int]) -> str:
    return ", ".join(f"{n} {state}" for state, n in states.items())


def summary(blocks: list[dict], newest_tested: str, newest_on_index) -> str:
    if not blocks:
        up_to = newest_on_index if newest_on_index is not None else newest_tested
        return f"{NAME}: the catalogue covers every release on the index up to {up_to}"
    releases = "; ".join(f"{b['version']}: {states_line(b['states'])}" for b in blocks)
    many = render.counted(len(blocks), "release")
    return f"{NAME}: {many} newer than {newest_tested}, the newest tested: {releases}"


def print_block(block: dict) -> None:
    status = block["status"]
    render.out(f"vLLM {block['version']} at {block['tree']} (not in tested_releases)")
    patches = status["patches"]
    width = max((len(p["id"]) for p in patches), default=0)
    column = max([15, *(len(p["state"]) for p in patches)])
    for p in patches:
        reason = p["reason"]["message"] if p["reason"] else ""
        detail = reason or (f"variant {p['variant']}" if p["variant"] else "")
        for line in render.wrap(f"  {p['id']:<{width}}  {p['state']:<{column}}  ", detail):
            render.out(render.printable(line))
        for notice in p["notices"]:
            for line in render.wrap("      known issue: ", notice["message"], render.INDENT):
                render.out(render.printable(line))
    for warning in status["warnings"]:
        for line in render.wrap("  warning: ", warning["message"], 4):
            render.out(render.printable(line))
    render.out(f"  {block['version']}: {states_line(block['states'])}")


def watch(pre: bool, as_json: bool) -> None:
    catalogue = load_catalogue()
    newest_tested = catalogue.newest_tested
    settings = pip_settings()
    transport = Transport(settings)
    newer, newest_on_index = newer_releases(Version(newest_tested), pre, settings, transport)
    progress = not as_json and sys.stderr.isatty()
    blocks = [assess(version, catalogue, progress) for version in newer]
    line = summary(blocks, newest_tested, newest_on_index)
    if as_json:
        emit(
            {
                "ok": True,
                "index": where(settings),
                "newest_tested": newest_tested,
                "newest_on_index": None if newest_on_index is None else str(newest_on_index),
                "pre": pre,
                "releases": blocks,
                "summary": line,
            }
        )
        return
    for block in blocks:
        print_block(block)
    render.out(line)
    for block in blocks:
        for text in render.wrap("", NEXT.format(version=block["version"], tree=block["tree"]), 4):
            render.out(render.printable(text))


def emit(data: dict) -> None:
    """This script's JSON (its own shape, for a cron job; each release's ``status`` is
    `patchkit status --json`'s body, docs/json.md)."""
    render.out_lines(json.dumps(data, indent=2))


def fail(message: str, code: int, as_json: bool) -> None:
    message = render.printable(" ".join(message.split()))
    with signals.swallowed():
        if as_json:
            try:
                emit({"ok": False, "error": message, "exit_code": code})
            except render.ReportLost:
                pass
        render.warn(f"{NAME}: error: {message}")
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    parser = Usage(prog="release_watch.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pre", action="store_true", help="count pre-releases too")
    parser.add_argument("--json", dest="as_json", action="store_true", help="JSON on stdout")
    args = parser.parse_args(argv)
    try:
        watch(args.pre, args.as_json)
    except render.ReportLost as exc:
        fail(f"stdout could not take the report ({exc}); nothing was changed", 1, False)
    except PatchkitError as exc:
        fail(str(exc), getattr(exc, "exit_code", exits.FAILURE), args.as_json)
    except OSError as exc:
        fail(os_error_line(exc, "accessing", "PATCHKIT_CACHE_DIR"), exits.FAILURE, args.as_json)
    except KeyboardInterrupt:
        fail("interrupted; a fetch left nothing half done", exits.INTERRUPTED, args.as_json)
    except signals.Terminated as exc:
        fail(f"{exc} received; a fetch left nothing half done", exc.exit_code, args.as_json)
    except Exception as exc:  # a bug: one line, the traceback on request
        if os.environ.get(exits.DEBUG_ENV) == "1":
            traceback.print_exc()
        first = str(exc).splitlines()[0] if str(exc) else ""
        fail(f"internal error {type(exc).__name__}: {first} (a bug)", exits.BUG, args.as_json)


if __name__ == "__main__":
    signals.install()  # SIGTERM and SIGHUP end it at a safe point, as they end patchkit
    main()
