"""GPU check of the torch path's GEMV route on its own (no vLLM needed).

The module is the catalogue's created file, imported as it is. Per LoRA module
of one decode step of the benchmark models (dense 27B and 35B-A3B widths, as
scripts/profile_lora_decode.py), per adapter set and token count: the GEMV
route and the GEMM route (the same module with GEMV_MAX_TOKENS = 0), each
against a float64 reference, timed as CUDA-graph replays (graph_timer). Then
the guarantees on the GPU: rows without LoRA bit-identical (adding and
writing), a quarantined adapter's rows NaN and the others as without it, a
captured graph following the slot weights of the batch it is replayed for, and
no wgmma in the PTX of any compiled GEMV kernel.

    python3 scripts/research/small-batch-lora/gemv_route_gpucheck.py  # from the repo root

Writes $OUT/gemv_route.json (or /tmp) and prints a table last.
"""

import importlib.util
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timer import graph_us  # noqa: E402

SOURCE = "patches/matmul-add-lora-linear/files/vllm/lora/punica_wrapper/patchkit_lora_matmul.py"
DENSE27B = [("qkv_proj", 5120, (12288, 1024, 1024), 2), ("o_proj", 6144, (5120,), 2),
            ("in_proj_qkv", 5120, (2048, 2048, 6144), 6), ("in_proj_z", 5120, (6144,), 6),
            ("out_proj", 6144, (5120,), 6), ("gate_up_proj", 5120, (17408, 17408), 8),
            ("down_proj", 17408, (5120,), 8)]  # fmt: skip
MOE35B = [
    ("qkv_proj", 2048, (8192, 512, 512), 2),
    ("o_proj", 4096, (2048,), 2),
    ("in_proj_qkv", 2048, (2048, 2048, 4096), 6),
    ("in_proj_z", 2048, (4096,), 6),
    ("out_proj", 4096, (2048,), 6),
    ("shared_expert.gate_up_proj", 2048, (512, 512), 8),
    ("shared_expert.down_proj", 512, (2048,), 8),
]  # (name, in, slices, per step)
ADAPTER_SETS = ((2, 128), (8, 16), (16, 64))
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "1,2,4,8,12,16,24,32").split(","))
DEV = "cuda"


