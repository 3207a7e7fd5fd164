"""`patchkit verify --model` and `--tensor-parallel-size`: everything decided on the CPU.

Usage errors (one line, exit 2, before any GPU work), the refusal of more
GPUs than are visible, the disk the merged references need (said before,
refused when it is not free, nothing written then), their removal after the
run, and the checks applied to served results (synthetic, with each failure
they must catch). The served run itself needs a GPU and vLLM; its output
on the test H200 is in docs/evidence.md.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import threading
from collections import namedtuple
from pathlib import Path
from signal import SIGKILL

import pytest

from patchkit.cli.verify_words import say as words
from patchkit.errors import PatchkitError, UsageProblem
from patchkit.verify import (
    e2e,
    enginefaults,
    engines,
    mergeplan,
    mergewrite,
    modelchecks,
    references,
    refwriter,
    rule,
    serving,
    usermodel,
)
from patchkit.verify.refwriter import ReferenceWriter
from tests.conftest import REPO, run_cli, run_subprocess
from tests.helpers import failing
from tests.verify_helpers import fake_controls, fake_served, lora, merged, shift, when_ready

torch = pytest.importorskip("torch", reason="the merged references need torch (the test extra)")
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


@pytest.fixture
def user(tmp_path: Path) -> dict:
    """A tiny Qwen3.5 checkpoint (32k positions, vocab 40) and two adapters on q_proj."""
    model = write_checkpoint(tmp_path / "model", base_tensors())
    config = json.loads((model / "config.json").read_text())
    config["text_config"] |= {"vocab_size": 40, "max_position_embeddings": 32768}
    config["image_token_id"] = 7
    (model / "config.json").write_text(json.dumps(config))
    factors = {f"{VL}layers.1.self_attn.q_proj": lin((2 * HEADS * HEAD_DIM, H), 4, seed=1)}
    return {
        "model": model,
        "one": write_adapter(tmp_path / "one", factors),
        "two": write_adapter(tmp_path / "two", factors),
    }


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ----- usage errors: one line, exit 2, nothing done -----


def usage_cases(user, tmp_path):
    model, one = str(user["model"]), f"one={user['one']}"
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    return [
        (["--lora", one], "--lora needs --model DIR"),
        (["--model", model], "--model needs at least one --lora NAME=DIR"),
        (["--model", model, "--lora", "one"], "expected NAME=DIR"),
        (["--model", model, "--lora", f"bad name={user['one']}"], "expected NAME=DIR"),
        (["--model", model, "--lora", f"one\n={user['one']}"], "expected NAME=DIR"),
        (["--model", model, "--lora", f"x={tmp_path}"], "holds no adapter_config.json"),
        (["--model", str(tmp_path / "nowhere"), "--lora", one], "not a directory"),
        (["--model", str(no_config), "--lora", one], "no readable config.json"),
        (["--model", model, "--lora", one, "--lora", f"one={user['two']}"], "a NAME given twice"),
        (["--model", model, "--lora", one, "--max-model-len", "300"], "need at least 616"),
        # 0 was taken as "not given" (16400); a length that small is refused like 300
        (["--model", model, "--lora", one, "--max-model-len", "0"], "len 0: the checks need"),
        (["--model", model, "--lora", one, "--max-model-len", "-1"], "len -1: the checks need"),
        # vLLM seeds numpy with it (0 to 2**32 - 1): larger ones failed on the GPU host
        (["--e2e", "--seed", str(2**64)], f"--seed {2**64}: a whole number from 0 to"),
        (["--e2e", "--seed", str(2**32)], f"--seed {2**32}: a whole number from 0 to"),
        (["--e2e", "--seed", "-1"], "--seed -1: a whole number from 0 to 4294967295"),
        (["--e2e", "--seed", str(10**300)], "--seed of 997 bits: a whole number from 0 to"),
        (["--e2e", "--max-model-len", "4096"], "--max-model-len goes with --model"),
        (["--e2e", "--workdir", str(user["model"])], f"--workdir {user['model']}: not empty"),
        (["--e2e", "--workdir", str(user["model"] / "config.json")], "not a directory"),
        (["--e2e", "--reference", "peft"], "--reference goes with --model"),
        (["--e2e", "--workdir", str(tmp_path), "--keep", str(tmp_path / "k")], "give one"),
        (["--e2e", "--tensor-parallel-size", "0"], "must be 1 or more"),
        (["--e2e", "--keep", str(tmp_path)], "not empty"),
        (["--e2e", "--keep", str(user["model"] / "config.json")], "--keep "),
        (["--model", model, "--lora", one, "--keep", str(user["model"].parent)], "not empty"),
    ]


def test_usage_errors_are_one_line_exit_2_and_change_nothing(user, tmp_path):
    cases = usage_cases(user, tmp_path)
    before = listing(tmp_path)
    for args, expected in cases:
        result = run_cli("verify", *args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("patchkit: error: "), (args, lines)
        assert expected in lines[0], (args, lines[0])
        assert "Traceback" not in result.output
        as_json = run_cli("verify", *args, "--json")
        assert json.loads(as_json.stdout) == {
            "format": 1,
            "command": "verify",
            "ok": False,
            "error": {"code": "usage", "message": lines[0].removeprefix("patchkit: error: ")},
            "exit_code": 2,
        }
    assert listing(tmp_path) == before


def test_keep_never_writes_over_a_directory_that_holds_files(user, tmp_path):
    """--keep DIR was used as it was: e2e saved its random model into DIR/model and
    DIR/adapter over a user's own (their model's config.json and weights), and
    served.json, reference.json and vLLM's logs over files of those names."""
    before = (user["model"] / "config.json").read_bytes()
    for keep in (tmp_path, user["model"].parent):
        result = run_cli("verify", "--e2e", "--keep", str(keep))
        assert result.exit_code == 2, result.output
        assert f"--keep {keep}: not empty" in result.stderr
    assert (user["model"] / "config.json").read_bytes() == before
    empty = tmp_path / "empty"
    empty.mkdir()
    from patchkit.cli.commands.verify import verify_request

    assert verify_request(False, None, (), 1, None, None, None, str(empty)).keep == empty
    assert verify_request(False, None, (), 1, None, None, None, str(tmp_path / "new")).keep


