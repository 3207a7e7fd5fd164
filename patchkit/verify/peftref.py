"""The transformers + PEFT reference: float32, the adapter unmerged, over the visible GPUs.

What it answers: the teacher-forced prompt log-probabilities of token-id
prompts (of ids[1:], as patchkit.verify.serving collects them from vLLM) for
the base model and for each adapter, computed by transformers with the
adapter loaded by PEFT and applied unmerged, in float32 from the model's own
bf16 weights (the upcast is exact). A merged bf16 reference rounds W + s·BA
to bf16 once per weight; in a 256-expert model that rounding flips near-tied
routing choices, and the reference's own noise (0.43-0.46 mean |d logprob|
on a 35B-A3B-wide cut) was as large as an adapter's effect. Here the only
rounding is float32's, so the reference is precise enough to judge a bf16
LoRA path by; vLLM cannot serve the Qwen3.5 hybrids in float32 (its GDN chunk
kernel refuses it), transformers can.

How: the model's class is the one its config.json names (``architectures``),
loaded with ``dtype=torch.float32`` and, on GPUs, ``device_map="auto"`` with
``max_memory`` per visible GPU (layers placed one after another, run in
turn: memory is pooled, compute is not parallel). Adapters are loaded with
``PeftModel.from_pretrained`` / ``load_adapter`` by name and switched with
``set_adapter``; base rows run under ``disable_adapter()``. Routed-expert
adapters (``target_parameters``, the layout PEFT 0.21 writes, 3D factors,
one parameter or both) are PEFT's own ``ParamWrapper``, which adds s·BA to
the float32 expert weights inside the forward. PEFT accepts several
``target_parameters`` adapters in one model only when they target the same
parameters, so adapters are grouped by that set: one group at a time, the
previous group's wrappers removed with ``unload()`` (the base weights stay
in memory, nothing is read again). The log-probabilities are taken from the
decoder's last hidden state through the output head in chunks of
LOGIT_CHUNK positions, so a 16k prompt never holds 16k x vocab logits.

It runs as one more job kind of patchkit.verify.serving (``job()``; the child
is ``python -m patchkit.verify.peftref JOB.json OUT.json``) and writes what a
served engine writes, without the generated tokens:
``{"runs": {"base": {prompt: {"prompt_logprobs": [...]}}, "lora:NAME": {...}},
"device": str, "seconds": float, "peak_bytes": int}``; an adapter PEFT does
not load gets ``{"error": ...}`` in place of its prompts, as in vLLM's result.

Memory, estimated before anything is loaded (``estimate``), refused in one
line when the visible GPUs cannot hold it (``placement``): the weights in
float32 (twice their bf16 bytes; numel x 4 from the safetensors headers),
the largest group of adapters in float32, and per GPU a working reserve:
LOGIT_CHUNK x vocab float32 logits three times (logits, log-softmax,
gather), ACTIVATION_COPIES x longest prompt x hidden float32 activations,
EXPERT_COPIES times the largest tensor (PEFT's ParamWrapper makes the delta
and W + delta of a whole 3D expert parameter), and CONTEXT_BYTES for the CUDA
context and allocator slack. ``peak_bytes`` records what it took (the sum of
torch.cuda.max_memory_allocated over the GPUs; the process's peak RSS on the
CPU).

A full Qwen3.5/3.6-35B-A3B (counted with transformers 5.17 on the meta device
from the model's published widths: 40 layers, 30 GDN + 10 attention, hidden
2048, 256 experts of 512, top 8, shared expert 512, vocabulary 248,320, the
27-layer vision tower included): 35.11 B parameters, 32.21 B of them routed
experts, 3.46 B active per token; 70.2 GB in bf16, 140.5 GB (130.8 GiB) in
float32. The working reserve at a 16k prompt: logits 3.0 GB, activations 4.3
GB, the largest expert tensor (gate_up_proj, 256 x 1024 x 2048) 2.1 GB x 3,
1 GiB context: 14.9 GB (13.8 GiB) per GPU. One H200 (140 GiB) cannot hold
it (130.8 GiB + 13.8 GiB); two can (65 GiB of weights each), so a 35B-A3B reference needs 2
H200s, or 4 of 80 GB. Time, estimated (assumptions, not a measurement of the
full model): reading 70 GB of bf16 shards at 2 GB/s, about 35 s (less from
the page cache); the float32 forward computes 2 x 3.46 GFLOP per token, at
an assumed 30 TFLOP/s of float32 on an H200 (half its non-tensor-core peak;
TF32 is off), 3.8 s per 16k tokens, plus transformers' per-expert loop
(every expert is hit at these lengths: about 8 kernels x 256 experts x 40
layers, about 1 s per forward at 10 us a launch) and its GDN chunk loop in
torch (16k / 64 chunks x 30 layers); so about 5-10 s per forward of a 16k
prompt, and a `verify --model` run with prompts of 600, 3000 and 16k tokens,
base plus an adapter and two controls (4 x 19.6k tokens), about 1-2 minutes
of forwards after 1-2 minutes of loading. ``seconds`` and ``peak_bytes`` of
each run are the measurement that replaces this estimate. Measured on one H200
(docs/evidence.md, 2026-12-01i): the 8-layer 35B-A3B-wide cut (6.8 B
parameters, 27 GB in float32), base and one adapter over 600, 3000 and 4096
tokens, took 19.1 s from start to answers and 32.2 GB at its peak; the full
model's 40 layers scale that to about 1.5-2 minutes, inside the estimate.

torch, transformers and peft are imported inside functions only.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from patchkit.adapters.modelshapes import ModelConfigInvalid
from patchkit.codes import Code
from patchkit.errors import PatchkitError
from patchkit.fs.files import read_user_json
from patchkit.terminal import printable
from patchkit.verify import serving


class ReferenceDoesNotFit(PatchkitError):
    """The float32 reference does not fit the visible GPUs: the bytes it ``needed`` and
    the ``free`` bytes (where known), or where transformers ``spilled`` its layers."""

    code = Code.REFERENCE_DOES_NOT_FIT


class ReferenceFailed(PatchkitError):
    """transformers + PEFT did not load an adapter the reference needs: what each
    ``refused`` ("label: error")."""

    code = Code.REFERENCE_FAILED


NAME = "peft-reference"  # the job's name: its log, its files, its entry in served.json
MODE = "peft"  # its Job.mode (not a vLLM mode)
LOGIT_CHUNK = 1024  # positions whose logits are held at once
ACTIVATION_COPIES = 32  # float32 activations of hidden width alive at once, per token
EXPERT_COPIES = 3  # ParamWrapper: B @ A, the delta, W + delta of one 3D parameter
CONTEXT_BYTES = 1 << 30  # per GPU: CUDA context, allocator slack
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def requests(adapters: dict[str, Path], prompts: dict) -> list[tuple[str, str, str | None]]:
    """Base on every prompt, then each adapter on every prompt, labelled as vLLM's are."""
    plan: list[tuple[str, str, str | None]] = [("base", p, None) for p in prompts]
    for adapter in adapters:
        plan += [(f"lora:{adapter}", p, adapter) for p in prompts]
    return plan


