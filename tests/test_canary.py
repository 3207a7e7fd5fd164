"""`patchkit canary` against a real HTTP server that answers like vLLM.

FakeVLLM (tests/canary_helpers.py) is an http.server in a thread. Its answers copy the
field names of vLLM 0.26.0's own code (the wheel's files, line numbers of 0.26.0):

* GET /v1/models: ModelList / ModelCard, vllm/entrypoints/openai/engine/
  protocol.py:89-102; adapters carry `parent` and `max_model_len: null`
  (openai/models/serving.py:149-165).
* POST /v1/completions: CompletionResponse / CompletionResponseChoice /
  CompletionLogProbs, openai/completion/protocol.py:568-620; `token_ids`
  only with `return_token_ids`, tokens as `token_id:N` with
  `return_tokens_as_token_ids` (generate/base/serving.py:273).
* Errors: ErrorResponse `{"error": {"message", "type", "param", "code"}}`
  (engine/protocol.py:63-71). A NaN log-probability makes the JSON encoder
  raise `Out of range float values are not JSON compliant` and vLLM 0.18+
  answers 400 BadRequestError (serve/utils/error_response.py:61); 0.17 a
  plain-text 500. A wrong API key: 401 `{"error": "Unauthorized"}`
  (serve/utils/server_utils.py:91), for /v1 paths only.
* /metrics: rendered by prometheus_client itself from a Counter named
  `vllm:corrupted_requests` with labels model_name and engine, as
  v1/metrics/loggers.py:571-582 declares it.

A later GPU run (scripts/proofs/canary_gpu.py --record) records a real vLLM
server's exchanges; those recordings are to replace these hand-made shapes.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from patchkit.canary import check, metrics, prompt
from patchkit.canary.report import ModelCheck, Report
from patchkit.codes import Code
from tests.canary_helpers import BASE, SANE_IDS, FakeVLLM, words
from tests.conftest import run_cli, run_subprocess

KEY = "sk-canary-secret-4711"


def canary_cli(url: str, *args: str, env: dict | None = None):
    return run_cli("canary", "--url", url, *args, env=env)


def canary_json(url: str, *args: str, env: dict | None = None) -> tuple[int, dict]:
    result = canary_cli(url, "--json", *args, env=env)
    return result.exit_code, json.loads(result.stdout)


def verdicts(report: dict) -> dict[str, str]:
    return {m["model"]: m["verdict"] for m in report["models"]}


@pytest.fixture(autouse=True)
def no_ambient_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


HEALTHY = {BASE: "ok", "sql-lora": "ok", "chat-lora": "ok"}


# ----- healthy servers -----


def test_healthy_base_and_two_adapters_pass_with_sound_requests():
    with FakeVLLM(HEALTHY) as server:
        code, report = canary_json(server.url)
    assert code == 0, report
    assert report["ok"] is True and report["error"] is None
    assert verdicts(report) == {BASE: "ok", "sql-lora": "ok", "chat-lora": "ok"}
    assert [m["kind"] for m in report["models"]] == ["base", "adapter", "adapter"]
    assert report["vllm_version"] == "0.26.0"
    assert report["corrupted_requests"]["present"] is True
    sent = server.completions()
    assert [r["body"]["model"] for r in sent] == [BASE, "sql-lora", "chat-lora"]
    for request in sent:
        body = request["body"]
        assert body["temperature"] == 0 and body["logprobs"] == 1
        assert body["max_tokens"] == prompt.NEW_TOKENS
        assert body["return_tokens_as_token_ids"] is True and body["return_token_ids"] is True
        assert 1800 <= prompt.estimate(body["prompt"]) <= 2000
    salts = {r["body"]["cache_salt"] for r in sent}
    assert len(salts) == 3  # each long prefill really runs: no prefix-cache hit


def test_requests_are_sequential_and_few():
    with FakeVLLM(HEALTHY) as server:
        code, _ = canary_json(server.url)
    assert code == 0
    spans = sorted((r["start"], r["end"]) for r in server.requests)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    # /v1/models, /version, /metrics before, and per model a completion and /metrics
    assert len(server.requests) == 3 + 2 * len(HEALTHY)


def test_text_output_of_a_healthy_server():
    with FakeVLLM(HEALTHY) as server:
        result = canary_cli(server.url)
    assert result.exit_code == 0, result.output
    assert "OK: all 3 models answer sanely" in result.stdout
    assert "vLLM 0.26.0 at http://127.0.0.1" in result.stdout
    assert "vllm:corrupted_requests_total: 0 -> 0" in result.stdout


# ----- NaN evidence -----


@pytest.mark.slow
def test_adapter_answering_bangs_with_token_id_zero_is_named():
    with FakeVLLM({BASE: "ok", "sql-lora": "ok", "bad-lora": "bang"}) as server:
        result = canary_cli(server.url)
        code, report = canary_json(server.url)
    assert result.exit_code == 1 and code == 1
    assert verdicts(report) == {BASE: "ok", "sql-lora": "ok", "bad-lora": "bad"}
    bad = report["models"][2]
    assert bad["token_ids"] == [0] * 32 and bad["text"].startswith("!!!!")
    assert any("32 tokens of id 0 in a row" in e for e in words(bad["evidence"]))
    assert report["recheck"]["model"] == BASE and report["recheck"]["verdict"] == "ok"
    assert "FAILED: adapter 'bad-lora' answers NaN" in result.stdout
    assert "sql-lora" not in result.stdout.split("FAILED:")[1]
    for step in ("`patchkit doctor`", "`patchkit apply", "restart the server"):
        assert step in result.stdout
    assert result.stderr.startswith("patchkit: error: adapter 'bad-lora' answers NaN")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("behaviour,status", [("nan400", 400), ("nan500", 500)])
def test_nan_json_error_is_bad_and_the_text_is_fetched(behaviour, status):
    with FakeVLLM({BASE: "ok", "bad-lora": behaviour}) as server:
        code, report = canary_json(server.url)
    assert code == 1
    bad = report["models"][1]
    assert bad["verdict"] == "bad" and bad["http_status"] == status
    assert any("not JSON compliant" in e and "NaN" in e for e in words(bad["evidence"]))
    retry = server.completions()[-2]  # the second look, before the base recheck
    assert retry["body"]["model"] == "bad-lora" and "logprobs" not in retry["body"]
    assert bad["token_ids"] == [0] * 32


@pytest.mark.parametrize("behaviour,verdict", [("plain500", "bad"), ("plain500-sane", "error")])
def test_plain_500_of_vllm_017_is_judged_by_the_text(behaviour, verdict):
    with FakeVLLM({BASE: "ok", "lora": behaviour}) as server:
        code, report = canary_json(server.url)
    assert code == 1
    assert verdicts(report)["lora"] == verdict
    assert "HTTP 500: 'Internal Server Error'" in report["models"][1]["evidence"][0]["message"]


def test_nan_log_probabilities_are_bad():
    with FakeVLLM({BASE: "ok", "lora": "nanlogprobs"}) as server:
        code, report = canary_json(server.url)
    assert code == 1
    assert verdicts(report) == {BASE: "ok", "lora": "bad"}
    assert "32 of 32 log-probabilities are NaN" in words(report["models"][1]["evidence"])


@pytest.mark.parametrize(
    "behaviour,evidence",
    [
        ("inf-positive", "1 of 32 log-probabilities are infinite"),
        ("inf-positive", "1 of 32 log-probabilities are positive (largest 5;"),
        ("minus-inf", "1 of 32 log-probabilities are infinite"),
        ("positive", "2 of 32 log-probabilities are positive (largest 0.5;"),
    ],
)
def test_infinite_or_positive_log_probabilities_are_bad(behaviour, evidence):
    """A log-probability is never above 0 and never infinite (vLLM floors -inf to -9999.0):
    [Infinity, 5.0, -0.1] was judged ok."""
    with FakeVLLM({BASE: "ok", "lora": behaviour}) as server:
        code, report = canary_json(server.url)
    assert code == 1 and verdicts(report) == {BASE: "ok", "lora": "bad"}
    assert evidence in " ".join(words(report["models"][1]["evidence"]))


@pytest.mark.parametrize(
    "behaviour,evidence",
    [
        ("nulllogprobs", "no log-probabilities in the answer"),
        ("nullentries", "29 of 32 log-probabilities missing (null)"),
    ],
)
def test_missing_log_probabilities_are_bad(behaviour, evidence):
    with FakeVLLM({BASE: behaviour}) as server:
        code, report = canary_json(server.url)
    assert code == 1 and verdicts(report) == {BASE: "bad"}
    assert evidence in report["models"][0]["evidence"][0]["message"]
    assert report["recheck"] is None  # no adapter was bad: nothing to recheck


def test_bang_text_without_token_ids_is_bad():
    with FakeVLLM({BASE: "ok", "lora": "bang-no-ids"}) as server:
        code, report = canary_json(server.url)
    assert code == 1 and verdicts(report)["lora"] == "bad"
    assert report["models"][1]["token_ids"] is None
    assert "the text is a run of '!'" in report["models"][1]["evidence"][0]["message"]


def test_impossible_greedy_log_probability_is_bad():
    with FakeVLLM({BASE: "floor"}) as server:
        code, report = canary_json(server.url)
    assert code == 1 and verdicts(report) == {BASE: "bad"}
    assert "log-probability -9999.0" in report["models"][0]["evidence"][0]["message"]


def test_base_going_bad_after_a_bad_adapter_says_polluted():
    with FakeVLLM({BASE: "polluted", "bad-lora": "bang"}) as server:
        result = canary_cli(server.url)
    assert result.exit_code == 1
    assert "again after the bad adapter" in result.stdout
    assert "the base model 'Qwen/Qwen3.5-tiny' went bad after it" in result.stderr
    assert "the server's state is polluted" in result.stdout


def test_base_model_bad_says_lora_is_not_the_only_cause():
    with FakeVLLM({BASE: "bang", "lora": "ok"}) as server:
        result = canary_cli(server.url)
    assert result.exit_code == 1
    assert "base 'Qwen/Qwen3.5-tiny' answers NaN" in result.stdout
    assert "LoRA is not the only cause" in result.stdout


# ----- /metrics -----


@pytest.mark.slow
def test_counter_rising_during_one_model_blames_that_model_only():
    with FakeVLLM({BASE: "ok", "a": "ok", "b": "corrupt", "c": "ok"}) as server:
        code, report = canary_json(server.url)
    assert code == 1
    assert verdicts(report) == {BASE: "ok", "a": "ok", "b": "bad", "c": "ok"}
    deltas = {m["model"]: m["corrupted_delta"] for m in report["models"]}
    assert deltas == {BASE: 0, "a": 0, "b": 1, "c": 0}
    assert report["corrupted_requests"] == {
        "name": "vllm:corrupted_requests_total",
        "present": True,
        "before": 0,
        "after": 1,
    }


@pytest.mark.parametrize("metrics", ["untyped", "two-engines"])
def test_counter_variants_are_read(metrics):
    with FakeVLLM({BASE: "ok", "b": "corrupt"}, metrics=metrics) as server:
        code, report = canary_json(server.url)
    assert code == 1
    engines = 2 if metrics == "two-engines" else 1
    assert report["models"][1]["corrupted_delta"] == engines


def test_a_nan_counter_is_unreadable_not_a_value():
    """`nan -> nan` was printed, and NaN > NaN is false: no rise could ever show."""
    with FakeVLLM(HEALTHY, metrics="nan") as server:
        result = canary_cli(server.url)
        code, report = canary_json(server.url)
    assert result.exit_code == 0 and code == 0
    assert "nan -> nan" not in result.stdout
    assert not any(line.startswith(f"{metrics.COUNTER}:") for line in result.stdout.splitlines())
    assert "vllm:corrupted_requests_total on /metrics is nan, not a count: unreadable" in (
        result.stdout
    )
    assert report["corrupted_requests"]["present"] is False
    assert report["corrupted_requests"]["before"] is None


def test_a_counter_turning_nan_while_a_model_ran_is_an_error_for_that_model():
    with FakeVLLM({BASE: "ok", "lora": "ok"}, metrics="nan-later") as server:
        code, report = canary_json(server.url)
    assert code == 1
    assert verdicts(report) == {BASE: "error", "lora": "error"}
    evidence = report["models"][0]["evidence"][0]
    assert evidence["code"] == "canary-counter-unreadable"
    assert "unreadable, so a rise in it cannot be seen" in evidence["message"]
    assert report["corrupted_requests"]["after"] == 0  # the last readable value


def test_absent_counter_is_said_and_does_not_fail():
    with FakeVLLM(HEALTHY, metrics="absent") as server:
        result = canary_cli(server.url)
        code, report = canary_json(server.url)
    assert result.exit_code == 0 and code == 0
    assert "VLLM_COMPUTE_NANS_IN_LOGITS=1" in result.stdout
    assert report["corrupted_requests"]["present"] is False
    assert any("VLLM_COMPUTE_NANS_IN_LOGITS=1" in n for n in words(report["notes"]))


# ----- reaching the server -----


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_fails_fast_with_one_line():
    started = time.monotonic()
    result = canary_cli(f"http://127.0.0.1:{closed_port()}")
    assert time.monotonic() - started < 5
    assert result.exit_code == 1
    assert result.stderr.startswith("patchkit: error: cannot reach the vLLM server at http://127")
    assert "is it running" in result.stderr and len(result.stderr.splitlines()) == 1
    assert "Traceback" not in result.output


def test_unreachable_server_json():
    result = canary_cli(f"http://127.0.0.1:{closed_port()}", "--json")
    data = json.loads(result.stdout)
    assert result.exit_code == 1
    assert data["ok"] is False and data["exit_code"] == 1
    assert "cannot reach" in data["error"]["message"]


@pytest.mark.slow
def test_server_that_accepts_but_never_answers_respects_timeout():
    with socket.socket() as listener:  # the kernel accepts; nobody reads or answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        started = time.monotonic()
        result = canary_cli(f"http://127.0.0.1:{listener.getsockname()[1]}", "--timeout", "2")
        elapsed = time.monotonic() - started
    assert result.exit_code == 1 and 1.5 < elapsed < 5
    assert "got no answer within 2 s" in result.stderr


@pytest.mark.slow
def test_address_that_drops_connection_attempts_fails_at_the_connect_timeout(monkeypatch):
    """A full accept queue drops SYNs, as a firewall or a dead pod IP does."""
    monkeypatch.setattr("patchkit.canary.server.CONNECT_TIMEOUT", 1.0)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        # the first filler's handshake done fills the queue (backlog 0): from then on the
        # kernel drops new SYNs; wait for that, not for a while
        assert select.select([], [fillers[0]], [], 30)[1], "the queue never filled"
        started = time.monotonic()
        result = canary_cli(f"http://127.0.0.1:{port}", "--timeout", "20")
        elapsed = time.monotonic() - started
        for filler in fillers:
            filler.close()
    assert result.exit_code == 1 and elapsed < 4
    assert "cannot connect within 1 s" in result.stderr


@pytest.mark.slow
def test_server_trickling_its_answer_is_cut_at_the_deadline():
    """Each byte comes within the read timeout; only the whole-run deadline stops it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        stop = threading.Event()

        def trickle():
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            while not stop.wait(0.1):
                try:
                    conn.sendall(b" ")
                except OSError:
                    break
            conn.close()

        threading.Thread(target=trickle, daemon=True).start()
        started = time.monotonic()
        result = canary_cli(f"http://127.0.0.1:{listener.getsockname()[1]}", "--timeout", "2")
        elapsed = time.monotonic() - started
        stop.set()
    assert result.exit_code == 1 and elapsed < 4
    assert "got no answer within 2 s" in result.stderr


