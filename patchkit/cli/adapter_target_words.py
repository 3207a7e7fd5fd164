"""The words of adapter check against a model and a release: the factors that do not fit
the model's config.json, what the --target release refuses or ignores, the notes and the
checks skipped (:mod:`patchkit.cli.adapter_words` takes them into its registry)."""

from __future__ import annotations

from patchkit.adapters.safetensorsfile import dims
from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason

WORDS: dict[Code, Words] = {}
words = registrar(WORDS)


# ----- against the model -----


@words(Code.ADAPTER_NO_SUCH_LAYER)
def _no_layer(r: Reason, _: str) -> str:
    layer, layers = r["layer"], r["layers"]
    said = "a layer index no module of the model has" if layer is None else layer
    return (
        f"layer {said}: the model has {layers} layers (0-{layers - 1}); "
        "vLLM finds no module of that name and skips it"
    )


@words(Code.ADAPTER_NO_SUCH_EXPERT)
def _no_expert(r: Reason, _: str) -> str:
    said = "an index no expert of the model has" if r["expert"] is None else r["expert"]
    return f"expert {said}: the model has {r['experts']} experts"


@words(Code.ADAPTER_NO_SUCH_MODULE)
def _no_module(r: Reason, _: str) -> str:
    return (
        f"the model has no {r['module']} in layer {r['layer']} ({r['layer_type']}, "
        f"{'MoE' if r['moe'] else 'dense'} {r['architecture']})"
    )


@words(Code.ADAPTER_EMBEDDING_MISFIT)
def _embedding_misfit(r: Reason, _: str) -> str:
    vocab, hidden = r["vocab"], r["hidden"]
    if r["embedding"]:
        need = f"lora_embedding_A (r, {vocab}), lora_embedding_B ({hidden}, r)"
    else:
        need = f"lora_A (r, {hidden}), lora_B ({vocab}, r)"
    a, b = dims(r["a"]), dims(r["b"])
    return f"{r['module']}: A {a} and B {b} do not fit the model (needs {need})"


@words(Code.ADAPTER_SWAPPED_IN_OUT, Code.ADAPTER_MISFIT)
def _misfit(r: Reason, _: str) -> str:
    out, inp = r["out"], r["inp"]
    how = "are swapped in/out" if r.code == Code.ADAPTER_SWAPPED_IN_OUT else "do not fit"
    return (
        f"lora_A {dims(r['a'])} and lora_B {dims(r['b'])} {how} {r['module']} ({out}, {inp}): "
        f"needs lora_A (r, {inp}), lora_B ({out}, r)"
    )


@words(Code.ADAPTER_NO_EXPERTS)
def _no_experts(r: Reason, _: str) -> str:
    return "the model has no routed experts (dense)"


@words(Code.ADAPTER_NESTED_TOO_DEEP)
def _nested(r: Reason, _: str) -> str:
    return "nested deeper than PEFT's two parameters"


@words(Code.ADAPTER_EXPERT_ROWS)
def _expert_rows(r: Reason, _: str) -> str:
    return f"lora_A {dims(r['a'])}: rows are not a multiple of the {r['experts']} experts (r * E)"


@words(Code.ADAPTER_EXPERTS_LEGACY, Code.ADAPTER_EXPERTS_MISFIT)
def _experts_misfit(r: Reason, _: str) -> str:
    n = r["experts"]
    wants = "; ".join(
        f"{p} {dims(shape)}: lora_A (r*{n}, {shape[2]}), lora_B ({shape[1]}, r*{n})"
        for p, shape in zip(r["parameters"], r["shapes"], strict=True)
    )
    how = (
        "are PEFT <= 0.19's layout (lora_A (r*E, out)); vLLM and PEFT >= 0.20 read "
        "(r*E, in): re-save with PEFT >= 0.20"
        if r.code == Code.ADAPTER_EXPERTS_LEGACY
        else "fit no expert parameter"
    )
    return f"lora_A {dims(r['a'])} and lora_B {dims(r['b'])} {how} ({r['module']} {wants})"


@words(Code.ADAPTER_NO_TARGET_MODULE)
def _no_target_module(r: Reason, _: str) -> str:
    return (
        f"names {r['name']}: {r['architecture']} has no such module and the "
        "adapter holds no tensor for it"
    )


@words(Code.ADAPTER_NO_TARGET_PARAMETER)
def _no_target_parameter(r: Reason, _: str) -> str:
    return f"names {r['name']}: the model has no parameter {r['parameter']} on routed experts"


