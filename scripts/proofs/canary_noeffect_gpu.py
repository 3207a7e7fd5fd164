"""Recording of adapters that change nothing, against a real `vllm serve` (one start).

What the CPU tests of canary's NO-EFFECT verdict replay, and the ledger's
proof of it, from one server on the test host (vLLM 0.26.0 patched):

  1. build (as canary_gpu.py) a tiny random Qwen3.5 hybrid with a trained
     byte-level tokenizer, and with PEFT the adapters
       healthy          random lora_A and lora_B (B moderate): a visible effect;
       prefix-mismatch  healthy's tensors under the names PEFT writes for the
                        text-only model (`base_model.model.model.layers.N...`,
                        not `...model.language_model.layers.N...`): 0.26.0's
                        load check reads only the last name part (q_proj is
                        fine), its Qwen3-VL/3.5 WeightsMapper maps only
                        `model.language_model.`, so no wrapped module finds its
                        weights (model_manager: "No LoRA weights found for
                        module", a debug line) and the adapter serves as the base;
       zero-b           healthy's lora_A, every lora_B zero (PEFT's own init);
       refused-suffix   healthy with layer 0's `mlp.down_proj` renamed
                        `mlp.dense_4h_to_h`: a suffix 0.26.0 refuses at load;
  2. `vllm serve` with healthy and prefix-mismatch on the command line and
     VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; zero-b is then loaded through POST
     /v1/load_lora_adapter (recorded with /v1/models before and after);
     refused-suffix is loaded the same way after every other recording (its
     refusal recorded), then the canary runs once more;
  3. `patchkit canary --json --record` (the exit code and JSON), the text
     form, and `patchkit canary --model zero-b` (the readiness check after a
     load);
  4. raw exchanges, in the --record format, with canary's own request body
     (patchkit.canary.check.request_body: greedy, 32 tokens, logprobs, a fresh
     cache_salt): each prompt asked --repeats times of every model, one after
     the other (models interleaved as the canary asks them), then the canary's
     prompt asked of all models at once (--concurrent rounds: the batch noise
     of a busy server), then prompt log-probabilities (prompt_logprobs=0) of a
     short prompt, twice per model;
  5. the server log's lines about LoRA or the adapters at WARNING and above
     (server-warnings.txt: the issue expects none), `patchkit adapter check`
     on every adapter (--target the served tree, --model the stand-in), and
     each adapter's adapter_config.json and safetensors header (no weights);
  6. OUT/summary.json and OUT/canary-noeffect.tar.gz: everything under OUT
     but the weights (build/) and compile caches, the one file to bring back.

Run on the GPU host after the bundles are unpacked and the default set applied:
  PYTHONPATH=/opt/site:/opt/site/deps:$PWD/.devtools:$PWD \\
      python3 scripts/proofs/canary_noeffect_gpu.py /opt/out/noeffect
`--dry` prints the plan and exits; `--self-check` builds the model and the
adapters on the CPU, checks their names and zeros, runs adapter check when
--target names a tree, and packs (no server).
Exit 0 when every recording was made (whatever the canary said: the summary's
`canary_as_expected` and the last line tell), 1 when one could not be, 2
when `vllm serve` cannot start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import canary_gpu as served  # noqa: E402  (the sibling proof: tokenizer, launcher, server)

BASE_NAME = served.BASE_NAME
API_KEY = served.API_KEY
STARTUP_ADAPTERS = ("healthy", "prefix-mismatch")  # --lora-modules
LOADED_ADAPTERS = ("zero-b", "refused-suffix")  # POST /v1/load_lora_adapter, in this order
ADAPTERS = STARTUP_ADAPTERS + LOADED_ADAPTERS
SERVED = (BASE_NAME, "healthy", "prefix-mismatch", "zero-b")  # what /v1/models should list
EXPECTED = {BASE_NAME: "ok", "healthy": "ok", "prefix-mismatch": "no-effect", "zero-b": "no-effect"}
# The text model's PEFT names (Qwen3_5ForCausalLM) against the multimodal one's.
MULTIMODAL_PREFIX = "base_model.model.model.language_model."
TEXT_ONLY_PREFIX = "base_model.model.model."
REFUSED_FROM, REFUSED_TO = ".layers.0.mlp.down_proj.", ".layers.0.mlp.dense_4h_to_h."
PROMPT_TOKENS = (2000, 300, 60)  # the canary's default first: its own prompt
PROMPT_LOGPROBS_TOKENS = 300
ARCHIVE = "canary-noeffect.tar.gz"
LEFT_OUT = ("build", "vllm-cache")  # weights and compile caches never travel


# ----- building -----


def build(work: Path, seed: int) -> dict:
    """The model, its tokenizer and the four adapters (see the module docstring)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    from patchkit.verify.toolkit import RANK, TARGET_MODULES, qwen35_config

    torch.manual_seed(seed)
    model_dir = work / "model"
    model = Qwen3_5ForConditionalGeneration(qwen35_config()).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    tokenizer = served.train_tokenizer(model_dir)
    tokenizer.update(served.check_tokenizer(model_dir))
    lora = LoraConfig(
        r=RANK, lora_alpha=RANK, target_modules=TARGET_MODULES, init_lora_weights=False
    )
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():  # random A and B, B moderate: LoRA visible, logits sane
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                scale = 0.3 if "lora_B" in name else 1.0
                param.normal_(0.0, param.shape[-1] ** -0.5 * scale)
    dirs = {name: work / name for name in ADAPTERS}
    peft_model.save_pretrained(dirs["healthy"])
    derive(dirs["healthy"], dirs["prefix-mismatch"], rename_prefix, text_only_config)
    derive(dirs["healthy"], dirs["zero-b"], zero_b, None)
    derive(dirs["healthy"], dirs["refused-suffix"], rename_suffix, None)
    return {"model": model_dir, "adapters": dirs, "tokenizer": tokenizer}