def test_a_bad_adapter_and_the_disk_are_decided_before_the_gpu(user, tmp_path):
    """The adapters were read (and the disk said) only after the kernel checks and
    --e2e had run on the GPU: a broken adapter_config.json failed minutes in. Here
    (no GPU) the adapter's error, not the missing GPU, is the one line."""
    bad = tmp_path / "bad"
    shutil.copytree(user["one"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": [1]}))
    result = run_cli("verify", "--model", str(user["model"]), "--lora", f"bad={bad}")
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"patchkit: error: {bad}/adapter_config.json: rank_pattern is not a JSON object "
        "(module pattern to value)"
    )
    work = tmp_path / "work"  # new: created only when the run starts, after the GPU check
    good = run_cli("verify", "--model", str(user["model"]), "--lora", f"one={user['one']}",
                   "--workdir", str(work))  # fmt: skip
    assert "merged references: 1 adapter(s), each merged twice" in good.stderr
    assert not work.exists()


@pytest.mark.parametrize(
    "values",
    [
        {"vocab_size": 2, "pad_token_id": 1},  # no plain token left: the prompt loop never ended
        {"vocab_size": 1},
        {"vocab_size": -3},
        {"vocab_size": "x"},
        {"max_position_embeddings": "abc"},
        {"max_position_embeddings": 1e400},
    ],
)
def test_a_config_with_unusable_sizes_is_one_line_not_a_hang(user, values):
    """vocab_size / max_position_embeddings that are not positive integers raised
    ValueError/OverflowError (exit 3); a vocabulary of special ids only hung make_prompts."""
    path = user["model"] / "config.json"
    config = json.loads(path.read_text())
    for key in ("vocab_size", "max_position_embeddings"):
        config["text_config"].pop(key, None)
    path.write_text(json.dumps({**config, **values}))
    with pytest.raises(UsageProblem, match=r"config.json") as err:
        usermodel.prepare(user["model"], [("one", user["one"])], 1, None, 0)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_an_interrupted_run_leaves_no_engine_running(tmp_path, monkeypatch):
    """SIGTERM (CI, `timeout`, Kubernetes) reaches only patchkit, raised as Terminated in
    wait(): the vLLM engine children went on holding the GPUs, orphaned, while the
    workdir was removed under them."""
    import signal
    import subprocess
    import sys

    from patchkit import signals

    started = []

    def sleeping(jobs, workdir):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        started.append(child)
        return {job.name: child for job in jobs}

    def terminated(signum, frame):
        raise signals.Terminated(signal.SIGTERM)

    monkeypatch.setattr(serving, "start", sleeping)
    previous = signal.signal(signal.SIGALRM, terminated)
    signal.alarm(1)
    try:
        with pytest.raises(signals.Terminated):
            job = serving.Job("eager", "/m", "eager", {}, [])
            serving.serve_all([job], tmp_path, 60.0, 1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    [child] = started
    try:
        assert child.wait(timeout=10) is not None
    finally:
        child.kill()


def test_every_seed_numpy_takes_is_accepted_and_none_other():
    from patchkit.errors import UsageProblem
    from patchkit.verify import runner

    for seed in (0, 11, 2**31, 2**32 - 1):
        runner.check_seed(seed)
    for seed in (-1, 2**32, 2**64, -(2**70)):
        with pytest.raises(UsageProblem, match="a whole number from 0 to 4294967295"):
            runner.check_seed(seed)


def test_a_max_model_len_of_0_is_a_length_not_the_default():
    from patchkit.errors import UsageProblem
    from patchkit.verify import usermodel

    assert usermodel.max_model_len({}, None) == 16400
    for asked in (0, -5, 615):
        with pytest.raises(UsageProblem, match=f"--max-model-len {asked}: the checks need"):
            usermodel.max_model_len({}, asked)
    assert usermodel.max_model_len({}, 616) == 616


def test_tensor_parallel_beyond_the_visible_gpus_is_refused():
    with pytest.raises(UsageProblem, match=r"needs 4 GPUs and 2 are visible.*use at most 2"):
        serving.check_tensor_parallel(4, 2)
    with pytest.raises(UsageProblem, match="needs 2 GPUs and 1 is visible"):
        serving.check_tensor_parallel(2, 1)
    serving.check_tensor_parallel(2, 2)


@pytest.mark.slow
def test_the_cli_refuses_tp_beyond_the_gpus_before_any_work():
    """torch is made to see one GPU; the refusal comes before vLLM is looked for."""
    fake_gpu = "import torch\ntorch.cuda.is_available = lambda: True\n"
    fake_gpu += "torch.cuda.device_count = lambda: 1\n"
    result = run_subprocess("verify", "--e2e", "--tensor-parallel-size", "2", code=fake_gpu)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "patchkit: error: --tensor-parallel-size 2 needs 2 GPUs and 1 is visible "
        "(CUDA_VISIBLE_DEVICES); use at most 1"
    )


def test_prompt_lengths_follow_max_model_len():
    config = {"max_position_embeddings": 262144}
    assert usermodel.max_model_len(config, None) == 16400
    assert usermodel.prompt_lengths(16400) == [600, 3000, 16384]
    assert usermodel.prompt_lengths(2000) == [600, 1984]
    assert usermodel.prompt_lengths(616) == [600]
    assert usermodel.max_model_len({"max_position_embeddings": 8192}, None) == 8192
    with pytest.raises(UsageProblem):
        usermodel.max_model_len(config, 615)


def test_prompts_avoid_special_ids_and_stay_in_the_plain_vocabulary():
    config = {"vocab_size": 12, "image_token_id": 3, "text_config": {}, "eos_token_id": 5}
    prompts = usermodel.make_prompts(config, [600, 3000], seed=1)
    assert [len(p) for p in prompts.values()] == [600, 3000]
    used = {t for p in prompts.values() for t in p}
    assert used == set(range(1, 12)) - {3, 5}
    big = usermodel.make_prompts({"vocab_size": 248320}, [600], seed=1)
    assert max(big["p600"]) < usermodel.PLAIN_VOCAB
    assert big == usermodel.make_prompts({"vocab_size": 248320}, [600], seed=1)


def test_engine_memory_and_lora_rank():
    assert [serving.lora_rank_limit(r) for r in (4, 64, 100, 128, 300)] == [8, 64, 128, 128, 320]
    total = 140 << 30
    fraction = serving.engine_memory(54 << 30, 248320, 2, 2 << 30, total)
    # 27 GiB of weights per GPU, 2 GiB KV, 3 GiB, and 3 x 4096 x 248320 x 4 B of logits
    assert 0.30 < fraction < 0.32
    assert serving.engine_memory(200 << 30, 248320, 1, 2 << 30, total) == 0.9
    assert serving.side_by_side(0.04, 0.9) == 22
    assert serving.side_by_side(0.9, 0.5) == 1


# ----- the merged references: the disk, said before and refused, then removed -----


def test_the_disk_the_references_need_is_said_before_anything_is_written(user, tmp_path):
    said = []
    adapters = {"one": user["one"], "two": user["two"]}
    plans = references.plan_references(user["model"], adapters, tmp_path / "work", said.append)
    needed = 2 * sum(p.bytes_needed for p in plans.values())  # reference and rounding control
    assert needed > 0 and not (tmp_path / "work").exists()
    assert said[0].startswith("merged references: 2 adapter(s), each merged twice (")
    assert f" need {mergeplan.human_bytes(needed)} under" in said[0]
    assert f"under {tmp_path / 'work'}" in said[0] and "removed afterwards unless --keep" in said[0]


def test_too_little_free_disk_is_refused_and_nothing_is_written(user, tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 100, 100))
    before = listing(tmp_path)
    with pytest.raises(PatchkitError, match=r"need .* and 100 B is free; give --workdir"):
        references.plan_references(user["model"], {"one": user["one"]}, tmp_path, print)
    assert listing(tmp_path) == before