def load():
    spec = importlib.util.spec_from_file_location("patchkit_lora_matmul", SOURCE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["patchkit_lora_matmul"] = module
    spec.loader.exec_module(module)
    return module


m = load()


def layer_with(hidden, widths, slots, rank, gen):
    """A layer laid out by the path (adopt_layer), every slot loaded with random weights."""
    meta = types.SimpleNamespace(
        token_lora_mapping=torch.full((256,), -1, dtype=torch.int32, device=DEV),
        active_lora_ids=torch.empty(slots + 1, dtype=torch.int32, device=DEV),
        no_lora_flag_cpu=torch.tensor([False]),
    )
    masks = m.SlotMasks(meta)
    layer = types.SimpleNamespace(
        lora_a_stacked=tuple(torch.zeros(slots, 1, rank, hidden, dtype=torch.bfloat16,
                                         device=DEV) for _ in widths),
        lora_b_stacked=tuple(torch.zeros(slots, 1, w, rank, dtype=torch.bfloat16, device=DEV)
                             for w in widths),
    )  # fmt: skip

    def set_lora(i, a, b):
        for s in range(len(widths)):
            layer.lora_a_stacked[s][i, 0].copy_(a[s])
            layer.lora_b_stacked[s][i, 0].copy_(b[s])

    layer.set_lora, layer.reset_lora = set_lora, lambda i: None
    m.adopt_layer(layer, masks)
    weights = {}
    for slot in range(slots):
        a = [(torch.randn(rank, hidden, generator=gen, device=DEV) * hidden**-0.5).bfloat16()
             for _ in widths]  # fmt: skip
        b = [(torch.randn(w, rank, generator=gen, device=DEV) * rank**-0.5).bfloat16()
             for w in widths]  # fmt: skip
        layer.set_lora(slot, a, b)
        weights[slot] = (a, b)
    return meta, masks, layer, weights


def map_batch(meta, masks, slots_of_rows):
    tokens = len(slots_of_rows)
    meta.token_lora_mapping[:tokens].copy_(torch.tensor(slots_of_rows, dtype=torch.int32))
    meta.no_lora_flag_cpu[0] = all(s < 0 for s in slots_of_rows)
    masks.update(tokens)


def reference(y0, x, slots_of_rows, weights, widths, add_inputs=True, bad=()):
    ref = y0.double().clone()
    for t, slot in enumerate(slots_of_rows):
        if slot < 0 or slot in bad:
            continue
        a, b = weights[slot]
        offset = 0
        row = torch.zeros(sum(widths), dtype=torch.float64, device=DEV)
        for s, w in enumerate(widths):
            row[offset : offset + w] = (x[t].double() @ a[s].double().T) @ b[s].double().T
            offset += w
        ref[t] = (ref[t] if add_inputs else 0) + row
    return ref


def linear(layer, masks, meta, y, x, scale=1.0, add_inputs=True):
    dtype = torch.bfloat16
    m._linear(y, x, list(layer.lora_a_stacked), list(layer.lora_b_stacked),
              masks.weights[dtype], masks.reduce_weights[dtype], masks.no_lora,
              meta.no_lora_flag_cpu, scale, add_inputs)  # fmt: skip


def rel(y, ref, y0):
    delta = ref - y0.double()
    return float((y.double() - ref).norm() / max(delta.norm(), 1e-30))


def time_one(model, name, hidden, widths, per_step, slots, rank) -> list[dict]:
    gen = torch.Generator(device=DEV).manual_seed(hidden + slots + rank)
    meta, masks, layer, weights = layer_with(hidden, widths, slots, rank, gen)
    rows = []
    for tokens in TOKENS:
        slots_of_rows = [t % slots for t in range(tokens)]
        map_batch(meta, masks, slots_of_rows)
        x = torch.randn(tokens, hidden, generator=gen, device=DEV).bfloat16()
        y0 = torch.randn(tokens, sum(widths), generator=gen, device=DEV).bfloat16()
        ref = reference(y0, x, slots_of_rows, weights, widths)
        row = {"model": model, "module": name, "slots": slots, "rank": rank,
               "tokens": tokens, "per_step": per_step}  # fmt: skip
        for route, bound in (("gemv", 64), ("gemm", 0)):
            m.GEMV_MAX_TOKENS = bound
            y = y0.clone()
            linear(layer, masks, meta, y, x)
            torch.cuda.synchronize()
            row[f"err_{route}"] = rel(y, ref, y0)
            y.copy_(y0)

            def call(y=y, x=x):
                linear(layer, masks, meta, y, x)

            row[f"us_{route}"] = graph_us(call)
        m.GEMV_MAX_TOKENS = 16
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def timing_rows():
    rows = []
    for model, modules in (("dense27b", DENSE27B), ("moe35b", MOE35B)):
        for name, hidden, widths, per_step in modules:
            for slots, rank in ADAPTER_SETS:
                rows += time_one(model, name, hidden, widths, per_step, slots, rank)
                torch.cuda.empty_cache()
    return rows


def guarantees():
    """Rows without LoRA, a quarantined adapter, dual-stream writes, graph replay."""
    found = {}
    hidden, widths, slots, rank = 2100, (300, 136, 4100), 8, 64
    gen = torch.Generator(device=DEV).manual_seed(7)
    meta, masks, layer, weights = layer_with(hidden, widths, slots, rank, gen)
    bad_a = [w.clone() for w in weights[5][0]]
    bad_a[1][3, 7] = float("nan")
    layer.set_lora(5, bad_a, weights[5][1])
    found["slot_5_marked_bad"] = bool(torch.isnan(masks.health[5]))
    rows = [-1, 5, 2, -1, 0, 5, 7, 3, -1, 2, 1, 6, 4, -1, 5, 0]
    map_batch(meta, masks, rows)
    x = torch.randn(len(rows), hidden, generator=gen, device=DEV).bfloat16()
    y0 = torch.randn(len(rows), sum(widths), generator=gen, device=DEV).bfloat16()
    none = [t for t, s in enumerate(rows) if s < 0]
    good = [t for t, s in enumerate(rows) if s >= 0 and s != 5]
    bad = [t for t, s in enumerate(rows) if s == 5]
    for add_inputs in (True, False):
        ref = reference(y0, x, rows, weights, widths, add_inputs, bad=(5,))
        for route, bound in (("gemv", 16), ("gemm", 0)):
            m.GEMV_MAX_TOKENS = bound
            y = y0.clone()
            linear(layer, masks, meta, y, x, 0.5 if add_inputs else 1.0, add_inputs)
            if add_inputs:
                ref_scaled = y0.double() + (ref - y0.double()) * 0.5
            else:
                ref_scaled = ref
            key = f"{route}_add{int(add_inputs)}"
            found[f"{key}_none_rows_bit_identical"] = bool(torch.equal(y[none], y0[none]))
            found[f"{key}_bad_rows_all_nan"] = bool(torch.isnan(y[bad]).all())
            base = y0[good] if add_inputs else torch.zeros_like(y0[good])
            found[f"{key}_good_rows_rel_err"] = rel(y[good], ref_scaled[good], base)
            found[f"{key}_good_rows_finite"] = bool(torch.isfinite(y[good]).all())
    m.GEMV_MAX_TOKENS = 16
    # a graph captured for one batch, replayed after the slot weights changed
    y = y0.clone()
    graph_y = y0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear(layer, masks, meta, graph_y, x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear(layer, masks, meta, graph_y, x)
    later = [2, -1, -1, 0, 7, -1, 3, 3, 1, -1, 6, 6, -1, 4, 2, -1]
    map_batch(meta, masks, later)
    graph_y.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(y0, x, later, weights, widths)
    lora = [t for t, s in enumerate(later) if s >= 0]
    off = [t for t, s in enumerate(later) if s < 0]
    found["replay_follows_new_batch_rel_err"] = rel(graph_y[lora], ref[lora], y0[lora])
    found["replay_none_rows_bit_identical"] = bool(torch.equal(graph_y[off], y0[off]))
    meta.token_lora_mapping[:16].copy_(torch.tensor(rows, dtype=torch.int32))  # stale mapping
    meta.no_lora_flag_cpu[0] = True  # a batch without LoRA: masks cleared, mapping stale
    masks.update(16)
    graph_y.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    found["replay_no_lora_batch_bit_identical"] = bool(torch.equal(graph_y, y0))
    del y
    return found


def ptx_has_no_wgmma():
    found = {}
    for kernel in (m._gemv_shrink_kernel, m._gemv_expand_kernel):
        compiled = [k for cache in kernel.device_caches.values() for k in cache[0].values()]
        found[kernel.__name__] = {
            "compiles": len(compiled),
            "wgmma_in_ptx": sum("wgmma" in k.asm["ptx"] for k in compiled),
            "mma_in_ptx": sum("mma." in k.asm["ptx"] for k in compiled),
        }
    return found


def main():
    print(torch.cuda.get_device_name(), torch.__version__, m.triton.__version__, flush=True)
    result = {"guarantees": guarantees()}
    print(json.dumps(result["guarantees"], indent=1), flush=True)
    result["rows"] = timing_rows()
    result["ptx"] = ptx_has_no_wgmma()
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "gemv_route.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["ptx"], indent=1))
    print("\nper decode step (sum over modules, µs): gemv route / gemm route")
    steps = {}
    for r in result["rows"]:
        key = (r["model"], r["slots"], r["rank"], r["tokens"])
        s = steps.setdefault(key, [0.0, 0.0])
        s[0] += r["us_gemv"] * r["per_step"]
        s[1] += r["us_gemm"] * r["per_step"]
    for (model, slots, rank, tokens), (g, h) in sorted(steps.items()):
        print(f"{model} {slots}x{rank} T={tokens}: {g:.0f} / {h:.0f} = {g / h:.2f}")
    worst = max(result["rows"], key=lambda r: max(r["err_gemv"], r["err_gemm"]))
    print("max rel err gemv", max(r["err_gemv"] for r in result["rows"]),
          "gemm", max(r["err_gemm"] for r in result["rows"]), worst["module"])  # fmt: skip


if __name__ == "__main__":
    main()