def derive(source: Path, dest: Path, tensors_fn, config_fn) -> None:
    """A copy of an adapter whose tensors (and config) are changed by the given functions."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    path = dest / "adapter_model.safetensors"
    tensors = tensors_fn(load_file(str(path)))
    save_file(tensors, str(path), metadata={"format": "pt"})
    if config_fn is not None:
        config_path = dest / "adapter_config.json"
        config = config_fn(json.loads(config_path.read_text()))
        config_path.write_text(json.dumps(config, indent=2) + "\n")


def rename_prefix(tensors: dict) -> dict:
    """The names PEFT writes for the text-only model: no `language_model.` level."""
    renamed = {}
    for name, tensor in tensors.items():
        if not name.startswith(MULTIMODAL_PREFIX):
            raise served.Stop(f"prefix-mismatch: {name} does not start with {MULTIMODAL_PREFIX}")
        renamed[TEXT_ONLY_PREFIX + name[len(MULTIMODAL_PREFIX) :]] = tensor
    return renamed


def text_only_config(config: dict) -> dict:
    """target_modules as a text-only training run writes them: the module suffixes."""
    from patchkit.verify.toolkit import TARGET_MODULES

    suffixes = TARGET_MODULES.split("(")[1].rstrip(")").split("|")
    return {**config, "target_modules": sorted(suffixes)}


def zero_b(tensors: dict) -> dict:
    """Every lora_B all zero: what PEFT initialises, saved before any training step."""
    return {n: (t.zero_() if "lora_B" in n else t) for n, t in tensors.items()}


def rename_suffix(tensors: dict) -> dict:
    """Layer 0's down_proj under another family's name (GPT-NeoX's dense_4h_to_h)."""
    renamed = {n.replace(REFUSED_FROM, REFUSED_TO): t for n, t in tensors.items()}
    if renamed.keys() == tensors.keys():
        raise served.Stop(f"refused-suffix: no tensor name holds {REFUSED_FROM}")
    return renamed


def self_check(built: dict) -> list[str]:
    """What the built adapters must be, checked from their files (empty: as built)."""
    problems = []
    heads = {name: safetensors_header(path) for name, path in built["adapters"].items()}
    if not all(n.startswith(MULTIMODAL_PREFIX) for n in heads["healthy"]):
        problems.append("healthy: a tensor name outside model.language_model")
    if any("language_model" in n for n in heads["prefix-mismatch"]):
        problems.append("prefix-mismatch: a tensor name still holds language_model")
    if not any(REFUSED_TO in n for n in heads["refused-suffix"]):
        problems.append(f"refused-suffix: no tensor name holds {REFUSED_TO}")
    if nonzero_b(built["adapters"]["zero-b"]):
        problems.append("zero-b: a lora_B holds a non-zero value")
    if not nonzero_b(built["adapters"]["healthy"]):
        problems.append("healthy: every lora_B is zero")
    return problems


def nonzero_b(adapter: Path) -> bool:
    from safetensors.torch import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    return any(bool(t.abs().sum() > 0) for n, t in tensors.items() if "lora_B" in n)


def safetensors_header(adapter: Path) -> dict:
    """The JSON header of adapter_model.safetensors (names, dtypes, shapes; no weights)."""
    with (adapter / "adapter_model.safetensors").open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return header


def keep_adapter_files(built: dict, out: Path) -> None:
    """Each adapter's config and header under OUT/adapters, and the model's config.json as
    OUT/model-config.json, for the CPU tests of adapter check."""
    shutil.copy(built["model"] / "config.json", out / "model-config.json")
    for name, path in built["adapters"].items():
        dest = out / "adapters" / name
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(path / "adapter_config.json", dest / "adapter_config.json")
        header = safetensors_header(path)
        (dest / "safetensors-header.json").write_text(json.dumps(header, indent=1) + "\n")


# ----- the server -----


def server_command(built: dict, port: int) -> list[str]:
    """canary_gpu's command line, with the start adapters, 4 LoRA slots, 16 sequences (the
    batches of the concurrent rounds)."""
    modules = [f"{name}={built['adapters'][name]}" for name in STARTUP_ADAPTERS]
    return served.serve_command(built["model"], modules, port, loras=4, seqs=16)


def start_server(built: dict, port: int, out: Path):
    command = server_command(built, port)
    (out / "server-command.json").write_text(json.dumps(command, indent=1) + "\n")
    env = served.server_env(out, triton=False)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    log = (out / "server.log").open("w")
    return subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=out,
        start_new_session=True,
    )