@pytest.mark.slow
def test_hanging_model_ends_the_run_at_the_deadline():
    with FakeVLLM({BASE: "ok", "slow": "hang", "after": "ok"}) as server:
        started = time.monotonic()
        code, report = canary_json(server.url, "--timeout", "3")
        elapsed = time.monotonic() - started
    assert code == 1 and elapsed < 5
    assert verdicts(report) == {BASE: "ok", "slow": "error", "after": "not-checked"}
    assert "got no answer" in report["models"][1]["evidence"][0]["message"]


def test_default_budget_is_sixty_seconds(monkeypatch):
    seen = {}

    def fake_run(url, api_key, models, prompt_tokens, timeout, record):
        seen["timeout"] = timeout
        return Report(url=url, models=[ModelCheck(model="m")])

    monkeypatch.setattr(check, "run", fake_run)
    assert canary_cli("http://127.0.0.1:1").exit_code == 0
    assert seen["timeout"] == 60.0 == check.DEFAULT_TIMEOUT


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_url_with_v1_suffix(suffix):
    with FakeVLLM(HEALTHY) as server:
        code, report = canary_json(server.url + suffix)
    assert code == 0
    assert report["url"] == server.url
    assert {r["path"] for r in server.requests} == {
        "/v1/models",
        "/version",
        "/metrics",
        "/v1/completions",
    }


