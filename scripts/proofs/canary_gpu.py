"""Proof of `patchkit canary` against a real `vllm serve` on the test H200.

Steps, all offline:
  1. build a tiny random Qwen3.5 hybrid (patchkit.e2e's config), a byte-level
     BPE tokenizer trained here (`!` at id 0 as in Qwen, every id of the
     model's vocabulary decodable) saved with it so the server can tokenize
     text, two healthy rank-64 PEFT adapters and `poisoned`, a copy of one
     with an inf in one lora_B tensor;
  2. healthy: `vllm serve` (the OpenAI server) with both healthy adapters,
     VLLM_COMPUTE_NANS_IN_LOGITS=1 and an API key; `patchkit canary --json`
     must exit 0 with every model ok;
  3. poisoned: the server again, with `poisoned` listed first and the two
     healthy adapters after it, on the Triton LoRA kernels
     (PATCHKIT_LORA_BACKEND=triton; an unpatched tree runs them anyway);
     the canary must exit 1, `poisoned` bad and every other model ok.
Every HTTP exchange of the canary (and a few more: a 401 without the key, a
404 for an unknown model, /health) is saved as JSON under OUT/<phase>/exchanges,
in the format of `patchkit canary --record`, for CPU tests to replay;
server logs, the canary's JSON and OUT/summary.json beside them.

Run on the GPU host (see ../shared/device/README.md), from the repository root:
  PYTHONPATH=/opt/site:/opt/site/deps:$PWD/.devtools:$PWD python scripts/proofs/canary_gpu.py OUT
Exit 0 when both phases behave as expected, 1 when one does not, 2 when
`vllm serve` cannot start (the line says which module the bundle lacks).
The whole run stays under --budget seconds (default 510, under 9 minutes);
each server start gets what is left, at most 240 s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from patchkit.verify.toolkit import RANK, TARGET_MODULES, VOCAB, qwen35_config  # noqa: E402

BASE_NAME = "tiny-qwen35"
API_KEY = "canary-gpu-throwaway-key"  # a key only this run knows: the Bearer path, for real
TEXT_VOCAB = 4000  # BPE target; the rest of the model's ids become special tokens
SERVER_START_MAX = 240.0
CANARY_TIMEOUT = 60
SERVER_IMPORT = "vllm.entrypoints.openai.api_server"
# The offline bundle has no model_hosting_container_standards (SageMaker's), and
# the device's generic placeholder for it made vLLM's app inert (uvicorn then
# answered every request with 500: "object _Inert can't be used in 'await'
# expression"). This stand-in keeps vLLM's routes and app as they are: its
# decorators return the function, bootstrap returns the app.
LAUNCH = f"""
import runpy, sys, types
def _passthrough(function):
    return function
def _factory(*args, **kwargs):
    return _passthrough
sagemaker = types.ModuleType("model_hosting_container_standards.sagemaker")
for name in ("register_ping_handler", "register_invocation_handler"):
    setattr(sagemaker, name, _passthrough)
for name in ("stateful_session_manager", "inject_adapter_id",
             "register_load_adapter_handler", "register_unload_adapter_handler"):
    setattr(sagemaker, name, _factory)
