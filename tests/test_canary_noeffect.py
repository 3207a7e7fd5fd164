"""NO-EFFECT against the answers of a real `vllm serve` (0.26.0, patched, on the test GPU).

tests/data/canary-noeffect-0.26.0.json.xz holds what scripts/proofs/canary_noeffect_gpu.py
recorded (packed by scripts/proofs/pack_noeffect_recording.py; docs/evidence.md): one
server with `healthy` (random lora_A and lora_B), `prefix-mismatch` (the same factors under
the text-only model's names, which 0.26.0 loads and never looks up) and `zero-b` (loaded
through /v1/load_lora_adapter), each prompt asked again and again of every model, alone and
in batches. From those answers: the server's repeat noise is measured and bounded by
effect.REPEAT_NOISE, a healthy adapter parts from its base by more, the no-op adapters do
not, and the canary replayed on them says ok, NO-EFFECT, NO-EFFECT whichever recorded
answers it gets. The adapters' files (headers, configs) are checked by `adapter check`
against the real 0.26.0 tree: it predicts what the server did.
"""

from __future__ import annotations

import itertools
import json
import lzma
from pathlib import Path

import pytest

from patchkit.adapters.check import check
from patchkit.canary import effect
from patchkit.canary.report import ModelCheck
from patchkit.cli.adapter_words import finding_words
from patchkit.vllmtree.tree import locate
from tests import adapter_helpers as ah
from tests.canary_helpers import ReplayServer
from tests.conftest import release_tree, run_cli

FIXTURE = Path(__file__).parent / "data" / "canary-noeffect-0.26.0.json.xz"
if not FIXTURE.exists():
    pytest.skip(
        f"{FIXTURE.name} is not in yet: run scripts/proofs/canary_noeffect_gpu.py on the GPU "
        "host and pack its archive with scripts/proofs/pack_noeffect_recording.py",
        allow_module_level=True,
    )
RECORDED = json.loads(lzma.open(FIXTURE, "rt").read())
BASE = "tiny-qwen35"
KEY = "canary-gpu-throwaway-key"
INERT = ("prefix-mismatch", "zero-b")


def verdict_of(exchange: dict) -> ModelCheck:
    """An answer as the canary reads it (tokens, log-probabilities, prompt length)."""
    from patchkit.canary.answers import read_completion

    done = read_completion(json.loads(exchange["body"]))
    return ModelCheck(
        model=exchange["request"]["model"],
        token_ids=done.token_ids,
        logprobs=done.logprobs,
        prompt_tokens=done.prompt_tokens,
    )


def answers(*groups: str) -> dict[tuple[str, str], list[ModelCheck]]:
    """{(model, prompt): the recorded answers}, the 200s of the groups named."""
    found: dict[tuple[str, str], list[ModelCheck]] = {}
    for group in groups:
        for exchange in RECORDED["exchanges"][group]:
            if exchange["status"] == 200 and exchange["path"] == "/v1/completions":
                key = (exchange["request"]["model"], exchange["request"]["prompt"])
                found.setdefault(key, []).append(verdict_of(exchange))
    return found


def pairs(a: list[ModelCheck], b: list[ModelCheck], same_list: bool):
    return itertools.combinations(a, 2) if same_list else itertools.product(a, b)


def differences(model: str, against: str, groups=("sequential", "concurrent")):
    """effect.compare of each recorded answer of ``model`` with each of ``against`` to the
    same prompt (each pair once where they are the same model)."""
    found = answers(*groups)
    out = []
    for (name, prompt), mine in found.items():
        if name != model:
            continue
        theirs = found.get((against, prompt), [])
        for a, b in pairs(mine, theirs, model == against):
            b.model = against
            compared = effect.compare(a, b)
            assert compared is not None, (model, against)
            out.append(compared)
    return out


# ----- the repeat noise, measured -----


@pytest.mark.parametrize("model", [BASE, "healthy"])
def test_asked_one_after_another_a_model_answers_bit_identically(model):
    """The canary's way of asking (one request at a time): the same prompt asked again of
    one model gets the same tokens and the same log-probabilities, to the bit."""
    repeats = differences(model, model, ("sequential",))
    assert len(repeats) >= 10
    assert all(r["first_different_token"] is None for r in repeats)
    assert max(r["max_logprob_difference"] for r in repeats) == 0.0


@pytest.mark.parametrize("model", [BASE, "healthy"])
def test_the_repeat_noise_bound_covers_batched_repeats_up_to_where_tokens_part(model):
    """Batched with other requests (a busy server batches the canary's with its traffic),
    a model's log-probabilities move before any token parts: REPEAT_NOISE covers the
    largest such move recorded, batched against batched and against unbatched."""
    repeats = differences(model, model)
    worst = max(r["max_logprob_difference"] for r in repeats)
    assert 0.0 < worst <= effect.REPEAT_NOISE


def test_batching_can_part_a_models_own_greedy_tokens():
    """Why the canary asks one request at a time and never compares a batched answer:
    batched, the base model's own repeats part at a token (recorded: at token 5)."""
    batched = differences(BASE, BASE, ("concurrent",))
    assert any(r["first_different_token"] is not None for r in batched)


def test_a_healthy_adapter_parts_from_its_base_by_more_than_the_noise():
    compared = differences("healthy", BASE)
    assert compared and not any(r["same"] for r in compared)