# ----- choosing models -----


def test_model_subset():
    with FakeVLLM({BASE: "ok", "a": "ok", "b": "bang"}) as server:
        code, report = canary_json(server.url, "--model", "a", "--model", BASE)
    assert code == 0
    assert [m["model"] for m in report["models"]] == ["a", BASE]
    assert [r["body"]["model"] for r in server.completions()] == ["a", BASE]


def test_unknown_model_is_named_and_fails():
    with FakeVLLM(HEALTHY) as server:
        result = canary_cli(server.url, "--model", "sql-lora", "--model", "nope-lora")
    assert result.exit_code == 1
    assert "'nope-lora' not-served: not in GET /v1/models" in result.stderr
    assert "served: Qwen/Qwen3.5-tiny, sql-lora, chat-lora" in result.stdout
    # the adapter's parent is asked once more, only to compare the adapter's answer with it
    assert [r["body"]["model"] for r in server.completions()] == ["sql-lora", BASE]


def test_prompt_shortened_to_fit_max_model_len():
    with FakeVLLM({BASE: "ok", "lora": "ok"}, max_model_len=1024) as server:
        code, report = canary_json(server.url)
    assert code == 0
    for request in server.completions():
        assert prompt.estimate(request["body"]["prompt"]) * 1.5 + 32 <= 1024
    assert "fit max_model_len 1024" in report["models"][1]["evidence"][0]["message"]


