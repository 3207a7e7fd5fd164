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


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_rule_plans_seeds_run_one_at_a_time_then_the_dense_cut(tmp_path):
    """GS_SEEDS: the healthy adapter at each seed, each alone (VMP_ONE_AT_A_TIME) in a
    folder of its own reading the one stand-in, its prompts as long as GS_RULE_LEN says;
    GS_RULE_DENSE: the 27B-wide cut built
    and verified after them on the same GPU."""
    gs = tmp_path / "gs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GS_", "VMP_"))}
    env.update(GS_PLAN="rule", GS_SEEDS="2 3", GS_RULE_DENSE="1", GS_RULE_LEN="16400",
               GS_DIR=str(gs))  # fmt: skip
    done = subprocess.run(["bash", "scripts/proofs/gpu_session.sh", "dry"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    for seed in ("2", "3"):
        run = (gs / f"rule-s{seed}.txt").read_text()
        assert f"VMP_SEED={seed} VMP_ONE_AT_A_TIME=1" in run
        assert f"verify_moe_proof.sh {gs}/rule-s{seed} 900 16400" in run
    assert "--preset wide27b" in (gs / "build.log").read_text() + done.stdout
    dense = (gs / "model-tp1.txt").read_text()
    assert f"--model {gs}/wide/model" in dense and "CUDA_VISIBLE_DEVICES=0" in dense
    assert not (gs / "rule.txt").exists()  # the seeds instead of healthy and engine-bug