sagemaker.bootstrap = lambda app: app
package = types.ModuleType("model_hosting_container_standards")
package.__path__ = []
package.sagemaker = sagemaker
sys.modules["model_hosting_container_standards"] = package
sys.modules["model_hosting_container_standards.sagemaker"] = sagemaker
sys.argv[0] = "vllm-serve"
runpy.run_module("{SERVER_IMPORT}", run_name="__main__", alter_sys=True)
"""
BUNDLE_HINT = (
    "add the missing package's wheel to ../shared/device/make-bundles.sh, or stand it in "
    "through ../shared/device/sitecustomize.py"
)


class Stop(Exception):
    """The run cannot go on; str() is the one line to print."""

    def __init__(self, line: str, code: int = 1):
        super().__init__(line)
        self.code = code


# ----- building the model, tokenizer and adapters -----


def train_tokenizer(model_dir: Path) -> dict:
    """A byte-level BPE trained on canary-like prose; ids fill the model's vocabulary.

    No special token is given to the trainer, so the byte alphabet comes
    first in code-point order and `!` (0x21, the lowest printable byte) gets
    id 0, as in Qwen's tokenizer. Ids after the learnt ones become special
    tokens up to the model's vocabulary, so every id the random model can
    emit decodes (vLLM's detokenizer rejects ids the tokenizer lacks).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from patchkit.canary.prompt import prompt_text

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    corpus = prompt_text(20000).splitlines() + [
        "The quick brown fox jumps over the lazy dog. What happened next? Nobody knows!",
        "Numbers like 0, 1, 2, 10, 42, 2026 and 3.14 appear in stories too.",
    ]
    tokenizer.train_from_iterator(corpus, trainer)
    if tokenizer.token_to_id("!") != 0:
        raise Stop(f"tokenizer: '!' got id {tokenizer.token_to_id('!')}, not 0")
    learnt = tokenizer.get_vocab_size()
    fillers = ["<|endoftext|>"] + [f"<|extra_{i}|>" for i in range(VOCAB - learnt - 1)]
    tokenizer.add_special_tokens(fillers)
    if tokenizer.get_vocab_size() != VOCAB:
        raise Stop(f"tokenizer: {tokenizer.get_vocab_size()} ids, the model has {VOCAB}")
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (model_dir / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    )
    return {"learnt": learnt, "eos": tokenizer.token_to_id("<|endoftext|>")}


def check_tokenizer(model_dir: Path) -> dict:
    """Load it the way vLLM does (transformers' AutoTokenizer) and count a canary prompt."""
    from transformers import AutoTokenizer

    from patchkit.canary.prompt import prompt_text

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.convert_ids_to_tokens(0) != "!" or len(tokenizer) != VOCAB:
        raise Stop(
            f"tokenizer as transformers loads it: id 0 is "
            f"{tokenizer.convert_ids_to_tokens(0)!r}, {len(tokenizer)} ids"
        )
    return {
        "bangs": tokenizer.encode("!!!!", add_special_tokens=False),
        "canary_prompt_2000": len(tokenizer.encode(prompt_text(2000), add_special_tokens=False)),
    }


def build(work: Path, seed: int) -> dict:
    """Model, tokenizer, adapters healthy-a and healthy-b, and poisoned (inf in one lora_B)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model_dir = work / "model"
    model = Qwen3_5ForConditionalGeneration(qwen35_config()).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    tokenizer = train_tokenizer(model_dir)
    tokenizer.update(check_tokenizer(model_dir))
    lora = LoraConfig(
        r=RANK, lora_alpha=RANK, target_modules=TARGET_MODULES, init_lora_weights=False
    )
    peft_model = get_peft_model(model, lora)
    adapters = {}
    for name in ("healthy-a", "healthy-b"):
        with torch.no_grad():  # random A and B, B moderate: LoRA visible, logits sane
            for pname, param in peft_model.named_parameters():
                if "lora_A" in pname or "lora_B" in pname:
                    scale = 0.3 if "lora_B" in pname else 1.0
                    param.normal_(0.0, param.shape[-1] ** -0.5 * scale)
        adapters[name] = work / name
        peft_model.save_pretrained(adapters[name])
    adapters["poisoned"] = work / "poisoned"
    tensor = poison(adapters["healthy-b"], adapters["poisoned"])
    return {
        "model": model_dir,
        "adapters": adapters,
        "poisoned_tensor": tensor,
        "tokenizer": tokenizer,
    }


def poison(source: Path, dest: Path) -> str:
    """Copy an adapter and write inf into one element of one lora_B (a down_proj: every token)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    path = dest / "adapter_model.safetensors"
    tensors = load_file(str(path))
    names = sorted(n for n in tensors if "lora_B" in n)
    name = next((n for n in names if "down_proj" in n), names[0])
    tensors[name][0, 0] = float("inf")
    save_file(tensors, str(path), metadata={"format": "pt"})
    return name


# ----- the server -----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(phase_dir: Path, triton: bool) -> dict:
    env = dict(os.environ)
    env["VLLM_COMPUTE_NANS_IN_LOGITS"] = "1"
    env["VLLM_CACHE_ROOT"] = str(phase_dir / "vllm-cache")  # nothing compiled before counts
    if importlib.util.find_spec("flashinfer") is None:  # as patchkit.e2e: no FlashInfer here
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if importlib.util.find_spec("deep_gemm") is None:
        env.setdefault("VLLM_USE_DEEP_GEMM", "0")
    if triton:
        env["PATCHKIT_LORA_BACKEND"] = "triton"
    else:
        env.pop("PATCHKIT_LORA_BACKEND", None)
    return env


def serve_command(model: Path, modules: list[str], port: int, loras: int, seqs: int) -> list:
    """The `vllm serve` command line of the stand-in with ``modules`` (NAME=PATH) at start."""
    return [
        sys.executable, "-c", LAUNCH,
        "--model", str(model), "--served-model-name", BASE_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
        "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", str(loras),
        "--lora-modules", *modules,
        "--enforce-eager", "--language-model-only", "--dtype", "bfloat16",
        "--max-model-len", "4096", "--max-num-seqs", str(seqs), "--gpu-memory-utilization", "0.3",
        "--attention-backend", "TRITON_ATTN", "--gdn-prefill-backend", "triton", "--seed", "0",
    ]  # fmt: skip


def start_server(built: dict, adapters: list[str], port: int, phase_dir: Path, triton: bool):
    """`vllm serve` in its own session (so stopping it stops its engine core too)."""
    modules = [f"{name}={built['adapters'][name]}" for name in adapters]
    command = serve_command(built["model"], modules, port, loras=3, seqs=4)
    (phase_dir / "server-command.json").write_text(json.dumps(command, indent=1))
    log = (phase_dir / "server.log").open("w")
    return subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=server_env(phase_dir, triton),
        cwd=phase_dir,
        start_new_session=True,
    )