class Recorder:
    """Raw HTTP exchanges with the server, one JSON file each in canary's --record format."""

    def __init__(self, port: int, out: Path):
        import httpx

        self.client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        self.out = out
        self.count = 0
        self.lock = threading.Lock()

    def send(self, group: str, method: str, path: str, body: dict | None, tag: str = "") -> dict:
        exchange = served.ask(self.client, method, path, body)
        if tag:
            exchange["tag"] = tag
        with self.lock:
            self.count += 1
            number = self.count
        folder = self.out / "exchanges" / group
        folder.mkdir(parents=True, exist_ok=True)
        slug = path.strip("/").replace("/", "_")
        name = f"{number:04d}-{method}-{slug}.json"
        (folder / name).write_text(json.dumps(exchange, indent=1) + "\n")
        return exchange

    def close(self) -> None:
        self.client.close()


def load_adapter(recorder: Recorder, built: dict, name: str, group: str) -> dict:
    """POST /v1/load_lora_adapter for one adapter, then GET /v1/models: both recorded."""
    body = {"lora_name": name, "lora_path": str(built["adapters"][name])}
    exchange = recorder.send(group, "POST", "/v1/load_lora_adapter", body, f"load-{name}")
    listed = recorder.send(group, "GET", "/v1/models", None, f"after-load-{name}")
    try:
        models = sorted(card["id"] for card in json.loads(listed["body"])["data"])
    except (ValueError, KeyError, TypeError):
        models = None
    return {"status": exchange["status"], "body": exchange["body"][:600], "models": models}