class Child:
    """A stand-in engine child for serving.pool: done after ``polls`` looks."""

    def __init__(self, polls: int):
        self.polls, self.returncode = polls, None

    def poll(self):
        self.polls -= 1
        if self.polls <= 0:
            self.returncode = 0
        return self.returncode


def test_the_pool_starts_a_job_as_soon_as_a_slot_is_free_and_what_it_reads_is_written(
    user, monkeypatch
):
    """Three at a time (an H100 and the 35B-A3B-wide cut): the two CUDA-graph engines and
    eager first. Waves made the second three wait for the slowest of the first, a
    CUDA-graph engine (223-260 s against 110 s eager, 2026-12-07). Here the reference
    engines wait only for their checkpoints: when eager ends (3 looks), nolora-eager
    takes its slot, merged-one not yet written; merged-one starts once written, rounding-one
    once written too, in the slots the others free. Never more than three at once; the
    result in the jobs' order."""
    setup = usermodel.prepare(user["model"], [("one", user["one"])], 1, 3016, 0)
    setup |= {"gpu_memory_utilization": 0.2, "kv_cache_bytes": 1 << 30}
    made = {"one": {"merged": Path("/m"), "rounding": Path("/r")}}
    jobs = engines.jobs(user["model"], {"one": user["one"]}, made, setup)
    lives = {"cudagraph": 9, "nolora-cudagraph": 8, "eager": 3, "nolora-eager": 3}
    looks, started, running = [0], [], {}

    def start(batch, workdir):
        [job] = batch
        alive = sorted(name for name, child in running.items() if child.returncode is None)
        started.append((looks[0], job.name, alive))
        running[job.name] = Child(lives.get(job.name, 3))
        assert len(alive) < 3
        return {job.name: running[job.name]}

    def ready(job):  # as refwriter writes them: the merged reference first, then rounding
        looks[0] += 1
        return looks[0] > {"/m": 30, "/r": 60}.get(job.model, 0)

    monkeypatch.setattr(serving, "start", start)
    monkeypatch.setattr(serving, "result", lambda name, child, workdir: {"runs": {}})
    monkeypatch.setattr(serving, "POLL_S", 0)
    served = serving.serve_all(jobs, Path("/w"), 60.0, 3, ready)
    order = [name for _, name, _ in started]
    assert order == [
        "cudagraph", "nolora-cudagraph", "eager", "nolora-eager", "merged-one", "rounding-one"
    ]  # fmt: skip
    first_three = {name for look, name, _ in started if look == started[0][0]}
    assert first_three == {"cudagraph", "nolora-cudagraph", "eager"}
    beside = {name: alive for _, name, alive in started}
    assert beside["nolora-eager"] == ["cudagraph", "nolora-cudagraph"]  # no wave to wait for
    assert list(served) == [job.name for job in jobs]


