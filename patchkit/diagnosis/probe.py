"""`patchkit probe report`: read nan-probe's JSON lines, say where each bad request went bad.

The probe (patches/nan-probe) logs, per real step, each probed point that had a
non-finite token row: the first decoder layer's ``input``, each layer's
``output`` (hidden state and residual), and each LoRA projection (``lora``,
with its ``order`` in the layer). For each affected request this module finds
the first step, then the first layer, in which one of its rows went bad, and
applies the decision tree an engineer would at 3 a.m.:

- bad already at the layer's input: the source is upstream (the embedding,
  an earlier pipeline stage);
- a LoRA projection of that layer bad: the first one in the layer's order,
  i.e. its LoRA path (or its base weights) with that request's adapter;
- every projection fine but the layer's output bad: the layer's own
  compute, attention or Gated DeltaNet, or the MLP; and, where the probe's
  header names LoRA modules it does not watch in that layer (MoE experts),
  their LoRA path with that request's adapter.

Input is read as data from a file the user names: every line must be a JSON
object of the probe's shape, or the command fails with the file and line.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.errors import PatchkitError, UsageProblem

STEP_KEYS = {"step": int, "layer": int, "module": str, "kind": str, "bad_requests": list}
KINDS = ("input", "output", "lora")
MAX_LINE = 1 << 20  # a probe line is a few kB; anything longer is not one
MAX_NAME = 512  # a module path inside a layer, a class name: a few dozen characters
SHOWN_UNWATCHED = 8  # unwatched modules named in one finding, at most
RUN = "_patchkit_run"  # set on each record: the index of the header before it (-1: none)


@dataclass
class Finding:
    """Where one request first went bad, and what the decision tree makes of it."""

    request: str
    adapter: str | None
    step: int
    layer: int
    module: str
    verdict: str
    look_at: str
    bad_modules: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ProbeReport:
    path: str
    steps: int  # distinct steps with a record
    records: int
    headers: int
    findings: list[Finding]
    padding_only: int  # records whose bad rows were all padding (no request)

    def to_json(self) -> dict:
        return {
            "ok": True,
            "command": "probe report",
            "file": self.path,
            "records": self.records,
            "steps": self.steps,
            "headers": self.headers,
            "padding_only": self.padding_only,
            "affected_requests": [f.to_json() for f in self.findings],
        }


def read_log(path: Path) -> tuple[list[dict], list[dict]]:
    """The step records and the header lines of a probe log.

    Opened without blocking and checked to be a regular file before a byte is
    read: a FIFO (or a device) named as the log would block open() or read()
    forever. Lines are read at most MAX_LINE + 1 bytes at a time, so a file of
    one endless line is refused without being held in memory.
    """
    handle = _open_regular(path)
    records: list[dict] = []
    headers: list[dict] = []
    with handle:
        for number, raw in enumerate(iter(lambda: handle.readline(MAX_LINE + 1), b""), start=1):
            if len(raw) > MAX_LINE:
                raise PatchkitError(
                    f"{path}:{number}: line longer than {MAX_LINE} bytes: not a nan-probe record"
                )
            try:
                line = raw.decode("utf-8", errors="strict")
            except UnicodeDecodeError:
                raise PatchkitError(f"{path}: not UTF-8 text (is it a nan-probe log?)") from None
            entry = _parse(path, number, line)
            if entry is None:
                continue
            if "probe" in entry:
                headers.append(entry)
            else:
                entry[RUN] = len(headers) - 1  # each server start writes its own header
                records.append(entry)
    return records, headers


def _open_regular(path: Path):
    """The log opened for reading in binary, refused unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UsageProblem(f"{path}: no such file (give the PATCHKIT_PROBE_LOG file)") from None
    except OSError as exc:
        raise PatchkitError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PatchkitError(f"{path}: not a regular file (give the PATCHKIT_PROBE_LOG file)")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _parse(path: Path, number: int, line: str) -> dict | None:
    """One line: None when blank, else a checked record or header.

    json.loads raises a plain ValueError (not a JSONDecodeError) for an
    integer longer than Python converts (4,300 digits): caught as not JSON too.
    """
    if not line.strip():
        return None
    where = f"{path}:{number}"
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise PatchkitError(
            f"{where}: not JSON ({exc.__class__.__name__}): not a nan-probe log"
        ) from None
    if not isinstance(entry, dict):
        raise PatchkitError(f"{where}: a JSON object expected, got {type(entry).__name__}")
    if entry.get("probe") == "nan-probe":
        _check_header(where, entry)
        return entry
    _check_record(where, entry)
    return entry


def _check_header(where: str, entry: dict) -> None:
    """``unprobed_lora``, where present (older logs have none): a list of
    {layer: int, module: str, class: str}, each name of a sane length."""
    entries = entry.get("unprobed_lora", [])
    if not isinstance(entries, list) or not all(_is_unprobed_entry(e) for e in entries):
        raise PatchkitError(
            f"{where}: 'unprobed_lora': a list of {{layer, module, class}} expected: "
            "not a nan-probe header"
        )