# ----- the recordings -----


def canary(port: int, out: Path, name: str, *extra: str) -> dict:
    """`patchkit canary` as an operator runs it (key from the environment); output kept."""
    command = [sys.executable, "-m", "patchkit", "canary", "--url", f"http://127.0.0.1:{port}/v1"]
    command += [*extra, "--timeout", str(served.CANARY_TIMEOUT)]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_API_KEY": API_KEY},
        cwd=ROOT,
        timeout=served.CANARY_TIMEOUT + 30,
    )
    folder = out / "canary"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.stdout").write_text(result.stdout)
    (folder / f"{name}.stderr").write_text(result.stderr)
    (folder / f"{name}.exit").write_text(f"{result.returncode}\n")
    return {"command": command[2:], "exit": result.returncode, "stdout": result.stdout}


def run_canaries(port: int, out: Path) -> dict:
    """The JSON run (recorded), the text run, and the check of the adapter just loaded."""
    record = str(out / "canary" / "exchanges")
    results = {
        "json": canary(port, out, "canary-json", "--json", "--record", record),
        "text": canary(port, out, "canary-text"),
        "zero-b": canary(port, out, "canary-zero-b", "--model", "zero-b"),
    }
    try:
        report = json.loads(results["json"]["stdout"])
        verdicts = {m["model"]: m["verdict"] for m in report.get("models", [])}
    except (ValueError, KeyError, TypeError, AttributeError):
        verdicts = {}
    summary = {name: {"exit": r["exit"]} for name, r in results.items()}
    summary["json"]["verdicts"] = verdicts
    summary["as_expected"] = bool(
        results["json"]["exit"] == 1
        and {m: v.lower() for m, v in verdicts.items()} == EXPECTED
        and results["zero-b"]["exit"] == 1
    )
    return summary


def request_body(model: str, prompt: str, **extra) -> dict:
    """The canary's own request (greedy, 32 tokens, logprobs, fresh cache_salt), with extra."""
    from patchkit.canary.check import request_body as canary_body

    return {**canary_body(model, prompt, True), **extra}


def record_repeats(recorder: Recorder, repeats: int) -> int:
    """Each prompt asked `repeats` times of every model, one request at a time."""
    from patchkit.canary.prompt import prompt_text

    sent = 0
    for tokens in PROMPT_TOKENS:
        prompt = prompt_text(tokens)
        for _ in range(repeats):
            for model in SERVED:
                body = request_body(model, prompt)
                recorder.send("sequential", "POST", "/v1/completions", body, f"p{tokens}")
                sent += 1
    return sent