# ----- the API key -----


@pytest.mark.slow
def test_api_key_is_sent_as_bearer_and_never_printed(tmp_path: Path):
    with FakeVLLM({BASE: "ok", "leaky": "leaky"}, api_key=KEY) as server:
        text = canary_cli(server.url, "--api-key", KEY, "--record", str(tmp_path))
        code, report = canary_json(server.url, env={"VLLM_API_KEY": KEY})
    assert text.exit_code == 1 and code == 1
    assert verdicts(report) == {BASE: "ok", "leaky": "error"}
    v1 = [r for r in server.requests if r["path"].startswith("/v1")]
    assert v1 and all(r["headers"]["Authorization"] == f"Bearer {KEY}" for r in v1)
    assert "engine failed for Bearer ***" in text.stdout  # the server echoed it; scrubbed
    recorded = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "Bearer ***" in recorded
    for output in (text.stdout, text.stderr, json.dumps(report), recorded):
        assert KEY not in output


def test_wrong_api_key_says_what_to_do():
    with FakeVLLM(HEALTHY, api_key=KEY) as server:
        result = canary_cli(server.url, "--api-key", "wrong-key-123")
    assert result.exit_code == 1
    assert "401 Unauthorized" in result.stderr and "--api-key" in result.stderr
    assert "wrong-key-123" not in result.output


