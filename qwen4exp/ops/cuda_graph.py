"""CUDA-graph capture of one call, for the GPU tests and the kernel benchmark (``benchmarks/bench_ops.py``)."""

from __future__ import annotations

import torch


def capture(fn):
    """Run ``fn()`` once on a side stream (compilation, allocator warm-up: nothing of that may happen while
    capturing), then capture one call in a CUDA graph. -> (graph, the captured call's output); ``graph.replay()``
    reruns it on the same memory."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