def test_a_job_still_running_past_its_time_is_killed_and_reported(user, monkeypatch):
    """Each child has ``timeout`` from its own start (a wave had it from the wave's)."""
    killed = []
    job = serving.Job("eager", "/m", "eager", {}, [])
    monkeypatch.setattr(serving, "start", lambda batch, workdir: {"eager": Child(10**9)})
    monkeypatch.setattr(serving, "kill", lambda child: killed.append(child))
    monkeypatch.setattr(serving, "result", lambda name, child, workdir: {"error": "killed"})
    monkeypatch.setattr(serving, "alone", lambda job, workdir, timeout: {"runs": {}})
    monkeypatch.setattr(serving, "POLL_S", 0)
    served = serving.serve_all([job], Path("/w"), -1.0, 1)
    assert len(killed) == 1 and served["eager"] == {"runs": {}, "first_attempt": "killed"}


def test_run_model_removes_the_merged_copies_and_its_workdir(user, tmp_path, monkeypatch):
    seen = {}

    def serve_all(jobs, workdir, timeout, at_once, ready=None):
        when_ready(jobs, ready)
        for kind in ("merged", "rounding"):
            seen[kind] = sorted(p.name for p in workdir.iterdir() if p.name.startswith(kind))
        seen["jobs"] = [(j.name, j.mode, bool(j.loras)) for j in jobs]
        seen["controls"] = sorted(p.name for p in workdir.iterdir() if p.name.startswith("control"))
        seen["loras"] = list(jobs[0].loras)
        seen["faults"] = [job.faults for job in jobs]
        seen["workdir"] = workdir
        return fake_served(["one", "two"])

    monkeypatch.setattr(serving, "serve_all", serve_all)
    work = tmp_path / "work"
    work.mkdir()
    setup = usermodel.prepare(user["model"], [("one", user["one"]), ("two", user["two"])], 1,
                               3016, 0)  # fmt: skip
    result = usermodel.run_model(user["model"], setup, work, None, (140 << 30, 130 << 30), print)
    assert failing(result.checks) == []
    assert [(a.adapter, a.verdict) for a in result.adapters] == [
        ("one", "PASSED"),
        ("two", "PASSED"),
    ]
    assert result.adapters[0].caught == [
        "50 % strength",
        "adapter ignored",
        "LoRA scale doubled in vLLM",
        "first LoRA layer skipped in vLLM",
        "another adapter's weights in its slot",
    ]
    assert seen["controls"] == ["control-one+half", "control-two+half"]  # only these have files
    engine = {n: [f"{n}+engine-{f}" for f in enginefaults.DENSE_FAULTS] for n in ("one", "two")}
    assert seen["loras"] == ["one", "two", "one+half", *engine["one"], "two+half", *engine["two"]]
    faults = {f"{n}+engine-{f}": f for n in ("one", "two") for f in enginefaults.DENSE_FAULTS}
    assert seen["faults"] == [faults, faults] + [{}] * 6  # the LoRA engines' workers only
    assert seen["merged"] == ["merged-one", "merged-two"]
    assert seen["rounding"] == ["rounding-one", "rounding-two"]
    assert seen["jobs"] == [
        ("eager", "eager", True),
        ("cudagraph", "cudagraph", True),
        ("merged-one", "eager", False),
        ("rounding-one", "eager", False),
        ("merged-two", "eager", False),
        ("rounding-two", "eager", False),
        ("nolora-eager", "eager", False),
        ("nolora-cudagraph", "cudagraph", False),
    ]
    assert seen["workdir"].parent == work and not seen["workdir"].exists()
    assert list(work.iterdir()) == []


