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

Before the tree: the torch LoRA path (matmul-add-lora-linear) quarantines an
adapter with a non-finite weight at load, which makes every row of it NaN from
its first LoRA projection on, so its rows point at layer 0 whatever tensor is
bad. With the probe on it writes a ``quarantine`` record (adapter, layer,
module, lora_A or lora_B, counts); a request of that adapter, bad after that
record, is judged by it: the report names the tensor and the command that
checks the adapter's files, not the projection where the NaN showed. Every
quarantine is listed too, served or not.

Input is read as data from a file the user names: every line must be a JSON
object of the probe's shape, or the command fails with the file and line;
only a last line cut short (the probe stopped mid-write) is skipped, with a
warning. The log is streamed: memory holds what the report keeps (a trail
per affected request), not the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from patchkit.codes import Code, Reason
from patchkit.errors import PatchkitError, UsageProblem

STEP_KEYS = {"step": int, "layer": int, "module": str, "kind": str, "bad_requests": list}
KINDS = ("input", "output", "lora")
MAX_LINE = 1 << 20  # a probe line is a few kB; anything longer is not one
MAX_NAME = 512  # a module path inside a layer, a class name: a few dozen characters
SHOWN_UNWATCHED = 8  # unwatched modules named in one finding, at most
QUARANTINE_KEYS = {"adapter_id": int, "module": str, "tensor": str, "nan": int, "inf": int}
TENSORS = ("lora_A", "lora_B")
MAX_PATH = 4096  # an adapter's directory, as the server was given it (PATH_MAX)
MAX_ADAPTER_NAME = 200  # vLLM's lora_name has no limit: a longer one is cut, not refused
MAX_QUOTED = 80  # characters of a field an error line quotes, at most
MAX_QUARANTINES = 256  # distinct quarantines kept for the list; the rest are counted
CHECK_COMMAND = "patchkit adapter check"


@dataclass
class RequestFinding:
    """Where one request first went bad, and what the decision tree makes of it: a reason
    (probe-input-bad, probe-projection-bad, probe-output-bad, probe-quarantined), whose
    words, the verdict and where to look, are patchkit.cli.probe_words'."""

    request: str
    adapter: str | None
    step: int
    layer: int
    module: str
    reason: Reason
    bad_modules: list[str] = field(default_factory=list)
    tensor: str | None = None  # lora_A / lora_B: the adapter was quarantined for it
    command: str | None = None  # what to run next

    def __post_init__(self) -> None:
        if not isinstance(self.reason, Reason):  # words are made by the command line only
            raise TypeError(f"a finding's reason is a Reason, not {type(self.reason).__name__}")


@dataclass(frozen=True)
class Quarantine:
    """An adapter the torch LoRA path quarantined at load, as the probe recorded it."""

    run: int  # the index of the header before it (-1: none)
    rank: int
    adapter: str | None
    adapter_id: int
    adapter_path: str | None
    layer: int | None
    module: str
    tensor: str
    nan: int
    inf: int

    def reason(self) -> Reason:
        """The quarantine as a message's facts (probe-quarantine): who, which tensor, the
        counts, and the command that names every non-finite tensor of the adapter."""
        return Reason.of(
            Code.PROBE_QUARANTINE,
            adapter=self.adapter,
            adapter_id=self.adapter_id,
            layer=self.layer,
            module=self.module,
            tensor=self.tensor,
            nan=self.nan,
            inf=self.inf,
            command=self.command(),
        )

    def command(self) -> str:
        """The next command, safe to paste: the path is one shell word (a tenant chooses
        it) that is never an option (a relative path starting with "-" is written
        "./-..."), or DIR where it holds characters that would not show as written."""
        path = self.adapter_path
        if not (path and path.isascii() and path.isprintable()):
            return f"{CHECK_COMMAND} DIR"
        return f"{CHECK_COMMAND} {shlex.quote('./' + path if path.startswith('-') else path)}"


@dataclass
class ProbeReport:
    path: str
    steps: int  # distinct steps with a record
    records: int
    headers: int
    findings: list[RequestFinding]
    padding_only: int  # records whose bad rows were all padding (no request)
    warnings: list[Reason] = field(default_factory=list)  # a cut last line, skipped
    quarantines: list[Quarantine] = field(default_factory=list)
    quarantines_not_listed: int = 0  # beyond MAX_QUARANTINES distinct ones


