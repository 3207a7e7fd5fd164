"""The excess of every answer of a recorded `verify` run against transformers + PEFT.

  python scripts/verify_rule_excess.py SERVED [SERVED ...] [--json OUT]

SERVED is a served.json (as `verify --keep DIR` leaves it, or tests/data's recordings,
.gz or .xz). For each LoRA engine (a key whose result has runs with a "base" label),
each adapter PEFT answered for (its "lora:NAME" under the PEFT entry: "peft" or
"PREFIX-peft") and each label the engine served for that adapter (the adapter itself,
its controls "control:NAME+KIND", and "base": the adapter not applied), per prompt: the
median |answer - PEFT LoRA| in units of the median |vLLM base - PEFT base| of the same
engine and prompt (patchkit.verify.rule's excess), the verdict the rule gives that
number alone, and the worst token. This is the table behind rule.py's PASS_EXCESS and
FAIL_EXCESS and the false-FAILED count of the healthy runs (docs/evidence.md).
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import sys
from pathlib import Path

from patchkit.verify.toolkit import FAIL_EXCESS, PASS_EXCESS, excess, median_distance


def load(path: Path) -> dict:
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix, open)
    with opener(path, "rt") as handle:
        return json.load(handle)


def rows(served: dict, source: str) -> list[dict]:
    """One row per engine, adapter, label and prompt."""
    out = []
    for peft_key in [k for k in served if k == "peft" or k.endswith("-peft")]:
        prefix = peft_key[: -len("peft")]
        theirs = (served[peft_key] or {}).get("runs") or {}
        for engine, result in served.items():
            runs = (result or {}).get("runs") or {}
            if not engine.startswith(prefix) or engine == peft_key or "base" not in runs:
                continue
            if not any(label.startswith("lora:") for label in runs):
                continue
            for adapter in [k[5:] for k in theirs if k.startswith("lora:")]:
                labels = [f"lora:{adapter}", "base"]
                labels += [k for k in runs if k.startswith(f"control:{adapter}+")]
                out += _rows_of(source, engine, adapter, labels, runs, theirs)
    return out


def _rows_of(source, engine, adapter, labels, runs, theirs) -> list[dict]:
    out = []
    for prompt, wanted in theirs[f"lora:{adapter}"].items():
        base = (runs.get("base") or {}).get(prompt)
        if not isinstance(base, dict) or not isinstance(wanted, dict):
            continue
        noise = median_distance(base["prompt_logprobs"], theirs["base"][prompt]["prompt_logprobs"])
        for label in labels:
            answer = (runs.get(label) or {}).get(prompt)
            if not isinstance(answer, dict):
                continue
            found = excess(answer["prompt_logprobs"], wanted["prompt_logprobs"], noise)
            verdict = (
                "PASSED"
                if found.ratio <= PASS_EXCESS
                else "FAILED"
                if found.ratio >= FAIL_EXCESS
                else "band"
            )
            out.append({"source": source, "engine": engine, "adapter": adapter,
                        "label": label, "prompt": prompt, "excess": round(found.ratio, 3),
                        "median": round(found.distance, 4), "noise": round(noise, 4),
                        "worst": round(found.worst, 3), "by_excess": verdict})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("served", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args(argv)
    found = [row for path in args.served for row in rows(load(path), path.name)]
    print(f"excess: PASSED <= {PASS_EXCESS}x, FAILED >= {FAIL_EXCESS}x")
    keys = ("source", "engine", "adapter", "label", "prompt", "excess", "median", "noise",
            "worst", "by_excess")  # fmt: skip
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in found:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    healthy = [r for r in found if r["label"] == f"lora:{r['adapter']}"]
    failed = [r for r in healthy if r["by_excess"] == "FAILED"]
    print(
        f"adapters' own answers: {len(healthy)} samples, {len(failed)} at or past the failure line"
    )
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
