"""The words of doctor's codes: what it sees of the GPUs, a tuned config's problem, each
bug's verdict and its fix (:mod:`patchkit.cli.words` holds the patches' words and takes
these into its own).

A verdict's reason may carry ``also``: reasons it says after its own words, each after
"; " (a patch still fitting its code, a setting that switches a patch off, a scan made
with another Triton than vLLM's).
"""

from __future__ import annotations

import shlex

from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Reason
from patchkit.doctor import sass
from patchkit.vocabulary import PatchState

# doctor's codes and their words; patchkit.cli.words takes them into its own (a reason
# doctor nests is one of doctor's, so its words are found here, and nothing imports back)
WORDS: dict[Code, Words] = {}


words = registrar(WORDS)


def say(reason: Reason) -> str:
    """The words of one of doctor's reasons."""
    return WORDS[reason.code](reason, "")


def _also(r: Reason) -> str:
    return "".join(f"; {say(more)}" for more in r.get("also", ()))


@words(Code.NO_NVIDIA_SMI)
def _no_smi(r: Reason, _: str) -> str:
    return "no nvidia-smi on PATH: GPU not visible here"


@words(Code.NVIDIA_SMI_FAILED)
def _smi_failed(r: Reason, _: str) -> str:
    return f"nvidia-smi failed: {r['detail']}"


@words(Code.NO_GPU_LISTED)
def _no_gpu(r: Reason, _: str) -> str:
    return "nvidia-smi lists no GPU"


@words(Code.TUNED_UNREADABLE)
def _tuned_unreadable(r: Reason, _: str) -> str:
    return f"unreadable: {r['detail']}"


@words(Code.TUNED_NOT_NESTED)
def _tuned_not_nested(r: Reason, _: str) -> str:
    return "not a {max_loras: {num_slices: ...}}"


@words(Code.TUNED_NO_SINGLE_SLICE)
def _tuned_no_single(r: Reason, _: str) -> str:
    return (
        f"max_loras {r['max_loras']} has no num_slices '1' entry: "
        "single-slice expand raises KeyError"
    )


@words(Code.TUNED_REPLACES_BLOCK_N)
def _tuned_block_n(r: Reason, _: str) -> str:
    return (
        f"max_loras {r['max_loras']}: {r['configs']} num_slices=1 configs with block_n > 32 "
        "and num_stages >= 2 replace the patched block_n 32"
    )


# ----- verdicts -----


@words(Code.VERDICT_NO_TREE)
def _no_tree(r: Reason, _: str) -> str:
    return "no vLLM found to judge by"


@words(Code.VERDICT_NO_VERSION)
def _no_version(r: Reason, _: str) -> str:
    return "no vLLM version to judge by"


@words(Code.VERDICT_OUT_OF_RANGE)
def _out_of_range(r: Reason, _: str) -> str:
    return f"vLLM {r['version']} is not in {r['affected']}"


@words(Code.VERDICT_NO_GPU)
def _no_gpu_cc(r: Reason, _: str) -> str:
    return f"no GPU of compute capability {r['compute_capability']} here"


@words(Code.VERDICT_PTXAS_FIXED)
def _ptxas_fixed(r: Reason, _: str) -> str:
    return f"Triton's ptxas {r['ptxas']} is {r['fixed_by']} or newer"


@words(Code.VERDICT_UNDECIDED)
def _undecided(r: Reason, _: str) -> str:
    return (
        f"unknown on vLLM {r['version']}: this catalogue has not decided that release (tested "
        f"up to {r['newest']}), and no patch for it is upstream, not applicable or applied "
        f"here{_also(r)}"
    )


@words(Code.PATCH_MOVED)
def _moved(r: Reason, _: str) -> str:
    return f"{r['patch']} does not fit its code ({PatchState.CHANGED_UPSTREAM})"


@words(Code.PATCH_FITS)
def _fits(r: Reason, _: str) -> str:
    return f"{r['patch']} still fits its code"


@words(Code.VERDICT_UPSTREAM)
def _upstream(r: Reason, _: str) -> str:
    return f"fixed in this vLLM ({r['patch']}: {PatchState.UPSTREAM})"


@words(Code.VERDICT_PROTECTED)
def _protected(r: Reason, _: str) -> str:
    return "; ".join(r["lines"])


@words(Code.VERDICT_OVERRIDDEN)
def _overridden(r: Reason, _: str) -> str:
    return f"{r['env']} replaces what {r['patch']} patched: {say(r['problem'])}"


@words(Code.VERDICT_IN_CONFLICT)
def _in_conflict(r: Reason, _: str) -> str:
    return f"{', '.join(r['patches'])} in conflict{_also(r)}"


@words(Code.VERDICT_NOT_APPLIED)
def _not_applied(r: Reason, _: str) -> str:
    return f"no patch for it is applied{_also(r)}"


@words(Code.PATCH_SWITCHED_OFF)
def _switched_off(r: Reason, _: str) -> str:
    return f"{r['patch']} is off ({', '.join(r['settings'])})"


