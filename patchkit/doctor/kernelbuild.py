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
Disassembling is about half of a cold compile's time, so a compile whose
PTX has no wgmma instruction is not disassembled: its SASS cannot hold an
HGMMA (:func:`patchkit.doctor.sass.wgmma_possible`), so its reading is
known (``no-register-operand``, nothing found) without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.doctor import sass
from patchkit.doctor.signatures import Launch
from patchkit.doctor.toolchain import Toolchain
from patchkit.fs.files import decode_json, read_json_file, write_cache_file

FORMAT = 1  # bump when a cached reading would mean something else
MAX_SCAN_BYTES = 64 << 20  # a remembered scan of a few hundred cases is a few MB


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
    with tempfile.TemporaryDirectory(prefix="patchkit-kernels-") as tmp:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            jobs = [(launch, Path(tmp) / f"{n}.cubin") for n, launch in enumerate(missing)]
            found = pool.map(lambda job: _read(job[0], disassemble, job[1]), jobs)
            for launch, reading in zip(missing, found, strict=True):
                readings[launch.key] = reading
                if reading.verdict != "error" or not reading.compiled:
                    _store(reading_key(launch, tools), reading)
    return readings


def _read(launch: Launch, disassemble: list[str], path: Path) -> Reading:
    """Compile, disassemble and scan one launch; a compile error is a reading too."""
    try:
        asm = launch.jit.preload(launch.data).asm
        cubin = asm["cubin"]
    except Exception as exc:  # a compile error is a finding to report, not a crash
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        where = f"{lines[0]} " if len(lines) > 1 else ""  # Triton's "at 191:23:", then the cause
        return Reading(
            "error", error=f"{type(exc).__name__}: {where}{lines[-1]}"[:300], compiled=False
        )
    ptx = asm.get("ptx")
    if isinstance(ptx, str) and not sass.wgmma_possible(ptx):
        return without_wgmma()
    key = machine_code_key(cubin, disassemble)
    with _reading_lock(key):  # another thread of this scan may be reading the same cubin
        cached = _cached(key)
        if cached is not None:
            return cached
        reading = _disassemble(cubin, disassemble, path)
        if reading.verdict != "error":
            _store(key, reading)
    return reading


def without_wgmma() -> Reading:
    """The reading of a compile whose PTX has no wgmma: what its SASS would show."""
    findings = sass.Findings()
    return Reading(findings.verdict, findings.hgmma, findings.register_a, findings.hazards)


def _disassemble(cubin: bytes, disassemble: list[str], path: Path) -> Reading:
    path.write_bytes(cubin)
    done = subprocess.run([*disassemble, str(path)], capture_output=True, text=True, timeout=120)
    if not done.stdout.strip():
        return Reading("error", error=f"the disassembler printed nothing ({done.stderr.strip()})")
    findings = sass.scan(done.stdout)
    return Reading(findings.verdict, findings.hgmma, findings.register_a, findings.hazards)


def machine_code_key(cubin: bytes, disassemble: list[str]) -> str:
    """Same cubin, same disassembler (path, size, mtime), same reading."""
    try:
        info = os.stat(disassemble[0])
        stamp = [info.st_size, info.st_mtime_ns]
    except OSError:
        stamp = []
    parts = [FORMAT, "cubin", hashlib.sha256(cubin).hexdigest(), disassemble, stamp]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _reading_lock(key: str) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(key, threading.Lock())


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
