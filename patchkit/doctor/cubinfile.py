"""A cubin's machine code as raw sm_90a instructions, so one disassembler run reads many.

nvdisasm takes about a quarter of a second to start, whatever it reads; run
once per cubin (cuobjdump runs it so) that was half of a cold compile's
time. Given raw instructions (``nvdisasm -b SM90a``) it decodes any number
of kernels laid end to end in one run. A Triton cubin keeps its kernel's
instructions in one executable section (``.text.<kernel>``, the functions it
calls inside it); with no relocation against that section its bytes are
final, and the raw listing is the ELF's listing line for line, at addresses
shifted by where the kernel lies in the run. A cubin with relocations,
several executable sections or an ELF this reader does not follow has no
raw code here: it is disassembled on its own, as before.
"""

from __future__ import annotations

import struct

INSTRUCTION_BYTES = 16  # every sm_90 instruction, control bits included
_ELF64_LE = b"\x7fELF\x02\x01"
_SECTION = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr


def code(cubin: bytes) -> bytes | None:
    """The instructions of the cubin's one executable section; None where that is not safe."""
    try:
        sections = _sections(cubin)
    except (struct.error, ValueError, IndexError):
        return None
    texts = [body for name, body in sections if name.startswith(".text.")]
    relocated = any(
        name.startswith((".rel.text", ".rela.text")) and body for name, body in sections
    )
    if len(texts) != 1 or relocated or not texts[0] or len(texts[0]) % INSTRUCTION_BYTES:
        return None
    return texts[0]


def _sections(elf: bytes) -> list[tuple[str, bytes]]:
    """(name, contents) of each section of a little-endian ELF64 file."""
    if not elf.startswith(_ELF64_LE):
        raise ValueError("not a little-endian ELF64 file")
    (offset,) = struct.unpack_from("<Q", elf, 0x28)
    size, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)
    if size != _SECTION.size:
        raise ValueError("unexpected section header size")
    headers = [_SECTION.unpack_from(elf, offset + n * size) for n in range(count)]
    names = headers[names_index]
    found = []
    for header in headers:
        start = names[4] + header[0]
        name = elf[start : elf.index(b"\0", start)].decode("ascii", "replace")
        kind, body_offset, body_size = header[1], header[4], header[5]
        empty = kind == 8  # SHT_NOBITS: no bytes in the file
        body = b"" if empty else elf[body_offset : body_offset + body_size]
        if len(body) != (0 if empty else body_size):
            raise ValueError(f"section {name} runs past the end of the file")
        found.append((name, body))
    return found
