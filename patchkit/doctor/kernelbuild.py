"""Compile each distinct launch for sm_90, disassemble it, read the SASS; cache the reading.

Compiling needs no GPU: Triton's ptxas and cuobjdump are in its wheel. A
reading is cached under patchkit's cache, keyed by everything that decides
the machine code: the launch's specialisation, the kernel's source (Triton's
own hash of it and the functions it calls), the Triton release and the
ptxas (path and version). A warm scan compiles nothing.

The SASS of a compile is read once per distinct machine code: launches that
Triton specialises apart (a size divisible by 16 or not, the same kernel at
another source line in another release) often compile to the same cubin,
byte for byte, and a reading depends only on the cubin and the disassembler.
Disassembling was about half of a cold compile's time, so a compile whose
PTX has no wgmma instruction is not disassembled: its SASS cannot hold an
HGMMA (:func:`patchkit.doctor.sass.wgmma_possible`), so its reading is
known (``no-register-operand``, nothing found) without it. The others are
disassembled together, one raw nvdisasm run per core
(:mod:`patchkit.doctor.cubinfile`), not one cuobjdump per cubin.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
from bisect import bisect_left
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.doctor import cubinfile, sass
from patchkit.doctor.signatures import Launch
from patchkit.doctor.toolchain import Toolchain
from patchkit.fs.files import decode_json, read_json_file, write_cache_file

FORMAT = 1  # bump when a cached reading would mean something else
MAX_SCAN_BYTES = 64 << 20  # a remembered scan of a few hundred cases is a few MB
RAW_BATCH = 32  # cubins per raw nvdisasm run: a listing of about 15 MB, 32 starts saved


@dataclass
class Reading:
    """What the SASS of one compile shows."""

    verdict: sass.KernelVerdict
    hgmma: int = 0
    register_a: int = 0
    hazards: list[sass.Hazard] = field(default_factory=list)
    error: str = ""
    compiled: bool = True  # False: Triton refused the kernel (deterministic, so cached too)

    def record(self) -> dict:
        """The reading as patchkit's cache keeps it (:meth:`stored` reads it back)."""
        return dataclasses.asdict(self) | {"hazards": [hazard_record(h) for h in self.hazards]}

    @classmethod
    def of(cls, findings: sass.Findings) -> Reading:
        """The reading of a disassembly that sass found ``findings`` in."""
        return cls(findings.verdict, findings.hgmma, findings.register_a, findings.hazards)

    @classmethod
    def stored(cls, data: dict) -> Reading:
        return cls(**data | {"hazards": [stored_hazard(h) for h in data["hazards"]]})


# A hazard in patchkit's cache, as FORMAT 1 wrote it: addresses in hex, registers as R<n>.


def hazard_record(hazard: sass.Hazard) -> dict:
    return {
        "address": sass.address(hazard.address),
        "instruction": hazard.instruction,
        "registers": [f"R{r}" for r in hazard.registers],
        "wgmma": sass.address(hazard.wgmma_address),
    }


def stored_hazard(data: dict) -> sass.Hazard:
    registers = tuple(int(r.removeprefix("R")) for r in data["registers"])
    return sass.Hazard(
        int(data["address"], 16), data["instruction"], registers, int(data["wgmma"], 16)
    )


def cache_dir() -> Path:
    from patchkit.fs.places import cache_root

    return cache_root() / "kernel-scan"


