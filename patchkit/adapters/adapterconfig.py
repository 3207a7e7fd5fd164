"""adapter_config.json, read by one rule for `adapter check`, `verify` and `doctor --kernels`.

The rule is vLLM's, read from its ``PEFTHelper`` (``vllm/lora/peft_helper.py``,
0.17.0 to 0.34.0). ``from_dict`` refuses a config without ``r``, ``lora_alpha``
or ``target_modules`` and drops every key it has no field for, unread.
``__post_init__`` refuses ``r <= 0`` (0.26.0 on; before, 0 divided by zero)
and scales each module by ``lora_alpha / r`` (``/ sqrt(r)`` when
``use_rslora`` is true: a truth test, so the string "false" turned rsLoRA
on); nothing else is asked of ``r``, so ``8.0`` is rank 8 there. From 0.32.0
a ``rank_pattern`` rank must be an ``int`` above 0, and each module's rank
and alpha come from the first ``rank_pattern``/``alpha_pattern`` key for
which ``regex.match(rf"(.*\\.)?({key})$", name)`` holds; before 0.32.0 both
patterns are dropped unread. ``_validate_features`` (0.32.0 on) refuses
DoRA, ``lora_bias``, PiSSA-style ``init_lora_weights``, aLoRA,
``layer_replication``, QALoRA and BD-LoRA; ``modules_to_save`` and a
``bias`` other than "none" are refused in every release.

So, here: ``r`` is a JSON number above 0 that is whole (8 and 8.0 are rank
8, as vLLM's arithmetic takes them; 4.7 passes vLLM's test but no factor has
that rank; ``true`` is no number, though Python compares it as 1);
``lora_alpha`` a JSON number; ``use_rslora`` true, false or null; a
``rank_pattern`` rank an integer above 0 and an ``alpha_pattern`` value a
number; every pattern key is compiled by :mod:`patchkit.adapters.patterns`
(matched in linear time; a key it cannot match so is refused, as is one
that is no regular expression, which vLLM's loader raises on); every key
that changes what the adapter means beyond ``scale * B @ A`` is refused,
naming it. :func:`read` never raises for the file's content: it lists every
problem (:class:`Problem`, naming the key), which `adapter check` reports as
findings and `verify` refuses on (:func:`read_strict`), so both say the same
words about the same key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.adapters.directory import Directory, about
from patchkit.adapters.names import ADAPTER_CONFIG
from patchkit.adapters.patterns import Matcher, compile_peft_key
from patchkit.adapters.safetensorsfile import shown
from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError, Refused

REQUIRED = ("r", "lora_alpha", "target_modules")
# init_lora_weights that only set the factors' first values (vLLM's _init_is_supported)
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
# keys of features vLLM refuses from 0.32.0 (earlier releases drop them unread); their
# words, what each feature does, are patchkit.cli.adapter_config_words'
DROPPED_FEATURES = (
    "lora_bias",
    "layer_replication",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with adapter_config.json: the key it names ("" for the file as a
    whole, ``rank_pattern['q_proj']`` for one entry) and what is wrong with it, a reason
    (its words are the command line's: patchkit.cli.adapter_config_words)."""

    key: str
    message: Reason


class PatternRefused(Refused):
    """A pattern key whose matching ran past patterns.MAX_WORK; carries its Problem (a
    refusal: the command line words it, as it does :func:`read_strict`'s)."""

    def __init__(self, path: Path, problem: Problem):
        super().__init__(refusal(path, problem))
        self.problem = problem


