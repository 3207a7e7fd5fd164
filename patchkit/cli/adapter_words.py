"""The words of adapter check's findings: what is wrong with a file, a tensor or a config
value (:mod:`patchkit.cli.words` takes these into its own registry, as it does doctor's).

Every finding's message, note and check skipped is a reason (a code of
:mod:`patchkit.codes` and its facts); those of adapter_config.json's rule are worded in
:mod:`patchkit.cli.adapter_config_words`, those against the model and the release in
:mod:`patchkit.cli.adapter_target_words`, and this module's table holds them all.
"""

from __future__ import annotations

from patchkit.adapters.safetensorsfile import dims, shown
from patchkit.cli import adapter_config_words, adapter_target_words
from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason

# adapter check's codes and their words; patchkit.cli.words takes them into its own
WORDS: dict[Code, Words] = {}
words = registrar(WORDS)


def finding_words(message: Reason) -> str:
    """The words of a finding's message, a note or a check skipped (a reason of adapter
    check's, made here)."""
    return WORDS[message.code](message, "")


@words(Code.ADAPTER_UNREADABLE)
def _unreadable(r: Reason, _: str) -> str:
    return r["error"]


@words(Code.ADAPTER_PICKLE)
def _pickle(r: Reason, _: str) -> str:
    return (
        "refused: a pickle, which loading runs as code and patchkit does not read; "
        "convert it to adapter_model.safetensors (PEFT's save_pretrained writes one)"
    )


@words(Code.ADAPTER_NO_WEIGHTS)
def _no_weights(r: Reason, _: str) -> str:
    return "missing: the adapter has no weights"


@words(Code.ADAPTER_NOT_FLOAT)
def _not_float(r: Reason, _: str) -> str:
    return f"is {r['dtype']}; LoRA factors are floating point"


@words(Code.ADAPTER_NOT_SCANNED)
def _not_scanned(r: Reason, _: str) -> str:
    return (
        f"is {shown(r['dtype'])}, a type patchkit does not scan for NaN/Inf (it scans "
        f"{', '.join(r['scanned'])}); refused unread"
    )


@words(Code.ADAPTER_EMPTY)
def _empty(r: Reason, _: str) -> str:
    return (
        f"{r['dtype']} {dims(r['shape'])} holds no values; a LoRA factor is "
        "(r, in) or (out, r) with r and both sizes above 0"
    )


@words(Code.ADAPTER_NONFINITE_VALUES)
def _nonfinite(r: Reason, _: str) -> str:
    beyond = (
        f", {r['beyond']} past bfloat16's largest ({r['largest']:.3g}), Inf once "
        "vLLM casts them to a bf16 model's LoRA dtype"
        if r["beyond"]
        else ""
    )
    what = "non-finite once served" if r["beyond"] else "non-finite"
    return (
        f"{r['count']} {what} of {r['values']} ({r['nan']} NaN, {r['inf']} Inf{beyond}); "
        f"first at flat index {r['first']} ({r['first_value']}), {r['dtype']} {dims(r['shape'])}"
    )


@words(Code.ADAPTER_NOT_FACTOR)
def _not_factor(r: Reason, _: str) -> str:
    return (
        "is no LoRA factor vLLM reads ('... is unsupported LoRA weight'; DoRA magnitudes, "
        "biases and modules_to_save copies are refused)"
    )


@words(Code.ADAPTER_UNPAIRED)
def _unpaired(r: Reason, _: str) -> str:
    return f"lora_{r['have']} without lora_{r['lack']}"


@words(Code.ADAPTER_NOT_MATRICES)
def _not_matrices(r: Reason, _: str) -> str:
    return f"lora_A {dims(r['a'])} and lora_B {dims(r['b'])} are not both matrices"


@words(Code.ADAPTER_TRANSPOSED)
def _transposed(r: Reason, _: str) -> str:
    return (
        f"lora_A {dims(r['a'])} and lora_B {dims(r['b'])}: "
        "transposed (PEFT saves lora_A (r, in), lora_B (out, r))"
    )


@words(Code.ADAPTER_RANKS_DIFFER)
def _ranks_differ(r: Reason, _: str) -> str:
    a, b = r["a"], r["b"]
    return f"lora_A {dims(a)} and lora_B {dims(b)}: rank {a[0]} in lora_A but {b[1]} in lora_B"


@words(Code.ADAPTER_RANK_NOT_CONFIG)
def _rank_not_config(r: Reason, _: str) -> str:
    pattern = r["pattern"]
    gives = f"r={r['want']}" if pattern is None else f"{r['want']} (rank_pattern[{shown(pattern)}])"
    unmatched = " and no rank_pattern key matches it" if r["unmatched"] else ""
    return f"rank {r['rank']}, but adapter_config.json gives {gives}{unmatched}"


@words(Code.ADAPTER_CONFIG_ABOVE_MAX_RANK)
def _config_above_max(r: Reason, _: str) -> str:
    return (
        f"{'r' if r['key'] == 'r' else 'rank'} {r['rank']} is above --max-lora-rank "
        f"{r['max_rank']}; vLLM refuses the adapter ('LoRA rank ... is greater than "
        "max_lora_rank')"
    )


@words(Code.ADAPTER_ABOVE_MAX_RANK)
def _above_max(r: Reason, _: str) -> str:
    return f"rank {r['rank']} is above --max-lora-rank {r['max_rank']}"


@words(Code.ADAPTER_SCALE_OUT_OF_RANGE)
def _scale(r: Reason, _: str) -> str:
    pattern, alpha, rank = r["pattern"], r["alpha"], r["r"]
    what = "lora_alpha / r" if pattern is None else f"alpha_pattern[{shown(pattern)}] / r"
    rslora = " (rsLoRA)" if r["rslora"] else ""
    formula = f"{alpha:g} / sqrt({rank})" if r["rslora"] else f"{alpha:g} / {rank}"
    return (
        f"scale {what}{rslora} = {formula} = {r['scale']:.4g}, outside "
        "[1/64, 16] (docs/adapter-check.md: the scale range)"
    )


@words(Code.ADAPTER_ZERO_FACTORS)
def _zero_factors(r: Reason, _: str) -> str:
    return (
        f"{r['factors']} is all zero in every one of its {r['modules']} modules: the adapter "
        "changes nothing, a server serves it as the base model (PEFT initialises lora_B "
        "to zero: saved before its first training step?)"
    )


WORDS.update(adapter_config_words.WORDS)  # adapter_config.json's, in their own module
WORDS.update(adapter_target_words.WORDS)  # against the model and the release, likewise
