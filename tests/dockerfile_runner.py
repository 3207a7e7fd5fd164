"""Run a Dockerfile stage's RUN lines against an image-like directory, without Docker.

The development and CI machines have no Docker engine. This reads the
Dockerfile (continuations, ARG, ENV, COPY, RUN, stages), performs each COPY
from the build context into ``image_root``, and runs each RUN line with
``/bin/sh -c`` as Docker does, with absolute paths of the image rewritten
under ``image_root`` and a PATH that holds only the image's Python and a few
shell tools (no GNU patch, no git), like the vLLM image.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_DIRS = ("/opt/", "/etc/")  # image paths the Dockerfile writes to
SHELL_TOOLS = ("mkdir", "cat", "rm", "ls", "sh")


@dataclass
class Stage:
    name: str | None
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse(dockerfile: Path) -> list[Stage]:
    """Stages with their (INSTRUCTION, arguments) in order; continuations joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    stages: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            words = args.split()
            name = words[2] if len(words) > 2 and words[1].upper() == "AS" else None
            stages.append(Stage(name, words[0]))
        elif stages:
            stages[-1].instructions.append((instruction, args.strip()))
    return stages


def stage(stages: list[Stage], name: str) -> Stage:
    return next(s for s in stages if s.name == name)


@dataclass
class ImageRunner:
    """Executes a stage against ``image_root`` with ``python_bin`` as the image's Python."""

    context: Path
    image_root: Path
    python_bin: Path  # the bin/ dir of the venv standing in for the image's Python
    env: dict[str, str] = field(default_factory=dict)

    def image_path(self, path: str) -> str:
        for prefix in IMAGE_DIRS:
            if path.startswith(prefix):
                return str(self.image_root / path.lstrip("/"))
        return path

    def rewrite(self, command: str) -> str:
        pattern = "|".join(re.escape(p) for p in IMAGE_DIRS)
        return re.sub(
            rf"(?<![\w/])({pattern})", lambda m: f"{self.image_root}{m.group(1)}", command
        )

    def tools_dir(self) -> Path:
        tools = self.image_root / "tools-bin"
        if not tools.exists():
            tools.mkdir(parents=True)
            for tool in SHELL_TOOLS:
                os.symlink(shutil.which(tool), tools / tool)
        return tools

    def copy(self, args: str) -> None:
        """Docker's COPY: a directory's contents go to dest; files into dest/ or as dest."""
        *sources, dest = shlex.split(args)
        target = Path(self.image_path(dest))
        into_dir = dest.endswith("/") or len(sources) > 1
        for source in sources:
            src = self.context / source
            if src.is_dir():
                ignore = shutil.ignore_patterns("__pycache__")
                shutil.copytree(src, target, dirs_exist_ok=True, ignore=ignore)
            else:
                out = target / src.name if into_dir else target
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out)

    def set_env(self, args: str) -> None:
        for pair in shlex.split(args):
            key, _, value = pair.partition("=")
            self.env[key] = value

    def run(self, command: str) -> subprocess.CompletedProcess:
        env = {
            **self.env,
            "PATH": f"{self.python_bin}:{self.tools_dir()}",
            "HOME": str(self.image_root / "root"),
        }
        return subprocess.run(
            ["/bin/sh", "-c", self.rewrite(command)], env=env, capture_output=True, text=True
        )

    def build(self, stage_: Stage, only: str | None = None) -> list[subprocess.CompletedProcess]:
        """Perform the stage; stop at the first failing RUN (as docker build does).

        ``only="RUN"`` repeats just the RUN lines (a rebuild over the same layers).
        """
        results = []
        for instruction, args in stage_.instructions:
            if only and instruction != only:
                continue
            if instruction == "COPY":
                self.copy(args)
            elif instruction == "ENV":
                self.set_env(args)
            elif instruction == "RUN":
                result = self.run(args)
                results.append(result)
                if result.returncode != 0:
                    break
        return results
