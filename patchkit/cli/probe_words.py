"""The words of probe report: a request's verdict and where to look, a quarantine, the
warning about its log (:mod:`patchkit.cli.words` takes them into its own registry, as it
does doctor's and adapter check's)."""

from __future__ import annotations

from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason

WORDS: dict[Code, Words] = {}
words = registrar(WORDS)

COMPUTE = {
    "gdn": "Gated DeltaNet (linear attention) or the MLP",
    "attention": "attention or the MLP",
    "any": "attention, Gated DeltaNet or the MLP",
}


@words(Code.PROBE_LAST_LINE_CUT)
def _last_line_cut(r: Reason, _: str) -> str:
    return (
        f"{r['path']}:{r['line']}: the last line is cut short ({r['why']}): skipped, "
        f"the {r['seen']} lines before it are reported (the probe stopped mid-write: "
        "a full disk, or a killed server)"
    )


@words(Code.PROBE_INPUT_BAD, Code.PROBE_PROJECTION_BAD, Code.PROBE_OUTPUT_BAD)
@words(Code.PROBE_QUARANTINED)
def _finding(r: Reason, _: str) -> str:
    """A request's line as the text report prints it: the verdict, then where to look."""
    return f"{verdict(r)}; look at {look_at(r)}"


def verdict(r: Reason) -> str:
    """What the decision tree found, first of a request's line (and --json's ``verdict``)."""
    if r.code == Code.PROBE_INPUT_BAD:
        return "hidden state already bad at the layer's input"
    if r.code == Code.PROBE_PROJECTION_BAD:
        return f"projection {r['module']} bad first"
    if r.code == Code.PROBE_OUTPUT_BAD:
        return "every probed projection fine, the layer output bad"
    q = r["quarantine"]
    return (
        f"{_named(q)} was quarantined at load: {_cause(q)}; the torch "
        f"LoRA path makes its rows NaN from its first LoRA projection on (here layer "
        f"{r['first_layer']}, {r['first_module']}), other requests are not affected"
    )


def look_at(r: Reason) -> str:
    """Where to look next (--json's ``look_at``)."""
    if r.code == Code.PROBE_INPUT_BAD:
        return "upstream of this layer: the embedding or an earlier pipeline stage"
    if r.code == Code.PROBE_PROJECTION_BAD:
        return (
            f"the LoRA path of {r['module']} for {_who(r['adapter'])}: its weights (an inf/NaN "
            "in lora_A or lora_B) or the LoRA kernels (patchkit doctor)"
        )
    if r.code == Code.PROBE_OUTPUT_BAD:
        said = f"the layer's own compute: {COMPUTE[r['compute']]}"
        if r["unwatched"]:
            said += (
                f"; or the LoRA path of {_listed(r['unwatched'], r['unwatched_count'])} for "
                f"{_who(r['adapter'])}, which the probe does not watch "
                f"({_listed(r['classes'], r['classes_count'])}): if only requests with an "
                "adapter go bad here, check that adapter's expert weights"
            )
        return said
    return (
        f"that tensor in the adapter's files: `{r['quarantine']['command']}` names every "
        "non-finite tensor; fix or replace the adapter, then load it again"
    )


@words(Code.PROBE_QUARANTINE)
def _quarantine(r: Reason, _: str) -> str:
    return f"quarantined at load: {_named(r)}: {_cause(r)}; check it: {r['command']}"


def _who(adapter: str | None) -> str:
    return f"adapter {adapter!r}" if adapter else "this request (no adapter named)"


def _named(q: Reason) -> str:
    adapter = repr(q["adapter"]) if q["adapter"] is not None else "(no name)"
    return f"adapter {adapter} (id {q['adapter_id']})"


def _cause(q: Reason) -> str:
    """'layer 1 mlp.shared_expert.down_proj lora_B has non-finite values (3 inf)'."""
    where = f"layer {q['layer']} " if q["layer"] is not None else ""
    counts = ", ".join(f"{n} {k}" for k, n in (("nan", q["nan"]), ("inf", q["inf"])) if n)
    return f"{where}{q['module']} {q['tensor']} has non-finite values ({counts or '?'})"


def _listed(names: list[str], count: int) -> str:
    """The names a finding kept (at most SHOWN_UNWATCHED), and how many more there were."""
    more = count - len(names)
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")
