"""partial-moe-adapter on the real loader code of 0.17.0 to 0.33.0.

An adapter is crafted as PEFT saves LoRA on a 3D MoE layer's routed experts
(``target_parameters``): its adapter_config.json fields, its safetensors key
names, PEFT's shapes. With one parameter, ``mlp.experts.down_proj`` or
``mlp.experts.gate_up_proj``, PEFT writes ``<experts>.lora_{A,B}`` alone;
with both, ``<experts>.base_layer.lora_{A,B}`` is gate_up_proj, A (r*E,
hidden), B (2*I, r*E), and ``<experts>.lora_{A,B}`` down_proj, A (r*E, I),
B (hidden, r*E). It then goes the way vLLM loads it, every step the
release's real code, pristine or as the catalogue's variant leaves it:

1. ``PEFTHelper.from_dict`` (peft_helper.py) reads the config;
2. ``LoRAModel.from_lora_tensors`` (lora_model.py, with ``LoRALayerWeights``
   and the name parsers of utils.py) makes the adapter's modules, each with
   the rank and scaling ``PEFTHelper`` gives it (rank_pattern / alpha_pattern
   from 0.32.0 on);
3. ``LoRAModelManager._create_merged_loras_inplace`` and
   ``_stack_moe_lora_weights`` (with patchkit's
   ``_patchkit_single_parameter_lora`` when patched) and the lookups they
   call (model_manager.py) stack the experts' factors;
4. ``FusedMoE3DWithLoRA.set_lora`` / ``reset_lora`` (layers/fused_moe.py)
   copy them into the layer's stacked buffers, as ``activate_adapter`` does.

The manager and the layer are objects holding what those methods read
(``Manager``, ``Experts``; the layer's buffers shaped as its
``create_lora_weights`` makes them, at tensor-parallel rank 0 of 1 or 2),
and the size properties the patch reads (``w13_input_size`` ...) are the
release's own. The names bound for the code: ``FusedMoE3DWithLoRA`` /
``FusedMoEWithLoRA`` are the test's layer class (the manager's isinstance
checks); ``PIN_MEMORY`` / ``is_pin_memory_available`` say no pinning (CPU);
``re`` is the standard library's for peft_helper.py's ``regex`` (the
patterns used here are plain). The result is checked against PEFT's own
reading of the layout (as patchkit/verify/mergeplan.py has it): expert e's delta
is ``B.view(out, r, E)[:, :, e] @ A.view(E, r, in)[e]`` times the scaling.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from tests.conftest import CATALOGUE, patched_text, release_tree, releases_with_variant
from tests.punica_harness import definitions, methods

PATCH = "partial-moe-adapter"
MANAGER_FILE = "vllm/lora/model_manager.py"
LAYER_FILE = "vllm/lora/layers/fused_moe.py"
EXPERTS = "model.language_model.layers.0.mlp.experts"  # PEFT's module name, prefix dropped
PEFT_PREFIX = "base_model.model."
RANK, ALPHA, NUM_EXPERTS, MAX_RANK, SLOTS, SLOT = 2, 8, 4, 4, 2, 1
# (hidden, intermediate): 2 * I == hidden, so lora_B rows are equal and lora_A tells;
# hidden == I (as in GPT-OSS), so lora_A columns are equal and lora_B tells.
DIMS = {"2I=H": (16, 8), "I=H": (12, 12)}
PARAMS = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}
OTHER = {"gate_up": "down", "down": "gate_up"}
# Per-parameter rank and alpha in PEFT's rank_pattern / alpha_pattern (read from 0.32.0 on).
PATTERNS = {"gate_up": ("gate_up_proj", 4, 12), "down": ("experts.down_proj", 4, 6)}

MANAGER_METHODS = (
    "_create_merged_loras_inplace",
    "_stack_moe_lora_weights",
    "_patchkit_single_parameter_lora",
    "_get_lora_layer_weights",
    "_get_text_lora_name",
    "_get_text_lora_names",
    "_pop_lora_weights",
)
LAYER_METHODS = {
    "FusedMoEWithLoRA": ("reset_lora", "_slice_w13_a", "_slice_w2_a", "_slice_w2_b"),
    "FusedMoE3DWithLoRA": ("set_lora", "_slice_w13_b"),
}
SIZES = ("w13_input_size", "w13_output_size", "w2_input_size", "w2_output_size")
# What PEFT 0.21.2 saved and merged (scripts/proofs/make_partial_moe_fixture.py).
PEFT_SAVED = Path(__file__).parent / "data" / "peft-0.21.2-moe-one-parameter.pt"


# ----- the release's real code -----


@cache
def source(version: str, relpath: str, patched: bool) -> str:
    """A file of the release, as the variant for it leaves it when patched and it has hunks."""
    variant = CATALOGUE.get(PATCH).expected_for(Version(version))
    if patched and any(f.path == relpath for f in variant.files):
        return patched_text(version, PATCH, relpath)
    return (release_tree(version) / relpath).read_text()


@cache
def helper_file(version: str) -> str:
    """The release's file that defines PEFTHelper (vllm/lora/peft_helper.py so far), found
    by its content, so a release that moves the class needs no edit here."""
    lora = release_tree(version) / "vllm/lora"
    return next(
        p.relative_to(release_tree(version)).as_posix()
        for p in sorted(lora.rglob("*.py"))
        if "\nclass PEFTHelper" in p.read_text()
    )


@cache
def lora_classes(version: str, patched: bool) -> dict:
    """PEFTHelper, LoRALayerWeights and LoRAModel of a release (their files import vLLM)."""
    lora = release_tree(version) / "vllm/lora"
    names = {"torch": torch, "PIN_MEMORY": False, "is_pin_memory_available": lambda: False}
    helper = {"dataclass": dataclass, "field": field, "fields": fields, "MISSING": MISSING}
    helper |= {"json": json, "math": math, "os": os, "re": re}
    text = source(version, helper_file(version), patched)
    definitions(release_tree(version) / helper_file(version), ("PEFTHelper",), helper, text)
    definitions(lora / "lora_weights.py", ("LoRALayerWeights",), names)
    parsers = [n for n in ("is_base_embedding_weights", "is_base_embeddding_weights")
               if f"def {n}(" in (lora / "utils.py").read_text()]  # fmt: skip
    definitions(lora / "utils.py", ("parse_fine_tuned_lora_name", *parsers), names)
    definitions(lora / "lora_model.py", ("LoRAModel",), names)
    return {"PEFTHelper": helper["PEFTHelper"], **names}


class Experts:
    """What the loader and set_lora touch on a FusedMoE3DWithLoRA layer (tp_rank 0)."""

    def __init__(self, version: str, hidden: int, inter: int, tp_size: int):
        shard = inter // tp_size
        self.tp_size, self.tp_rank, self.fully_sharded = tp_size, 0, False
        self.intermediate_size_per_partition = self._tp_shard_size = shard
        self.hidden_size, self.global_num_experts, self.ep_rank = hidden, NUM_EXPERTS, 0
        self.local_num_experts, self._w13_slices = NUM_EXPERTS, 1
        self._base_model = "Qwen3_5MoeForConditionalGeneration"
        self.base_layer = type("Runner", (), {})()  # 0.17-0.23 read these on base_layer
        self.base_layer.hidden_size, self.base_layer.global_num_experts = hidden, NUM_EXPERTS
        self.base_layer.ep_rank, self.base_layer.intermediate_size_per_partition = 0, shard
        shape = (SLOTS, NUM_EXPERTS)
        self.w13_lora_a_stacked = (torch.zeros(*shape, MAX_RANK, hidden),)
        self.w13_lora_b_stacked = (torch.zeros(*shape, 2 * shard, MAX_RANK),)
        self.w2_lora_a_stacked = (torch.zeros(*shape, MAX_RANK, shard),)
        self.w2_lora_b_stacked = (torch.zeros(*shape, hidden, MAX_RANK),)
        self.adapter_enabled = torch.zeros(SLOTS + 1, dtype=torch.int)
        text = source(version, LAYER_FILE, False)
        for cls, names in LAYER_METHODS.items():
            for name, function in methods(text, LAYER_FILE, cls, names).items():
                setattr(self, name, function.__get__(self))


def experts_layer(version: str, hidden: int, inter: int, tp_size: int = 1) -> Experts:
    """An Experts object whose class has the release's size properties."""
    text = source(version, LAYER_FILE, False)
    found = methods(text, LAYER_FILE, "FusedMoE3DWithLoRA", SIZES)
    assert sorted(found) == sorted(SIZES)
    cls = type("Experts", (Experts,), {n: property(f) for n, f in found.items()})
    return cls(version, hidden, inter, tp_size)