def job(
    model_dir: Path, adapters: dict[str, Path], prompts: dict[str, list[int]], name: str = NAME
) -> serving.Job:
    """The reference as a serving job: serving.alone runs it in a child of its own and
    reads its result (workdir/vllm-NAME.json).

    It takes every visible GPU: run it alone (serving.alone, after the engines), not
    beside vLLM engines.
    """
    return serving.Job(
        name=name,
        model=str(model_dir),
        mode=MODE,
        prompts=prompts,
        requests=requests(adapters, prompts),
        loras={n: str(p) for n, p in adapters.items()},
        runner=__name__,
    )


# ----- memory: estimated before loading -----


@dataclass(frozen=True)
class Estimate:
    """Bytes the reference needs: spread over the GPUs (weights, adapters), and on each."""

    weights: int  # the model in float32
    adapters: int  # the largest group of adapters loaded at once, in float32
    working: int  # on every GPU: logits chunk, activations, expert deltas, context
    bf16: int  # the model's bytes as stored (for the message)

    @property
    def spread(self) -> int:
        return self.weights + self.adapters


def _float32_bytes(files: list[Path]) -> tuple[int, int, int]:
    """(float32 bytes, stored bytes, largest tensor's elements) of safetensors files."""
    from patchkit.adapters.safetensorsfile import SafetensorsFile

    as_float32 = stored = largest = 0
    for path in files:
        with SafetensorsFile(path) as f:
            for info in f.tensors.values():
                stored += info.nbytes
                floating = info.dtype in FLOAT_DTYPES
                as_float32 += info.numel * 4 if floating else info.nbytes
                largest = max(largest, info.numel if floating else 0)
    return as_float32, stored, largest


def groups(adapters: dict[str, Path]) -> list[list[str]]:
    """Adapters that PEFT can hold in one model: the same target_parameters (or none)."""
    from patchkit.verify.adapterfiles import read_adapter_config

    out: dict[tuple, list[str]] = {}
    for name, path in adapters.items():
        key = tuple(sorted(read_adapter_config(path).target_parameters))
        out.setdefault(key, []).append(name)
    return list(out.values())


def _adapter_bytes(path: Path) -> int:
    """An adapter's factors in float32 (twice a bf16 file's size where not safetensors)."""
    tensors = path / "adapter_model.safetensors"
    if tensors.is_file():
        return _float32_bytes([tensors])[0]
    return 2 * sum(p.stat().st_size for p in path.glob("adapter_model.*") if p.is_file())


