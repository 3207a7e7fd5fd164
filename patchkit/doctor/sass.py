"""Find the wgmma register race (triton#9433, vLLM #48590) in Hopper SASS.

A register-A wgmma reads its A fragment from registers, asynchronously:
``HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR12], R24, gsb0`` reads
R88-R91 until a ``WARPGROUP.DEPBAR.LE gsb0, N`` retires it (that wait
leaves at most N wgmma groups in flight). The PTX spec makes writing those
registers before then undefined; ptxas before 13.3 does it in Triton's
pipelined loops, when the next iteration loads and converts the next
fragment (``LDS.64 R88``, ``F2FP.BF16.F32.PACK_AB R88, ...``) into the
registers an in-flight wgmma still reads.

The detector follows the program in order, keeps the A registers of each
issued wgmma as pending until a DEPBAR retires it, and flags every write to
a pending register. Each loop (a backward branch) is followed a second time
from the state at its back-edge, because the race crosses iterations.
Predicated writes count (they may execute); ``@!PT`` ones never do.
It reads text only, so it is tested on recorded snippets.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_REG = re.compile(r"R(\d+)$")
_HGMMA_A_REGS = 4  # a 64xNx16 bf16/fp16 A fragment: 4 registers per thread
# opcodes whose first operand is not a register they write
_NO_DESTINATION = ("ST", "RED", "BRA", "BAR", "WARPGROUP", "DEPBAR", "MEMBAR", "FENCE", "EXIT")

# What one compile's SASS shows ("error": it could not be compiled or read).
KernelVerdict = Literal["hazard", "clean", "no-register-operand", "error"]


def address(value: int) -> str:
    """An instruction's address as the listing names it: ``0x44e0`` (``/*44e0*/``)."""
    return f"0x{value:04x}"


@dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str  # "", "@P0", "@!P1", ...
    opcode: str
    operands: tuple[str, ...]

    @property
    def never_runs(self) -> bool:
        return self.predicate == "@!PT"

    def written_registers(self) -> set[int]:
        """The general registers this instruction writes (its destination)."""
        if self.opcode.startswith(_NO_DESTINATION) or self.opcode.startswith("HGMMA"):
            return set()
        if not self.operands:
            return set()
        match = _REG.match(self.operands[0])
        if not match:
            return set()
        width = 4 if ".128" in self.opcode else 2 if ".64" in self.opcode else 1
        first = int(match.group(1))
        return set(range(first, first + width))

    def register_a(self) -> set[int]:
        """For a register-A HGMMA, the registers of its A fragment; else empty."""
        if not self.opcode.startswith("HGMMA") or len(self.operands) < 2:
            return set()
        match = _REG.match(self.operands[1])
        if not match:
            return set()
        first = int(match.group(1))
        return set(range(first, first + _HGMMA_A_REGS))

    def depbar_keep(self) -> int | None:
        """N of ``WARPGROUP.DEPBAR.LE gsb0, N``; None for other instructions."""
        if self.opcode != "WARPGROUP.DEPBAR.LE" or len(self.operands) < 2:
            return None
        return int(self.operands[1], 16) if self.operands[1].startswith("0x") else None

    def branch_target(self) -> int | None:
        if self.opcode != "BRA" or not self.operands:
            return None
        target = self.operands[-1]
        return int(target, 16) if target.startswith("0x") else None

    def text(self) -> str:
        return " ".join(filter(None, [self.predicate, self.opcode, ", ".join(self.operands)]))


def moved(ins: Instruction, by: int) -> Instruction:
    """``ins`` as a listing ``by`` bytes further on shows it: its address and a branch's
    target (a relative jump, printed as the address it reaches) both shifted."""
    target = ins.branch_target()
    operands = ins.operands if target is None else (*ins.operands[:-1], f"{target + by:#x}")
    return dataclasses.replace(ins, address=ins.address + by, operands=operands)


@dataclass(frozen=True)
class Hazard:
    address: int
    instruction: str
    registers: tuple[int, ...]
    wgmma_address: int  # the in-flight HGMMA whose A fragment is overwritten