@words(Code.VERDICT_STALE)
def _stale(r: Reason, _: str) -> str:
    caches = r["caches"]
    return f"{r['pyc']} stale .pyc, {caches} cache{'s' if caches != 1 else ''} older than the patch"


PYC_PROBLEMS = {
    Code.PYC_TRUNCATED: "truncated",
    Code.PYC_UNCHECKED_HASH: "hash-based, unchecked: never re-validated",
    Code.PYC_HASH_DIFFERS: "hash differs from source",
    Code.PYC_OTHER_SOURCE: "built from another version of the source",
}


@words(*PYC_PROBLEMS)
def _stale_pyc(r: Reason, _: str) -> str:
    return f"{r['path']} ({PYC_PROBLEMS[r.code]})"


@words(Code.PYC_UNREADABLE)
def _unreadable_pyc(r: Reason, _: str) -> str:
    return f"{r['path']} (unreadable: {r['error']})"


@words(Code.VERDICT_FRESH)
def _fresh(r: Reason, _: str) -> str:
    return "bytecode matches its source; no older caches"


# ----- the kernel scan's verdicts -----


def _compiler(r: Reason) -> str:
    said = f"Triton {r['triton']}, ptxas {r['ptxas_version'] or 'unknown'} ({r['ptxas']})"
    if r["no_vllm_triton"]:
        said += "; no Triton installed next to vLLM to compare with"
    return said


@words(Code.SCAN_HAZARD)
def _hazard(r: Reason, _: str) -> str:
    return (
        f"kernel scan: {r['configs']} config(s) this install runs overwrite the A registers "
        f"of an in-flight wgmma, e.g. {r['label']}: {r['instruction']} at "
        f"{sass.address(r['address'])} (HGMMA at {sass.address(r['wgmma_address'])}); "
        f"{_compiler(r)}"
    )


@words(Code.SCAN_NONE_RUN)
def _none_run(r: Reason, _: str) -> str:
    return f"kernel scan: {r['why'] or 'no Triton LoRA kernel runs'}{_also(r)}"


@words(Code.SCAN_CLEAN)
def _clean(r: Reason, _: str) -> str:
    said = (
        f"kernel scan: no overwrite in the {r['configs']} config(s) this install runs, "
        f"{_compiler(r)}"
    )
    if r["approximate"]:
        said += f"; {r['approximate']} of them approximate ({r['approximate_why']})"
    if r["ptxas_keeps_from"]:
        said += f" (a ptxas from {r['ptxas_keeps_from']} on keeps wgmma registers)"
    if r["replaced_by"]:
        said += f"; the dense LoRA kernels do not run: {r['replaced_by']}"
    return said + _also(r)


@words(Code.SCAN_IDLE_HAZARD)
def _idle_hazard(r: Reason, _: str) -> str:
    return f"hazard only in configs not run here, e.g. {r['label']} ({r['why']})"


@words(Code.SCAN_ERRORS)
def _scan_errors(r: Reason, _: str) -> str:
    return f"{r['configs']} config(s) could not be scanned (see the scan)"


@words(Code.SCAN_OTHER_TRITON)
def _other_triton(r: Reason, _: str) -> str:
    where = f" ({r['vllm_triton_location']})" if r["vllm_triton_location"] else ""
    python = shlex.quote(r["python"]) if r["python"] else "the Python of vLLM's environment"
    return (
        f"the kernel scan compiled with Triton {r['triton']} ({r['location']}), but vLLM here "
        f"runs Triton {r['vllm_triton']}{where}, so the scan is not evidence for it; scan with "
        f"that one: {python} {r['command']} (patchkit installed there)"
    )


# ----- fixes -----


@words(Code.FIX_COMMAND)
def _command(r: Reason, _: str) -> str:
    return r["command"]


@words(Code.FIX_AFTER_CONFLICT)
def _after_conflict(r: Reason, _: str) -> str:
    return (
        f"apply refuses {', '.join(r['patches'])} while it is in conflict: `{r['status']}` "
        f"names the line that differs; once that file is what the patch expects, "
        f"{r['command']}"
    )


@words(Code.FIX_OVERRIDE_FILES)
def _override_files(r: Reason, _: str) -> str:
    return f"fix or remove the {r['env']} files listed above"


@words(Code.FIX_RETUNE)
def _retune(r: Reason, _: str) -> str:
    return f"remove or retune {r['file']} (block_n 32 or num_stages 1)"


@words(Code.FIX_SWITCHES)
def _switches(r: Reason, _: str) -> str:
    ways = [f"{env} unset ({patch})" for env, patch in zip(r["unset"], r["patches"], strict=True)]
    if r["ptxas_from"]:
        ways.append(f"TRITON_PTXAS_PATH pointing at a ptxas >= {r['ptxas_from']}")
    return ", or ".join(ways)


@words(Code.FIX_STALE)
def _stale_fix(r: Reason, _: str) -> str:
    steps = []
    if r["pyc"]:
        steps.append("delete the stale .pyc files listed (Python rebuilds them from the source)")
    if r["command"]:
        steps.append(r["command"])
    return ", then ".join(steps)