def _is_unprobed_entry(entry) -> bool:
    return (
        isinstance(entry, dict)
        and _is_index(entry.get("layer"))
        and _is_name(entry.get("module"))
        and _is_name(entry.get("class", "?"))
    )


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_name(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME


def _check_record(where: str, entry: dict) -> None:
    for key, kind in STEP_KEYS.items():
        value = entry.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise PatchkitError(
                f"{where}: {key!r}: {kind.__name__} expected, got {value!r}: not a nan-probe record"
            )
    if not _is_name(entry["module"]):
        raise PatchkitError(
            f"{where}: 'module': a name of 1 to {MAX_NAME} characters expected: "
            "not a nan-probe record"
        )
    if entry["kind"] not in KINDS:
        raise PatchkitError(
            f"{where}: 'kind': one of {', '.join(KINDS)} expected, got {entry['kind']!r}"
        )
    if not all(isinstance(r, str) for r in entry["bad_requests"]):
        raise PatchkitError(f"{where}: 'bad_requests': a list of request ids expected")
    adapters = entry.get("adapters", {})
    if not isinstance(adapters, dict) or not all(isinstance(a, str) for a in adapters.values()):
        # an adapter value goes into the report: a NaN would make --json invalid JSON
        raise PatchkitError(
            f"{where}: 'adapters': an object of request id to adapter name expected"
        )


def is_bad(record: dict) -> bool:
    """Whether the record saw a non-finite value (stats lines are logged when all is fine)."""
    counts = [record.get(k, 0) for k in ("nan_rows", "inf_rows", "nan", "inf")]
    found = any(isinstance(c, (int, float)) and c > 0 for c in counts)
    return found or bool(record["bad_requests"])


def report(path: Path) -> ProbeReport:
    """Read the log and judge every request that had a non-finite row."""
    records, headers = read_log(path)
    bad = [r for r in records if is_bad(r)]
    by_request: dict[str, list[dict]] = {}
    for record in bad:
        for request in record["bad_requests"]:
            by_request.setdefault(request, []).append(record)
    unwatched = [unprobed_by_layer(header) for header in headers]
    findings = [judge(request, found, unwatched) for request, found in by_request.items()]
    findings.sort(key=lambda f: (f.step, f.layer, f.request))
    return ProbeReport(
        path=str(path),
        steps=len({r["step"] for r in records}),
        records=len(records),
        headers=len(headers),
        findings=findings,
        padding_only=sum(1 for r in bad if not r["bad_requests"]),
    )


def unprobed_by_layer(header: dict) -> dict[int, dict[str, str]]:
    """Layer -> {module: class} of the LoRA modules one header says the probe does
    not watch there (MoE expert LoRA); empty for an older log without the list."""
    found: dict[int, dict[str, str]] = {}
    for entry in header.get("unprobed_lora", []):
        found.setdefault(entry["layer"], {})[entry["module"]] = entry.get("class", "?")
    return found


def judge(request: str, records: list[dict], unwatched: list[dict]) -> Finding:
    """The decision tree, at the first step and the first layer where the request went bad.

    ``unwatched`` holds, per header of the log, what that server's probe did not
    watch; a record belongs to the header written before it.
    """
    step = min(r["step"] for r in records)
    at_step = [r for r in records if r["step"] == step]
    layer = min(r["layer"] for r in at_step)
    here = [r for r in at_step if r["layer"] == layer]
    adapter = next((r.get("adapters", {}).get(request) for r in here), None)
    names = [_name(r) for r in sorted(here, key=_position)]
    inputs = [r for r in here if r["kind"] == "input"]
    projections = sorted((r for r in here if r["kind"] == "lora"), key=_position)
    common = dict(request=request, adapter=adapter, step=step, layer=layer, bad_modules=names)
    if inputs:
        verdict = "hidden state already bad at the layer's input"
        look_at = "upstream of this layer: the embedding or an earlier pipeline stage"
        return Finding(**common, module="input", verdict=verdict, look_at=look_at)
    who = f"adapter {adapter!r}" if adapter else "this request (no adapter named)"
    if projections:
        first = projections[0]["module"]
        look_at = (
            f"the LoRA path of {first} for {who}: its weights (an inf/NaN in lora_A or "
            "lora_B) or the LoRA kernels (patchkit doctor)"
        )
        return Finding(**common, module=first, verdict=f"projection {first} bad first",
                       look_at=look_at)  # fmt: skip
    verdict = "every probed projection fine, the layer output bad"
    look_at = f"the layer's own compute: {_compute_of(records, layer)}"
    run = here[0][RUN]
    modules = unwatched[run].get(layer, {}) if run >= 0 else {}
    if modules and adapter:
        look_at += (
            f"; or the LoRA path of {_listed(list(modules))} for {who}, which the probe "
            f"does not watch ({_listed(sorted(set(modules.values())))}): if only requests "
            "with an adapter go bad here, check that adapter's expert weights"
        )
    return Finding(**common, module="output", verdict=verdict, look_at=look_at)


def _listed(names: list[str]) -> str:
    """At most SHOWN_UNWATCHED names: a header's list must not multiply into every finding."""
    more = len(names) - SHOWN_UNWATCHED
    return ", ".join(names[:SHOWN_UNWATCHED]) + (f" and {more} more" if more > 0 else "")


def _position(record: dict) -> tuple[int, int]:
    """Input first, then the projections in their order, then the output."""
    rank = {"input": 0, "lora": 1, "output": 2}[record["kind"]]
    order = record.get("order", 0)
    return rank, order if isinstance(order, int) else 0


def _name(record: dict) -> str:
    return record["module"]


def _compute_of(records: list[dict], layer: int) -> str:
    """Attention, GDN or the MLP, by the module names the layer's records carry."""
    names = " ".join(r["module"] for r in records if r["layer"] == layer)
    if "linear_attn" in names:
        return "Gated DeltaNet (linear attention) or the MLP"
    if "self_attn" in names:
        return "attention or the MLP"
    return "attention, Gated DeltaNet or the MLP"
