"""The plan of a merged reference: which checkpoint rows each adapter module changes, and how.

``plan_merge(model_dir, adapter_dir)`` reads only headers and small files
and decides, before anything is written, which tensors each adapter module
changes (linear modules, embeddings, fused or per-expert MoE experts in
either of PEFT's layouts, under either Qwen3.5 naming), with which rank
and scale (PEFT's rules), which shards are rewritten, linked or copied, and
how many bytes the merged copy needs. Anything it cannot merge exactly is
refused in one line naming the module; what vLLM reads differently from
PEFT is said in the plan's notes, so a failed comparison is explained.
Why each rule is what it is: docs/verify.md ("The merged reference").
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.adapters.safetensorsfile import dims
from patchkit.codes import Code
from patchkit.errors import PatchkitError
from patchkit.verify.adapterfiles import (
    ADAPTER_CONFIG,
    AdapterConfig,
    AdapterRefused,
    AdapterTensors,
    AdapterUnreadable,
    FactorCache,
    module_keys,
    read_adapter_config,
)
from patchkit.verify.checkpoint import INDEX_NAME, Checkpoint, CheckpointInvalid

_MERGEABLE = ("F32", "F16", "BF16", "F64")


class NotEnoughSpace(PatchkitError):
    """The merged checkpoints need more disk than is free: ``path``, ``needed`` and
    ``free`` (bytes). Nothing was written."""

    code = Code.NOT_ENOUGH_SPACE


class WorkdirUnusable(PatchkitError):
    """A directory verify writes into that cannot take its files (not new or empty, not
    a directory, not creatable): ``path``."""

    code = Code.WORKDIR_UNUSABLE


class MergeRefused(PatchkitError):
    """An adapter module the merge cannot put into this checkpoint (no base tensor, factors
    that do not fit it, a quantized weight, a rank its config does not give): ``path``
    (the adapter's weights), ``module`` and ``detail``."""

    code = Code.MERGE_REFUSED


# The fused expert parameters of Qwen3.5-MoE in registration order (PEFT nests
# target_parameters wrappers in this order: the first is the innermost base_layer).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
# The per-expert matrices of the same experts (gate_up_proj = gate_proj rows, then up_proj rows).
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
# vLLM's fused names, which HF checkpoints of Qwen3.5 do not hold.
_VLLM_FUSED = {
    "in_proj_qkvz": "in_proj_qkv and in_proj_z",
    "in_proj_ba": "in_proj_b and in_proj_a",
    "qkv_proj": "q_proj, k_proj and v_proj",
    "gate_up_proj": "gate_proj and up_proj",
}


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _alternatives(name: str) -> list[str]:
    """The name, then the same module under the other Qwen3.5 naming (VL wrapper / text-only)."""
    vl = "model.language_model."
    if name.startswith(vl):
        return [name, "model." + name[len(vl) :]]
    if name.startswith("model.") and not name.startswith("model.visual."):
        return [name, vl + name[len("model.") :]]
    return [name]


@dataclass
class _Lora:
    """One adapter module's factors and how they form its delta."""

    module: str
    a_key: str
    b_key: str
    # linear: B @ A. embedding: (B @ A).T. experts / experts-legacy: one (E, d1, d2)
    # delta, expert e from the factors in the layout of vLLM and PEFT >= 0.20, or of
    # PEFT <= 0.19 (for (E, out, in) parameters such as Qwen3.5's).
    kind: str
    scale: float
    rank: int
    experts: int = 1

    def factors(self, cache: FactorCache, expert: int | None):
        """(left, right), float32, with delta rows = scale * left @ right."""
        a = cache.get(self.a_key)
        b = cache.get(self.b_key)
        if self.kind == "linear":
            return b, a
        if self.kind == "embedding":
            return a.T, b.T
        e, n, r = expert, self.experts, self.rank
        if self.kind == "experts":  # A (r*E, d2), B (d1, r*E)
            return b.view(b.shape[0], r, n)[:, :, e], a.view(n, r, a.shape[1])[e]
        if self.kind == "experts-legacy":  # A (r*E, d1), B (d2, r*E)
            return a.view(n, r, a.shape[1])[e].T, b.view(b.shape[0], r, n)[:, :, e].T
        raise AssertionError(self.kind)


@dataclass
class Piece:
    """Rows [row0, row0 + nrows) of checkpoint tensor `key` gain rows [sub0, sub0 + nrows)
    of a module's delta (of one expert, for expert modules)."""

    key: str
    row0: int
    nrows: int
    lora: _Lora
    expert: int | None = None
    sub0: int = 0


@dataclass
class ModuleMerge:
    """What one adapter module does to the checkpoint."""

    module: str
    kind: str
    rank: int
    scale: float
    targets: tuple[str, ...]


@dataclass
class MergePlan:
    """What `write_merged` will do, decided before anything is written."""

    model_dir: Path
    adapter_dir: Path
    modules: list[ModuleMerge]
    rewrite: list[str]  # shards rewritten with merged tensors
    link: list[str]  # shards hard-linked (or symlinked) unchanged
    copy: list[str]  # other files copied
    index_text: str | None  # the index written, when the checkpoint has one
    bytes_needed: int
    notes: list[str] = field(default_factory=list)
    # per checkpoint tensor, the rows the adapter's modules add to it
    pieces: dict[str, list[Piece]] = field(default_factory=dict, repr=False)
    # each shard's (size, mtime_ns) when planned: write_merged refuses one changed since
    sources: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    @property
    def changed_tensors(self) -> list[str]:
        return sorted(self.pieces)

    def describe(self) -> list[str]:
        """Lines for the user, before anything is written."""
        touched = len(self.changed_tensors)
        lines = [
            f"merged copy of {self.model_dir} with {self.adapter_dir}: needs "
            f"{human_bytes(self.bytes_needed)} ({len(self.rewrite)} of "
            f"{len(self.rewrite) + len(self.link)} weight files rewritten, {len(self.link)} "
            f"linked, {len(self.copy)} other files copied); {len(self.modules)} adapter modules "
            f"change {touched} tensors"
        ]
        lines += [f"note: {n}" for n in self.notes]
        return lines


class _Planner:
    def __init__(self, ckpt: Checkpoint, cfg: AdapterConfig, adapter: AdapterTensors):
        self.ckpt = ckpt
        self.cfg = cfg
        self.adapter = adapter
        self.pieces: dict[str, list[Piece]] = {}
        self.modules: list[ModuleMerge] = []
        self.notes: list[str] = []
        self.renamed: list[tuple[str, str]] = []
        self.vllm_scale_differs: list[str] = []
        self.legacy_layout: list[str] = []
        self.expert_params: dict[str, set[str]] = {}
        self.per_expert: list[str] = []
        self.square: list[str] = []
        self._layouts: dict[str, dict | None] = {}
        self._modules: dict[str, dict[str, str]] = {}

    # -- names -------------------------------------------------------------

    def find(self, name: str) -> str | None:
        for alt in _alternatives(name):
            if self.ckpt.has(alt):
                if alt != name:
                    self.renamed.append((name, alt))
                return alt
        return None

    def where(self, key: str) -> str:
        return f"{key} in {self.ckpt.where[key]}"

    def fail(self, module: str, what: str) -> MergeRefused:
        return MergeRefused(
            f"{self.adapter.path.name}: module {module}: {what}",
            path=self.adapter.path,
            module=module,
            detail=what,
        )

    def shapes(self, entry: dict[str, str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.adapter.shapes[entry["A"]], self.adapter.shapes[entry["B"]]

    def add(self, piece: Piece) -> None:
        info = self.ckpt.info(piece.key)
        if info.dtype not in _MERGEABLE:
            raise self.fail(
                piece.lora.module,
                f"base tensor {self.where(piece.key)} is {info.dtype}; LoRA can be merged into "
                "F32/F16/BF16 weights only (use the unquantized checkpoint)",
            )
        self.pieces.setdefault(piece.key, []).append(piece)

    def record(self, lora: _Lora, targets) -> None:
        self.modules.append(
            ModuleMerge(
                lora.module, lora.kind, lora.rank, lora.scale, tuple(dict.fromkeys(targets))
            )
        )
        if not math.isclose(lora.scale, self.cfg.global_scale, rel_tol=1e-9):
            self.vllm_scale_differs.append(lora.module)

    def check_factors(self, module: str, entry: dict[str, str]) -> None:
        for which in ("A", "B"):
            key = entry[which]
            shape, dtype = self.adapter.shapes[key], self.adapter.dtypes[key]
            if len(shape) != 2:
                raise self.fail(
                    module,
                    f"lora_{which} is {dims(shape)}, not a matrix (LoRA on a convolution such "
                    "as the GDN conv1d is not supported)",
                )
            if dtype not in _MERGEABLE:
                raise self.fail(
                    module,
                    f"lora_{which} is {dtype!r}; the merge reads {', '.join(_MERGEABLE)} factors",
                )

    def rank_for(self, module: str, pattern_name: str, rank: int) -> tuple[int, float]:
        cfg_rank, alpha = self.cfg.rank_alpha(pattern_name)
        if rank != cfg_rank:
            raise self.fail(
                module,
                f"its tensors have rank {rank} but {ADAPTER_CONFIG} gives r={cfg_rank} for "
                f"{pattern_name} (r / rank_pattern)",
            )
        return rank, self.cfg.scale(rank, alpha)

    # -- modules -----------------------------------------------------------

    def plan_module(self, module: str, entry: dict[str, str]) -> None:
        self.check_factors(module, entry)
        if entry["kind"] == "embedding":
            return self.plan_embedding(module, entry)
        root, depth = module, 0
        while root.endswith(".base_layer"):
            root, depth = root[: -len(".base_layer")], depth + 1
        if root.rsplit(".", 1)[-1] == "experts":
            layout = self.expert_layout(root)
            if layout is not None:
                return self.plan_experts(module, entry, root, depth, layout)
        if depth:
            raise self.fail(
                module, "no base tensor: a nested base_layer that is not an MoE experts module"
            )
        key = self.find(module + ".weight")
        if key is None:
            match = re.fullmatch(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)", module)
            layout = self.expert_layout(match.group(1)) if match else None
            if layout is not None and layout["fused"]:
                return self.plan_expert_slice(
                    module, entry, layout, int(match.group(2)), match.group(3)
                )
            last = module.rsplit(".", 1)[-1]
            hint = (
                f" ({last} is vLLM's fused name; HF checkpoints hold {_VLLM_FUSED[last]})"
                if last in _VLLM_FUSED
                else ""
            )
            raise self.fail(module, f"no base tensor {module}.weight in {self.ckpt.dir}{hint}")
        return self.plan_linear(module, entry, key)

    def plan_linear(self, module: str, entry: dict[str, str], key: str) -> None:
        info = self.ckpt.info(key)
        a, b = self.shapes(entry)
        self.check_tied(module, key)
        if len(info.shape) != 2 or a[1] != info.shape[1] or b[0] != info.shape[0] or a[0] != b[1]:
            raise self.fail(
                module,
                f"lora_A {dims(a)} and lora_B {dims(b)} do not fit base tensor "
                f"{self.where(key)} {dims(info.shape)} (needs A (r, {info.shape[-1]}), "
                f"B ({info.shape[0]}, r))",
            )
        rank, scale = self.rank_for(module, module, a[0])
        lora = _Lora(module, entry["A"], entry["B"], "linear", scale, rank)
        self.add(Piece(key, 0, info.shape[0], lora))
        self.record(lora, [key])

    def plan_embedding(self, module: str, entry: dict[str, str]) -> None:
        key = self.find(module + ".weight")
        if key is None:
            raise self.fail(module, f"no base tensor {module}.weight in {self.ckpt.dir}")
        self.check_tied(module, key)
        info = self.ckpt.info(key)
        a, b = self.shapes(entry)
        if len(info.shape) != 2 or a[1] != info.shape[0] or b[0] != info.shape[1] or a[0] != b[1]:
            raise self.fail(
                module,
                f"lora_embedding_A {dims(a)} and lora_embedding_B {dims(b)} do not fit base "
                f"tensor {self.where(key)} {dims(info.shape)}",
            )
        rank, scale = self.rank_for(module, module, a[0])
        lora = _Lora(module, entry["A"], entry["B"], "embedding", scale, rank)
        self.add(Piece(key, 0, info.shape[0], lora))
        self.record(lora, [key])

    def check_tied(self, module: str, key: str) -> None:
        last = module.rsplit(".", 1)[-1]
        if last in ("lm_head", "embed_tokens") and self.ckpt.tied_embeddings():
            raise self.fail(
                module,
                f"the model ties lm_head to embed_tokens (tie_word_embeddings), so merging into "
                f"{key} would change both",
            )

    # -- experts -----------------------------------------------------------

    def expert_layout(self, root: str) -> dict | None:
        """The experts under `root`: fused 3-D tensors or per-expert matrices (cached)."""
        if root not in self._layouts:
            self._layouts[root] = self._expert_layout(root)
        return self._layouts[root]

    def _expert_layout(self, root: str) -> dict | None:
        for alt in _alternatives(root):
            gate_up, down = alt + ".gate_up_proj", alt + ".down_proj"
            if self.ckpt.has(gate_up) or self.ckpt.has(down):
                params = {}
                for name, key in (("gate_up_proj", gate_up), ("down_proj", down)):
                    if self.ckpt.has(key):
                        shape = self.ckpt.info(key).shape
                        if len(shape) != 3:
                            raise CheckpointInvalid(
                                f"{self.where(key)}: fused experts are {dims(shape)}, not 3-D",
                                path=self.ckpt.dir / self.ckpt.where[key],
                                tensor=key,
                            )
                        params[name] = shape
                if alt != root:
                    self.renamed.append((root, alt))
                return {"fused": True, "root": alt, "params": params}
            prefix = alt + "."
            indices = {
                int(k[len(prefix) :].split(".", 1)[0])
                for k in self.ckpt.where
                if k.startswith(prefix) and k[len(prefix) :].split(".", 1)[0].isdigit()
            }
            if indices:
                count = max(indices) + 1
                if indices != set(range(count)):
                    missing = sorted(set(range(count)) - indices)[:3]
                    raise CheckpointInvalid(
                        f"{self.ckpt.dir}: experts under {alt} miss indices {missing}",
                        path=self.ckpt.dir,
                    )
                params = {}
                gate, up, down = (self.ckpt.has(f"{alt}.0.{p}.weight") for p in EXPERT_PROJ)
                if gate and up:
                    g, u = (self.ckpt.info(f"{alt}.0.{p}.weight").shape for p in EXPERT_PROJ[:2])
                    if g != u or len(g) != 2:
                        raise CheckpointInvalid(
                            f"{self.ckpt.dir}: {alt}.0 gate_proj {g} and up_proj {u} differ",
                            path=self.ckpt.dir,
                        )
                    params["gate_up_proj"] = (count, 2 * g[0], g[1])
                if down:
                    d = self.ckpt.info(f"{alt}.0.down_proj.weight").shape
                    params["down_proj"] = (count, d[0], d[1])
                if alt != root:
                    self.renamed.append((root, alt))
                return {"fused": False, "root": alt, "params": params}
        return None

    def expert_rows(self, layout: dict, param: str, expert: int) -> list[tuple[str, int, int, int]]:
        """Where one expert's rows of an (E, d1, d2) parameter live: (key, row0, nrows, sub0)."""
        root = layout["root"]
        _, d1, _ = layout["params"][param]
        if layout["fused"]:
            return [(f"{root}.{param}", expert * d1, d1, 0)]
        if param == "down_proj":
            return [(f"{root}.{expert}.down_proj.weight", 0, d1, 0)]
        half = d1 // 2
        return [
            (f"{root}.{expert}.gate_proj.weight", 0, half, 0),
            (f"{root}.{expert}.up_proj.weight", 0, half, half),
        ]

    def plan_experts(self, module, entry, root, depth, layout) -> None:
        a, b = self.shapes(entry)
        targeted = [
            p
            for p in EXPERT_PARAMS
            if any(
                f"{root}.{p}" == t or f"{root}.{p}".endswith("." + t)
                for t in self.cfg.target_parameters
            )
        ]
        if targeted:
            if depth >= len(targeted):
                raise self.fail(
                    module, f"more nested base_layers than target_parameters {targeted}"
                )
            candidates = [targeted[len(targeted) - 1 - depth]]
        elif depth == 0 and (module + ".base_layer") in self._modules:
            candidates = ["down_proj"]  # vLLM's convention: base_layer is gate_up_proj
        elif depth == 1:
            candidates = ["gate_up_proj"]
        else:
            candidates = list(EXPERT_PARAMS)
        fits = []
        for param in candidates:
            if param not in layout["params"]:
                continue
            n, d1, d2 = layout["params"][param]
            if a[0] % n or b[1] != a[0]:
                continue
            if a[1] == d2 and b[0] == d1:
                fits.append((param, "experts"))
            elif a[1] == d1 and b[0] == d2:
                fits.append((param, "experts-legacy"))
        shapes = ", ".join(
            f"{layout['root']}.{p} {dims(layout['params'][p])}"
            for p in candidates
            if p in layout["params"]
        )
        if not fits:
            raise self.fail(
                module,
                f"lora_A {dims(a)} and lora_B {dims(b)} fit no expert parameter "
                f"({shapes or 'none in the checkpoint'}; an (E, d1, d2) parameter takes "
                "A (r*E, d2), B (d1, r*E), or from PEFT <= 0.19 A (r*E, d1), B (d2, r*E))",
            )
        if len(fits) > 1:
            raise self.fail(
                module,
                f"lora_A {dims(a)} and lora_B {dims(b)} fit both {shapes}; name the parameter "
                f"in {ADAPTER_CONFIG} target_parameters",
            )
        param, kind = fits[0]
        n, d1, d2 = layout["params"][param]
        if d1 == d2:
            self.square.append(module)
        pattern_name = f"{root}.{param}"
        rank, scale = self.rank_for(module, pattern_name, a[0] // n)
        lora = _Lora(module, entry["A"], entry["B"], kind, scale, rank, experts=n)
        targets = []
        for e in range(n):
            for key, row0, nrows, sub0 in self.expert_rows(layout, param, e):
                self.add(Piece(key, row0, nrows, lora, expert=e, sub0=sub0))
                targets.append(key)
        self.record(lora, targets)
        if kind == "experts-legacy":
            self.legacy_layout.append(module)
        self.expert_params.setdefault(layout["root"], set()).add(param)

    def plan_expert_slice(self, module, entry, layout, expert, proj) -> None:
        """A per-expert adapter module on a fused experts checkpoint."""
        param = "down_proj" if proj == "down_proj" else "gate_up_proj"
        if param not in layout["params"]:
            raise self.fail(module, f"no base tensor {layout['root']}.{param} in {self.ckpt.dir}")
        n, d1, d2 = layout["params"][param]
        rows = d1 if param == "down_proj" else d1 // 2
        offset = d1 // 2 if proj == "up_proj" else 0
        key = f"{layout['root']}.{param}"
        a, b = self.shapes(entry)
        if expert >= n or a[1] != d2 or b[0] != rows or a[0] != b[1]:
            raise self.fail(
                module,
                f"lora_A {dims(a)} and lora_B {dims(b)} do not fit expert {expert} of "
                f"{self.where(key)} {dims((n, d1, d2))} (needs A (r, {d2}), B ({rows}, r))",
            )
        rank, scale = self.rank_for(module, module, a[0])
        lora = _Lora(module, entry["A"], entry["B"], "linear", scale, rank)
        self.add(Piece(key, expert * d1 + offset, rows, lora))
        self.record(lora, [key])

    # -- all of it ---------------------------------------------------------

    def run(self, modules: dict[str, dict[str, str]]) -> None:
        self._modules = modules
        for module in sorted(modules):
            self.plan_module(module, modules[module])
        if self.renamed:
            first, to = self.renamed[0]
            self.notes.append(
                f"the adapter names modules as {first}, the checkpoint as {to}: merged onto the "
                "checkpoint's names; vLLM applies LoRA only to names its hf_to_vllm_mapper "
                "produces, so it may not apply this adapter at all"
            )
        if self.vllm_scale_differs:
            names = self.vllm_scale_differs
            self.notes.append(
                f"rank_pattern/alpha_pattern give {len(names)} modules (e.g. {names[0]}) a scale "
                f"other than the global {self.cfg.global_scale:g}; vLLM before 0.32 applies the "
                "global one (vllm/lora/peft_helper.py) and will not match this merge"
            )
        if self.legacy_layout:
            self.notes.append(
                f"{len(self.legacy_layout)} fused expert modules (e.g. {self.legacy_layout[0]}) "
                "have lora_A as (r*E, out), as PEFT <= 0.19 saved them; vLLM 0.22-0.33 "
                "(FusedMoE3DWithLoRA) and PEFT >= 0.20 read lora_A as (r*E, in), so vLLM "
                "refuses or misreads this adapter"
            )
        single = sorted(root for root, params in self.expert_params.items() if len(params) == 1)
        if single:
            param = next(iter(self.expert_params[single[0]]))
            self.notes.append(
                f"{len(single)} experts module{'s' if len(single) != 1 else ''} (e.g. {single[0]}) "
                "adapt one parameter "
                f"({param}); vLLM 0.17-0.33 (_stack_moe_lora_weights) needs both gate_up_proj "
                "and down_proj in a fused expert adapter and will not load it unless "
                "partial-moe-adapter is applied (`patchkit apply`)"
            )
        if self.square:
            self.notes.append(
                f"{len(self.square)} fused expert modules (e.g. {self.square[0]}) have square "
                "matrices, which fit both layouts: read as vLLM and PEFT >= 0.20 do"
            )
        self.per_expert = [m for m in self._modules if re.search(r"\.experts\.\d+\.", m)]
        if self.per_expert and self.ckpt.architecture().startswith("Qwen3_5Moe"):
            self.notes.append(
                f"{len(self.per_expert)} per-expert modules (e.g. {self.per_expert[0]}): vLLM "
                "serves Qwen3.5-MoE experts with FusedMoE3DWithLoRA and loads per-expert "
                "adapters only with --enable-mixed-moe-lora-format"
            )
        if self.per_expert and self.cfg.use_rslora:
            self.notes.append(
                "per-expert rsLoRA modules: vLLM before 0.32 scales packed experts by "
                "lora_alpha/r (PackedLoRALayerWeights.pack_moe), not lora_alpha/sqrt(r)"
            )


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def _index_text(ckpt: Checkpoint) -> str | None:
    if ckpt.index_meta is None:
        return None
    weight_map = {key: ckpt.where[key] for key in sorted(ckpt.where)}
    meta = dict(ckpt.index_meta)
    meta["total_size"] = sum(
        info.nbytes for shard in ckpt.shards.values() for info in shard.tensors.values()
    )
    return json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2) + "\n"


def plan_merge(model_dir: Path | str, adapter_dir: Path | str) -> MergePlan:
    """Decide the merge of one PEFT LoRA adapter into a safetensors checkpoint; writes nothing."""
    model_dir, adapter_dir = Path(model_dir), Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterUnreadable(f"adapter directory {adapter_dir} does not exist", path=adapter_dir)
    ckpt = Checkpoint(model_dir)
    cfg = read_adapter_config(adapter_dir)
    adapter = AdapterTensors(adapter_dir)
    try:
        modules, notes = module_keys(adapter)
        if not modules:
            raise AdapterRefused(f"{adapter.path}: holds no LoRA factors", path=adapter.path)
        planner = _Planner(ckpt, cfg, adapter)
        planner.run(modules)
    finally:
        adapter.close()
        ckpt.close()
    rewrite = sorted({ckpt.where[key] for key in planner.pieces})
    link = sorted(set(ckpt.shards) - set(rewrite))
    copy = []
    for path in sorted(model_dir.iterdir()):
        if path.name in ckpt.shards or path.name == INDEX_NAME:
            continue
        if (
            path.is_file()
            and not path.name.endswith(_WEIGHT_SUFFIXES)
            and not path.name.startswith(".")
        ):
            copy.append(path.name)
    index_text = _index_text(ckpt)
    sizes = {name: (model_dir / name).stat() for name in list(ckpt.shards) + copy}
    needed = sum(sizes[name].st_size for name in rewrite + copy)
    if index_text is not None:
        needed += len(index_text.encode())
    return MergePlan(
        model_dir=model_dir,
        adapter_dir=adapter_dir,
        modules=planner.modules,
        rewrite=rewrite,
        link=link,
        copy=copy,
        index_text=index_text,
        bytes_needed=needed,
        notes=notes + planner.notes,
        pieces=planner.pieces,
        sources={n: (s.st_size, s.st_mtime_ns) for n, s in sizes.items() if n in ckpt.shards},
    )