def test_a_second_ctrl_c_while_the_run_cleans_up_waits_for_the_cleanup(user, tmp_path, monkeypatch):
    """Ctrl-C, then Ctrl-C again while close() waits for the merged references' writing
    (the tensor being written): the second KeyboardInterrupt left close() and the
    workdir's removal with it, the run's files behind. It is acted on once they are done."""
    import os
    import signal

    write = mergewrite.write_merged

    def second_ctrl_c(plan, dest, *args, cancel=None, **kwargs):
        cancel.wait()  # the run has ended: close() waits for this thread
        os.kill(os.getpid(), signal.SIGINT)
        return write(plan, dest, *args, cancel=cancel, **kwargs)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(mergewrite, "write_merged", second_ctrl_c)
    monkeypatch.setattr(serving, "serve_all", interrupted)
    work = tmp_path / "work"
    work.mkdir()
    setup = usermodel.prepare(user["model"], [("one", user["one"])], 1, 3016, 0)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            usermodel.run_model(user["model"], setup, work, None, (1 << 40, 1 << 40), print)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(work.iterdir()) == []


def test_run_model_cleans_up_when_interrupted_and_keeps_with_keep(user, tmp_path, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(serving, "serve_all", interrupted)
    work = tmp_path / "work"
    work.mkdir()
    setup = usermodel.prepare(user["model"], [("one", user["one"])], 1, 3016, 0)
    with pytest.raises(KeyboardInterrupt):
        usermodel.run_model(user["model"], setup, work, None, (1 << 40, 1 << 40), print)
    assert list(work.iterdir()) == []
    monkeypatch.setattr(
        serving, "serve_all", lambda *a: (when_ready(a[0], a[4]), fake_served(["one"]))[1]
    )
    keep = tmp_path / "keep"
    usermodel.run_model(user["model"], setup, None, keep, (1 << 40, 1 << 40), print)
    assert (keep / "merged-one" / "config.json").is_file()
    assert (keep / "rounding-one" / "config.json").is_file()
    merged = {f.name: f.read_bytes() for f in (keep / "merged-one").glob("*.safetensors")}
    control = {f.name: f.read_bytes() for f in (keep / "rounding-one").glob("*.safetensors")}
    assert merged.keys() == control.keys()
    assert any(merged[name] != control[name] for name in merged)  # rounded another way
    assert set(json.loads((keep / "served.json").read_text())) == {
        "eager",
        "cudagraph",
        "merged-one",
        "rounding-one",
    }


# ----- the checks of --model on served results -----


def test_compare_passes_a_clean_run():
    assert failing(modelchecks.compare(fake_served(["one", "two"]), ["one", "two"])) == []


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda s: lora(s)["p600"]["prompt_logprobs"].__setitem__(3, math.nan),
         "eager: no NaN log-probabilities"),
        (lambda s: lora(s, "cudagraph")["p3000"].__setitem__("tokens", [0, 0, 0, 0]),
         "cudagraph: no run of token id 0"),
        (lambda s: s["eager"].__setitem__("corrupted_requests", 1),
         "eager: vllm:corrupted_requests"),
        (lambda s: lora(s)["p3000"]["prompt_logprobs"].__setitem__(10, -12.0),
         "eager: one 3000 tokens vs merged"),
        (lambda s: lora(s, name="two").update(copy.deepcopy(s["eager"]["runs"]["base"])),
         "eager: two adapter differs from base"),
        (lambda s: s["eager"]["runs"].__setitem__("lora:two", {"error": "ValueError: x"}),
         "eager: two adapter served"),
        (lambda s: s["cudagraph"]["runs"]["base_after_lora"].update(copy.deepcopy(lora(s))),
         "cudagraph: base after LoRA equals base before"),
        (lambda s: s["eager"]["runs"]["lora_after_long"]["p600"].__setitem__("tokens", [9]),
         "eager: short prompt after a long one unaffected"),
        (lambda s: s.__setitem__("merged-two", {"error": "vLLM (merged-two) exited 1: boom"}),
         "reference two (merged, no LoRA): vLLM ran"),
        (lambda s: s.__setitem__("cudagraph", {"error": "vLLM (cudagraph) exited 1: boom"}),
         "cudagraph: vLLM ran"),
        (lambda s: s.__setitem__("rounding-two", {"error": "vLLM (rounding-two) exited 1: x"}),
         "reference two (rounding control): vLLM ran"),
        (lambda s: s["rounding-one"]["runs"]["merged"]["p600"]["prompt_logprobs"].__setitem__(
            0, math.nan), "reference one: its own bf16 rounding"),
    ],
)  # fmt: skip
def test_compare_catches(damage, expected):
    served = fake_served(["one", "two"])
    damage(served)
    assert expected in failing(modelchecks.compare(served, ["one", "two"]))


