"""What the canary concludes: a verdict per model, the run's report, and what to do next."""

from __future__ import annotations

from dataclasses import dataclass, field

from patchkit.canary import effect
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

    def mark(self, verdict: str, code: Code, **facts) -> None:
        """Add evidence; `bad` outranks `error`, which outranks `no-effect` and `ok`."""
        self.mark_reason(verdict, Reason.of(code, **facts))

    def mark_reason(self, verdict: str, reason: Reason) -> None:
        """:meth:`mark` with the message already made (the counter's: patchkit.canary.metrics)."""
        if verdict not in RANK or RANK[verdict] > RANK.get(self.verdict, -1):
            self.verdict = verdict
        self.evidence.append(reason)

    def add(self, code: Code, **facts) -> None:
        """Evidence that does not change the verdict (a note on this model)."""
        self.evidence.append(Reason.of(code, **facts))


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

    def outcome(self) -> Reason:
        """The run in one line: ``canary-ok`` (how many models, how many not checked), or
        ``canary-failed`` with what is wrong (the words escape and cut what came from the
        server, and the whole line)."""
        if self.ok:
            return Reason.of(Code.CANARY_OK, count=len(self.models), skipped=len(self.skipped))
        others = [v for v in self.models if v.verdict not in ("ok", "bad", effect.NO_EFFECT)]
        polluted = self.recheck.model if self.recheck and self.recheck.verdict != "ok" else None
        return Reason.of(
            Code.CANARY_FAILED,
            bad=[{"model": v.model, "kind": v.kind} for v in self.models if v.verdict == "bad"],
            no_effect=[v.model for v in self.models if v.verdict == effect.NO_EFFECT],
            polluted=polluted,
            others=[
                {
                    "model": v.model,
                    "verdict": v.verdict,
                    "evidence": v.evidence[0] if v.evidence else None,
                }
                for v in others
            ],
            models=self.by_verdict(),
        )

    def next_steps(self) -> list[Reason]:
        return next_steps(self)

    def by_verdict(self) -> dict[str, list[str]]:
        """The models that are not ok (the recheck too), by verdict."""
        failed = [v for v in self.models if v.verdict != "ok"]
        by_verdict: dict[str, list[str]] = {}
        for v in failed + ([self.recheck] if self.recheck and self.recheck.verdict != "ok" else []):
            by_verdict.setdefault(v.verdict, []).append(v.model)
        return by_verdict

    def error(self) -> Reason | None:
        """The failure as the JSON's ``error``: :meth:`outcome`, None when all is well."""
        return None if self.ok else self.outcome()


def next_steps(report: Report) -> list[Reason]:
    """What the on-call engineer does next, given what went wrong."""
    if report.ok:
        return []
    bad = [v for v in report.models if v.verdict == "bad"]
    bad_base = [v for v in bad if v.kind == "base"]
    bad_adapters = [v.model for v in bad if v.kind == "adapter"]
    steps = []
    if bad_adapters and not bad_base:
        steps += [
            Reason.of(Code.CANARY_STEP_DOCTOR, command="patchkit doctor", adapters=bad_adapters),
            Reason.of(Code.CANARY_STEP_APPLY, command="patchkit apply --clear-caches"),
            Reason.of(Code.CANARY_STEP_REPLACE_ADAPTER, adapters=bad_adapters),
        ]
    if bad_base:
        steps.append(Reason.of(Code.CANARY_STEP_BASE_NAN))
    steps += effect.next_steps([v for v in report.models if v.verdict == effect.NO_EFFECT])
    if report.recheck and report.recheck.verdict != "ok":
        steps.append(Reason.of(Code.CANARY_STEP_POLLUTED))
    if bad:
        steps.append(Reason.of(Code.CANARY_STEP_RESTART))
    if any(v.verdict in ("error", "not-checked") for v in report.models):
        steps.append(Reason.of(Code.CANARY_STEP_SERVER_LOG))
    if any(v.verdict == "not-served" for v in report.models):
        steps.append(Reason.of(Code.CANARY_STEP_MODEL_NAMES))
    if any(note.code == Code.CANARY_COUNTER_ABSENT for note in report.notes):
        steps.append(Reason.of(Code.CANARY_STEP_COUNTER, counter=COUNTER))
    return steps