def record_concurrent(recorder: Recorder, rounds: int) -> int:
    """The canary's prompt asked of every model twice at once: answers computed in batches."""
    from patchkit.canary.prompt import prompt_text

    prompt = prompt_text(PROMPT_TOKENS[0])
    sent = 0
    for round_number in range(rounds):
        threads = [
            threading.Thread(
                target=recorder.send,
                args=("concurrent", "POST", "/v1/completions", request_body(model, prompt)),
                kwargs={"tag": f"round{round_number}"},
            )
            for model in SERVED * 2
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        sent += len(threads)
    return sent


def record_prompt_logprobs(recorder: Recorder) -> int:
    """Teacher-forced log-probabilities of a short prompt, twice per model."""
    from patchkit.canary.prompt import prompt_text

    prompt = prompt_text(PROMPT_LOGPROBS_TOKENS)
    sent = 0
    for _ in range(2):
        for model in SERVED:
            body = request_body(model, prompt, prompt_logprobs=0)
            recorder.send("prompt-logprobs", "POST", "/v1/completions", body, "prompt-logprobs")
            sent += 1
    return sent


def greedy(exchange: dict) -> tuple[list[int] | None, list[float] | None]:
    try:
        choice = json.loads(exchange["body"])["choices"][0]
        return choice.get("token_ids"), choice["logprobs"]["token_logprobs"]
    except (ValueError, KeyError, TypeError, IndexError):
        return None, None


def compare(out: Path) -> dict:
    """For the summary: per model and group, against the base answers of the same prompt:
    how many answers share the base's tokens, and the largest |logprob| difference then."""
    groups = {}
    for group in ("sequential", "concurrent"):
        answers: dict[tuple[str, str], list] = {}
        for path in sorted((out / "exchanges" / group).glob("*.json")):
            exchange = json.loads(path.read_text())
            key = (exchange["request"]["model"], exchange["request"]["prompt"])
            answers.setdefault(key, []).append(greedy(exchange))
        table = {}
        for (model, prompt), found in answers.items():
            base = answers.get((BASE_NAME, prompt), [])
            if not base or base[0][0] is None:
                continue
            ids, values = base[0]
            same = [v for t, v in found if t == ids and v is not None]
            row = table.setdefault(model, {"answers": 0, "same_tokens": 0, "max_delta": 0.0})
            row["answers"] += len(found)
            row["same_tokens"] += len(same)
            for other in same:
                delta = max(abs(a - b) for a, b in zip(values, other, strict=True))
                row["max_delta"] = max(row["max_delta"], delta)
        groups[group] = table
    return groups


def server_warnings(log: Path) -> list[str]:
    """Log lines at WARNING or above that speak of LoRA or name an adapter."""
    words = ("lora", "adapter", *(name.lower() for name in ADAPTERS))
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [
        line
        for line in lines
        if any(level in line for level in ("WARNING", "ERROR", "CRITICAL"))
        and any(word in line.lower() for word in words)
    ]


def adapter_checks(built: dict, out: Path, target: str | None) -> dict:
    """`patchkit adapter check` on every adapter, JSON and text, as the admission check."""
    folder = out / "adapter-check"
    folder.mkdir(parents=True, exist_ok=True)
    exits = {}
    for name, path in built["adapters"].items():
        base = [sys.executable, "-m", "patchkit", "adapter", "check", str(path)]
        base += ["--model", str(built["model"])] + (["--target", target] if target else [])
        for form, extra in (("json", ["--json"]), ("text", [])):
            result = subprocess.run(
                base + extra, capture_output=True, text=True, cwd=ROOT, timeout=120
            )
            (folder / f"{name}.{form}").write_text(result.stdout + result.stderr)
            exits[f"{name}.{form}"] = result.returncode
    return exits


# ----- the run -----


def pack(out: Path) -> Path:
    """OUT/canary-noeffect.tar.gz: everything under OUT but weights and caches."""
    archive = out / ARCHIVE

    def keep(info: tarfile.TarInfo):
        parts = Path(info.name).parts
        if any(part in LEFT_OUT for part in parts) or info.name.endswith(ARCHIVE):
            return None
        return info

    with tarfile.open(archive, "w:gz") as tar:
        for child in sorted(out.iterdir()):
            if child.name not in LEFT_OUT and child.name != ARCHIVE:
                tar.add(child, arcname=f"noeffect/{child.name}", filter=keep)
    return archive


def serve_and_record(built: dict, out: Path, args, deadline: float, summary: dict) -> None:
    port = served.free_port()
    print(f"starting vllm serve on port {port} with {', '.join(STARTUP_ADAPTERS)}", flush=True)
    process = start_server(built, port, out)
    recorder = None
    try:
        start_deadline = min(time.monotonic() + served.SERVER_START_MAX, deadline - 90)
        summary["server_start_seconds"] = round(
            served.wait_healthy(process, port, out / "server.log", start_deadline), 1
        )
        print(f"/health answered after {summary['server_start_seconds']} s", flush=True)
        recorder = Recorder(port, out)
        recorder.send("setup", "GET", "/v1/models", None, "before-load")
        summary["load"] = {"zero-b": load_adapter(recorder, built, "zero-b", "setup")}
        print(f"loaded: {json.dumps(summary['load'])[:400]}", flush=True)
        summary["canary"] = run_canaries(port, out)
        print(f"canary: {json.dumps(summary['canary'])}", flush=True)
        summary["sent"] = {
            "sequential": record_repeats(recorder, args.repeats),
            "concurrent": record_concurrent(recorder, args.concurrent),
            "prompt_logprobs": record_prompt_logprobs(recorder),
        }
        # last, so a refusal that went wrong could not spoil the recordings above
        summary["load"]["refused-suffix"] = load_adapter(
            recorder, built, "refused-suffix", "refusal"
        )
        summary["canary"]["after"] = canary(port, out, "canary-after", "--json")["exit"]
    finally:
        if recorder is not None:
            recorder.close()
        served.stop_server(process)
    summary["compare"] = compare(out)
    summary["server_warnings"] = server_warnings(out / "server.log")
    (out / "server-warnings.txt").write_text("".join(f"{x}\n" for x in summary["server_warnings"]))


def dry_plan(args) -> dict:
    """What a run does, without torch, vLLM or a GPU."""
    sequential = len(PROMPT_TOKENS) * args.repeats * len(SERVED)
    return {
        "out": str(args.out),
        "adapters": {"--lora-modules": list(STARTUP_ADAPTERS), "loaded": list(LOADED_ADAPTERS)},
        "served": list(SERVED),
        "expected": EXPECTED,
        "requests": {
            "sequential": sequential,
            "concurrent": args.concurrent * 2 * len(SERVED),
            "prompt_logprobs": 2 * len(SERVED),
        },
        "canary runs": ["--json --record", "text", "--model zero-b", "--json (after)"],
        "archive": str(args.out / ARCHIVE),
        "budget_s": args.budget,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for recordings, logs and the archive")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=4, help="sequential asks per prompt/model")
    parser.add_argument("--concurrent", type=int, default=3, help="rounds of all models at once")
    parser.add_argument("--target", help="the served tree for adapter check (default: found)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry", action="store_true", help="print the plan and exit")
    mode.add_argument("--self-check", action="store_true", help="build on the CPU and pack")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2: the repeat noise needs two answers")
    if args.concurrent < 0 or args.budget <= 0:
        parser.error("--concurrent and --budget must not be negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.dry:
        print(json.dumps(dry_plan(args), indent=1))
        return 0
    started = time.monotonic()
    deadline = started + args.budget
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"started": time.time(), "mode": "self-check" if args.self_check else "gpu"}
    code = 0
    try:
        if not args.self_check:
            summary["tree"] = served.tree_state()
            print(f"vLLM tree: {summary['tree']}", flush=True)
            importer = served.preflight()
        built = build(out / "build", args.seed)
        summary["build"] = {"seconds": round(time.monotonic() - started, 1)}
        summary["build"]["tokenizer"] = built["tokenizer"]
        summary["build"]["problems"] = self_check(built)
        keep_adapter_files(built, out)
        print(f"built in {summary['build']['seconds']} s: {summary['build']}", flush=True)
        if summary["build"]["problems"]:
            raise served.Stop(f"adapters not as built: {summary['build']['problems']}")
        if not args.self_check:
            served.preflight_result(importer, timeout=max(10.0, deadline - time.monotonic() - 200))
            serve_and_record(built, out, args, deadline, summary)
        target = args.target or (summary.get("tree") or {}).get("target")
        if target or not args.self_check:
            summary["adapter_check"] = adapter_checks(built, out, target)
    except served.Stop as stop:
        print(f"canary_noeffect_gpu: {stop}", flush=True)
        summary["stopped"], code = str(stop), stop.code
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["canary_as_expected"] = (summary.get("canary") or {}).get("as_expected")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    archive = pack(out)
    print(
        f"{'RECORDED' if code == 0 else 'FAILED'} in {summary['seconds']} s; canary as "
        f"expected: {summary['canary_as_expected']}; {archive}",
        flush=True,
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
