"""GPU check of the branch's torch path on its own (no vLLM): results vs float64,
bad-adapter containment, CUDA-graph replay timings of split vs single-GEMM shrink."""

import json
import os
import types

import torch
from graph_timer import graph_us, module_from_diff

m = module_from_diff("patches/matmul-add-lora-linear/torch-ops.diff", "patchkit_lora_matmul")
dev, H, OUT, L = "cuda", 5120, 5120, 4
out = {}


for r in (64, 128):
    for T in (1, 4, 16, 64, 65, 256, 257, 1024):
        meta = types.SimpleNamespace(
            token_lora_mapping=torch.empty(1024, dtype=torch.int32, device=dev),
            active_lora_ids=torch.empty(L + 1, dtype=torch.int32, device=dev),
            no_lora_flag_cpu=torch.tensor([False]),
        )
        masks = m.SlotMasks(meta)
        layer = types.SimpleNamespace(
            lora_a_stacked=(torch.zeros(L, 1, r, H, dtype=torch.bfloat16, device=dev),),
            lora_b_stacked=(torch.zeros(L, 1, OUT, r, dtype=torch.bfloat16, device=dev),),
        )
        layer.set_lora = lambda i, a, b: (
            layer.lora_a_stacked[0][i, 0].copy_(a),
            layer.lora_b_stacked[0][i, 0].copy_(b),
        )
        layer.reset_lora = lambda i: (
            layer.lora_a_stacked[0][i].zero_(),
            layer.lora_b_stacked[0][i].zero_(),
        )
        m.adopt_layer(layer, masks)
        gen = torch.Generator(device=dev).manual_seed(T + r)
        ws = {}
        for slot in range(L):
            a = (torch.randn(r, H, generator=gen, device=dev) * H**-0.5).to(torch.bfloat16)
            b = (torch.randn(OUT, r, generator=gen, device=dev) * r**-0.5).to(torch.bfloat16)
            if slot == 2:
                b[5, 3] = float("inf")
            layer.set_lora(slot, a, b)
            ws[slot] = (a, b)
        slots = (torch.arange(T, device=dev) % (L + 1) - 1).to(torch.int32)
        if T == 1:
            slots[0] = 0
        meta.token_lora_mapping[:T].copy_(slots)
        masks.update(T)
        x = torch.randn(T, H, generator=gen, device=dev).to(torch.bfloat16)
        y0 = torch.randn(T, OUT, generator=gen, device=dev).to(torch.bfloat16)
        w, rw = masks.weights[torch.bfloat16], masks.reduce_weights[torch.bfloat16]

        def call(y, rwt=rw):
            m._linear(
                y,
                x,
                list(layer.lora_a_stacked),
                list(layer.lora_b_stacked),
                w,
                rwt,
                masks.no_lora,
                meta.no_lora_flag_cpu,
                1.0,
                True,
            )

        y = y0.clone()
        call(y)
        torch.cuda.synchronize()
        ref = y0.double().clone()
        for t in range(T):
            s = int(slots[t])
            if s >= 0 and s != 2:
                a, b = ws[s]
                ref[t] += (x[t].double() @ a.double().T) @ b.double().T
        sl = slots.cpu()
        good = (sl >= 0) & (sl != 2)
        none = sl < 0
        bad = sl == 2
        err = (
            float(
                (y[good].double() - ref[good]).norm()
                / max((ref[good] - y0[good].double()).norm(), 1e-30)
            )
            if good.any()
            else 0.0
        )
        row = {
            "split": m._splits(x, list(layer.lora_a_stacked), rw),
            "rel_err_of_delta": round(err, 5),
            "none_rows_bit_identical": bool(torch.equal(y[none], y0[none])),
            "bad_rows_nan": bool((~torch.isfinite(y[bad])).all(dim=1).all()) if bad.any() else None,
            "good_rows_finite": bool(torch.isfinite(y[good]).all()),
        }
        yy = y0.clone()
        row["us_path"] = graph_us(lambda: call(yy))
        rw32 = torch.zeros(rw.shape, dtype=torch.float32, device=dev)  # dtype mismatch: single GEMM
        row["us_single_gemm"] = graph_us(lambda: call(yy, rw32))
        out[f"r{r}_T{T}"] = row
        print(r, T, row, flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/gpucheck.json", "w"), indent=1)
