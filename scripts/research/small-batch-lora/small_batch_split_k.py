"""Torch-only: split-K shrink variants for the 1-slice call at small token counts."""

import json
import os

import torch
from graph_timer import graph_us as graph_time
from graph_timer import lora_operands, relative_error, shipped_path

dev = "cuda"
H, OUT, L = 5120, 5120, 4


res = {}
for r in (64, 128):
    for T in (1, 4, 16, 64, 256):
        x, A, B, y = lora_operands(T, r)
        not_own = torch.zeros(T, dtype=torch.int32, device=dev).unsqueeze(1) != torch.arange(
            L, device=dev, dtype=torch.int32
        )
        m3 = not_own.view(T, L, 1)
        cur, ref = shipped_path(x, A, B, y, not_own)
        row = {"cur": graph_time(cur)}
        for k in (4, 8, 16):
            xs = x.view(T, k, H // k).transpose(0, 1)
            As = A.view(L * r, k, H // k).permute(1, 2, 0)

            def sk(xs=xs, As=As):
                p = torch.bmm(xs, As)
                h = p.sum(0).view(T, L, r).masked_fill_(m3, 0.0)
                y.addmm_(h.view(T, L * r), B)

            row[f"splitk{k}"] = graph_time(sk)

            def skm(xs=xs, As=As):
                p = torch.bmm(xs, As)
                h = torch.where(m3, 0.0, p.view(k, T, L, r).sum(0, dtype=torch.float32)).to(
                    torch.bfloat16
                )
                y.addmm_(h.view(T, L * r), B)

            row[f"splitk{k}_where"] = graph_time(skm)
            row[f"splitk{k}_err"] = relative_error(sk, y, ref)
            row[f"bmm_only{k}"] = graph_time(lambda xs=xs, As=As: torch.bmm(xs, As))
        row["mm_only"] = graph_time(lambda: torch.mm(x, A.t()))
        res[f"r{r}_T{T}"] = row
        print(r, T, row, flush=True)
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/micro2.json", "w"), indent=1)