class Manager:
    """What _create_merged_loras_inplace reads on a LoRAModelManager of a 3D MoE model."""

    def __init__(self, version: str, layer: Experts, patched: bool):
        self.modules, self.packed_modules = {EXPERTS: layer}, {}
        self.is_pooling_model = self.supports_mm = False
        self._is_3d_moe_model, self._is_non_gated_moe = True, False
        self._enable_mixed_moe_lora_format = self._enable_moe_shared_loras = False
        names = {**lora_classes(version, patched), "FusedMoE3DWithLoRA": Experts}
        names["FusedMoEWithLoRA"] = Experts
        text = source(version, MANAGER_FILE, patched)
        found = methods(text, MANAGER_FILE, "LoRAModelManager", MANAGER_METHODS, names)
        assert ("_patchkit_single_parameter_lora" in found) == patched
        for name, function in found.items():
            setattr(self, name, function.__get__(self))


# ----- the adapter, as PEFT saves it -----


def factors(hidden: int, inter: int, ranks: dict | None = None) -> dict:
    """PEFT's (lora_A, lora_B) of each expert parameter: A (r*E, in), B (out, r*E)."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
    pairs = {}
    for k, (d_in, d_out) in shapes.items():
        rows = (ranks or {}).get(k, RANK) * NUM_EXPERTS
        pairs[k] = (torch.randn(rows, d_in, generator=gen), torch.randn(d_out, rows, generator=gen))
    return pairs


def peft_adapter(trained: tuple[str, ...], pairs: dict, patterns: bool = False):
    """adapter_config.json's fields and the safetensors dict PEFT writes."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
              "lora_dropout": 0.0, "bias": "none", "target_modules": [], "use_rslora": False,
              "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
              "rank_pattern": {}, "alpha_pattern": {},
              "target_parameters": [PARAMS[k] for k in trained]}  # fmt: skip
    for k in trained if patterns else ():
        key, rank, alpha = PATTERNS[k]
        config["rank_pattern"][key], config["alpha_pattern"][key] = rank, alpha
    # PEFT nests the wrappers in registration order: gate_up_proj innermost
    # (base_layer) when both are targeted; one parameter has no base_layer level.
    wrappers = {"gate_up": ".base_layer", "down": ""} if len(trained) == 2 else {trained[0]: ""}
    tensors = {}
    for k, level in wrappers.items():
        a, b = pairs[k]  # copies, as read from the file: vLLM scales lora_B in place
        tensors[f"{PEFT_PREFIX}{EXPERTS}{level}.lora_A.weight"] = a.clone()
        tensors[f"{PEFT_PREFIX}{EXPERTS}{level}.lora_B.weight"] = b.clone()
    return config, tensors


