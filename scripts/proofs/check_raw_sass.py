"""The kernel scan's two shortcuts, checked on every distinct cubin of Triton's caches (CPU).

`doctor --kernels` does not disassemble a compile whose PTX has no wgmma
(its SASS cannot hold an HGMMA), and reads the others in one raw nvdisasm
run per core instead of a cuobjdump per cubin (patchkit/doctor/kernelbuild.py).
This runs cuobjdump on every distinct cubin the caches hold and checks
both: no HGMMA where the PTX has no wgmma, and the raw run's reading
(HGMMA count, register-A count, each hazard's address, instruction and
registers) equal to cuobjdump's everywhere else. The tests' Triton caches
after a run of the suite hold the widest set at hand:

    python scripts/proofs/check_raw_sass.py TRITON_SITE CACHE_DIR [CACHE_DIR ...]

TRITON_SITE is the directory holding the ``triton`` package whose
cuobjdump and nvdisasm to use; prints one summary line, exits 1 on a mismatch.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from patchkit.doctor import cubinfile, kernelbuild, sass  # noqa: E402


def main(site: Path, caches: list[Path]) -> int:
    bin_dir = site / "triton/backends/nvidia/bin"
    cubins: dict[bytes, bool] = {}  # distinct cubin -> its PTX names wgmma
    for cache in caches:
        for path in sorted(cache.rglob("*.cubin")):
            ptx = path.with_suffix(".ptx")
            if ptx.is_file():
                cubins[path.read_bytes()] = sass.wgmma_possible(ptx.read_text())
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [(n, c) for n, c in enumerate(cubins)]
        alone = dict(pool.map(lambda job: (job[1], cuobjdump(bin_dir, job, Path(tmp))), jobs))
    unread = [c for c, wgmma in cubins.items() if not wgmma]
    hgmma = [c for c in unread if alone[c].hgmma]
    read = [c for c, wgmma in cubins.items() if wgmma]
    raw_code = [(str(n), cubinfile.code(c)) for n, c in enumerate(read)]
    alone_read = [c for (_, code), c in zip(raw_code, read, strict=True) if code is None]
    batch = [(key, code) for key, code in raw_code if code is not None]
    raw = {}
    for part in kernelbuild.batches(batch):
        raw |= kernelbuild.read_raw(part, str(bin_dir / "nvdisasm"))
    differ = [
        n for n, c in enumerate(read) if str(n) in raw and facts(raw[str(n)]) != facts(alone[c])
    ]
    left = len(batch) - len(raw)
    hazards = sum(1 for c in read if alone[c].hazards)
    print(
        f"{len(cubins)} distinct cubins: {len(unread)} without wgmma in their PTX "
        f"({len(hgmma)} with an HGMMA in their SASS); {len(read)} with, {len(raw)} read raw "
        f"({len(differ)} differing from cuobjdump, {hazards} with hazards), {left} left to "
        f"cuobjdump by the raw run, {len(alone_read)} without raw code"
    )
    return 1 if hgmma or differ else 0


def cuobjdump(bin_dir: Path, job: tuple[int, bytes], tmp: Path) -> sass.Findings:
    path = tmp / f"{job[0]}.cubin"
    path.write_bytes(job[1])
    command = [str(bin_dir / "cuobjdump"), "-sass", str(path)]
    listing = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    if not sass.parse(listing):
        raise SystemExit(f"cuobjdump printed no instructions for {path}")
    return sass.scan(listing)


def facts(found) -> tuple:
    return found.hgmma, found.register_a, found.hazards


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]]))