@dataclass(frozen=True)
class Sighting:
    """One bad record as one request's finding needs it (not the whole line: a line
    names the batch's every request and adapter, and may be kept for each of them)."""

    step: int
    layer: int
    module: str
    kind: str
    order: int
    run: int  # the index of the header before it (-1: none)
    adapter: str | None
    quarantine: Quarantine | None = None  # its adapter's, recorded before this sighting


@dataclass
class RequestTrail:
    """What one request's finding needs: its records at its first bad step and first
    bad layer there (the only ones judged), and per layer which compute the names of
    its bad records pointed at (GDN or attention), over every step."""

    first: list[Sighting] = field(default_factory=list)
    compute: dict[int, int] = field(default_factory=dict)  # layer -> GDN | ATTENTION bits

    def add(self, sighting: Sighting) -> None:
        self.compute[sighting.layer] = self.compute.get(sighting.layer, 0) | _compute_bits(
            sighting.module
        )
        if self.first:
            at = (self.first[0].step, self.first[0].layer)
            if (sighting.step, sighting.layer) > at:
                return
            if (sighting.step, sighting.layer) < at:
                self.first.clear()
        self.first.append(sighting)


@dataclass
class Tally:
    """Everything the report keeps while the log streams by, line after line.

    Its size is bounded by what the report shows (a trail per affected request,
    the distinct step numbers, each header's unwatched modules), not by the
    log's size: a healthy stats line is counted and dropped.
    """

    records: int = 0
    padding_only: int = 0
    steps: set[int] = field(default_factory=set)
    unwatched: list[dict[int, dict[str, str]]] = field(default_factory=list)
    trails: dict[str, RequestTrail] = field(default_factory=dict)
    quarantined: dict[tuple, Quarantine] = field(default_factory=dict)  # (run, name): latest
    listed: dict[tuple, Quarantine] = field(default_factory=dict)  # distinct, in order
    not_listed: int = 0

    def add(self, kind: str, entry: dict) -> None:
        """One checked line, of the kind :func:`line_kind` gave it."""
        if kind == HEADER:  # each server start writes its own header
            self.unwatched.append(unprobed_by_layer(entry))
            return
        if kind == QUARANTINE:
            self.add_quarantine(entry)
            return
        self.records += 1
        self.steps.add(entry["step"])
        if not is_bad(entry):
            return
        if not entry["bad_requests"]:
            self.padding_only += 1
        adapters = {r: bounded(a, MAX_ADAPTER_NAME) for r, a in entry.get("adapters", {}).items()}
        order = entry.get("order", 0)
        for request in entry["bad_requests"]:
            sighting = Sighting(
                entry["step"],
                entry["layer"],
                entry["module"],
                entry["kind"],
                order if isinstance(order, int) and not isinstance(order, bool) else 0,
                len(self.unwatched) - 1,
                adapters.get(request),
                self.quarantined.get((len(self.unwatched) - 1, adapters.get(request))),
            )
            self.trails.setdefault(request, RequestTrail()).add(sighting)

    def add_quarantine(self, entry: dict) -> None:
        """The latest quarantine of each adapter name in this run judges its requests'
        later records; the list keeps each distinct one once (ranks write one each)."""
        run = len(self.unwatched) - 1
        found = Quarantine(
            run=run,
            rank=entry.get("rank", 0),
            adapter=bounded(entry.get("adapter"), MAX_ADAPTER_NAME),
            adapter_id=entry["adapter_id"],
            adapter_path=bounded(entry.get("adapter_path"), MAX_PATH),
            layer=entry.get("layer"),
            module=entry["module"],
            tensor=entry["tensor"],
            nan=entry["nan"],
            inf=entry["inf"],
        )
        if found.adapter is not None:
            self.quarantined[(run, found.adapter)] = found
        same = (run, found.adapter, found.adapter_id, found.layer, found.module, found.tensor)
        if same in self.listed:
            return
        if len(self.listed) < MAX_QUARANTINES:
            self.listed[same] = found
        else:
            self.not_listed += 1