# ----- against the --target release -----


def _how(r: Reason) -> str:
    """`` (`COMMAND`)`` that applies the patch here, or why patchkit cannot."""
    if r["command"] is not None:
        return f" (`{r['command']}`)"
    return f" (it is {r['state']} here: `patchkit status` says why)"


@words(Code.ADAPTER_ONE_EXPERT_PARAMETER)
def _one_expert_parameter(r: Reason, _: str) -> str:
    return (
        f"layer {r['layer']}: an adapter on one expert parameter; vLLM {r['version']} stops "
        f"at `assert gate_up_proj_lora is not None` (_stack_moe_lora_weights) unless "
        f"{r['patch']} is applied{_how(r)}"
    )


@words(Code.ADAPTER_PARTIAL_GDN)
def _partial_gdn(r: Reason, _: str) -> str:
    return (
        f"layer {r['layer']}: {r['have']} without {r['lack']}; vLLM {r['version']} packs them "
        f"as in_proj_qkvz and expand_packed_lora fails on the missing one unless {r['patch']} "
        f"is applied{_how(r)}"
    )


@words(Code.ADAPTER_NOT_WRAPPED)
def _not_wrapped(r: Reason, _: str) -> str:
    hint = (
        " (a per-expert adapter on a 3D-expert model: re-save it with PEFT "
        "target_parameters, or serve with --enable-mixed-moe-lora-format where the "
        "release has it)"
        if r["per_expert_on_3d"]
        else ""
    )
    return (
        f"vLLM {r['version']} refuses the adapter: its LoRA code wraps no module "
        f"named like {r['module']} for {r['architecture']}{hint}"
    )


@words(Code.ADAPTER_REACH_REFUSED)
def _reach_refused(r: Reason, _: str) -> str:
    return f"vLLM {r['version']} refuses the adapter: {r['module']}: {reach_words(r['why'])}"


def _example(r: Reason) -> str:
    return f"e.g. {r['example']} -> {r['vllm_module']}: {reach_words(r['why'])}"


@words(Code.ADAPTER_SERVED_AS_BASE)
def _served_as_base(r: Reason, _: str) -> str:
    return (
        f"vLLM {r['version']} would serve this adapter as the base model: none of its "
        f"{r['modules']} modules reaches a module its LoRA code wraps ({_example(r)}); "
        "it loads without a warning"
    )


@words(Code.ADAPTER_MODULES_IGNORED)
def _modules_ignored(r: Reason, _: str) -> str:
    return (
        f"vLLM {r['version']} ignores {r['ignored']} of the adapter's {r['modules']} modules: "
        f"their weights reach no module its LoRA code wraps, so they serve as the base model "
        f"({_example(r)})"
    )


@words(Code.ADAPTER_PATTERNS_UNREAD)
def _patterns_unread(r: Reason, _: str) -> str:
    return (
        f"vLLM {r['version']} does not read {' or '.join(r['patterns'])} (its PEFTHelper has "
        f"no such field; 0.32.0 on reads them): it serves {r['modules']} module(s) (e.g. "
        f"{r['example']}) at the scale of r and lora_alpha, not the one PEFT trained"
    )


# ----- notes -----


@words(Code.ADAPTER_EMBEDDING_COPY)
def _embedding_copy(r: Reason, _: str) -> str:
    return f"{r['tensor']}: a full embedding copy; vLLM skips it, so does this check"


@words(Code.ADAPTER_ZERO_MODULES)
def _zero_modules(r: Reason, _: str) -> str:
    return (
        f"{r['zero']} of {r['modules']} modules have an all-zero {r['factors']} and change "
        f"nothing (e.g. {r['example']})"
    )


@words(Code.ADAPTER_OUTSIDE_LAYERS)
def _outside_layers(r: Reason, _: str) -> str:
    return (
        f"{r['modules']} modules outside the language model's layers (e.g. {r['example']}): "
        "shapes not checked"
    )


@words(Code.ADAPTER_OTHER_LAYOUT)
def _other_layout(r: Reason, _: str) -> str:
    return (
        f"the adapter's layers are under {r['prefix']}layers.N, the model's checkpoint "
        f"({r['architecture']}) has them under {r['want']}layers.N: a release that does not "
        "map one to the other serves those modules as the base model (vLLM #34186); --target "
        "says what a release does"
    )


