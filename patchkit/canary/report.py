"""What the canary concludes: a verdict per model, the run's report, and what to do next."""

from __future__ import annotations

from dataclasses import dataclass, field

from patchkit.canary import effect, fields
from patchkit.canary.messages import say, words
from patchkit.canary.metrics import COUNTER
from patchkit.canary.prompt import DEFAULT_PROMPT_TOKENS
from patchkit.codes import Code, Reason

# which verdict a new piece of evidence may replace (another word always replaces)
RANK = {"ok": 0, effect.NO_EFFECT: 1, "error": 2, "bad": 3}


@dataclass
class ModelCheck:
    """What one model answered and what the canary makes of it.

    verdict: ok, bad (evidence of NaN: the failure this tool exists for),
    no-effect (an adapter that answers as its parent: patchkit.canary.effect),
    error (the request failed some other way), not-served (a --model the
    server does not list), not-checked (the time budget ran out first).
    """

    model: str
    parent: str | None = None
    root: str | None = None  # where /v1/models says the model was loaded from
    verdict: str = "ok"
    evidence: list[Reason] = field(default_factory=list)
    http_status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float | None] | None = None
    corrupted_delta: float | None = None
    seconds: float = 0.0
    effect: dict | None = None  # an adapter against its parent (patchkit.canary.effect)

    @property
    def kind(self) -> str:
        return "adapter" if self.parent else "base"

    def mark(self, verdict: str, code: Code, message: str, **facts) -> None:
        """Add evidence; `bad` outranks `error`, which outranks `no-effect` and `ok`."""
        self.mark_reason(verdict, say(code, message, **facts))

    def mark_reason(self, verdict: str, reason: Reason) -> None:
        """:meth:`mark` with the message already made (the counter's: patchkit.canary.metrics)."""
        if verdict not in RANK or RANK[verdict] > RANK.get(self.verdict, -1):
            self.verdict = verdict
        self.evidence.append(reason)

    def add(self, code: Code, message: str, **facts) -> None:
        """Evidence that does not change the verdict (a note on this model)."""
        self.evidence.append(say(code, message, **facts))