def load(version, patched, trained, pairs, layer, patterns=False) -> Experts:
    """The crafted adapter through vLLM's loader into the layer (slot SLOT)."""
    config, tensors = peft_adapter(trained, pairs, patterns)
    return load_saved(version, patched, config, tensors, layer)


def load_saved(version: str, patched: bool, config: dict, tensors: dict, layer: Experts):
    """vLLM's way from an adapter's config and tensors to the layer's stacked buffers."""
    classes = lora_classes(version, patched)
    helper = classes["PEFTHelper"].from_dict(config)
    model = classes["LoRAModel"].from_lora_tensors(
        lora_model_id=1, tensors=tensors, peft_helper=helper, device="cpu", dtype=torch.float32
    )
    Manager(version, layer, patched)._create_merged_loras_inplace(model)
    experts_lora = model.get_lora(EXPERTS)  # what activate_adapter sets on the layer
    layer.set_lora(SLOT, experts_lora.lora_a, experts_lora.lora_b)
    return layer


# ----- what the layer holds -----


def peft_delta(pair: tuple[torch.Tensor, torch.Tensor], scaling: float) -> torch.Tensor:
    """(E, out, in): PEFT's delta of a fused expert parameter."""
    a, b = pair
    rank = a.shape[0] // NUM_EXPERTS
    a_e = a.view(NUM_EXPERTS, rank, a.shape[1])
    b_e = b.view(b.shape[0], rank, NUM_EXPERTS).permute(2, 0, 1)
    return torch.bmm(b_e, a_e) * scaling