# ----- JSON, usage errors, dependencies -----


def test_json_shape_of_a_failed_run():
    with FakeVLLM({BASE: "ok", "bad-lora": "nan400"}) as server:
        code, report = canary_json(server.url)
    assert code == 1
    assert list(report)[:2] == ["format", "command"]
    assert report["format"] == 1 and report["command"] == "canary"
    assert set(report) == {
        "format", "command", "ok", "exit_code", "error", "url", "vllm_version", "prompt_tokens",
        "new_tokens", "models", "recheck", "parents", "corrupted_requests", "notes", "skipped",
        "next_steps", "seconds",
    }  # fmt: skip
    assert report["skipped"] == 0
    assert report["ok"] is False and report["exit_code"] == 1
    assert report["error"] == {
        "code": "canary-failed",
        "message": "adapter 'bad-lora' answers NaN",
        "bad": [{"model": "bad-lora", "kind": "adapter"}],
        "no_effect": [],
        "polluted": None,
        "others": [],
        "models": {"bad": ["bad-lora"]},
    }
    assert set(report["models"][1]) == {
        "kind", "model", "parent", "root", "verdict", "evidence", "http_status", "prompt_tokens",
        "completion_tokens", "text", "token_ids", "logprobs", "effect", "corrupted_delta",
        "seconds",
    }  # fmt: skip
    assert report["models"][1]["parent"] == BASE and report["models"][0]["parent"] is None
    codes = [e["code"] for e in report["models"][1]["evidence"]]
    assert codes[0] == "canary-nan-error" and report["models"][1]["evidence"][0]["http_status"]
    steps = report["next_steps"]
    assert {"code", "message"} <= set(steps[0]) and steps[0]["command"] == "patchkit doctor"


