"""Torch-only: where the 1-slice add_lora_linear time goes at small token counts (no vLLM)."""

import json, os, sys
import torch
from torch.profiler import profile, ProfilerActivity

dev = "cuda"
H, OUT, L = 5120, 5120, 4
res = {}


def graph_time(fn, iters=200):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(15):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / 20)
    ts.sort()
    return ts[len(ts) // 2]


for r in (64, 128):
    for T in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        A = torch.randn(L * r, H, device=dev, dtype=torch.bfloat16) / 70
        A1 = A[:r].clone()
        B = torch.randn(L * r, OUT, device=dev, dtype=torch.bfloat16) / 10
        B1 = B[:r].clone()
        y = torch.zeros(T, OUT, device=dev, dtype=torch.bfloat16)
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
