"""Capturing a forward into a CUDA graph: the warm-up on a side stream, the capture into a shared
memory pool, and no Python garbage collection while a stream captures. Used by the decode step's
batch buckets and the short prefills' token buckets alike."""

from __future__ import annotations

import contextlib
import gc

import torch

from mxc.kernels import launch


def capture(run, launcher, pool, plain: bool = False) -> tuple[torch.cuda.CUDAGraph, object]:
    """``run()`` (a forward over static buffers) twice on a side stream, then captured: (graph, its output).
    ``plain``: capture with plain launches even from a PDL launcher."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), launch.using(launcher):
        for _ in range(2):  # warm up allocations (and the kernels' one-time setup) outside the graph
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    as_plain = getattr(launcher, "plain", None) if plain else None
    with _no_collection(), torch.cuda.graph(graph, pool=pool), launch.using(launcher), \
            (as_plain() if as_plain else contextlib.nullcontext()):
        out = run()
    return graph, out


@contextlib.contextmanager
def _no_collection():
    """No Python garbage collection during a capture: a collection there can free an unreachable
    model's CUDA graphs, and destroying a graph while a stream captures invalidates the capture
    (torch 2.11 no longer collects before capturing; seen on the H200 when a test's model was
    collected during the next test's capture). Collected once before instead."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
