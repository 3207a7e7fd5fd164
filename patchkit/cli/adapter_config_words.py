"""The words of what adapter_config.json's rule refuses (patchkit.adapters.adapterconfig):
a finding of `adapter check`, and the one line `verify` and `doctor --kernels` refuse an
adapter with. :mod:`patchkit.cli.adapter_words` takes them into its registry."""

from __future__ import annotations

from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason

WORDS: dict[Code, Words] = {}
words = registrar(WORDS)

DROPPED = "vLLM refuses it from 0.32.0; earlier releases drop the key unread"
# what each feature adapterconfig.DROPPED_FEATURES names does
FEATURES = {
    "lora_bias": "lora_B carries a bias",
    "layer_replication": "layers duplicated by the adapter",
    "alora_invocation_tokens": "aLoRA acts only after its invocation tokens",
    "use_qalora": "QALoRA",
    "use_bdlora": "block-diagonal LoRA",
}


@words(Code.ADAPTER_CONFIG_REFUSED)
def _refused(r: Reason, _: str) -> str:
    problem = WORDS[r["problem"].code](r["problem"], "")
    more = r["more"]
    tail = (
        f" ({more} more problem{'s' if more > 1 else ''}: `patchkit adapter check` names each)"
        if more
        else ""
    )
    said = f"{r['key']} {problem}" if r["key"] else problem
    return f"{r['path']}: {said}{tail}"


@words(Code.ADAPTER_CONFIG_MISSING)
def _missing(r: Reason, _: str) -> str:
    return "missing; vLLM reads r, lora_alpha and target_modules from it"


@words(Code.ADAPTER_CONFIG_UNREADABLE)
def _unreadable(r: Reason, _: str) -> str:
    return r["error"]


@words(Code.ADAPTER_CONFIG_KEY_MISSING)
def _key_missing(r: Reason, _: str) -> str:
    return "missing; vLLM refuses the adapter without it (PEFTHelper.from_dict)"


@words(Code.ADAPTER_CONFIG_NOT_LORA)
def _not_lora(r: Reason, _: str) -> str:
    return f"is {r['value']}, not LORA"


@words(Code.ADAPTER_CONFIG_BAD_R)
def _bad_r(r: Reason, _: str) -> str:
    return (
        f"is {r['value']}; it must be a whole number above 0 (vLLM refuses r <= 0 "
        "and scales each module by lora_alpha / r; a factor's rank is whole)"
    )


@words(Code.ADAPTER_CONFIG_BAD_ALPHA)
def _bad_alpha(r: Reason, _: str) -> str:
    return f"is {r['value']}; it must be a number (the scale's)"


@words(Code.ADAPTER_CONFIG_BAD_RSLORA)
def _bad_rslora(r: Reason, _: str) -> str:
    return f"is {r['value']}, not true or false (vLLM tests its truth: any string turns rsLoRA on)"


@words(Code.ADAPTER_CONFIG_BAD_TARGET_MODULES)
def _bad_targets(r: Reason, _: str) -> str:
    return f"is {r['value']}; a list of names or a str expected"


@words(Code.ADAPTER_CONFIG_BAD_TARGET_PARAMETERS)
def _bad_parameters(r: Reason, _: str) -> str:
    return f"is {r['value']}; a list of parameter names expected"


@words(Code.ADAPTER_CONFIG_PATTERN_NOT_OBJECT)
def _pattern_not_object(r: Reason, _: str) -> str:
    return "is not a JSON object (module pattern to value)"


@words(Code.ADAPTER_CONFIG_BAD_PATTERN_RANK)
def _bad_pattern_rank(r: Reason, _: str) -> str:
    return f"is {r['value']}; a rank is an integer above 0 (vLLM refuses any other from 0.32.0)"


@words(Code.ADAPTER_CONFIG_BAD_PATTERN_ALPHA)
def _bad_pattern_alpha(r: Reason, _: str) -> str:
    return f"is {r['value']}; a number expected"


@words(Code.ADAPTER_CONFIG_KEY_REFUSED)
def _key_refused(r: Reason, _: str) -> str:
    return (
        f"key {r['pattern']} is refused: {r['why']} (vLLM matches each key against every "
        "module's name with Python's regex when it loads the adapter, 0.32.0 on)"
    )


@words(Code.ADAPTER_CONFIG_DORA)
def _dora(r: Reason, _: str) -> str:
    return f"is {r['value']}: DoRA rescales each column by a magnitude vector; vLLM refuses it"


@words(Code.ADAPTER_CONFIG_BIAS)
def _bias(r: Reason, _: str) -> str:
    return f"is {r['value']}: the adapter trains the base model's biases; vLLM refuses it"


@words(Code.ADAPTER_CONFIG_MODULES_TO_SAVE)
def _modules_to_save(r: Reason, _: str) -> str:
    return (
        f"is {r['value']}: whole modules replaced by saved copies; vLLM refuses it (0.34.0 "
        "takes only a classification model's classifier and score)"
    )


@words(Code.ADAPTER_CONFIG_TRAINABLE_TOKENS)
def _trainable_tokens(r: Reason, _: str) -> str:
    return (
        f"is {r['value']}: embedding rows replaced (PEFT's trainable tokens); vLLM never "
        "reads the key and refuses their tensors"
    )


@words(Code.ADAPTER_CONFIG_FEATURE)
def _feature(r: Reason, _: str) -> str:
    return f"is {r['value']}: {FEATURES[r['feature']]}; {DROPPED}"


@words(Code.ADAPTER_CONFIG_INIT)
def _init(r: Reason, _: str) -> str:
    return (
        f"is {r['value']}: PiSSA/OLoRA/CorDA/LoftQ change the base weights at init; "
        f"{DROPPED}; convert the adapter with PEFT's path_initial_model_for_weight_conversion"
    )