@pytest.mark.parametrize(
    "args",
    [
        ("--url", "localhost:8000"),
        ("--url", "http://x", "--prompt-tokens", "0"),
        ("--url", "http://x", "--timeout", "0"),
        ("--url", "http://x", "--timeout", "nan"),  # accepted before: a deadline never reached
        ("--url", "http://[::1"),  # httpx.InvalidURL, exit 3 before
        ("--url", "http://127.0.0.1:99999"),  # a port out of range
        ("--url", "http://"),  # no host
        (),
    ],
)
def test_usage_errors_exit_2(args):
    result = run_cli("canary", *args, "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["exit_code"] == 2


def test_missing_dependencies_give_one_line():
    code = "import sys; sys.modules['httpx'] = None"
    result = run_subprocess("canary", "--url", "http://127.0.0.1:1", code=code)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "patchkit: error: patchkit canary needs httpx and prometheus-client: "
        "pip install 'httpx>=0.27' 'prometheus-client>=0.20'"
    )


def test_other_commands_do_not_import_httpx():
    probe = (
        "import sys; from patchkit.cli import main as cli; "
        "assert 'httpx' not in sys.modules and 'prometheus_client' not in sys.modules"
    )
    assert run_subprocess_code(probe) == 0


def run_subprocess_code(code: str) -> int:
    import subprocess

    return subprocess.run([sys.executable, "-c", code]).returncode


def test_record_writes_each_exchange(tmp_path: Path):
    with FakeVLLM({BASE: "ok"}) as server:
        assert canary_cli(server.url, "--record", str(tmp_path / "rec")).exit_code == 0
    files = sorted((tmp_path / "rec").iterdir())
    assert [f.name.split("-", 1)[1] for f in files] == [
        "GET-v1_models.json",
        "GET-version.json",
        "GET-metrics.json",
        "POST-v1_completions.json",
        "GET-metrics.json",
    ]
    exchange = json.loads(files[3].read_text())
    assert exchange["status"] == 200 and exchange["request"]["model"] == BASE
    assert json.loads(exchange["body"])["choices"][0]["token_ids"] == SANE_IDS[:32]


