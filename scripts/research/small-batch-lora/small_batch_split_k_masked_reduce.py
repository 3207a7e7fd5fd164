"""Torch-only: split-K shrink whose reduction is a batched GEMM that also applies the slot mask."""

import json
import os

import torch
from graph_timer import graph_us as graph_time
from graph_timer import lora_operands, relative_error, shipped_path

dev = "cuda"
H, OUT, L = 5120, 5120, 4


res = {}
for r in (64, 128):
    for T in (1, 4, 16, 64, 256, 1024):
        x, A, B, y = lora_operands(T, r)
        slot = torch.arange(T, device=dev, dtype=torch.int32) % (L + 1) - 1  # -1 and all slots
        not_own = slot.unsqueeze(1) != torch.arange(L, device=dev, dtype=torch.int32)
        m3 = not_own.view(T, L, 1)
        cur, ref = shipped_path(x, A, B, y, not_own)
        row = {"cur": graph_time(cur)}
        row["cur_err"] = relative_error(cur, y, ref)
        for k in (4, 8, 16):
            xs = x.view(T, k, H // k).transpose(0, 1)
            As = A.view(L * r, k, H // k).permute(1, 2, 0)
            P = torch.empty(k, T, L * r, device=dev, dtype=torch.bfloat16)
            W = (~not_own).to(torch.bfloat16).view(T * L, 1, 1).expand(T * L, 1, k).contiguous()
            Pv = P.as_strided((T * L, k, r), (r, T * L * r, 1))
            S = torch.empty(T * L, 1, r, device=dev, dtype=torch.bfloat16)

            def mulmask(xs=xs, As=As, P=P, W=W, Pv=Pv, S=S):
                torch.bmm(xs, As, out=P)
                torch.bmm(W, Pv, out=S)
                y.addmm_(S.view(T, L * r), B)

            row[f"k{k}"] = graph_time(mulmask)
            row[f"k{k}_err"] = relative_error(mulmask, y, ref)
            row[f"k{k}_reduce_only"] = graph_time(lambda W=W, Pv=Pv, S=S: torch.bmm(W, Pv, out=S))
        res[f"r{r}_T{T}"] = row
        print(
            r,
            T,
            {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()},
            flush=True,
        )
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/micro3.json", "w"), indent=1)