@pytest.mark.parametrize(
    "rounding, lora_off, passes",
    [
        (0.004, 0.02, True),  # within the fixed bound 0.03
        (0.004, 0.04, False),  # beyond it, and the reference is precise (1.5 x 0.004)
        (0.03, 0.04, True),  # a wide model: the reference itself moves 0.03; 1.5 x = 0.045
        (0.03, 0.05, False),  # beyond 1.5 x the reference's own rounding
    ],
)
def test_the_bound_is_the_references_own_rounding_times_the_factor(rounding, lora_off, passes):
    served = fake_served(["one"])
    shift(served["rounding-one"]["runs"]["merged"], rounding - 0.004)
    shift(lora(served), lora_off)
    checks = {c.name: c for c in modelchecks.compare(served, ["one"])}
    row = checks["eager: one 600 tokens vs merged"]
    assert row.ok is passes, row.detail
    assert checks["reference one: its own bf16 rounding"].ok


def test_the_references_rounding_is_taken_over_all_prompts():
    """One prompt's distance between the two roundings is a sample of one perturbation:
    a control 0.03 away on the 3000-token prompt widens the 600-token bound too."""
    served = fake_served(["one"])
    shift({"p3000": served["rounding-one"]["runs"]["merged"]["p3000"]}, 0.026)  # 0.03 apart
    shift({"p600": lora(served)["p600"]}, 0.04)
    checks = {c.name: c for c in modelchecks.compare(served, ["one"])}
    row = checks["eager: one 600 tokens vs merged"]
    assert row.ok and "(<= 0.045)" in row.detail, row.detail


def test_a_control_with_one_wild_token_does_not_let_a_broken_position_by():
    """The max bound is 1.5 x the control's worst token but never past MAX_CEILING:
    a control 6 nats off on one token must not pass LoRA 8 nats off on two."""
    served = fake_served(["one"])
    served["rounding-one"]["runs"]["merged"]["p600"]["prompt_logprobs"][10] -= 6.0
    for position in (0, 300):
        lora(served)["p600"]["prompt_logprobs"][position] -= 8.0
    checks = {c.name: c for c in modelchecks.compare(served, ["one"])}
    row = checks["eager: one 600 tokens vs merged"]
    assert not row.ok and f"(<= {rule.MAX_CEILING})" in row.detail, row.detail
    assert checks["cudagraph: one 600 tokens vs merged"].ok


def test_a_bound_wide_against_the_effect_is_said_and_the_controls_decide():
    """An adapter that moves log-probs by 0.1 against the bound 0.03: 30 % of its effect.
    That failed the adapter (FAILED on a healthy one); now the row says so and the
    half-strength control decides: 0.05 away it is rejected, so the run could tell."""
    served = fake_served(["one"], effect=0.1)
    result = usermodel.judge(served, ["one"], fake_controls(["one"]), merged(served, ["one"]))
    row = {c.name: c for c in result.checks}["eager: one adapter differs from base"]
    assert row.ok and "(> 25%: an adapter at 70% of its strength could pass" in row.detail
    assert result.adapters[0].verdict == "PASSED"
    assert result.adapters[0].caught == ["50 % strength", "adapter ignored"]


def test_a_control_inside_the_bound_makes_the_adapter_inconclusive_not_passed():
    """Effect 0.05: the half-strength control sits 0.025 from the reference, inside the
    bound 0.03. The adapter matches its reference, but so would the control: the run
    cannot tell, and says which control it missed."""
    served = fake_served(["one"], effect=0.05)
    result = usermodel.judge(served, ["one"], fake_controls(["one"]), merged(served, ["one"]))
    [verdict] = result.adapters
    assert verdict.verdict == "INCONCLUSIVE" and result.verdict == "INCONCLUSIVE"
    assert verdict.missed == ["50 % strength"] and verdict.caught == ["adapter ignored"]
    assert "control 50 % strength rejected" in words(verdict.why)
    assert "--reference peft" in words(verdict.decides_instead)
    assert not [c.name for c in result.checks if c.failed]


def test_a_reference_too_coarse_to_judge_by_fails_and_says_why():
    served = fake_served(["one"])
    shift(served["rounding-one"]["runs"]["merged"], 0.2)
    shift(lora(served), 0.15)  # within 1.5 x the 0.2 apart: passes only on a reference this coarse
    checks = {c.name: c for c in modelchecks.compare(served, ["one"])}
    coarse = checks["reference one: its own bf16 rounding"]
    assert not coarse.ok and "too coarse in bf16 to judge a LoRA path by" in coarse.detail
    assert not coarse.decided and coarse.adapter == "one"  # undecided, not a failure


def test_an_adapter_too_weak_to_tell_from_noise_fails_with_the_reason():
    served = fake_served(["one"], effect=0.1)
    for group in [served["merged-one"]["runs"]["merged"], lora(served), lora(served, "cudagraph")]:
        for request in group.values():
            request["prompt_logprobs"] = [v + 0.095 for v in request["prompt_logprobs"]]
    checks = {c.name: c for c in modelchecks.compare(served, ["one"])}
    weak = checks["eager: one adapter differs from base"]
    assert not weak.ok and "too little to tell LoRA applied from not" in weak.detail
    assert not weak.decided


