"""What the catalogue says an image of one vLLM release must show after the build.

The expectations come from patches/ (each patch's variant or decision for the
release), not from running patchkit: the image's own `patchkit apply`, which
decides by the tree's content, is what is checked against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from packaging.version import Version

from patchkit.catalogue.load import load_catalogue
from patchkit.catalogue.model import Decision, Variant


@dataclass
class Expected:
    states: dict[str, str] = field(default_factory=dict)  # patch id -> state after `apply`
    files: set[str] = field(default_factory=set)  # vllm/... the applied variants change or add
    drift: tuple[str, str] | None = None  # (vllm/... path, a line the first applied one removes)


def expected(release: str) -> Expected:
    """Each patch's state after a plain apply on ``release``, the files the applied ones
    change or create, and a line to edit for a drifted base."""
    out = Expected()
    for patch in load_catalogue().patches:
        entry = patch.expected_for(Version(release))
        if isinstance(entry, Decision):
            out.states[patch.id] = entry.state
        elif patch.opt_in:
            out.states[patch.id] = "opt-in"
        elif isinstance(entry, Variant):
            out.states[patch.id] = "applied"
            out.files.update(entry.paths)
            out.drift = out.drift or removed_line(entry)
    return out


def removed_line(variant: Variant) -> tuple[str, str] | None:
    """The first non-blank line a variant's hunks remove: changed by hand in the base, the
    hunk no longer matches and the file is neither pristine nor patched."""
    for file_patch in variant.files:
        for hunk in file_patch.hunks:
            kept = {old for old, _ in hunk.context}
            lines = [line for i, line in enumerate(hunk.old) if i not in kept and line.strip()]
            if lines:
                return file_patch.path, lines[0]
    return None


def newest_tested() -> str:
    return load_catalogue().newest_tested
