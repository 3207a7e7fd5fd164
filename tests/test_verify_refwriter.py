"""The merged references written beside the first engines (patchkit.verify.refwriter):
a reference engine starts only on a complete checkpoint, a failed writing stops the run
as it did before any engine started, and a run that ends early leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the merged references need torch (the test extra)")
from patchkit.verify import mergeplan, mergewrite, references, serving  # noqa: E402
from patchkit.verify.refwriter import ReferenceWriter  # noqa: E402
from tests.checkpoint_helpers import (  # noqa: E402
    HEAD_DIM,
    HEADS,
    VL,
    H,
    base_tensors,
    lin,
    write_adapter,
    write_checkpoint,
)
from tests.verify_helpers import when_ready  # noqa: E402


@pytest.fixture
def plans(tmp_path: Path) -> dict:
    """One adapter's merge planned on the tiny checkpoint (nothing written yet)."""
    model = write_checkpoint(tmp_path / "model", base_tensors())
    factors = {f"{VL}layers.1.self_attn.q_proj": lin((2 * HEADS * HEAD_DIM, H), 4, seed=1)}
    adapter = write_adapter(tmp_path / "one", factors)
    return {"one": mergeplan.plan_merge(model, adapter)}


def job(model: Path | str) -> serving.Job:
    return serving.Job("j", str(model), "eager", {}, [])


def test_a_reference_engine_waits_for_its_checkpoint_and_the_others_do_not(plans, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    writer = ReferenceWriter(plans, work, lambda line: None, 0)
    merged, rounding = writer.paths["one"]["merged"], writer.paths["one"]["rounding"]
    assert writer.ready(job(tmp_path / "model"))  # the base model: nothing to wait for
    when_ready([job(merged), job(rounding)], writer.ready)
    writer.close()
    assert (merged / "config.json").is_file() and (rounding / "config.json").is_file()
    assert not [name for name in os.listdir(work) if ".partial-" in name]


def test_a_failed_writing_is_raised_where_the_run_asks_whether_a_job_may_start(plans, tmp_path):
    """A shard changed between the plan and the writing (or no space left): the pool gets
    the error at its next look, kills its engines and the run ends as before."""
    model = plans["one"].model_dir
    shard = next(model.glob("*.safetensors"))
    os.utime(shard, ns=(0, 0))  # its mtime no longer what the plan read
    work = tmp_path / "work"
    work.mkdir()
    writer = ReferenceWriter(plans, work, lambda line: None, 0)
    writer._thread.join()
    with pytest.raises(mergewrite.ChangedSincePlanned):
        writer.ready(job(writer.paths["one"]["merged"]))
    writer.close()
    assert os.listdir(work) == []


def test_a_run_that_ends_while_writing_stops_it_and_leaves_no_partial_directory(
    plans, tmp_path, monkeypatch
):
    """close() before the first tensor (the run interrupted at once): write_merged stops,
    its staging directory goes, and no reference is there afterwards."""
    work = tmp_path / "work"
    work.mkdir()
    write = references.write_references

    def cancelled_at_once(plans, workdir, say, seed, cancel=None, written=None):
        cancel.set()  # as if close() came before the first tensor
        return write(plans, workdir, say, seed, cancel, written)

    monkeypatch.setattr(references, "write_references", cancelled_at_once)
    writer = ReferenceWriter(plans, work, lambda line: None, 0)
    writer.close()
    assert os.listdir(work) == []
    with pytest.raises(mergewrite.Cancelled):
        writer.ready(job(writer.paths["one"]["merged"]))