def import_failure(log: Path) -> str | None:
    """The first ModuleNotFoundError/ImportError line of a server log, if any."""
    text = log.read_text(errors="replace") if log.exists() else ""
    match = re.search(r"^.*\b(ModuleNotFoundError|ImportError): .*$", text, re.MULTILINE)
    return match.group(0).strip() if match else None


def last_error(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    errors = [line.strip() for line in lines if "Error" in line and "Traceback" not in line]
    return (errors[-1] if errors else " | ".join(lines[-3:]))[:300]


def wait_healthy(process, port: int, log: Path, deadline: float) -> float:
    """Poll /health until 200; a clear Stop when the server dies or the time runs out."""
    import httpx

    started = time.monotonic()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            missing = import_failure(log)
            if missing:
                raise Stop(f"vllm serve could not start: {missing}; {BUNDLE_HINT}", 2)
            raise Stop(f"vllm serve exited {process.returncode} at start: {last_error(log)}", 2)
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise Stop(
        f"vllm serve did not answer /health within {deadline - started:.0f} s: {last_error(log)}"
    )


def stop_server(process) -> None:
    """SIGTERM to the server's own process group, SIGKILL after 20 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def preflight() -> subprocess.Popen:
    """Import the OpenAI server module in a child while the model builds: a missing
    bundle module shows in a minute, not after the build."""
    return subprocess.Popen(
        [sys.executable, "-c", f"import {SERVER_IMPORT}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def preflight_result(child: subprocess.Popen, timeout: float) -> None:
    try:
        output, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return  # slow, not failed: the server start will tell
    if child.returncode != 0:
        lines = [line for line in output.splitlines() if line.strip()]
        missing = next((x for x in lines if re.search(r"(ModuleNotFound|Import)Error", x)), None)
        detail = missing or (lines[-1] if lines else f"exit {child.returncode}")
        raise Stop(
            f"vllm serve cannot start: `import {SERVER_IMPORT}` failed: "
            f"{detail.strip()}; {BUNDLE_HINT}",
            2,
        )


# ----- the canary and the extra recordings -----


def run_canary(port: int, phase_dir: Path) -> tuple[int, dict, float]:
    """`patchkit canary --json --record`, as an operator would run it; key from the env."""
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "patchkit",
            "canary",
            "--url",
            f"http://127.0.0.1:{port}/v1",
            "--json",
            "--record",
            str(phase_dir / "exchanges"),
            "--timeout",
            str(CANARY_TIMEOUT),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_API_KEY": API_KEY},
        cwd=ROOT,
        timeout=CANARY_TIMEOUT + 30,
    )
    (phase_dir / "canary.json").write_text(result.stdout)
    (phase_dir / "canary.stderr").write_text(result.stderr)
    try:
        report = json.loads(result.stdout)
    except ValueError:
        report = {"unparsed": result.stdout[-2000:], "stderr": result.stderr[-2000:]}
    return result.returncode, report, time.monotonic() - started


def ask(client, method: str, path: str, body: dict | None, headers: dict | None = None) -> dict:
    """One request and its answer as `patchkit canary --record` writes them; a request that
    gets no answer is recorded with status 0 and the error, not raised."""
    import httpx

    started = time.monotonic()
    try:
        answer = client.request(method, path, json=body, headers=headers)
        status, text = answer.status_code, answer.text
    except httpx.HTTPError as exc:
        status, text = 0, f"{type(exc).__name__}: {exc}"
    return {
        "method": method,
        "path": path,
        "request": body,
        "status": status,
        "body": text,
        "seconds": time.monotonic() - started,
    }


def record_extra(port: int, phase_dir: Path) -> None:
    """Real answers the canary does not provoke: no key (401), an unknown model (404), /health."""
    import httpx

    out = phase_dir / "exchanges" / "extra"
    out.mkdir(parents=True, exist_ok=True)
    plan = [
        ("GET", "/v1/models", None, {}),
        (
            "POST",
            "/v1/completions",
            {"model": "no-such-model", "prompt": "Hello", "max_tokens": 4},
            {"Authorization": f"Bearer {API_KEY}"},
        ),
        ("GET", "/health", None, {}),
    ]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20) as client:
        for number, (method, path, body, headers) in enumerate(plan, start=1):
            exchange = ask(client, method, path, body, headers)
            name = f"{number:03d}-{method}-{path.strip('/').replace('/', '_')}.json"
            (out / name).write_text(json.dumps(exchange, indent=1) + "\n")


# ----- the phases -----


def expect(phase: str, code: int, report: dict, adapters: list[str]) -> list[str]:
    """What went against the expectation of this phase (empty: as expected)."""
    models = {m["model"]: m for m in report.get("models", [])}
    problems = []
    if set(models) != {BASE_NAME, *adapters}:
        problems.append(f"served {sorted(models)}, expected {sorted([BASE_NAME, *adapters])}")
    if phase == "healthy":
        if code != 0:
            problems.append(f"canary exit {code}, expected 0: {report.get('error')}")
        problems += [f"{n} is {m['verdict']}" for n, m in models.items() if m["verdict"] != "ok"]
        return problems
    if code != 1:
        problems.append(f"canary exit {code}, expected 1")
    if models.get("poisoned", {}).get("verdict") != "bad":
        problems.append(f"poisoned is {models.get('poisoned', {}).get('verdict')}, expected bad")
    problems += [
        f"{n} is {m['verdict']}, expected ok"
        for n, m in models.items()
        if n != "poisoned" and m["verdict"] != "ok"
    ]
    if "'poisoned'" not in str(report.get("error")) or "healthy" in str(report.get("error")):
        problems.append(f"error line names the wrong models: {report.get('error')!r}")
    return problems


def run_phase(phase: str, built: dict, out: Path, deadline: float) -> dict:
    adapters = (
        ["healthy-a", "healthy-b"] if phase == "healthy" else ["poisoned", "healthy-a", "healthy-b"]
    )
    phase_dir = out / phase
    phase_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    print(f"[{phase}] starting vllm serve on port {port} with {', '.join(adapters)}", flush=True)
    process = start_server(built, adapters, port, phase_dir, triton=(phase == "poisoned"))
    try:
        start_deadline = min(time.monotonic() + SERVER_START_MAX, deadline - CANARY_TIMEOUT - 30)
        started_in = wait_healthy(process, port, phase_dir / "server.log", start_deadline)
        print(
            f"[{phase}] /health answered after {started_in:.0f} s; running the canary", flush=True
        )
        code, report, seconds = run_canary(port, phase_dir)
        record_extra(port, phase_dir)
    finally:
        stop_server(process)
    problems = expect(phase, code, report, adapters)
    verdicts = {m["model"]: m["verdict"] for m in report.get("models", [])}
    print(
        f"[{phase}] canary exit {code} in {seconds:.1f} s: {verdicts}"
        + (f"; PROBLEMS: {problems}" if problems else "; as expected"),
        flush=True,
    )
    return {
        "phase": phase,
        "adapters": adapters,
        "lora_backend": "triton" if phase == "poisoned" else "default",
        "server_start_seconds": round(started_in, 1),
        "canary_exit": code,
        "canary_seconds": round(seconds, 1),
        "verdicts": verdicts,
        "recheck": (report.get("recheck") or {}).get("verdict"),
        "corrupted_requests": report.get("corrupted_requests"),
        "error": report.get("error"),
        "problems": problems,
    }


def tree_state() -> dict:
    """Which vLLM is served and whether patchkit's patches are applied to it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return {"error": "no vllm importable"}
    target = str(Path(list(spec.submodule_search_locations)[0]).parent)
    result = subprocess.run(
        [sys.executable, "-m", "patchkit", "status", "--target", target, "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    try:
        data = json.loads(result.stdout)
    except ValueError:
        return {"target": target, "error": result.stderr.strip()[-300:]}
    return {
        "target": target,
        "version": data["vllm"]["version"],
        "patches": {p["id"]: p["state"] for p in data["patches"]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for logs, recordings and summary.json")
    parser.add_argument("--budget", type=float, default=510.0, help="seconds for the whole run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.budget
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"tree": tree_state(), "phases": [], "started": time.time()}
    print(f"vLLM tree: {summary['tree']}", flush=True)
    try:
        importer = preflight()
        built = build(out / "build", args.seed)
        summary["build"] = {
            "seconds": round(time.monotonic() - started, 1),
            "poisoned_tensor": built["poisoned_tensor"],
            "tokenizer": built["tokenizer"],
        }
        print(
            f"built in {summary['build']['seconds']} s; tokenizer {built['tokenizer']}; "
            f"inf in {built['poisoned_tensor']}",
            flush=True,
        )
        preflight_result(importer, timeout=max(10.0, deadline - time.monotonic() - 300))
        for phase in ("healthy", "poisoned"):
            summary["phases"].append(run_phase(phase, built, out, deadline))
        code = 0 if all(not p["problems"] for p in summary["phases"]) else 1
    except Stop as stop:
        print(f"canary_gpu: {stop}", flush=True)
        summary["stopped"], code = str(stop), stop.code
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["ok"] = code == 0
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(
        f"{'PASSED' if code == 0 else 'FAILED'} in {summary['seconds']} s; {out / 'summary.json'}",
        flush=True,
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