@dataclass
class Findings:
    hgmma: int = 0
    register_a: int = 0
    hazards: list[Hazard] = field(default_factory=list)

    @property
    def verdict(self) -> KernelVerdict:
        if self.hazards:
            return "hazard"
        return "clean" if self.register_a else "no-register-operand"


def wgmma_possible(ptx: str) -> bool:
    """Whether SASS compiled from ``ptx`` can hold an HGMMA at all.

    ptxas lowers the PTX it is given; an HGMMA is its translation of a
    ``wgmma.mma_async`` (which needs the ``wgmma.fence`` / ``commit_group`` /
    ``wait_group`` around it), and it does not turn ``mma.sync`` or scalar
    code into a warpgroup MMA. So PTX without the word ``wgmma`` compiles to
    SASS with no HGMMA, no register-A operand and no hazard: the reading a
    disassembly would give (:class:`Findings` empty). Any mention of
    ``wgmma``, a comment included, counts as possible: that kernel is read.
    """
    return "wgmma" in ptx


def parse(sass: str) -> list[Instruction]:
    """The instructions of a cuobjdump/nvdisasm listing, in address order."""
    found = []
    for line in sass.splitlines():
        match = _LINE.search(line)
        if not match:
            continue
        body = match.group(2).strip()
        predicate = ""
        if body.startswith("@"):
            predicate, _, body = body.partition(" ")
        opcode, _, rest = body.strip().partition(" ")
        operands = tuple(op.strip() for op in rest.split(",") if op.strip())
        found.append(Instruction(int(match.group(1), 16), predicate, opcode, operands))
    return found


@dataclass
class _InFlight:
    """wgmma groups not yet retired: committed groups (``gsb0``) and the open one."""

    groups: list[list[tuple[int, set[int]]]] = field(default_factory=list)
    open: list[tuple[int, set[int]]] = field(default_factory=list)

    def copy(self) -> _InFlight:
        return _InFlight([list(g) for g in self.groups], list(self.open))

    def reading(self):
        for group in [*self.groups, self.open]:
            yield from group


def scan(sass: str) -> Findings:
    """Every write to the A registers of an in-flight register-A wgmma."""
    return scan_program(parse(sass))


def scan_program(program: list[Instruction]) -> Findings:
    """:func:`scan` of a listing already parsed (one function's, in address order)."""
    findings = Findings(
        hgmma=sum(1 for i in program if i.opcode.startswith("HGMMA")),
        register_a=sum(1 for i in program if i.register_a()),
    )
    if not findings.register_a:
        return findings
    index = {ins.address: n for n, ins in enumerate(program)}
    hazards: dict[int, Hazard] = {}
    in_flight = _InFlight()
    for n, ins in enumerate(program):
        _step(ins, in_flight, hazards)
        target = ins.branch_target()
        if target is not None and target < ins.address and target in index:
            looped = in_flight.copy()  # the back-edge taken: run the body once more
            for again in program[index[target] : n + 1]:
                _step(again, looped, hazards)
    findings.hazards = [hazards[a] for a in sorted(hazards)]
    return findings


def _step(ins: Instruction, in_flight: _InFlight, hazards: dict[int, Hazard]) -> None:
    """Apply one instruction to the in-flight wgmma groups; record a hazard it causes."""
    if ins.never_runs:
        return
    keep = ins.depbar_keep()
    if keep is not None:
        in_flight.groups = in_flight.groups[len(in_flight.groups) - keep :] if keep else []
        return
    if ins.opcode.startswith("HGMMA"):
        in_flight.open.append((ins.address, ins.register_a()))
        if "gsb0" in ins.operands:  # commits the group
            in_flight.groups.append(in_flight.open)
            in_flight.open = []
        return
    written = ins.written_registers()
    for wgmma_address, registers in in_flight.reading():
        clash = written & registers
        if clash and ins.address not in hazards:
            hazards[ins.address] = Hazard(
                ins.address, ins.text(), tuple(sorted(clash)), wgmma_address
            )
