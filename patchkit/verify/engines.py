"""The vLLM engines of a `verify --model` run: which engines, their jobs, and what each
served (read back from served.json by what the engine is)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from patchkit.verify import baserows, serving

# How long one engine (or the PEFT reference) may take, from its own start (seconds).
ENGINE_TIMEOUT = 1800.0


def adapter_rank(adapter_dir: Path) -> int:
    """The largest rank an adapter uses (r and rank_pattern), read as the merge reads it
    (size-capped, every value checked: a raw json.loads had no cap and no checks)."""
    from patchkit.verify import adapterfiles

    config = adapterfiles.read_adapter_config(adapter_dir)
    return max(config.ranks)


# The two references of an adapter: merged and rounded to nearest, and its rounding
# control (the same merge rounded stochastically), each served by an engine of its own.
REFERENCES = ("merged", "rounding")


@dataclass(frozen=True)
class Engine:
    """One vLLM engine of a run: the LoRA engine in one mode, or one adapter's reference."""

    name: str  # its job's name: its log, its files and its entry in served.json
    mode: str  # serving.MODES: eager, or torch.compile + CUDA graphs
    kind: str  # "lora" (every adapter, LoRA on), or one of REFERENCES (merged, no LoRA)
    adapter: str | None = None  # the adapter a reference is merged from; None for "lora"


def lora_engines(prefix: str = "") -> list[Engine]:
    """The LoRA engine in each mode, named PREFIX+MODE."""
    return [Engine(f"{prefix}{mode}", mode, "lora") for mode in serving.MODES]


def reference_engines(adapters: list[str], prefix: str = "") -> list[Engine]:
    """Each adapter's references, served eager without LoRA, named PREFIX+KIND-ADAPTER."""
    return [
        Engine(f"{prefix}{kind}-{adapter}", "eager", kind, adapter)
        for adapter in adapters
        for kind in REFERENCES
    ]


def engines(adapters: list[str], prefix: str = "") -> list[Engine]:
    """Every engine of a run, in the order they start. Names are made only here and in
    the two functions above; a prefix keeps two runs apart in one served.json (--e2e's
    MoE case is "moe-")."""
    return lora_engines(prefix) + reference_engines(adapters, prefix)


# served.json's entry of the transformers + PEFT reference (not a vLLM engine)
PEFT_ENTRY = "peft"


@dataclass
class EngineServed:
    """What one engine served: its result as patchkit.verify.serving wrote it,
    ``{"corrupted_requests", "runs", ...}`` or ``{"error": ...}`` (checks reads it)."""

    engine: Engine
    result: dict

    @property
    def runs(self) -> dict:
        """{request label: {prompt: request}}; {} when the engine did not run."""
        return self.result.get("runs", {})


@dataclass
class Served:
    """Every engine of a run and what it served, found by what the engine is."""

    engines: list[EngineServed]
    peft: dict | None = None  # the PEFT reference's result, when it ran

    @classmethod
    def from_json(
        cls, served: dict, adapters: list[str], prefix: str = "", merged: bool = True
    ) -> Served:
        """served.json's form, ``{engine name: result}`` (what serving.serve_all returns
        and recorded runs hold), read for the engines of a run of these adapters
        (without merged references when ``merged`` is False: `--reference peft`)."""
        wanted = engines(adapters, prefix) if merged else lora_engines(prefix)
        return cls([EngineServed(e, served[e.name]) for e in wanted], served.get(PEFT_ENTRY))

    def lora(self) -> list[EngineServed]:
        """The LoRA engines, one per mode, in serving.MODES order."""
        return [s for s in self.engines if s.engine.kind == "lora"]

    def reference(self, kind: str, adapter: str) -> EngineServed:
        """The engine serving ``adapter``'s reference of ``kind`` (one of REFERENCES)."""
        return next(
            s for s in self.engines if s.engine.kind == kind and s.engine.adapter == adapter
        )


def lora_requests(
    adapters: list[str], prompts: dict, control_names: list[str] = ()
) -> list[tuple[str, str, str | None]]:
    """Base, every adapter, every control, a short prompt after the longest, base again."""
    names = list(prompts)
    plan = [("base", p, None) for p in names]
    for adapter in adapters:
        plan += [(f"lora:{adapter}", p, adapter) for p in names]
    for control in control_names:
        plan += [(f"control:{control}", p, control) for p in names]
    plan.append(("lora_after_long", names[0], adapters[0]))
    plan += [("base_after_lora", p, None) for p in names]
    return plan


def served_controls(controls: dict[str, list] | None) -> dict[str, str]:
    """{LoRA name: directory} of the controls that are served (not judged on base)."""
    return {
        c.name: str(c.path)
        for group in (controls or {}).values()
        for c in group
        if c.path is not None
    }


def served_faults(controls: dict[str, list] | None) -> dict[str, str]:
    """{LoRA name: fault} of the engine-side controls (patchkit.verify.enginefaults)."""
    return {c.name: c.fault for group in (controls or {}).values() for c in group if c.is_engine}


def jobs(
    model_dir: Path,
    adapters: dict[str, Path],
    references: dict[str, dict[str, Path]],
    setup: dict,
    prefix: str = "",
    controls: dict[str, list] | None = None,
) -> list[serving.Job]:
    """The LoRA engine in each mode (every adapter and control), and one eager engine
    per merged reference and rounding control (none with `--reference peft`)."""
    prompts = setup["prompts"]
    common = {
        k: setup[k]
        for k in (
            "tensor_parallel_size",
            "max_model_len",
            "seed",
            "gpu_memory_utilization",
            "kv_cache_bytes",
        )
    }
    rank = serving.lora_rank_limit(max(adapter_rank(p) for p in adapters.values()))
    extra = served_controls(controls)
    out = [
        serving.Job(
            name=engine.name,
            model=str(model_dir),
            mode=engine.mode,
            prompts=prompts,
            requests=lora_requests(list(adapters), prompts, list(extra)),
            loras={**{n: str(p) for n, p in adapters.items()}, **extra},
            faults=served_faults(controls),
            max_lora_rank=rank,
            **common,
        )
        for engine in lora_engines(prefix)
    ]
    requests = [("merged", p, None) for p in prompts]
    for engine in reference_engines(list(references), prefix):
        out.append(
            serving.Job(
                name=engine.name,
                model=str(references[engine.adapter][engine.kind]),
                mode=engine.mode,
                prompts=prompts,
                requests=requests,
                **common,
            )
        )
    return out + baserows.jobs(str(model_dir), prompts, common, prefix)  # LoRA off, per mode