@dataclass
class AdapterConfig:
    """The values of one adapter_config.json that passed the rule, and every problem.

    A value that failed it is left at its default here (``r`` None, a pattern
    entry left out) and named in ``problems``: `adapter check` goes on with the
    rest, `verify` refuses (:func:`read_strict`).
    """

    path: Path
    problems: list[Problem] = field(default_factory=list)
    r: int | None = None
    alpha: float | None = None
    use_rslora: bool = False
    target_modules: list[str] | str | None = None
    target_parameters: list[str] = field(default_factory=list)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    # each pattern key, compiled (patterns.compile_peft_key): matched without backtracking
    matchers: dict[str, Matcher] = field(default_factory=dict, repr=False)

    @property
    def ranks(self) -> set[int]:
        """r and every rank_pattern rank (what vLLM compares with --max-lora-rank)."""
        return ({self.r} if self.r is not None else set()) | set(self.rank_pattern.values())

    def matching(self, which: str, name: str) -> tuple[str, float] | None:
        """(key, value) of the first ``rank_pattern`` or ``alpha_pattern`` key matching
        the module ``name``, PEFT's and vLLM's rule; None when none does. A key whose
        matching runs past patterns.MAX_WORK raises :class:`PatternRefused`."""
        pattern = self.rank_pattern if which == "rank_pattern" else self.alpha_pattern
        for key, value in pattern.items():
            try:
                found = self.matchers[key].match(name)
            except ValueError as exc:
                problem = Problem(which, _key_refused(key, exc))
                raise PatternRefused(self.path, problem) from None
            if found:
                return key, value
        return None

    def rank_alpha(self, name: str) -> tuple[int, float]:
        """The rank and alpha of the module ``name`` (without ``base_model.model.``)."""
        rank = self.matching("rank_pattern", name)
        alpha = self.matching("alpha_pattern", name)
        return (self.r if rank is None else rank[1]), (self.alpha if alpha is None else alpha[1])

    def scale(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @property
    def global_scale(self) -> float:
        return self.scale(self.r, self.alpha)


def read(folder: Directory) -> AdapterConfig:
    """adapter_config.json of the adapter directory ``folder``, judged by the rule above.

    Read through the directory's descriptor (a regular file, or a link to one
    beside it; capped at 1 MiB; no FIFO, no device, no link out of the
    directory). Never raises for what the file holds: a file that is missing
    or not a JSON object is one problem with no key, and nothing else is read.
    """
    config = AdapterConfig(folder.path / ADAPTER_CONFIG)
    if not folder.has(ADAPTER_CONFIG):
        config.problems.append(Problem("", Reason.of(Code.ADAPTER_CONFIG_MISSING)))
        return config
    try:
        values = folder.read_json(ADAPTER_CONFIG, "a PEFT adapter config")
    except PatchkitError as exc:
        unread = Reason.of(Code.ADAPTER_CONFIG_UNREADABLE, error=about(exc, config.path))
        config.problems.append(Problem("", unread))
        return config
    _judge(values, config)
    return config


def read_strict(adapter_dir: Path) -> AdapterConfig:
    """:func:`read`, refusing the first problem in one line naming the file and the key
    (and how many more there are): what `verify` and `doctor` need before any work."""
    with Directory(adapter_dir) as folder:
        config = read(folder)
    if config.problems:
        raise Refused(refusal(config.path, config.problems[0], len(config.problems) - 1))
    return config


def read_ranks(adapter_dir: Path) -> set[int]:
    """r and every rank_pattern rank, by the same rule; only a problem of those keys (or of
    the file) refuses, in one line: `doctor --kernels` needs the ranks, nothing else."""
    with Directory(adapter_dir) as folder:
        config = read(folder)
    for problem in config.problems:
        if problem.key in ("", "r") or problem.key.startswith("rank_pattern"):
            raise Refused(refusal(config.path, problem))
    return config.ranks


def refusal(path: Path, problem: Problem, more: int = 0) -> Reason:
    """The one line that refuses an adapter on ``problem`` of its config at ``path`` (and
    ``more`` problems after it, which `adapter check` names)."""
    return Reason.of(
        Code.ADAPTER_CONFIG_REFUSED,
        path=str(path),
        key=problem.key,
        problem=problem.message,
        more=more,
    )


def _judge(values: dict, config: AdapterConfig) -> None:
    say = config.problems.append
    for key in REQUIRED:
        if key not in values:
            say(Problem(key, Reason.of(Code.ADAPTER_CONFIG_KEY_MISSING)))
    peft_type = values.get("peft_type", "LORA")
    if not (isinstance(peft_type, str) and peft_type.upper() == "LORA"):
        say(_bad("peft_type", Code.ADAPTER_CONFIG_NOT_LORA, peft_type))
    if "r" in values:
        r = values["r"]
        if _is_number(r) and r > 0 and r == int(r):
            config.r = int(r)
        else:
            say(_bad("r", Code.ADAPTER_CONFIG_BAD_R, r))
    if "lora_alpha" in values:
        alpha = values["lora_alpha"]
        if _is_number(alpha):
            config.alpha = alpha
        else:
            say(_bad("lora_alpha", Code.ADAPTER_CONFIG_BAD_ALPHA, alpha))
    rslora = values.get("use_rslora")
    if rslora is None or isinstance(rslora, bool):
        config.use_rslora = bool(rslora)
    else:
        say(_bad("use_rslora", Code.ADAPTER_CONFIG_BAD_RSLORA, rslora))
    targets = values.get("target_modules")
    if targets is None or isinstance(targets, str) or _strings(targets):
        config.target_modules = targets
    else:
        say(_bad("target_modules", Code.ADAPTER_CONFIG_BAD_TARGET_MODULES, targets))
    params = values.get("target_parameters") or []
    params = [params] if isinstance(params, str) else params
    if _strings(params):
        config.target_parameters = list(params)
    else:
        say(_bad("target_parameters", Code.ADAPTER_CONFIG_BAD_TARGET_PARAMETERS, params))
    _patterns(values, config)
    _features(values, config)


def _bad(key: str, code: Code, value: object) -> Problem:
    """A key whose value the rule refuses: ``value`` as the words show it (cut when long:
    a config value may be any JSON, a list of a million names)."""
    return Problem(key, Reason.of(code, value=shown(value)))


def _patterns(values: dict, config: AdapterConfig) -> None:
    say = config.problems.append
    for which in ("rank_pattern", "alpha_pattern"):
        pattern = values.get(which) or {}
        if not isinstance(pattern, dict):
            say(Problem(which, Reason.of(Code.ADAPTER_CONFIG_PATTERN_NOT_OBJECT)))
            continue
        kept = config.rank_pattern if which == "rank_pattern" else config.alpha_pattern
        for key, value in pattern.items():
            if which == "rank_pattern" and not (type(value) is int and value > 0):
                say(_bad(f"{which}[{shown(key)}]", Code.ADAPTER_CONFIG_BAD_PATTERN_RANK, value))
                continue
            if which == "alpha_pattern" and not _is_number(value):
                say(_bad(f"{which}[{shown(key)}]", Code.ADAPTER_CONFIG_BAD_PATTERN_ALPHA, value))
                continue
            if key not in config.matchers:
                try:
                    config.matchers[key] = compile_peft_key(key)
                except ValueError as exc:
                    say(Problem(which, _key_refused(key, exc)))
                    continue
            kept[key] = value


def _key_refused(key: str, exc: ValueError) -> Reason:
    """A pattern key patchkit will not match: ``why`` is patterns.compile_peft_key's or the
    matcher's refusal (no regular expression, past the work bound)."""
    return Reason.of(Code.ADAPTER_CONFIG_KEY_REFUSED, pattern=shown(key), why=str(exc))


def _features(values: dict, config: AdapterConfig) -> None:
    """Keys that make the adapter more than scale * B @ A: vLLM refuses or ignores them,
    and patchkit's merge cannot reproduce them."""
    say = config.problems.append
    get = values.get
    if get("use_dora"):
        say(_bad("use_dora", Code.ADAPTER_CONFIG_DORA, get("use_dora")))
    if get("bias", "none") != "none":
        say(_bad("bias", Code.ADAPTER_CONFIG_BIAS, get("bias")))
    if get("modules_to_save"):
        say(_bad("modules_to_save", Code.ADAPTER_CONFIG_MODULES_TO_SAVE, get("modules_to_save")))
    if get("trainable_token_indices"):
        tokens = get("trainable_token_indices")
        say(_bad("trainable_token_indices", Code.ADAPTER_CONFIG_TRAINABLE_TOKENS, tokens))
    for key in DROPPED_FEATURES:
        if get(key):
            said = Reason.of(Code.ADAPTER_CONFIG_FEATURE, feature=key, value=shown(get(key)))
            say(Problem(key, said))
    init = get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in PLAIN_INITS:
        say(_bad("init_lora_weights", Code.ADAPTER_CONFIG_INIT, init))


def _is_number(value: object) -> bool:
    """An int or a float, not a bool (JSON numbers: finite, decode_user_json saw to that)."""
    return type(value) in (int, float) and math.isfinite(value)


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
