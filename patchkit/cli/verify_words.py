"""The words of verify's reasons: why an adapter's verdict, what would decide an open
one, and why the adapter was judged against its reference (:mod:`patchkit.cli.words`
takes these into its own registry).

The verdict's rule (patchkit.verify.rule) and the choice of reference
(patchkit.verify.usermodel, patchkit.verify.references) return these reasons; a reason
that quotes another (the merged verdict the PEFT reference replaced) nests it, and its
words are made here from it, never cut out of a sentence.
"""

from __future__ import annotations

from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason

WORDS: dict[Code, Words] = {}
words = registrar(WORDS)


def say(reason: Reason | None) -> str:
    """The words of one of verify's reasons; '' for none (a reference not chosen yet)."""
    return "" if reason is None else WORDS[reason.code](reason, "")


@words(Code.VERIFY_CHECK_FAILED, Code.VERIFY_CHECK_OPEN)
def _check(r: Reason, _: str) -> str:
    return f"{r['check']}: {r['detail']}"


@words(Code.VERIFY_WITHIN)
def _within(r: Reason, _: str) -> str:
    controls = {
        "past-failure-line": f", and every control past the failure line ({r['fail_excess']}x)",
        "outside": ", and every control outside it",
        None: "",
    }[r["controls"]]
    return f"within the {r['reference']} reference's bound{controls}"


@words(Code.VERIFY_DECIDES_PEFT)
def _decides_peft(r: Reason, _: str) -> str:
    return (
        "`--reference peft` (transformers + PEFT in float32 from the same bf16 weights, the "
        "adapter unmerged)"
    )


@words(Code.VERIFY_DECIDES_OTHER_PROMPTS)
def _decides_other(r: Reason, _: str) -> str:
    return (
        "the same check on other prompts (another --seed) or longer ones (a larger "
        "--max-model-len), where its answers fall on one side of the band; a control "
        "this run could not reject, only a stronger adapter"
    )


@words(Code.VERIFY_DECIDES_TOKENS)
def _decides_tokens(r: Reason, _: str) -> str:
    where = "no token lies past the max bound"
    if r["lone"]:
        some = "one token lies" if r["lone"] == 1 else f"{r['lone']} tokens lie"
        where = f"at most {some} past the max bound, none past the {r['ceiling']}-nat ceiling"
    return (
        f"the same check on other prompts (another --seed), where {where}: it passes there; "
        "a token alone never fails, so tokens past the bound at every seed leave it open"
    )


@words(Code.VERIFY_DECIDES_MEASURED_STRETCHES)
def _decides_measured_stretches(r: Reason, _: str) -> str:
    return (
        f"healthy stretches measured past token {r['upto']} (none is yet): the same check "
        f"with --max-model-len {r['max_model_len']} decides the first {r['upto']} tokens, not "
        "the region past them"
    )


@words(Code.VERIFY_DECIDES_REFERENCE_RUN)
def _decides_reference_run(r: Reason, _: str) -> str:
    return f"the same run with its reference running (it did not: {r['missing']})"


@words(Code.VERIFY_REFERENCE_ASKED)
def _asked(r: Reason, _: str) -> str:
    return f"--reference {r['reference']}"


@words(Code.VERIFY_ROUNDING_SMALL)
def _rounding(r: Reason, _: str) -> str:
    return f"its own bf16 rounding is small (mean {r['mean']:.4f}, max {r['max']:.3f})"


@words(Code.VERIFY_MERGED_DECIDED)
def _merged_decided(r: Reason, _: str) -> str:
    if r["mean"] is None:  # its rounding control served nothing finite
        return "it decided, its own bf16 rounding unknown (no finite distance measured)"
    return f"it decided despite its coarse bf16 rounding (mean {r['mean']:.4f}, max {r['max']:.3f})"


@words(Code.VERIFY_MERGED_NOT_RUN)
def _merged_not_run(r: Reason, _: str) -> str:
    return f"the merged reference did not run ({r['missing']}): nothing was compared with it"


@words(Code.VERIFY_MERGED_UNDECIDED)
def _merged_undecided(r: Reason, _: str) -> str:
    return f"the merged reference could not decide ({say(r['verdict'])})"


@words(Code.VERIFY_PEFT_DECIDES)
def _peft_decides(r: Reason, _: str) -> str:
    return f"{say(r['because'])}; the PEFT reference decides"


@words(Code.VERIFY_PEFT_DID_NOT_RUN)
def _peft_missing(r: Reason, _: str) -> str:
    return f"{say(r['because'])}; it did not run, {r['missing']}"


@words(Code.VERIFY_PARTIAL_PEFT)
def _partial(r: Reason, _: str) -> str:
    return (
        "an adapter on one expert parameter has no merged reference here: transformers + PEFT "
        "(float32, unmerged) decides"
    )


@words(Code.VERIFY_MOE_REFERENCE)
def _moe_reference(r: Reason, _: str) -> str:
    why = say(r["why"])
    return f"MoE case: {r['adapter']} judged against the {r['reference']} reference: {why}"