@pytest.mark.parametrize("model", INERT)
def test_the_no_op_adapters_answer_as_their_base_within_the_noise(model):
    """Asked as the canary asks, every answer is its base's; batched, every answer whose
    tokens stay the base's is within the noise."""
    alone = differences(model, BASE, ("sequential",))
    assert alone and all(r["same"] for r in alone)
    batched = differences(model, BASE)
    assert all(r["same"] for r in batched if r["first_different_token"] is None)


# ----- the canary on the recorded answers -----


class Replay(ReplayServer):
    """Answers each request with a recorded answer: the canary's own run, or for each model
    the answer at ``pick[model]`` among those recorded for the prompt asked."""

    def __init__(self, group: str, pick: dict[str, int] | None = None):
        self.exchanges = RECORDED["exchanges"][group] + RECORDED["exchanges"]["canary"]
        self.pick = pick or {}
        super().__init__()

    def answer(self, method: str, path: str, request) -> tuple[int, bytes]:
        def fits(e: dict) -> bool:
            if (e["method"], e["path"]) != (method, path):
                return False
            if request is None:
                return True
            asked = e["request"] or {}
            return all(asked.get(k) == request.get(k) for k in ("model", "prompt", "logprobs"))

        found = [e for e in self.exchanges if fits(e)]
        if not found:
            return 404, b'{"detail": "not recorded"}'
        model = (request or {}).get("model")
        chosen = found[self.pick.get(model, 0) % len(found)]
        return chosen["status"], chosen["body"].encode()


def canary(url: str, *args: str) -> tuple[int, dict]:
    result = run_cli("canary", "--url", url, "--api-key", KEY, "--json", *args)
    return result.exit_code, json.loads(result.stdout)


def verdicts(report: dict) -> dict[str, str]:
    return {m["model"]: m["verdict"] for m in report["models"]}


EXPECTED = {BASE: "ok", "healthy": "ok", "prefix-mismatch": "no-effect", "zero-b": "no-effect"}


def test_the_recorded_canary_run_replayed_says_ok_no_effect_no_effect():
    with Replay("canary") as server:
        code, report = canary(server.url)
    assert code == 1 and verdicts(report) == EXPECTED
    assert report["error"]["models"] == {"no-effect": list(INERT)}


@pytest.mark.parametrize("offsets", [(0, 1), (1, 0), (2, 3), (3, 2), (1, 3)])
def test_any_pairing_of_recorded_repeats_gets_the_same_verdicts(offsets):
    """The canary's prompt asked of each model several times: whichever answer of the base
    and whichever of each adapter it gets, the verdicts stand."""
    base, adapters = offsets
    pick = {BASE: base} | {name: adapters for name in ("healthy", *INERT)}
    with Replay("sequential", pick) as server:
        code, report = canary(server.url)
    assert code == 1 and verdicts(report) == EXPECTED


def test_the_recorded_runs_of_the_gpu_host_said_so_live():
    assert RECORDED["canary"]["canary-json.exit"].strip() == "1"
    live = json.loads(RECORDED["canary"]["canary-json.stdout"])
    assert verdicts(live) == EXPECTED
    assert RECORDED["canary"]["canary-zero-b.exit"].strip() == "1"


def test_the_server_log_said_nothing_about_the_no_op_adapters():
    assert not [w for w in RECORDED["server_warnings"] if any(n in w for n in INERT)]


# ----- adapter check predicts what the server did -----


def rebuilt(tmp_path: Path, name: str) -> Path:
    """The adapter from its recorded config and header: the names and shapes PEFT wrote,
    every value FILL's small number (zero-b: every lora_B zero, as recorded)."""
    files = RECORDED["adapters"][name]
    tensors = {
        key: ah.tensor(info["shape"], info["dtype"], zero=name == "zero-b" and "lora_B" in key)
        for key, info in files["safetensors-header.json"].items()
    }
    folder = tmp_path / name
    folder.mkdir()
    ah.write_safetensors(folder / "adapter_model.safetensors", tensors)
    (folder / "adapter_config.json").write_text(json.dumps(files["adapter_config.json"]))
    return folder


@pytest.fixture
def model(tmp_path):
    """The stand-in's config.json as recorded (as transformers writes it, else rebuilt)."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = RECORDED.get("model_config")
    if config is None:
        pytest.importorskip("transformers", reason="the stand-in's config.json comes from it")
        from patchkit.verify.toolkit import qwen35_config

        config = json.loads(qwen35_config().to_json_string())
        config["architectures"] = ["Qwen3_5ForConditionalGeneration"]  # save_pretrained's
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
def test_adapter_check_predicts_the_servers_answers(tmp_path, model):
    tree = locate(str(release_tree("0.26.0")))
    reports = {n: check(rebuilt(tmp_path, n), model, tree) for n in RECORDED["adapters"]}
    assert reports["healthy"].ok
    codes = {n: [str(f.message.code) for f in reports[n].findings] for n in INERT}
    assert codes == {"prefix-mismatch": ["adapter-served-as-base"],
                     "zero-b": ["adapter-zero-factors"]}  # fmt: skip
    assert "lora_B is all zero" in finding_words(reports["zero-b"].findings[0].message)
    found = reports["refused-suffix"].findings
    refusal = [finding_words(f.message) for f in found if f.kind == "release"]
    assert refusal and "dense_4h_to_h" in refusal[0]
    # ... and the server refused it at /v1/load_lora_adapter, naming the same module
    [load] = [
        e for e in RECORDED["exchanges"]["refusal"] if e["path"].endswith("load_lora_adapter")
    ]
    assert load["status"] >= 400 and "dense_4h_to_h" in load["body"]
