import re, sys

lines = [l for l in open(sys.argv[1])]
ins = []
for l in lines:
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", l)
    if m:
        ins.append((int(m[1], 16), m[2].strip()))
addr_idx = {a: i for i, (a, _) in enumerate(ins)}


def regs(op, n):
    m = re.match(r"R(\d+)", op)
    return set(range(int(m[1]), int(m[1]) + n)) if m else set()


# find back-edges: BRA to lower address
for i, (a, t) in enumerate(ins):
    m = re.search(r"BRA (0x[0-9a-f]+)", t)
    if not m:
        continue
    tgt = int(m[1], 16)
    if tgt >= a:
        continue
    body = ins[addr_idx[tgt] : i + 1]
    hg = [(j, x) for j, x in enumerate(body) if "HGMMA" in x[1]]
    if not hg:
        continue
    # pending model: simulate twice around the loop
    pending = []  # list of reg sets for gsb0 groups
    hazards = []
    for rnd in range(2):
        for ad, txt in body:
            op = re.sub(r"^@!?U?P\w+\s+", "", txt)
            if op.startswith("HGMMA") and ", R" in op:
                parts = [p.strip() for p in op.split(None, 1)[1].split(",")]
                a_reg = parts[1]
                if a_reg.startswith("R"):
                    pending.append((ad, regs(a_reg, 4)))
                continue
            m2 = re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", op)
            if m2:
                keep = int(m2[1], 16)
                pending = pending[-keep:] if keep else []
                continue
            if op.startswith("@!PT"):
                continue
            mm = re.match(r"([A-Z0-9_.]+)\s+(R\d+)", op)
            if mm and not mm[1].startswith(
                ("ST", "BRA", "HGMMA", "WARPGROUP", "BAR", "ISETP", "FSETP")
            ):
                width = 2 if ".64" in mm[1] else 4 if ".128" in mm[1] else 1
                w = regs(mm[2], width)
                for had, r in pending:
                    if w & r and rnd == 1:
                        hazards.append((hex(ad), txt, hex(had)))
    print(sys.argv[1], "loop", hex(tgt), hex(a), "hazards", len(hazards))
    for h in hazards:
        print("   ", h)
