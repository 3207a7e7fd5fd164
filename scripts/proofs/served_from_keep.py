"""served.json of a `verify --model --keep DIR` run, put together from DIR/model's files.

verify writes each engine's answers to DIR/model/vllm-NAME.json (NAME from its
vllm-NAME.job.json; the PEFT reference is the job "peft") and then all of them, as
{NAME: answers}, to DIR/model/served.json. A sitting's archive may leave served.json
out by size (gpu_session.sh packs files under 3 MB): this makes it again from the
engines' files, for tests/data (xz).

    python3 scripts/proofs/served_from_keep.py DIR/model OUT.json.xz

tests/test_verify_engine_recordings.py shows the result is what verify judged: every
row of the run's report is rebuilt from it.
"""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path


def served(model: Path) -> dict:
    """{engine name: its answers}, in name order; one line and exit 1 where one is missing."""
    out = {}
    for job in sorted(model.glob("vllm-*.job.json")):
        name = job.name[len("vllm-") : -len(".job.json")]
        answers = model / f"vllm-{name}.json"
        if not answers.is_file():
            sys.exit(f"{answers}: missing (the engine {name} wrote no answers)")
        out[name] = json.loads(answers.read_text())
    if not out:
        sys.exit(f"{model}: no vllm-*.job.json here (not a --keep DIR/model)")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: served_from_keep.py DIR/model OUT.json.xz", file=sys.stderr)
        return 2
    found = served(Path(argv[0]))
    with lzma.open(argv[1], "wt", preset=9 | lzma.PRESET_EXTREME) as handle:
        json.dump(found, handle)
    print(f"{argv[1]}: {', '.join(found)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
