"""`patchkit canary` against the recorded answers of a real `vllm serve`.

tests/data/canary-h200-0.26.0/ holds every HTTP exchange of the canary's run
against vLLM 0.26.0's OpenAI server on the test H200 (scripts/proofs/canary_gpu.py,
docs/evidence.md): a tiny Qwen3.5 with two healthy adapters, then with
an adapter whose lora_B holds an inf, on the Triton LoRA kernels. A local
server replays those answers, request by request, so the protocol shapes the
canary judges are the real server's, not hand-made ones.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from pathlib import Path

import pytest

from tests.canary_helpers import ReplayServer, words
from tests.conftest import run_cli

RECORDED = Path(__file__).parent / "data" / "canary-h200-0.26.0"
KEY = "canary-gpu-throwaway-key"  # the throwaway key of the recorded run


def key(method: str, path: str, request) -> tuple:
    """What picks a recorded answer: the route, the model, and whether logprobs were asked."""
    if not isinstance(request, dict):
        return method, path, None, None
    return method, path, request.get("model"), request.get("logprobs") is not None


class Replay(ReplayServer):
    """A server that answers each request with the next recorded answer of the same kind."""

    def __init__(self, phase: str):
        self.answers: dict[tuple, deque] = defaultdict(deque)
        for path in sorted((RECORDED / phase).glob("*.json")):
            exchange = json.loads(path.read_text())
            request = exchange["request"]
            self.answers[key(exchange["method"], exchange["path"], request)].append(exchange)
        super().__init__()

    def answer(self, method: str, path: str, request) -> tuple[int, bytes]:
        queue = self.answers.get(key(method, path, request))
        if not queue:
            return 404, b'{"detail": "not recorded"}'
        exchange = queue.popleft() if len(queue) > 1 else queue[0]  # the last one repeats
        body = exchange["body"]
        return exchange["status"], (body if isinstance(body, str) else json.dumps(body)).encode()


def canary(phase: str) -> tuple[int, dict]:
    with Replay(phase) as server:
        result = run_cli("canary", "--url", server.url, "--api-key", KEY, "--json")
    return result.exit_code, json.loads(result.stdout)


def test_the_recorded_healthy_server_passes():
    code, report = canary("healthy")
    assert code == 0, report
    assert {m["model"]: m["verdict"] for m in report["models"]} == {
        "tiny-qwen35": "ok", "healthy-a": "ok", "healthy-b": "ok"
    }  # fmt: skip
    assert report["corrupted_requests"]["present"] is True
    assert report["vllm_version"] == "0.26.0"


@pytest.mark.slow
def test_the_recorded_poisoned_adapter_is_named_and_only_it():
    code, report = canary("poisoned")
    assert code == 1
    verdicts = {m["model"]: m["verdict"] for m in report["models"]}
    assert verdicts == {"tiny-qwen35": "ok", "poisoned": "bad", "healthy-a": "ok",
                        "healthy-b": "ok"}  # fmt: skip
    poisoned = next(m for m in report["models"] if m["model"] == "poisoned")
    evidence = " ".join(words(poisoned["evidence"]))
    assert "Out of range float values are not JSON compliant" in evidence  # vLLM's real 400
    assert "tokens of id 0 in a row" in evidence  # the second look, without logprobs: !!!!
    assert "vllm:corrupted_requests_total rose by 2" in evidence  # the real counter
    assert report["recheck"]["verdict"] == "ok"  # the base model stays sane after it


@pytest.mark.parametrize("phase", ["healthy", "poisoned"])
def test_the_recordings_are_the_real_servers(phase):
    """What the replay stands on: vLLM 0.26.0's own answers, key and all."""
    exchanges = [json.loads(p.read_text()) for p in sorted((RECORDED / phase).glob("*.json"))]
    models = json.loads(next(e for e in exchanges if e["path"] == "/v1/models")["body"])
    assert {m["id"] for m in models["data"] if m["parent"]} >= {"healthy-a", "healthy-b"}
    assert all(KEY not in json.dumps(e) for e in exchanges)  # the recorder kept no headers