def text_config(model_dir: Path) -> dict:
    """config.json with its text_config over it (a multimodal model's language model)."""
    try:
        config = read_user_json(model_dir / "config.json")
    except (OSError, ValueError) as exc:
        raise ModelConfigInvalid(f"{model_dir}/config.json", f"not readable ({exc})") from None
    if not isinstance(config, dict):
        raise ModelConfigInvalid(f"{model_dir}/config.json", "not a JSON object")
    text = config.get("text_config")
    return {**config, **(text if isinstance(text, dict) else {})}


def estimate(model_dir: Path, adapters: dict[str, Path], prompts: dict) -> Estimate:
    """What the reference needs, from the safetensors headers and config.json alone."""
    weights, stored, largest = _float32_bytes(sorted(model_dir.glob("*.safetensors")))
    sizes = {name: _adapter_bytes(path) for name, path in adapters.items()}
    adapter_bytes = max((sum(sizes[n] for n in g) for g in groups(adapters)), default=0)
    config = text_config(model_dir)
    vocab, hidden = int(config.get("vocab_size") or 0), int(config.get("hidden_size") or 0)
    longest = max((len(ids) for ids in prompts.values()), default=0)
    working = working_bytes(vocab, hidden, longest, largest)
    return Estimate(weights, adapter_bytes, working, stored)


def working_bytes(vocab: int, hidden: int, longest: int, largest: int) -> int:
    """The reserve each GPU keeps beside its share of the weights: a chunk of float32
    logits three times, the longest prompt's activations, PEFT's copies of the largest
    tensor (a 3D expert parameter under ParamWrapper), the CUDA context."""
    return (
        3 * LOGIT_CHUNK * vocab * 4
        + ACTIVATION_COPIES * longest * hidden * 4
        + EXPERT_COPIES * largest * 4
        + CONTEXT_BYTES
    )


def placement(need: Estimate, free: list[int]) -> dict[int, int]:
    """max_memory per GPU (its free bytes less the working reserve), or one line saying
    why the visible GPUs cannot hold the reference (PatchkitError)."""
    from patchkit.verify.mergeplan import human_bytes

    budgets = {gpu: max(0, room - need.working) for gpu, room in enumerate(free)}
    if not free or sum(budgets.values()) < need.spread:
        raise ReferenceDoesNotFit(
            f"the float32 reference (transformers + PEFT) needs {human_bytes(need.spread)} "
            f"for the weights and adapters ({human_bytes(need.bf16)} as stored, float32 is "
            f"twice bf16) and {human_bytes(need.working)} working memory on each GPU; the "
            f"{len(free)} visible GPU(s) have {human_bytes(sum(free))} free: make more GPUs "
            "visible (CUDA_VISIBLE_DEVICES) or take the merged reference",
            needed=need.spread,
            working=need.working,
            free=sum(free),
            gpus=len(free),
        )
    return budgets


def gpu_placement(
    model_dir: Path, adapters: dict[str, Path], prompts: dict
) -> dict[int, int] | None:
    """max_memory over the visible GPUs for this reference (placement of its estimate),
    or None where torch sees no GPU (the CPU then holds it)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return placement(estimate(model_dir, adapters, prompts), _gpus_free())


# ----- the child: load, switch adapters, read log-probabilities -----


def _model_class(model_dir: Path):
    """The class config.json's ``architectures`` names (how transformers picks it)."""
    import transformers

    names = read_user_json(model_dir / "config.json").get("architectures") or []
    found = getattr(transformers, names[0], None) if names else None
    return found or transformers.AutoModelForCausalLM


def load_base(model_dir: Path, max_memory: dict[int, int] | None):
    """The model in float32 from its bf16 weights: on the CPU (max_memory None) or
    spread over the GPUs within max_memory; refuses a placement that spills off them."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (no TF32)
    torch.backends.cudnn.allow_tf32 = False
    placed = {} if max_memory is None else {"device_map": "auto", "max_memory": max_memory}
    model = _model_class(model_dir).from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa", **placed
    )
    spilled = {d for d in (getattr(model, "hf_device_map", None) or {}).values()} & {"cpu", "disk"}
    if spilled:
        raise ReferenceDoesNotFit(
            f"the float32 reference did not fit the GPUs: transformers placed layers on "
            f"{', '.join(sorted(spilled))}",
            spilled=sorted(spilled),
        )
    return model.eval()


def token_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i = 1..n-1, the decoder's output through the head in
    chunks. ``model`` is a transformers model, or a PeftModel around one."""
    import torch

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = hf.get_output_embeddings()
    device = hf.get_input_embeddings().weight.device
    tokens = torch.tensor([ids], device=device)
    with torch.inference_mode():
        hidden = hf.model(input_ids=tokens, use_cache=False).last_hidden_state[0, :-1]
        targets = tokens[0, 1:]
        out: list[float] = []
        for start in range(0, targets.numel(), LOGIT_CHUNK):
            logits = head(hidden[start : start + LOGIT_CHUNK]).float()
            chosen = targets[start : start + LOGIT_CHUNK, None].to(logits.device)
            out += torch.log_softmax(logits, dim=-1).gather(1, chosen).squeeze(1).tolist()
    return out