@dataclass
class Report:
    url: str
    version: str | None = None
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    models: list[ModelCheck] = field(default_factory=list)
    recheck: ModelCheck | None = None  # the base model again, after a bad adapter
    parents: list[ModelCheck] = field(default_factory=list)  # asked only to compare adapters
    counter: dict = field(default_factory=dict)  # name, present, before, after
    notes: list[Reason] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # listed, past MAX_MODELS: not checked
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        checked = self.models + ([self.recheck] if self.recheck else [])
        return bool(self.models) and all(v.verdict == "ok" for v in checked)

    def summary(self) -> str:
        """One line of at most fields.LINE characters: what is wrong (or that all is well).

        Model names and evidence come from the server: each is escaped and cut,
        and so is the whole line.
        """
        if self.ok:
            more = f" ({len(self.skipped)} more not checked)" if self.skipped else ""
            n = len(self.models)
            sane = f"all {n} models answer sanely" if n != 1 else "the 1 model answers sanely"
            return sane + more
        bad = [v for v in self.models if v.verdict == "bad"]
        inert = [v for v in self.models if v.verdict == effect.NO_EFFECT]
        others = [v for v in self.models if v.verdict not in ("ok", "bad", effect.NO_EFFECT)]
        parts = []
        if bad:
            names = ", ".join(f"{v.kind} '{fields.one_line(v.model, 60)}'" for v in bad[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            parts.append(f"{names}{more} answer{'s' if len(bad) == 1 else ''} NaN")
        if inert:
            parts.append(effect.summary(inert))
        if self.recheck and self.recheck.verdict != "ok":
            name = fields.one_line(self.recheck.model, 60)
            parts.append(f"the base model '{name}' went bad after it")
        for v in others[:3]:
            evidence = words(v.evidence[0]) if v.evidence else ""
            parts.append(f"'{fields.one_line(v.model, 60)}' {v.verdict}: {evidence}")
        if len(others) > 3:
            parts.append(f"{len(others) - 3} more not ok")
        return fields.one_line("; ".join(parts), fields.LINE)

    def next_steps(self) -> list[Reason]:
        return next_steps(self)

    def error(self) -> Reason | None:
        """The failure as the JSON's ``error``: the summary line, and the models by verdict."""
        if self.ok:
            return None
        failed = [v for v in self.models if v.verdict != "ok"]
        by_verdict: dict[str, list[str]] = {}
        for v in failed + ([self.recheck] if self.recheck and self.recheck.verdict != "ok" else []):
            by_verdict.setdefault(v.verdict, []).append(v.model)
        return say(Code.CANARY_FAILED, self.summary(), models=by_verdict)


def next_steps(report: Report) -> list[Reason]:
    """What the on-call engineer does next, given what went wrong."""
    if report.ok:
        return []
    bad = [v for v in report.models if v.verdict == "bad"]
    bad_base = [v for v in bad if v.kind == "base"]
    bad_adapters = [v.model for v in bad if v.kind == "adapter"]
    steps = []
    if bad_adapters and not bad_base:
        names = ", ".join(bad_adapters)
        steps += [
            say(
                Code.CANARY_STEP_DOCTOR,
                f"the NaN comes through the LoRA path of {names} (the base model is sane): run "
                "`patchkit doctor` in the serving image (the Python that runs vLLM); it says "
                "whether vLLM #48590 (Hopper LoRA kernel) is exposed",
                command="patchkit doctor",
                adapters=bad_adapters,
            ),
            say(
                Code.CANARY_STEP_APPLY,
                "if exposed: `patchkit apply --clear-caches`, then restart the server",
                command="patchkit apply --clear-caches",
            ),
            say(
                Code.CANARY_STEP_REPLACE_ADAPTER,
                f"if protected: the weights of {names} themselves hold inf/NaN (patchkit's "
                "torch LoRA path keeps such an adapter's NaN in its own requests); replace the "
                "adapter, and stop routing to it meanwhile (POST /v1/unload_lora_adapter when "
                "the server allows runtime LoRA updates)",
                adapters=bad_adapters,
            ),
        ]
    if bad_base:
        steps.append(
            say(
                Code.CANARY_STEP_BASE_NAN,
                "the base model itself answers NaN, so LoRA is not the only cause: run "
                "`patchkit doctor` in the serving image and `patchkit apply --clear-caches`",
            )
        )
    steps += effect.next_steps([v for v in report.models if v.verdict == effect.NO_EFFECT])
    if report.recheck and report.recheck.verdict != "ok":
        steps.append(
            say(
                Code.CANARY_STEP_POLLUTED,
                "the base model went bad after the adapter: the server's state is polluted",
            )
        )
    if bad:
        steps.append(
            say(
                Code.CANARY_STEP_RESTART,
                "restart the server: once a NaN has appeared, later requests can stay bad "
                "until a restart",
            )
        )
    if any(v.verdict in ("error", "not-checked") for v in report.models):
        steps.append(
            say(
                Code.CANARY_STEP_SERVER_LOG,
                "look at the server's log for the failed requests; check --timeout",
            )
        )
    if any(v.verdict == "not-served" for v in report.models):
        steps.append(
            say(
                Code.CANARY_STEP_MODEL_NAMES,
                "check the --model names against GET /v1/models (listed in the evidence)",
            )
        )
    if any(note.code == Code.CANARY_COUNTER_ABSENT for note in report.notes):
        steps.append(
            say(
                Code.CANARY_STEP_COUNTER,
                "start the server with VLLM_COMPUTE_NANS_IN_LOGITS=1 so the next NaN is also "
                f"counted in {COUNTER}",
            )
        )
    return steps
