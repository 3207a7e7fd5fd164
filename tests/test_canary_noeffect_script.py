"""scripts/proofs/canary_noeffect_gpu.py on the CPU: its arguments, its plan, the adapters it
builds (names, zeros), what it packs (never the weights) and how it compares answers."""

from __future__ import annotations

import json
import tarfile

import pytest

from scripts.proofs import canary_noeffect_gpu as script


def test_fewer_than_two_repeats_cannot_measure_repeat_noise(capsys):
    with pytest.raises(SystemExit) as exc:
        script.parse(["out", "--repeats", "1"])
    assert exc.value.code == 2
    assert "--repeats must be at least 2" in capsys.readouterr().err


def test_dry_prints_the_plan_without_torch_or_a_server(tmp_path, capsys):
    assert script.main([str(tmp_path / "out"), "--dry", "--repeats", "3"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["served"] == ["tiny-qwen35", "healthy", "prefix-mismatch", "zero-b"]
    assert plan["requests"]["sequential"] == 3 * 3 * 4
    assert plan["expected"]["zero-b"] == "no-effect"
    assert not (tmp_path / "out").exists()


def test_the_archive_leaves_out_weights_and_caches(tmp_path):
    for name in ("build/model/model.safetensors", "vllm-cache/x", "exchanges/setup/0001.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / "summary.json").write_text("{}")
    with tarfile.open(script.pack(tmp_path)) as tar:
        names = tar.getnames()
    assert "noeffect/summary.json" in names and "noeffect/exchanges/setup/0001.json" in names
    assert not [n for n in names if "build" in n or "vllm-cache" in n]


def exchange(model: str, ids: list[int], logprobs: list[float]) -> dict:
    choice = {"token_ids": ids, "logprobs": {"token_logprobs": logprobs}}
    body = json.dumps({"choices": [choice]})
    return {"request": {"model": model, "prompt": "p"}, "status": 200, "body": body}


def test_compare_counts_answers_equal_to_the_base_and_their_largest_difference(tmp_path):
    folder = tmp_path / "exchanges" / "sequential"
    folder.mkdir(parents=True)
    answers = [
        exchange("tiny-qwen35", [1, 2], [-1.0, -2.0]),
        exchange("tiny-qwen35", [1, 2], [-1.0, -2.0005]),
        exchange("zero-b", [1, 2], [-1.0, -2.0]),
        exchange("healthy", [3, 2], [-0.5, -2.0]),
    ]
    for number, answer in enumerate(answers):
        (folder / f"{number:04d}.json").write_text(json.dumps(answer))
    table = script.compare(tmp_path)["sequential"]
    assert table["tiny-qwen35"]["same_tokens"] == 2
    assert table["tiny-qwen35"]["max_delta"] == pytest.approx(0.0005)
    assert table["zero-b"] == {"answers": 1, "same_tokens": 1, "max_delta": 0.0}
    assert table["healthy"]["same_tokens"] == 0


@pytest.mark.slow
def test_self_check_builds_the_adapters_as_described(tmp_path):
    pytest.importorskip("peft", reason="building the stand-in adapters needs peft")
    out = tmp_path / "out"
    assert script.main([str(out), "--self-check"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["build"]["problems"] == []
    headers = {
        name: json.loads((out / "adapters" / name / "safetensors-header.json").read_text())
        for name in script.ADAPTERS
    }
    healthy = sorted(headers["healthy"])
    assert sorted(n.replace("language_model.", "", 1) for n in healthy) == sorted(
        headers["prefix-mismatch"]
    )
    assert sorted(headers["zero-b"]) == healthy
    config = json.loads((out / "adapters" / "prefix-mismatch" / "adapter_config.json").read_text())
    assert "q_proj" in config["target_modules"]
    with tarfile.open(out / script.ARCHIVE) as tar:
        assert not [n for n in tar.getnames() if n.endswith(".safetensors")]
