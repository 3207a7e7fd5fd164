"""scripts/proofs/gpu_session.sh's serving plan, as its dry run prints it (no GPU)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO

MORE = re.compile(r"bench_serving\.py more \S+ --rounds (\d+) --deadline (\d+)")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_deadlines_alone_end_a_serving_sittings_rounds(tmp_path):
    """`more --rounds N` is the last round's number across a run's steps, not a count
    for the step: a cap under the seconds a step may take (a round takes more than a
    second) ends its rounds before their deadline, as 2026-12-03c's prefill rounds
    ended at round 99, 270 s early."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GS_")}
    env.update(GS_PLAN="serving", GS_SETS="m2=moe35b@24:2x128", GS_BENCH_END="1400",
               GS_RELOAD_S="60", GS_B64_S="600", GS_DIR=str(tmp_path / "gs"))  # fmt: skip
    done = subprocess.run(["bash", "scripts/proofs/gpu_session.sh", "dry"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [MORE.search(line) for log in (tmp_path / "gs").glob("serving-*.log")
             for line in log.read_text().splitlines()]  # fmt: skip
    steps = [(int(m[1]), int(m[2])) for m in steps if m]
    assert len(steps) == 3, steps  # batch 1 and 4, batch 64 and prefill, reloads
    for last_round, deadline in steps:
        assert last_round >= deadline, f"--rounds {last_round} caps a {deadline}-s step"
