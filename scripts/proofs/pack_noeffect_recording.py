"""Pack the archive of canary_noeffect_gpu.py into the fixture the CPU tests replay.

  python scripts/proofs/pack_noeffect_recording.py canary-noeffect.tar.gz \\
      tests/data/canary-noeffect-0.26.0.json.xz

Keeps, as one xz-compressed JSON document: every recorded HTTP exchange by
group (setup, refusal, sequential, concurrent, prompt-logprobs, and the
canary's own --record), the canary runs' output and exit codes, each
adapter's adapter_config.json and safetensors header (no weights), the
adapter check outputs, the server log's lines about LoRA at WARNING and
above, and summary.json. The server log itself and the build stay out.
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
import tarfile
from pathlib import PurePosixPath

GROUPS = ("setup", "refusal", "sequential", "concurrent", "prompt-logprobs")


def pack(archive: str) -> dict:
    """The fixture's document from the archive's members (read, never extracted)."""
    data: dict = {"exchanges": {g: [] for g in (*GROUPS, "canary")}, "canary": {}}
    data |= {"adapters": {}, "adapter_check": {}, "server_warnings": [], "summary": None}
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if not member.isfile():
                continue
            parts = PurePosixPath(member.name).parts[1:]  # below noeffect/
            text = tar.extractfile(member).read().decode()
            file_into(data, parts, text)
    return data


def file_into(data: dict, parts: tuple[str, ...], text: str) -> None:
    if parts[:1] == ("exchanges",) and len(parts) == 3 and parts[1] in GROUPS:
        data["exchanges"][parts[1]].append(json.loads(text))
    elif parts[:2] == ("canary", "exchanges") and len(parts) == 3:
        data["exchanges"]["canary"].append(json.loads(text))
    elif parts[:1] == ("canary",) and len(parts) == 2:
        data["canary"][parts[1]] = text
    elif parts[:1] == ("adapters",) and len(parts) == 3:
        data["adapters"].setdefault(parts[1], {})[parts[2]] = json.loads(text)
    elif parts[:1] == ("adapter-check",) and len(parts) == 2:
        data["adapter_check"][parts[1]] = text
    elif parts == ("server-warnings.txt",):
        data["server_warnings"] = text.splitlines()
    elif parts == ("summary.json",):
        data["summary"] = json.loads(text)
    elif parts == ("model-config.json",):
        data["model_config"] = json.loads(text)
    elif parts == ("server-command.json",):
        data["server_command"] = json.loads(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archive", help="canary-noeffect.tar.gz from the GPU run")
    parser.add_argument("dest", help="the fixture to write (.json.xz)")
    args = parser.parse_args(argv)
    data = pack(args.archive)
    if not data["exchanges"]["sequential"] or data["summary"] is None:
        print(f"{args.archive}: no sequential exchanges or no summary.json", file=sys.stderr)
        return 1
    with lzma.open(args.dest, "wt", preset=9) as handle:
        json.dump(data, handle, separators=(",", ":"))
    counts = {group: len(items) for group, items in data["exchanges"].items()}
    print(f"{args.dest}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
