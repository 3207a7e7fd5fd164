"""What `adapter check` found: typed findings, one per problem, each naming file and tensor."""

from __future__ import annotations

from dataclasses import dataclass, field

from patchkit.codes import Reason
from patchkit.vocabulary import Word


class Kind(Word):
    """What is wrong; the same word in text and JSON."""

    FILE = "file"  # the weights file is missing, unreadable, lies, or is refused (.bin/.pt)
    CONFIG = "config"  # adapter_config.json missing, not JSON, or a value vLLM refuses
    SCALING = "scaling"  # lora_alpha / r (or / sqrt(r)) outside the stated range
    NONFINITE = "nonfinite"  # NaN or Inf in a tensor
    NAME = "name"  # a tensor that is no LoRA factor vLLM reads, or a factor without its pair
    RANK = "rank"  # lora_A and lora_B disagree, or the rank is not the config's r
    RANK_LIMIT = "rank-limit"  # above --max-lora-rank
    SHAPE = "shape"  # a factor that does not fit the model's module
    LAYOUT = "layout"  # transposed factors, an old PEFT expert layout
    TARGET = "target"  # a module or parameter the model does not have
    RELEASE = "release"  # what the --target vLLM release refuses or ignores
    EFFECT = "effect"  # factors that change nothing: every value of lora_A or lora_B is zero


@dataclass(frozen=True)
class AdapterFinding:
    """One problem: where (file, and the tensor or key) and what."""

    kind: Kind
    file: str
    tensor: str  # the tensor name, the config key, or "" for the file as a whole
    # what is wrong: a reason, its code finer than the kind's (words: patchkit.cli.adapter_words)
    message: Reason

    def __post_init__(self) -> None:
        if not isinstance(self.message, Reason):  # words are made by the command line only
            raise TypeError(f"a finding's message is a Reason, not {type(self.message).__name__}")


@dataclass
class Report:
    """Everything one `adapter check` found, and what it could not check and why."""

    adapter: str
    model: str | None
    target: str | None
    vllm_version: str | None = None
    tensors: int = 0
    bytes_scanned: int = 0
    findings: list[AdapterFinding] = field(default_factory=list)
    skipped: list[Reason] = field(default_factory=list)  # checks not run, each with its reason
    notes: list[Reason] = field(default_factory=list)
    # with --target: per adapter module, whether the release wraps it (patchkit.adapters.reach)
    targets: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def add(self, kind: Kind, file: str, tensor: str, message: Reason) -> None:
        self.findings.append(AdapterFinding(kind, file, tensor, message))
