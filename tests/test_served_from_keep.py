"""scripts/proofs/served_from_keep.py: served.json again from a --keep run's engine files."""

from __future__ import annotations

import json
import lzma
import subprocess
import sys

from tests.conftest import REPO

SCRIPT = "scripts/proofs/served_from_keep.py"


def test_each_job_with_its_answers_and_a_missing_one_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name, answers in {"eager": {"runs": {"base": {}}}, "peft": {"runs": {}}}.items():
        (model / f"vllm-{name}.job.json").write_text("{}")
        (model / f"vllm-{name}.json").write_text(json.dumps(answers))
    (model / "vllm-eager.log").write_text("not a job")
    out = tmp_path / "served.json.xz"
    done = subprocess.run([sys.executable, SCRIPT, str(model), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    with lzma.open(out, "rt") as handle:
        assert json.load(handle) == {"eager": {"runs": {"base": {}}}, "peft": {"runs": {}}}
    (model / "vllm-cudagraph.job.json").write_text("{}")  # an engine that wrote nothing
    again = tmp_path / "again.json.xz"
    done = subprocess.run([sys.executable, SCRIPT, str(model), str(again)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1 and "vllm-cudagraph.json: missing" in done.stderr
    assert not again.exists()