def reference_runs(
    load, adapters: dict[str, Path], prompts: dict, plan: list[tuple[str, str, str | None]]
) -> dict:
    """Every request of ``plan``: each adapter group wrapped by PEFT in turn around the
    model ``load()`` returns (load_base), base rows with the first group's adapters
    disabled, and the group's wrappers unloaded after it.

    {label: {prompt: {"prompt_logprobs": [...]}}}, or {label: {"error": ...}} for an
    adapter PEFT did not load (the model is then loaded again: PEFT may have wrapped
    some of its layers before it failed).
    """
    import gc

    runs: dict = {}
    wanted = {name: [(lbl, p) for lbl, p, a in plan if a == name] for name in adapters}
    base_rows = [(label, p) for label, p, adapter in plan if adapter is None]
    model = load()
    for group in groups(adapters):
        try:
            wrapped = _wrap(model, group, adapters)
        except Exception as exc:  # a file PEFT refuses: its group is marked, the rest runs
            error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            runs |= {label: {"error": error} for name in group for label, _ in wanted[name]}
            del model
            gc.collect()
            model = load()
            continue
        if base_rows:
            _run(runs, wrapped, base_rows, prompts, adapter=None)
            base_rows = []
        for name in group:
            wrapped.set_adapter(peft_name(name))
            _run(runs, wrapped, wanted[name], prompts, adapter=name)
        model = wrapped.unload()
        del wrapped
    _run(runs, model, base_rows, prompts, adapter=None)  # no adapter loaded (or none given)
    return runs


def _wrap(model, group: list[str], adapters: dict[str, Path]):
    """A PeftModel around ``model`` holding every adapter of ``group``, each under
    peft_name(its name)."""
    from peft import PeftModel

    first, *rest = group
    wrapped = PeftModel.from_pretrained(model, adapters[first], adapter_name=peft_name(first))
    for name in rest:
        wrapped.load_adapter(adapters[name], adapter_name=peft_name(name))
    return wrapped.eval()


def peft_name(name: str) -> str:
    """The name an adapter has inside PEFT. PEFT makes it a key of torch ModuleDicts,
    where a name that is an nn.Module attribute ("half", "float", "train") fails to
    load ("attribute 'half' already exists"); a user's --lora NAME may be one."""
    return f"adapter_{name}"


def _run(runs: dict, model, rows: list[tuple[str, str]], prompts: dict, adapter) -> None:
    """The rows' log-probabilities; with ``adapter`` None under PEFT's disable_adapter()."""
    from contextlib import nullcontext

    off = model.disable_adapter() if adapter is None and hasattr(model, "disable_adapter") else None
    with off or nullcontext():
        for label, prompt in rows:
            runs.setdefault(label, {})[prompt] = {
                "prompt_logprobs": token_logprobs(model, prompts[prompt])
            }


def _gpus_free() -> list[int]:
    import torch

    return [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]


def _device() -> str:
    import torch

    count = torch.cuda.device_count()
    return f"{count} x {torch.cuda.get_device_name(0)}" if count else "cpu"


def _peak_bytes() -> int:
    import resource

    import torch

    if torch.cuda.is_available():
        return sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run(spec: serving.Job, out_file: Path) -> None:
    """The child: check the memory, load, answer every request, write the result.

    A reference that does not fit is written as {"error": one line} (and the
    log says it), so serving.result reports it as it reports an engine that
    did not start; serve_all then tries it once alone, where it may fit.
    """

    started = time.monotonic()
    adapters = {n: Path(p) for n, p in spec.loras.items()}
    model_dir = Path(spec.model)
    result: dict = {"name": spec.name, "mode": spec.mode, "device": _device()}
    try:
        max_memory = gpu_placement(model_dir, adapters, spec.prompts)
        result["runs"] = reference_runs(
            lambda: load_base(model_dir, max_memory), adapters, spec.prompts, spec.requests
        )
    except PatchkitError as exc:
        print(printable(f"patchkit: error: {exc}"), file=sys.stderr)
        result["error"] = str(exc)
    result |= {"seconds": time.monotonic() - started, "peak_bytes": _peak_bytes()}
    out_file.write_text(json.dumps(result))


if __name__ == "__main__":  # the child process of serving.start for a reference job
    run(serving.Job(**json.loads(Path(sys.argv[1]).read_text())), Path(sys.argv[2]))