def rank0_shard(delta: torch.Tensor, param: str, tp_size: int) -> torch.Tensor:
    """The part tensor-parallel rank 0 holds: gate and up rows, or down's input columns."""
    if param == "down":
        return delta[:, :, : delta.shape[2] // tp_size]
    inter = delta.shape[1] // 2
    shard = inter // tp_size
    return torch.cat([delta[:, :shard], delta[:, inter : inter + shard]], dim=1)


def buffers(layer: Experts, param: str) -> tuple[torch.Tensor, torch.Tensor]:
    if param == "gate_up":
        return layer.w13_lora_a_stacked[0][SLOT], layer.w13_lora_b_stacked[0][SLOT]
    return layer.w2_lora_a_stacked[0][SLOT], layer.w2_lora_b_stacked[0][SLOT]


def layer_delta(layer: Experts, param: str) -> torch.Tensor:
    a, b = buffers(layer, param)
    return torch.bmm(b, a)


def assert_delta(layer: Experts, param: str, expected: torch.Tensor) -> None:
    torch.testing.assert_close(layer_delta(layer, param), expected, rtol=1e-5, atol=1e-5)


# Every tested release where the catalogue has a variant (today all of them): the
# families of _stack_moe_lora_weights (0.17-0.20, 0.21-0.23 reading the experts'
# count on base_layer, 0.24-0.32, 0.33+ popping base_layer) and of LoRAModel /
# PEFTHelper (0.31, 0.32+ with rank/alpha patterns) come with them.
VERSIONS = releases_with_variant(PATCH)
# Where the variant reads PEFT's rank_pattern / alpha_pattern: it changes the file that
# defines PEFTHelper (which matches them), whatever the variant's name.
WITH_PATTERNS = [
    version
    for version in VERSIONS
    if helper_file(version) in CATALOGUE.get(PATCH).expected_for(Version(version)).paths
]


@pytest.mark.slow
@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("trained", ["down", "gate_up"])
@pytest.mark.parametrize("version", VERSIONS)
def test_one_parameter_is_read_as_itself_and_the_other_stays_at_base(
    version, trained, dims, tp_size
):
    hidden, inter = DIMS[dims]
    pairs = factors(hidden, inter)
    layer = load(version, True, (trained,), pairs, experts_layer(version, hidden, inter, tp_size))
    assert_delta(layer, trained, rank0_shard(peft_delta(pairs[trained], ALPHA / RANK), trained,
                                             tp_size))  # fmt: skip
    a, b = buffers(layer, OTHER[trained])
    assert not a.any() and not b.any()  # a zero LoRA: the other projection keeps base weights
    assert layer.adapter_enabled[SLOT] == 1


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("version", VERSIONS)
def test_both_parameters_load_exactly_as_before(version, dims):
    hidden, inter = DIMS[dims]
    pairs = factors(hidden, inter)
    layers = [
        load(version, patched, ("gate_up", "down"), pairs, experts_layer(version, hidden, inter))
        for patched in (False, True)
    ]
    for param in ("gate_up", "down"):
        (a0, b0), (a1, b1) = (buffers(layer, param) for layer in layers)
        assert torch.equal(a0, a1) and torch.equal(b0, b1)
        assert_delta(layers[1], param, peft_delta(pairs[param], ALPHA / RANK))


@pytest.mark.parametrize("version", VERSIONS)
def test_a_shape_that_fits_neither_projection_is_refused(version):
    hidden, inter = DIMS["2I=H"]
    a, b = factors(hidden, inter)["down"]
    odd = {"down": (torch.cat([a, a[:, :1]], dim=1), b)}  # lora_A one column too wide
    layer = experts_layer(version, hidden, inter)
    with pytest.raises(ValueError) as refused:
        load(version, True, ("down",), odd, layer)
    message = str(refused.value)
    assert f"LoRA {EXPERTS} has lora_A (8, 9) and lora_B (16, 8)" in message
    assert "fits neither expert projection" in message
    assert "gate_up_proj (lora_A (r*E, 16), lora_B (16, r*E))" in message
    assert "down_proj (lora_A (r*E, 8), lora_B (16, r*E))" in message
    assert not layer.adapter_enabled.any() and not layer.w2_lora_a_stacked[0].any()


@pytest.mark.parametrize("trained", ["down", "gate_up"])
@pytest.mark.parametrize("version", VERSIONS)
def test_the_unpatched_code_reproduces_the_failure(version, trained):
    hidden, inter = DIMS["2I=H"]
    layer = experts_layer(version, hidden, inter)
    with pytest.raises(AssertionError):
        load(version, False, (trained,), factors(hidden, inter), layer)
    assert "assert gate_up_proj_lora is not None" in source(version, MANAGER_FILE, False)


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_drops_target_parameters_so_the_loader_reads_shapes(version):
    """No release keeps the config's target_parameters; 0.32+ patched keeps it for patterns."""
    config, _ = peft_adapter(("down",), factors(*DIMS["2I=H"]))
    helper = lora_classes(version, False)["PEFTHelper"].from_dict(config)
    assert helper.r == RANK and not hasattr(helper, "target_parameters")


@pytest.mark.parametrize("trained", ["down", "gate_up"])
@pytest.mark.parametrize("version", WITH_PATTERNS)
def test_one_parameter_takes_its_own_rank_and_alpha_pattern(version, trained):
    """0.32+ names <experts> down_proj for the patterns; a gate_up_proj adapter is its own."""
    _, rank, alpha = PATTERNS[trained]
    hidden, inter = DIMS["2I=H"]
    pairs = factors(hidden, inter, {trained: rank})
    layer = load(version, True, (trained,), pairs, experts_layer(version, hidden, inter), True)
    assert_delta(layer, trained, peft_delta(pairs[trained], alpha / rank))
    assert not any(t.any() for t in buffers(layer, OTHER[trained]))
    config, _ = peft_adapter((trained,), pairs, patterns=True)
    patched = lora_classes(version, True)["PEFTHelper"].from_dict(config)
    assert patched.get_rank_and_scaling(EXPERTS) == (rank, alpha / rank)
    # Unpatched, <experts> is down_proj's: a gate_up_proj adapter gets r and lora_alpha.
    unpatched = lora_classes(version, False)["PEFTHelper"].from_dict(config)
    expected = (rank, alpha / rank) if trained == "down" else (RANK, ALPHA / RANK)
    assert unpatched.get_rank_and_scaling(EXPERTS) == expected


@pytest.mark.parametrize("version", WITH_PATTERNS)
def test_both_parameters_keep_their_patterns_exactly_as_before(version):
    hidden, inter = DIMS["2I=H"]
    pairs = factors(hidden, inter, {k: rank for k, (_, rank, _) in PATTERNS.items()})
    both = ("gate_up", "down")
    layers = [load(version, patched, both, pairs, experts_layer(version, hidden, inter), True)
              for patched in (False, True)]  # fmt: skip
    for param in both:
        (a0, b0), (a1, b1) = (buffers(layer, param) for layer in layers)
        assert torch.equal(a0, a1) and torch.equal(b0, b1)
        _, rank, alpha = PATTERNS[param]
        assert_delta(layers[1], param, peft_delta(pairs[param], alpha / rank))


@cache
def peft_saved() -> dict:
    return torch.load(PEFT_SAVED, weights_only=True)


def files(saved: dict) -> dict:
    """The tensors as read from the file, each load its own: vLLM scales lora_B in place."""
    return {k: v.clone() for k, v in saved["tensors"].items()}


@pytest.mark.parametrize("case", ["down", "gate_up", "both"])
@pytest.mark.parametrize("version", VERSIONS)
def test_what_peft_saves_loads_as_peft_merges_it(version, case):
    """PEFT's own files for each case; its merge_and_unload of zeroed experts is the delta."""
    saved = peft_saved()[case]
    assert peft_saved()["versions"]["peft"] == "0.21.2"
    merged = {"gate_up": saved["merged"]["gate_up_proj"], "down": saved["merged"]["down_proj"]}
    experts, inter2, hidden = merged["gate_up"].shape
    assert experts == NUM_EXPERTS
    layer = experts_layer(version, hidden, inter2 // 2)
    load_saved(version, True, saved["config"], files(saved), layer)
    for param in ("gate_up", "down"):
        assert_delta(layer, param, merged[param])
        assert merged[param].any() == (case in (param, "both"))
    pristine = experts_layer(version, hidden, inter2 // 2)
    if case != "both":
        with pytest.raises(AssertionError):
            load_saved(version, False, saved["config"], files(saved), pristine)
        return
    load_saved(version, False, saved["config"], files(saved), pristine)
    for param in ("gate_up", "down"):
        (a0, b0), (a1, b1) = buffers(pristine, param), buffers(layer, param)
        assert torch.equal(a0, a1) and torch.equal(b0, b1)
