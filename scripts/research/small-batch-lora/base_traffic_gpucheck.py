"""GPU check of the slot masks under base traffic (no vLLM): what one batch without
LoRA costs in update_metadata, before and after the masks remember which rows a
LoRA batch wrote, and that a graph captured with LoRA, replayed for batches
without (cudagraph_specialize_lora off), leaves every row unchanged.

  python scripts/research/small-batch-lora/base_traffic_gpucheck.py OLD.diff [NEW.diff]

OLD.diff / NEW.diff: patches/matmul-add-lora-linear/torch-ops.diff of two
commits (NEW defaults to the working tree's). Writes $OUT/base-traffic.json.
"""

import json
import os
import sys
import time
import types

import torch
from graph_timer import module_from_diff

DEV, HIDDEN, WIDTHS, SLOTS, RANK, ROWS = "cuda", 5120, (5120, 1024), 4, 64, 8192


def setup(m):
    meta = types.SimpleNamespace(
        token_lora_mapping=torch.zeros(ROWS, dtype=torch.int32, device=DEV),
        active_lora_ids=torch.empty(SLOTS + 1, dtype=torch.int32, device=DEV),
        no_lora_flag_cpu=torch.tensor([False]),
    )
    masks = m.SlotMasks(meta)
    layer = types.SimpleNamespace(
        lora_a_stacked=tuple(torch.zeros(SLOTS, 1, RANK, HIDDEN, dtype=torch.bfloat16,
                                         device=DEV) for _ in WIDTHS),
        lora_b_stacked=tuple(torch.zeros(SLOTS, 1, w, RANK, dtype=torch.bfloat16, device=DEV)
                             for w in WIDTHS),
    )  # fmt: skip
    layer.set_lora = layer.reset_lora = lambda *args: None
    m.adopt_layer(layer, masks)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for a, b in zip(layer.lora_a_stacked, layer.lora_b_stacked, strict=True):
        a.copy_(torch.randn(a.shape, generator=gen, device=DEV) * HIDDEN**-0.5)
        b.copy_(torch.randn(b.shape, generator=gen, device=DEV) * RANK**-0.5)
    return meta, masks, layer


def lora_batch(meta, masks, tokens):
    meta.no_lora_flag_cpu.fill_(False)
    meta.token_lora_mapping[:tokens].copy_(torch.arange(tokens, device=DEV) % SLOTS)
    masks.update(tokens)


def base_batch_cost(m, tokens, repeats=200):
    """CUDA kernels and host µs of one update for a batch without LoRA, in a run of them."""
    meta, masks, _ = setup(m)
    lora_batch(meta, masks, 64)
    meta.no_lora_flag_cpu.fill_(True)
    masks.update(tokens)  # the first batch without LoRA clears what the LoRA batch wrote
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        masks.update(tokens)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    started = time.perf_counter()
    for _ in range(repeats):
        masks.update(tokens)
    host_us = (time.perf_counter() - started) / repeats * 1e6
    torch.cuda.synchronize()
    return {"kernels_per_batch": len(kernels), "host_us_per_batch": round(host_us, 2)}


def replay_for_base_batches(m):
    """A graph captured with LoRA at 64 tokens, replayed after batches without LoRA of
    10 and then 64 tokens (vLLM leaves the stale mapping): y unchanged, bit for bit."""
    meta, masks, layer = setup(m)
    lora_batch(meta, masks, 64)
    x = torch.randn(64, HIDDEN, device=DEV).to(torch.bfloat16)
    y = torch.randn(64, sum(WIDTHS), device=DEV).to(torch.bfloat16)
    flag = torch.tensor([False])  # the captured graph runs the kernels whatever the batch

    def call():
        m._linear(y, x, list(layer.lora_a_stacked), list(layer.lora_b_stacked),
                  masks.weights[torch.bfloat16], masks.reduce_weights[torch.bfloat16],
                  masks.no_lora, flag, 1.0, True)  # fmt: skip

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()  # warm-up, outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    before = y.clone()
    graph.replay()
    torch.cuda.synchronize()
    changed_with_lora = not torch.equal(y, before)
    results = {"lora_batch_changes_y": changed_with_lora}
    meta.no_lora_flag_cpu.fill_(True)
    for tokens in (10, 64):
        masks.update(tokens)
        before = y.clone()
        graph.replay()
        torch.cuda.synchronize()
        results[f"base_batch_{tokens}_y_unchanged"] = torch.equal(y, before)
    return results


def main() -> None:
    paths = {"old": sys.argv[1],
             "new": sys.argv[2] if len(sys.argv) > 2 else
             "patches/matmul-add-lora-linear/torch-ops.diff"}  # fmt: skip
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for label, path in paths.items():
        m = module_from_diff(path, f"patchkit_lora_matmul_{label}")
        out[label] = {"tokens_1": base_batch_cost(m, 1), "tokens_64": base_batch_cost(m, 64),
                      "replay": replay_for_base_batches(m)}  # fmt: skip
        print(label, json.dumps(out[label]), flush=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "base-traffic.json"), "w"),
              indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