def test_e2e_checks_the_moe_case_like_a_user_model():
    """The MoE engines of --e2e are judged by model.compare under the moe- prefix."""
    served = fake_served(["moe"], prefix="moe-")
    checks = modelchecks.compare(served, ["moe"], prefix="moe-")
    assert checks and failing(checks) == []
    assert "moe-eager: moe 600 tokens vs merged" in [c.name for c in checks]
    lora(served, "moe-cudagraph", "moe")["p3000"]["prompt_logprobs"][0] = -30.0
    assert failing(modelchecks.compare(served, ["moe"], prefix="moe-")) == [
        "moe-cudagraph: moe 3000 tokens vs merged"
    ]
    assert e2e.MOE_PROMPT_LENGTHS == [600, 3000]


def test_jobs_name_their_engines_and_requests():
    setup = {"prompts": {"p600": [1] * 600, "p3000": [1] * 3000}, "tensor_parallel_size": 2,
             "max_model_len": 3016, "seed": 1, "gpu_memory_utilization": 0.05,
             "kv_cache_bytes": 1 << 30}  # fmt: skip
    adapters = {"one": Path("/a/one"), "two": Path("/a/two")}
    requests = engines.lora_requests(list(adapters), setup["prompts"])
    assert requests == [
        ("base", "p600", None), ("base", "p3000", None),
        ("lora:one", "p600", "one"), ("lora:one", "p3000", "one"),
        ("lora:two", "p600", "two"), ("lora:two", "p3000", "two"),
        ("lora_after_long", "p600", "one"),
        ("base_after_lora", "p600", None), ("base_after_lora", "p3000", None),
    ]  # fmt: skip
    job = serving.Job(name="x", model="/m", mode="eager", prompts={}, requests=requests)
    assert serving.Job(**json.loads(json.dumps(job.__dict__))).requests[2] == [
        "lora:one",
        "p600",
        "one",
    ]


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and __import__("importlib").util.find_spec("vllm")),
    reason="needs a CUDA GPU and vLLM: run scripts/proofs/verify_gpu_proof.sh on a GPU host",
)
def test_verify_model_on_this_gpu(tmp_path):
    pytest.importorskip("peft", reason="building the stand-in user model needs peft")
    from scripts.proofs.verify_model_gpu import build

    build(tmp_path / "user")
    u = tmp_path / "user"
    result = run_subprocess("verify", "--model", str(u / "model"), "--lora", f"full={u / 'full'}",
                            "--lora", f"z={u / 'z'}")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]


def test_the_stand_ins_poisoned_adapter_is_its_source_with_one_inf_in_one_lora_b(tmp_path):
    """verify_model_gpu --poison (the poisoned adapter of the GPU sittings' poison runs):
    the copy holds every tensor of its source, one value of layer 1's mlp.down_proj
    lora_B made inf, the rest equal."""
    safetensors = pytest.importorskip("safetensors.torch", reason="the test extra has it")
    from scripts.proofs.verify_model_gpu import poison

    source = tmp_path / "full"
    source.mkdir()
    (source / "adapter_config.json").write_text("{}")
    prefix = "base_model.model.model.language_model.layers"
    tensors = {f"{prefix}.{n}.mlp.down_proj.lora_{x}.weight": torch.ones(4, 4)
               for n in (0, 1) for x in "AB"}  # fmt: skip
    safetensors.save_file(tensors, str(source / "adapter_model.safetensors"))
    name = poison(source, tmp_path / "poisoned")
    assert name == f"{prefix}.1.mlp.down_proj.lora_B.weight"
    copied = safetensors.load_file(str(tmp_path / "poisoned" / "adapter_model.safetensors"))
    assert set(copied) == set(tensors)
    assert int(torch.isinf(copied[name]).sum()) == 1
    assert all(torch.equal(copied[n], t) for n, t in tensors.items() if n != name)
    assert (tmp_path / "poisoned" / "adapter_config.json").exists()


def test_a_failed_engine_is_reported_by_its_exception_not_a_source_line():
    """Lines of a real vLLM 0.26.0 engine log from the test H200 (its worker's traceback):
    the first line with "Error" in it is ``raise AttributeError(``, which tells nothing."""
    log = Path(__file__).parent / "data" / "vllm-0.26.0-moe-engine-failure.log"
    assert serving.first_error(log) == (
        "AttributeError: '_OpNamespace' '_moe_C' object has no attribute 'topk_softmax'"
    )


