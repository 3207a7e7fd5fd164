"""What the small-batch LoRA measurements share: the CUDA-graph replay timer, the
operands and the first shipped path, the error of a call, and the patched module."""

import importlib.util

import torch


def graph_us(fn, iters: int = 20) -> float:
    """Median µs per call of fn, `iters` calls captured in one CUDA graph, 15 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    times.sort()
    return round(times[len(times) // 2], 2)


def lora_operands(tokens: int, rank: int, hidden: int = 5120, out: int = 5120, slots: int = 4):
    """x, A (slots * rank, hidden), B (slots * rank, out), y: random bf16 on the GPU."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(slots * rank, hidden, device="cuda", dtype=torch.bfloat16) / 70
    b = torch.randn(slots * rank, out, device="cuda", dtype=torch.bfloat16) / 10
    y = torch.zeros(tokens, out, device="cuda", dtype=torch.bfloat16)
    return x, a, b, y


def shipped_path(x, a, b, y, not_own):
    """The first torch path of one slice (mm, masked_fill_, addmm_) and its float64 result.

    not_own: (tokens, slots) bool, True where the token does not use the slot.
    """
    tokens, slots = not_own.shape
    rank = a.size(0) // slots
    masked = not_own.view(tokens, slots, 1)

    def call():
        h = torch.mm(x, a.t()).view(tokens, slots, rank).masked_fill_(masked, 0.0)
        y.addmm_(h.view(tokens, slots * rank), b)

    shrunk = torch.mm(x.double(), a.double().t()).view(tokens, slots, rank)
    reference = shrunk.masked_fill(masked, 0).view(tokens, -1) @ b.double()
    return call, reference


def relative_error(call, y, reference) -> float:
    """||y - reference|| / ||reference|| after one call into a zeroed y."""
    y.zero_()
    call()
    torch.cuda.synchronize()
    return float((y.double() - reference).norm() / reference.norm())


def module_from_diff(path: str, name: str):
    """The torch path's module, imported on its own from the new-file section of a
    torch-ops.diff (patches/matmul-add-lora-linear/, or one of an older commit)."""
    lines = open(path).read().split("\n")
    start = lines.index("--- /dev/null")
    source = "\n".join(line[1:] for line in lines[start + 3 :] if line.startswith("+")) + "\n"
    file = f"/tmp/{name}.py"
    open(file, "w").write(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