@words(Code.ADAPTER_EXPERT_BY_SHAPE)
def _expert_by_shape(r: Reason, _: str) -> str:
    return f"{r['module']}: one expert parameter, by its shapes {r['parameter']}"


@words(Code.ADAPTER_VISION_TOWER)
def _vision_tower(r: Reason, _: str) -> str:
    return (
        f"{r['modules']} module(s) in the vision tower (e.g. {r['example']}): "
        f"{reach_words(r['why'])}; text prompts never reach them"
    )


@words(Code.ADAPTER_RELEASE_UNDECIDED)
def _undecided(r: Reason, _: str) -> str:
    finding = WORDS[r["finding"].code](r["finding"], "")
    return (
        f"{r['tensor']}: unknown on vLLM {r['version']}, which this catalogue has not decided "
        f"(seen up to {r['seen_up_to']}, and the code it was seen in is still there): "
        f"{finding}"
    )


# ----- checks skipped -----


@words(Code.ADAPTER_SKIPPED_NO_MODEL)
def _no_model(r: Reason, _: str) -> str:
    return "shapes and targets against the model (no --model)"


@words(Code.ADAPTER_SKIPPED_NO_TARGET)
def _no_target(r: Reason, _: str) -> str:
    return (
        "what a vLLM release refuses or ignores (single-parameter expert adapters, partial GDN "
        "adapters, modules its LoRA code does not wrap) (no --target)"
    )


@words(Code.ADAPTER_SKIPPED_UNKNOWN_MODEL)
def _unknown_model(r: Reason, _: str) -> str:
    return (
        f"shapes against the model ({r['architecture'] or 'no architecture'} in config.json; "
        "patchkit knows Qwen3.5/3.6 and Qwen3-Next widths)"
    )


@words(Code.ADAPTER_SKIPPED_LORA_MODULES)
def _lora_modules(r: Reason, _: str) -> str:
    if r["error"] is not None:
        why = r["error"]
    elif r["architecture"]:
        why = f"architecture {r['architecture']}"
    else:
        why = "no --model to name the architecture"
    return (
        f"modules vLLM {r['version']}'s LoRA code wraps ({why}; patchkit reads "
        "the Qwen3.5/3.6 and Qwen3-Next model files)"
    )


@words(Code.ADAPTER_SKIPPED_REACH)
def _skipped_reach(r: Reason, _: str) -> str:
    return f"which modules vLLM {r['version']} reaches ({r['error']})"


@words(Code.ADAPTER_SKIPPED_PATTERNS)
def _skipped_patterns(r: Reason, _: str) -> str:
    return f"whether vLLM {r['version']} reads {' and '.join(r['patterns'])} ({r['error']})"


# ----- where one adapter module ends on a release (Reach.why) -----


def reach_words(why: Reason) -> str:
    """The words of a Reach's why ("" for a wrapped module that is part of nothing)."""
    return WORDS[why.code](why, "")


@words(Code.REACH_SKIP_PREFIX)
def _skip_prefix(_r: Reason, _: str) -> str:
    return "skipped by the model's lora_skip_prefixes"


@words(Code.REACH_MAPS_TO_NOTHING)
def _maps_to_nothing(_r: Reason, _: str) -> str:
    return "its name maps to nothing (vLLM raises)"


@words(Code.REACH_NO_WRAPPED_NAME)
def _no_wrapped_name(_r: Reason, _: str) -> str:
    return "no wrapped module has its last name"


@words(Code.REACH_NOT_LORA_LAYER)
def _not_lora_layer(r: Reason, _: str) -> str:
    return f"{r['layer']} is no LoRA layer"


@words(Code.REACH_WRAPPED)
def _wrapped(r: Reason, _: str) -> str:
    return f"part of {r['packed']}" if r["packed"] else ""


@words(Code.REACH_VISION_TOWER)
def _tower(r: Reason, _: str) -> str:
    option = (
        "only with --enable-tower-connector-lora"
        if r["option"]
        else "never (LoRA only in the language model)"
    )
    refused = (
        f"; with it, refused: {r['refused_layer']} is no LoRA layer" if r["refused_layer"] else ""
    )
    return f"the vision tower, wrapped {option}{refused}"


@words(Code.REACH_NOT_IN_MODEL)
def _not_in_model(r: Reason, _: str) -> str:
    layers = f"its language model's layers are {r['layers']}N..."
    return f"no module of {r['served']} is named so ({layers})"