def test_an_engine_wide_health_row_names_the_adapter_whose_requests_went_bad():
    """One engine serves every adapter: its NaN and token-0 rows say whose requests
    held them (the poisoned adapter on the H200 was named only by its own rows)."""
    served = fake_served(["one", "two"])
    lora(served, name="two")["p600"]["prompt_logprobs"][3] = math.nan
    lora(served, name="two")["p3000"]["tokens"] = [0, 0, 0, 0]
    checks = {c.name: c for c in modelchecks.compare(served, ["one", "two"])}
    assert checks["eager: no NaN log-probabilities"].detail == "1 NaN (in lora:two)"
    zero = checks["eager: no run of token id 0"]
    assert not zero.ok and zero.detail.endswith("zeros in a row (in lora:two)")
    assert checks["cudagraph: no NaN log-probabilities"].detail == "0 NaN"


# ----- the merged references written beside the first engines (refwriter) -----


@pytest.fixture
def plans(user) -> dict:
    """One adapter's merge planned on the tiny checkpoint (nothing written yet)."""
    return {"one": mergeplan.plan_merge(user["model"], user["one"])}


def reading(model: Path | str) -> serving.Job:
    """A job whose engine reads ``model``."""
    return serving.Job("j", str(model), "eager", {}, [])


def test_a_reference_engine_waits_for_its_checkpoint_and_the_others_do_not(plans, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    writer = ReferenceWriter(plans, work, lambda line: None, 0)
    merged, rounding = writer.paths["one"]["merged"], writer.paths["one"]["rounding"]
    assert writer.ready(reading(tmp_path / "model"))  # the base model: nothing to wait for
    when_ready([reading(merged), reading(rounding)], writer.ready)
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
        writer.ready(reading(writer.paths["one"]["merged"]))
    writer.close()
    assert os.listdir(work) == []


def test_a_failed_writing_ends_the_pool_and_kills_the_engine_running_beside_it(
    plans, tmp_path, monkeypatch
):
    """The base engine (a stand-in child, tests/serving_helpers.py) runs while the merged
    reference is written; the writing fails (a shard changed since planned): the pool's
    next look raises that error, as the run raised it before any engine ran, and the
    engine is killed, not left holding its GPU."""
    os.utime(next(plans["one"].model_dir.glob("*.safetensors")), ns=(0, 0))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    engine_up, children = threading.Event(), []
    start, write = serving.start, references.write_references

    def started(jobs, workdir):
        found = start(jobs, workdir)
        children.extend(found.values())
        engine_up.set()
        return found

    def once_the_engine_is_up(*args, **kwargs):
        engine_up.wait()
        return write(*args, **kwargs)

    monkeypatch.setattr(serving, "start", started)
    monkeypatch.setattr(references, "write_references", once_the_engine_is_up)
    writer = ReferenceWriter(plans, work, lambda line: None, 0)
    models = {"base": plans["one"].model_dir, "merged-one": writer.paths["one"]["merged"]}
    jobs = [serving.Job(name, str(model), "eager", {}, [], runner="tests.serving_helpers")
            for name, model in models.items()]  # fmt: skip
    try:
        with pytest.raises(mergewrite.ChangedSincePlanned):
            serving.serve_all(jobs, work, 600.0, 2, writer.ready)
        ended = [child.poll() for child in children]
    finally:
        writer.close()
        for child in children:
            serving.kill(child)  # none outlives the test, whatever the pool did
    assert ended == [-SIGKILL]


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
        writer.ready(reading(writer.paths["one"]["merged"]))


def test_close_waits_for_a_tensor_slower_than_its_patience_and_nothing_comes_back(
    plans, tmp_path, monkeypatch
):
    """close() waited STOP_WAIT_S (120 s) and returned; the run then removed the workdir
    while the thread went on, and write_merged's mkdir(parents=True) made it again (or a
    staging directory stayed in it). Here the tensor being written when the run ends
    outlasts that wait (0 s) and ends only once close() has said it waits for it."""
    work = tmp_path / "work"
    work.mkdir()
    release, said = threading.Event(), []
    write = mergewrite.write_merged

    def slow(plan, dest, *args, cancel=None, **kwargs):
        cancel.wait()  # mid-write when the run ends
        release.wait()  # a tensor slower than close()'s wait
        return write(plan, dest, *args, cancel=cancel, **kwargs)

    def say(line):
        said.append(line)
        if "waiting for the tensor" in line:
            release.set()

    monkeypatch.setattr(mergewrite, "write_merged", slow)
    monkeypatch.setattr(refwriter, "STOP_WAIT_S", 0)
    writer = ReferenceWriter(plans, work, say, 0)
    try:
        writer.close()
        still_writing = writer._thread.is_alive()
        shutil.rmtree(work)  # what run_model does right after close()
    finally:
        release.set()
        writer._thread.join()
    assert not still_writing and not work.exists()
    assert any("waiting for the tensor" in line for line in said)


def test_a_cancelled_writing_makes_nothing_not_even_its_directory(plans, tmp_path):
    """write_merged made dest's parent (mkdir parents=True) and its staging directory
    before it first looked at ``cancel``: a writing told to stop after its run removed
    the workdir made the workdir again."""
    cancel = threading.Event()
    cancel.set()
    gone = tmp_path / "removed-workdir"
    with pytest.raises(mergewrite.Cancelled):
        mergewrite.write_merged(plans["one"], gone / "merged-one", cancel=cancel)
    assert not gone.exists()