@pytest.mark.slow
def test_record_never_writes_through_a_link_and_a_dir_it_cannot_write_is_one_line(tmp_path):
    """--record DIR in a shared place: a symlink named like a record file made the
    canary overwrite the file it points to (write_text follows links)."""
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "001-GET-v1_models.json").symlink_to(outside)
    with FakeVLLM({BASE: "ok"}) as server:
        assert canary_cli(server.url, "--record", str(rec)).exit_code == 0
    assert outside.read_text() == "precious"
    assert not (rec / "001-GET-v1_models.json").is_symlink()
    assert json.loads((rec / "001-GET-v1_models.json").read_text())["status"] == 200
    blocked = tmp_path / "blocked"
    blocked.write_text("a file")
    with FakeVLLM({BASE: "ok"}) as server:
        result = canary_cli(server.url, "--record", str(blocked / "sub"))
    assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# ----- the prompt -----


def test_prompt_is_deterministic_varied_and_sized():
    text = prompt.prompt_text(2000)
    assert text == prompt.prompt_text(2000)
    assert 1900 <= prompt.estimate(text) <= 2000
    sentences = [s for s in text.replace("\n", " ").split(". ") if s]
    assert len(set(sentences)) > 0.9 * len(sentences)
    assert prompt.estimate(prompt.prompt_text(200)) <= 200
    assert prompt.prompt_text(16).startswith("Here is a long story")


def test_the_text_report_escapes_control_characters_the_server_sends():
    """Model ids come from the server's /v1/models: an ESC sequence or a newline in one
    went raw to the terminal (or forged an `OK:` line in a cron log)."""
    evil = "m\x1b[2J\nOK: all models answer sanely"
    with FakeVLLM({evil: "ok"}) as server:
        result = canary_cli(server.url)
    assert "\x1b" not in result.stdout
    assert "OK: all models answer sanely" not in result.stdout.splitlines()
    assert "m\\x1b[2J\\nOK: all models answer sanely" in result.stdout


def test_an_adapter_answering_exactly_as_its_base_is_no_effect():
    with FakeVLLM({BASE: "ok", "sql-lora": "ok", "inert-lora": "inert"}) as server:
        code, report = canary_json(server.url)
    assert code == 1
    assert verdicts(report) == {BASE: "ok", "sql-lora": "ok", "inert-lora": "no-effect"}
    assert report["error"]["code"] == "canary-failed"
    assert report["error"]["models"] == {"no-effect": ["inert-lora"]}
    assert "'inert-lora' answers as the base model (no effect)" in report["error"]["message"]
    inert, healthy = report["models"][2], report["models"][1]
    assert inert["evidence"][0]["code"] == "canary-no-effect"
    assert inert["effect"]["first_different_token"] is None
    assert inert["effect"]["max_logprob_difference"] == 0.0
    assert healthy["effect"]["same"] is False and healthy["effect"]["parent"] == BASE
    assert report["models"][0]["effect"] is None  # a base model has nothing to differ from
    steps = {step["code"]: step for step in report["next_steps"]}
    assert "targets this vLLM release does not wrap" in steps["canary-step-no-effect"]["message"]
    assert steps["canary-step-adapter-check"]["command"] == (
        f"patchkit adapter check /models/inert-lora --model /models/{BASE} --target SITE_PACKAGES"
    )


def test_the_text_report_names_no_effect_and_the_admission_check():
    with FakeVLLM({BASE: "ok", "inert-lora": "inert"}) as server:
        result = canary_cli(server.url)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[2].startswith("  NO-EFFECT   inert-lora")
    assert "the same 32 greedy tokens as its base model" in lines[2]
    assert "FAILED: adapter 'inert-lora' answers as the base model (no effect)" in lines
    assert any("`patchkit adapter check /models/inert-lora --model" in line for line in lines)
    assert "adapter 'inert-lora' answers as the base model (no effect)" in result.stderr


