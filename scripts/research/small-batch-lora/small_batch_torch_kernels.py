"""Torch-only: where the 1-slice add_lora_linear time goes at small token counts (no vLLM)."""

import json
import os

import torch
from graph_timer import graph_us as graph_time
from graph_timer import lora_operands
from torch.profiler import ProfilerActivity, profile

dev = "cuda"
H, OUT, L = 5120, 5120, 4
res = {}


for r in (64, 128):
    for T in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        x, A, B, y = lora_operands(T, r)
        A1, B1 = A[:r].clone(), B[:r].clone()
        mapping = torch.zeros(T, dtype=torch.int32, device=dev)
        not_own = mapping.unsqueeze(1) != torch.arange(L, device=dev, dtype=torch.int32)
        m3 = not_own.view(T, L, 1)
        not_own_t = not_own.t().contiguous().view(L, 1, T)

        def cur():
            h = torch.mm(x, A.t()).view(T, L, r).masked_fill_(m3, 0.0)
            y.addmm_(h.view(T, L * r), B)

        def transposed():
            ht = torch.mm(A, x.t()).view(L, r, T).masked_fill_(not_own_t, 0.0)
            y.addmm_(ht.view(L * r, T).t(), B)

        def nomask():
            h = torch.mm(x, A.t())
            y.addmm_(h, B)

        def one_slot():
            h = torch.mm(x, A1.t())
            y.addmm_(h, B1)

        def shrink_only():
            torch.mm(x, A.t())

        row = {
            n: round(graph_time(f), 2)
            for n, f in dict(
                cur=cur,
                transposed=transposed,
                nomask=nomask,
                one_slot=one_slot,
                shrink_only=shrink_only,
            ).items()
        }
        res[f"r{r}_T{T}"] = row
        print(r, T, row, flush=True)
        if T in (1, 16, 64):
            for name, f in (("cur", cur), ("transposed", transposed)):
                with profile(activities=[ProfilerActivity.CUDA]) as p:
                    for _ in range(20):
                        f()
                    torch.cuda.synchronize()
                ks = [
                    (e.key[:90], round(e.device_time_total / max(e.count, 1), 2), e.count)
                    for e in p.key_averages()
                ]
                res[f"r{r}_T{T}_{name}_kernels"] = ks
                print("  ", name, ks, flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(f"{out}/micro.json", "w"), indent=1)