def read_log(path: Path, tally: Tally) -> list[Reason]:
    """Stream the log's lines into ``tally``; return the warnings (a cut last line).

    Opened without blocking and checked to be a regular file before a byte is
    read: a FIFO (or a device) named as the log would block open() or read()
    forever. Lines are read at most MAX_LINE + 1 bytes at a time, so a file of
    one endless line is refused without being held in memory, and one line
    ahead, so the last line is known as such: the probe writing into a full
    file system, or killed mid-write, leaves a cut last line, which is skipped
    with a warning when a probe line came before it (a file whose only line is
    not JSON is not a probe log).
    """
    handle = _open_regular(path)
    seen = 0
    with handle:
        for number, raw, last in _lines(handle):
            if len(raw) > MAX_LINE:
                raise ProbeLogInvalid(
                    At(path, number), f"line longer than {MAX_LINE} bytes: not a nan-probe record"
                )
            try:
                entry = _parse(path, number, _decoded(path, raw))
            except CutLine as exc:
                if not (last and seen):
                    raise
                cut = Reason.of(
                    Code.PROBE_LAST_LINE_CUT, path=str(path), line=number, why=exc.why, seen=seen
                )
                return [cut]
            if entry is not None:
                seen += 1
                tally.add(*entry)
    return []


class At(NamedTuple):
    """A line of the log, as an error names it: "path:number"."""

    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


class ProbeLogInvalid(PatchkitError):
    """A line that is no nan-probe line: its ``path``, its ``line`` (where the error says
    it) and the ``detail``; the log is refused whole."""

    code = Code.PROBE_LOG_INVALID

    def __init__(self, where: At | Path, detail: str, **facts: object):
        at = dict(where._asdict()) if isinstance(where, At) else {"path": where}
        super().__init__(f"{where}: {detail}", **at, detail=detail, **facts)


class ProbeLogUnreadable(PatchkitError):
    """The log cannot be opened, or is no regular file: ``path``."""

    code = Code.PROBE_LOG_UNREADABLE


class CutLine(ProbeLogInvalid):
    """A line that is not (UTF-8) JSON: what a write cut short leaves as the last line."""

    def __init__(self, where: At | Path, detail: str, why: str):
        super().__init__(where, detail, why=why)
        self.why = why


def _lines(handle):
    """(number, raw line, whether it is the last) for each line, one line ahead."""
    number, raw = 1, handle.readline(MAX_LINE + 1)
    while raw:
        following = handle.readline(MAX_LINE + 1)
        yield number, raw, not following
        number, raw = number + 1, following