def test_an_adapter_named_alone_is_compared_with_its_parent_asked_once_more():
    with FakeVLLM({BASE: "ok", "inert-lora": "inert"}) as server:
        code, report = canary_json(server.url, "--model", "inert-lora")
    assert code == 1
    assert verdicts(report) == {"inert-lora": "no-effect"}
    assert [r["body"]["model"] for r in server.completions()] == ["inert-lora", BASE]
    assert [p["model"] for p in report["parents"]] == [BASE]


def test_an_adapter_whose_tokens_part_from_its_parents_is_not_no_effect():
    """The same log-probabilities, one token id other: the adapter changed the answer."""
    with FakeVLLM({BASE: "ok", "lora": "inert-other-token"}) as server:
        code, report = canary_json(server.url)
    assert code == 0 and verdicts(report) == {BASE: "ok", "lora": "ok"}
    assert report["models"][1]["effect"]["first_different_token"] == 5


def test_an_adapter_path_from_the_server_is_quoted_in_the_command_and_escaped():
    root = "/adapters/x; rm -rf ~\n$(id)"
    with FakeVLLM({BASE: "ok", "inert-lora": "inert"}, roots={"inert-lora": root}) as server:
        code, report = canary_json(server.url)
        result = canary_cli(server.url)
    step = next(s for s in report["next_steps"] if s["code"] == "canary-step-adapter-check")
    assert step["command"].startswith("patchkit adapter check '/adapters/x; rm -rf ~\n$(id)' ")
    assert "rm -rf ~\\n$(id)'" in result.stdout  # the newline escaped, one line


def test_evidence_of_nan_outranks_no_effect_and_error_outranks_it():
    check = ModelCheck("lora", parent=BASE)
    check.mark("no-effect", Code.CANARY_NO_EFFECT, parent=BASE)
    check.mark("error", Code.CANARY_UNANSWERED, error="no answer")
    assert check.verdict == "error"
    check.mark("no-effect", Code.CANARY_NO_EFFECT, parent=BASE)
    assert check.verdict == "error"
    check.mark("bad", Code.CANARY_COUNTER_ROSE, rise=1.0)
    assert check.verdict == "bad" and len(check.evidence) == 4


class MetricsAnswer:
    """What read_counter asks of a server: GET /metrics, answering ``status`` and ``body``
    (or raising ``raises``)."""

    def __init__(self, status: int = 200, body: str = "", raises: Exception | None = None):
        self.status, self.body, self.raises = status, body, raises

    def get(self, path: str):
        if self.raises:
            raise self.raises
        return self


@pytest.mark.parametrize(
    "answer, code, said",
    [
        (
            MetricsAnswer(raises=metrics.Unanswered("refused")),
            Code.CANARY_METRICS_NOT_READ,
            "/metrics not read: refused",
        ),
        (MetricsAnswer(503), Code.CANARY_METRICS_HTTP_STATUS, "/metrics answered HTTP 503"),
        (
            MetricsAnswer(body=f"{metrics.COUNTER} 1\n" * (metrics.MAX_COUNTER_LINES + 1)),
            Code.CANARY_COUNTER_TOO_LONG,
            f"{metrics.COUNTER} has more than {metrics.MAX_COUNTER_LINES} lines on /metrics: "
            "unreadable",
        ),
        (
            MetricsAnswer(body=f"{metrics.COUNTER} one\n"),
            Code.CANARY_COUNTER_NOT_PROMETHEUS,
            f"{metrics.COUNTER} on /metrics is not Prometheus text (ValueError: ",
        ),
    ],
)
def test_why_the_counter_was_not_read_is_a_code_and_its_words(answer, code, said):
    """Each way /metrics fails the canary is a code of its own; its words are the note's."""
    from patchkit.cli.words import say

    reading = metrics.read_counter(answer)
    assert reading.value is None and reading.why.code == code
    assert say(reading.why).startswith(said)