def reading_key(launch: Launch, tools: Toolchain) -> str:
    """Same key, same machine code: specialisation, kernel source, Triton, ptxas."""
    parts = [
        FORMAT,
        launch.key,
        launch.jit.cache_key,
        tools.triton,
        tools.ptxas,
        tools.ptxas_version,
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def read_all(
    launches: list[Launch], tools: Toolchain, disassemble: list[str]
) -> dict[str, Reading]:
    """A reading per launch key: from the cache, else compiled and read (in parallel).

    Triton compiles in this process, so its active driver must be the
    stand-in sm_90 one (:func:`patchkit.doctor.signatures.sm90`) around
    this call.
    """
    readings, missing = {}, []
    for launch in launches:
        cached = _cached(reading_key(launch, tools))
        if cached is not None:
            readings[launch.key] = cached
        else:
            missing.append(launch)
    if not missing:
        return readings
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        built = list(pool.map(lambda launch: _compile(launch, disassemble), missing))
        cubins = {key: cubin for reading, key, cubin in built if reading is None}
        machine_code = read_machine_code(cubins, disassemble, pool)
    for launch, (reading, key, _) in zip(missing, built, strict=True):
        reading = reading or machine_code[key]
        readings[launch.key] = reading
        if reading.verdict != "error" or not reading.compiled:
            _store(reading_key(launch, tools), reading)
    return readings


def _compile(launch: Launch, disassemble: list[str]) -> tuple[Reading | None, str, bytes]:
    """One launch compiled: (its reading, "", b"") when the compile alone decides it (an
    error, or PTX without wgmma), else (None, its machine-code key, its cubin)."""
    try:
        asm = launch.jit.preload(launch.data).asm
        cubin = asm["cubin"]
    except Exception as exc:  # a compile error is a finding to report, not a crash
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        where = f"{lines[0]} " if len(lines) > 1 else ""  # Triton's "at 191:23:", then the cause
        error = f"{type(exc).__name__}: {where}{lines[-1]}"[:300]
        return Reading("error", error=error, compiled=False), "", b""
    ptx = asm.get("ptx")
    if isinstance(ptx, str) and not sass.wgmma_possible(ptx):
        return without_wgmma(), "", b""
    return None, machine_code_key(cubin, disassemble), cubin


def without_wgmma() -> Reading:
    """The reading of a compile whose PTX has no wgmma: what its SASS would show."""
    return Reading.of(sass.Findings())


def read_machine_code(
    cubins: dict[str, bytes], disassemble: list[str], pool: ThreadPoolExecutor
) -> dict[str, Reading]:
    """A reading per machine-code key: cached, else from the raw disassembly of many
    cubins at once (:mod:`patchkit.doctor.cubinfile`), else from ``disassemble`` on the cubin."""
    cached = {key: reading for key in cubins if (reading := _cached(key)) is not None}
    found: dict[str, Reading] = {}
    raw_tool = raw_disassembler(disassemble)
    raw = {key: cubinfile.code(c) for key, c in cubins.items() if key not in cached and raw_tool}
    dealt = batches([(key, code) for key, code in raw.items() if code is not None])
    for read in pool.map(lambda batch: read_raw(batch, raw_tool), dealt):
        found.update(read)
    rest = [(key, c) for key, c in cubins.items() if key not in cached and key not in found]
    with tempfile.TemporaryDirectory(prefix="patchkit-kernels-") as tmp:
        jobs = [(c, Path(tmp) / f"{n}.cubin") for n, (_, c) in enumerate(rest)]
        read = pool.map(lambda job: _disassemble(job[0], disassemble, job[1]), jobs)
        found.update(zip([key for key, _ in rest], read, strict=True))
    for key, reading in found.items():
        if reading.verdict != "error":
            _store(key, reading)
    return cached | found


def raw_disassembler(disassemble: list[str]) -> str | None:
    """The nvdisasm that ``disassemble`` is or runs (cuobjdump's, beside it); None if none."""
    tool = Path(disassemble[0])
    nvdisasm = tool if tool.name == "nvdisasm" else tool.with_name("nvdisasm")
    return str(nvdisasm) if nvdisasm.is_file() else None


def batches(items: list, cores: int | None = None) -> list[list]:
    """``items`` dealt into one batch per core, one disassembler run each, and more
    batches where one would hold more than RAW_BATCH (a run's listing is held whole)."""
    count = max(cores or os.cpu_count() or 2, -(-len(items) // RAW_BATCH))
    count = min(count, len(items))
    return [items[n::count] for n in range(count)]


def read_raw(batch: list[tuple[str, bytes]], nvdisasm: str) -> dict[str, Reading]:
    """Readings of the cubins whose code (``(key, code)``) one raw nvdisasm run decoded
    whole; a cubin it did not (a count of instructions off) is left out, to be read alone."""
    with tempfile.NamedTemporaryFile(prefix="patchkit-kernels-", suffix=".bin") as file:
        file.write(b"".join(code for _, code in batch))
        file.flush()
        command = [nvdisasm, "-b", "SM90a", "-hex", "-novliw", file.name]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError):
            return {}
    program = sass.parse(done.stdout) if done.returncode == 0 else []
    addresses = [ins.address for ins in program]
    found, start = {}, 0
    for key, code in batch:
        end = start + len(code)
        part = program[bisect_left(addresses, start) : bisect_left(addresses, end)]
        if len(part) == len(code) // cubinfile.INSTRUCTION_BYTES:
            found[key] = Reading.of(sass.scan_program([sass.moved(ins, -start) for ins in part]))
        start = end
    return found


def _disassemble(cubin: bytes, disassemble: list[str], path: Path) -> Reading:
    path.write_bytes(cubin)
    done = subprocess.run([*disassemble, str(path)], capture_output=True, text=True, timeout=120)
    if not done.stdout.strip():
        return Reading("error", error=f"the disassembler printed nothing ({done.stderr.strip()})")
    return Reading.of(sass.scan(done.stdout))


def machine_code_key(cubin: bytes, disassemble: list[str]) -> str:
    """Same cubin, same disassembler (path, size, mtime), same reading."""
    try:
        info = os.stat(disassemble[0])
        stamp = [info.st_size, info.st_mtime_ns]
    except OSError:
        stamp = []
    parts = [FORMAT, "cubin", hashlib.sha256(cubin).hexdigest(), disassemble, stamp]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _cached(key: str) -> Reading | None:
    path = cache_dir() / f"{key}.json"
    try:
        data = read_json_file(path)
        return Reading.stored(data) if isinstance(data, dict) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _store(key: str, reading: Reading) -> None:
    try:
        write_cache_file(cache_dir() / f"{key}.json", json.dumps(reading.record()).encode())
    except OSError:
        pass  # a read-only cache only costs time


def recall(key: str) -> dict | None:
    """A whole scan's result remembered under ``key`` (see kernelscan.scan_key)."""
    try:
        raw = (cache_dir() / "scans" / f"{key}.json").read_bytes()
        data = decode_json(raw, MAX_SCAN_BYTES)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remember(key: str, result: dict) -> None:
    try:
        write_cache_file(cache_dir() / "scans" / f"{key}.json", json.dumps(result).encode())
    except OSError:
        pass  # a read-only cache only costs time
