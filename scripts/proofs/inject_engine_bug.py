"""Put a bug into a copy of vLLM's LoRA code: the run that `verify` must say FAILED on.

  python scripts/proofs/inject_engine_bug.py SITE [--undo]

SITE holds vllm/ (a hard-linked copy of the site that serves, as the GPU sittings make
/opt/site's copies). The bug is an off-by-one in the packed LoRA layers' set_lora
(vllm/lora/layers/column_parallel_linear.py, MergedColumnParallelLinearWithLoRA): the
loop that copies each slice's lora_A and lora_B into the slot stops one slice short, so
the last slice of every packed module serves no LoRA (the shared expert's up_proj, the
Gated DeltaNet's in_proj_z, ...). It is of none of the kinds verify's controls make
(patchkit.verify.adaptercontrols, patchkit.verify.enginefaults): the rule was not tuned
on it. The file is rewritten as a file of its own first (a hard link would carry the
bug into the tree it was linked from) and its bytecode removed; --undo writes the line
back. One line, exit 1, nothing written, where the line is not there exactly once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FILE = "vllm/lora/layers/column_parallel_linear.py"
GOOD = (
    "        for i in range(self.n_slices):\n            if (lora_a_i := lora_a[i]) is not None:\n"
)
BAD = GOOD.replace("range(self.n_slices)", "range(self.n_slices - 1)")


def swap(site: Path, old: str, new: str) -> str:
    path = site / FILE
    text = path.read_text()
    if text.count(old) != 1:
        return f"{path}: the set_lora slice loop is not there exactly once; nothing written"
    path.unlink()  # a file of its own: the hard link keeps the original as it was
    path.write_text(text.replace(old, new))
    for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        cached.unlink()
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("--undo", action="store_true")
    args = parser.parse_args(argv)
    old, new = (BAD, GOOD) if args.undo else (GOOD, BAD)
    error = swap(args.site, old, new)
    if error:
        print(f"inject_engine_bug: {error}", file=sys.stderr)
        return 1
    print(f"inject_engine_bug: {'removed from' if args.undo else 'put into'} {args.site / FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