def _decoded(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        raise CutLine(path, "not UTF-8 text (is it a nan-probe log?)", "not UTF-8") from None


def _open_regular(path: Path):
    """The log opened for reading in binary, refused unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UsageProblem(
            f"{path}: no such file (give the PATCHKIT_PROBE_LOG file)", path=path
        ) from None
    except OSError as exc:
        raise ProbeLogUnreadable(
            f"{path}: cannot read: {exc.strerror}", path=path, error=exc.strerror
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ProbeLogUnreadable(
                f"{path}: not a regular file (give the PATCHKIT_PROBE_LOG file)", path=path
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _parse(path: Path, number: int, line: str) -> tuple[str, dict] | None:
    """One line: None when blank, else its kind (:func:`line_kind`) and the line,
    checked as that kind.

    json.loads raises a plain ValueError (not a JSONDecodeError) for an
    integer longer than Python converts (4,300 digits): caught as not JSON too.
    """
    if not line.strip():
        return None
    where = At(path, number)
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError) as exc:
        name = exc.__class__.__name__
        raise CutLine(where, f"not JSON ({name}): not a nan-probe log", "not JSON") from None
    if not isinstance(entry, dict):
        raise ProbeLogInvalid(where, f"a JSON object expected, got {type(entry).__name__}")
    kind = line_kind(where, entry)
    {HEADER: _check_header, QUARANTINE: _check_quarantine, RECORD: _check_record}[kind](
        where, entry
    )
    return kind, entry


HEADER, QUARANTINE, RECORD = "header", "quarantine", "record"
RECORD_ONLY = ("step", "bad_requests", "event")  # keys a header never carries


def line_kind(where: At, entry: dict) -> str:
    """What a line is, decided once, here, for the checks and the tally alike: a header
    is the line with a ``probe`` key, and that key says ``nan-probe`` and the line
    carries nothing of a record's (a line that is both would have a header's
    checks and a record's meaning, and its bad requests would go unreported); a
    quarantine is ``"event": "quarantine"``; anything else is a step's record."""
    if "probe" in entry:
        if entry["probe"] != "nan-probe":
            raise ProbeLogInvalid(
                where,
                f"'probe': {quoted(entry['probe'])} is not 'nan-probe': not a nan-probe header",
            )
        mixed = [key for key in RECORD_ONLY if key in entry]
        if mixed:
            raise ProbeLogInvalid(
                where,
                f'a header ("probe": "nan-probe") with a record\'s {mixed[0]!r}: '
                "a line is a header or a record, not both",
            )
        return HEADER
    return QUARANTINE if entry.get("event") == "quarantine" else RECORD


def _check_quarantine(where: At, entry: dict) -> None:
    """A quarantine record: every value goes into the report, so each is checked."""
    _check_types(where, entry, QUARANTINE_KEYS, "quarantine record")
    problems = [
        ("module", _is_name(entry["module"])),
        ("tensor", entry["tensor"] in TENSORS),
        ("nan", entry["nan"] >= 0 and entry["inf"] >= 0),
        ("layer", entry.get("layer") is None or _is_index(entry.get("layer"))),
        ("rank", _is_index(entry.get("rank", 0))),
        ("adapter", _is_text(entry.get("adapter"))),
        ("adapter_path", _is_text(entry.get("adapter_path"))),
    ]
    for key, fine in problems:
        if not fine:
            raise ProbeLogInvalid(
                where,
                f"{key!r}: {quoted(entry.get(key))} does not fit: "
                "not a nan-probe quarantine record",
            )


def _is_text(value) -> bool:
    """None or a non-empty string, of any length: a tenant names its adapter, so a
    long name (or path) is cut where it is kept (:func:`bounded`), never a refusal
    of the log, which would hide every other finding."""
    return value is None or (isinstance(value, str) and len(value) > 0)


def bounded(text: str | None, limit: int) -> str | None:
    """``text`` cut to at most ``limit`` characters, the cut marked with its length and
    a hash of the whole: two long names that share their first characters stay two.

    The same cut as nan-probe's writer makes (patchkit_nan_probe.bounded), so a
    name the writer cut and the same name in full on a step's record are one
    adapter; a cut text is not cut again.
    """
    if text is None or len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    mark = f"...[{len(text)} chars, sha256 {digest}]"
    return text[: limit - len(mark)] + mark


def quoted(value) -> str:
    """A field as an error line quotes it: its repr, at most MAX_QUOTED characters."""
    shown = repr(value)
    if len(shown) <= MAX_QUOTED:
        return shown
    return f"{shown[:MAX_QUOTED]}... ({len(shown)} characters)"


def _check_header(where: At, entry: dict) -> None:
    """``unprobed_lora``, where present (older logs have none): a list of
    {layer: int, module: str, class: str}, each name of a sane length."""
    entries = entry.get("unprobed_lora", [])
    if not isinstance(entries, list) or not all(_is_unprobed_entry(e) for e in entries):
        raise ProbeLogInvalid(
            where,
            "'unprobed_lora': a list of {layer, module, class} expected: not a nan-probe header",
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


def _check_types(where: At, entry: dict, keys: dict, what: str) -> None:
    """Each key of ``keys`` holds its type (a bool is no int here), or one line."""
    for key, kind in keys.items():
        value = entry.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProbeLogInvalid(
                where,
                f"{key!r}: {kind.__name__} expected, got {quoted(value)}: not a nan-probe {what}",
            )


def _is_name(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME


def _check_record(where: At, entry: dict) -> None:
    _check_types(where, entry, STEP_KEYS, "record")
    if not _is_name(entry["module"]):
        raise ProbeLogInvalid(
            where,
            f"'module': a name of 1 to {MAX_NAME} characters expected: not a nan-probe record",
        )
    if entry["kind"] not in KINDS:
        raise ProbeLogInvalid(
            where, f"'kind': one of {', '.join(KINDS)} expected, got {quoted(entry['kind'])}"
        )
    if not all(isinstance(r, str) for r in entry["bad_requests"]):
        raise ProbeLogInvalid(where, "'bad_requests': a list of request ids expected")
    adapters = entry.get("adapters", {})
    if not isinstance(adapters, dict) or not all(isinstance(a, str) for a in adapters.values()):
        # an adapter value goes into the report: a NaN would make --json invalid JSON
        raise ProbeLogInvalid(where, "'adapters': an object of request id to adapter name expected")


def is_bad(record: dict) -> bool:
    """Whether the record saw a non-finite value (stats lines are logged when all is fine)."""
    counts = [record.get(k, 0) for k in ("nan_rows", "inf_rows", "nan", "inf")]
    found = any(isinstance(c, (int, float)) and c > 0 for c in counts)
    return found or bool(record["bad_requests"])


def report(path: Path) -> ProbeReport:
    """Read the log and judge every request that had a non-finite row."""
    tally = Tally()
    warnings = read_log(path, tally)
    findings = [judge(request, trail, tally.unwatched) for request, trail in tally.trails.items()]
    findings.sort(key=lambda f: (f.step, f.layer, f.request))
    return ProbeReport(
        path=str(path),
        steps=len(tally.steps),
        records=tally.records,
        headers=len(tally.unwatched),
        findings=findings,
        padding_only=tally.padding_only,
        warnings=warnings,
        quarantines=list(tally.listed.values()),
        quarantines_not_listed=tally.not_listed,
    )


def unprobed_by_layer(header: dict) -> dict[int, dict[str, str]]:
    """Layer -> {module: class} of the LoRA modules one header says the probe does
    not watch there (MoE expert LoRA); empty for an older log without the list."""
    found: dict[int, dict[str, str]] = {}
    for entry in header.get("unprobed_lora", []):
        found.setdefault(entry["layer"], {})[entry["module"]] = entry.get("class", "?")
    return found


def judge(request: str, trail: RequestTrail, unwatched: list[dict]) -> RequestFinding:
    """The decision tree, at the first step and the first layer where the request went bad.

    ``unwatched`` holds, per header of the log, what that server's probe did not
    watch; a record belongs to the header written before it.
    """
    here = sorted(trail.first, key=_position)
    step, layer = here[0].step, here[0].layer
    adapter = next((s.adapter for s in trail.first), None)
    names = [s.module for s in here]
    inputs = [s for s in here if s.kind == "input"]
    projections = [s for s in here if s.kind == "lora"]
    common = dict(request=request, adapter=adapter, step=step, layer=layer, bad_modules=names)
    quarantine = next((s.quarantine for s in here if s.quarantine is not None), None)
    if quarantine is not None:
        return quarantined(common, quarantine, here[0])
    if inputs:
        said = Reason.of(Code.PROBE_INPUT_BAD)
        return RequestFinding(**common, module="input", reason=said)
    if projections:
        first = projections[0].module
        said = Reason.of(Code.PROBE_PROJECTION_BAD, module=first, adapter=adapter)
        return RequestFinding(**common, module=first, reason=said)
    run = trail.first[0].run
    modules = unwatched[run].get(layer, {}) if run >= 0 else {}
    names = list(modules) if adapter else []
    classes = sorted(set(modules.values())) if adapter else []
    said = Reason.of(
        Code.PROBE_OUTPUT_BAD,
        compute=_compute_of(trail.compute.get(layer, 0)),
        adapter=adapter,
        unwatched=names[:SHOWN_UNWATCHED],
        unwatched_count=len(names),
        classes=classes[:SHOWN_UNWATCHED],
        classes_count=len(classes),
    )
    return RequestFinding(**common, module="output", reason=said)


def quarantined(common: dict, quarantine: Quarantine, first: Sighting) -> RequestFinding:
    """A request of an adapter quarantined at load: the recorded tensor is the cause.

    Its rows were made NaN by the quarantine from the first LoRA projection
    that runs (``first``), wherever the bad tensor is; the finding names the
    tensor, not that projection.
    """
    said = Reason.of(
        Code.PROBE_QUARANTINED,
        quarantine=quarantine.reason(),
        first_layer=first.layer,
        first_module=first.module,
    )
    common = {**common, "layer": quarantine.layer if quarantine.layer is not None else -1}
    return RequestFinding(
        **common,
        module=quarantine.module,
        reason=said,
        tensor=quarantine.tensor,
        command=quarantine.command(),
    )


def _position(sighting: Sighting) -> tuple[int, int]:
    """Input first, then the projections in their order, then the output."""
    return {"input": 0, "lora": 1, "output": 2}[sighting.kind], sighting.order


GDN, ATTENTION = 1, 2


def _compute_bits(module: str) -> int:
    return (GDN if "linear_attn" in module else 0) | (ATTENTION if "self_attn" in module else 0)


def _compute_of(bits: int) -> str:
    """Which compute the layer's bad records point at, by their module names: ``gdn`` or
    ``attention`` (each or the MLP), ``any`` where their names say neither."""
    if bits & GDN:
        return "gdn"
    if bits & ATTENTION:
        return "attention"
    return "any"
