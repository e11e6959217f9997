"""Host-to-device staging (``context.to_device``, ``StaticInputs.fill``) with the host far ahead of the GPU: the
pinned buffers of torch's caching host allocator are kept until their copies have run."""

import numpy as np
import torch

from mxc.kernels.context import StaticInputs, to_device


def test_copies_queued_behind_the_gpu_arrive_intact():
    """24 copies, each of other values, enqueued while the GPU sleeps: a staging buffer reused before its copy ran
    would deliver later values."""
    n = 24
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of every copy below
    got = [to_device("cuda", np.full(1000 + i, i, dtype=np.int64), np.arange(i, dtype=np.int32)) for i in range(n)]
    inputs = StaticInputs("cuda", a=np.zeros(64, dtype=np.int64))
    filled = []
    for i in range(n):  # a CUDA graph's inputs refilled, read by the stream after each fill
        inputs.fill(a=np.full(64, i, dtype=np.int64))
        filled.append(inputs.tensors["a"].clone())
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(got):
        assert torch.equal(a.cpu(), torch.full((1000 + i,), i, dtype=torch.int64))
        assert torch.equal(b.cpu(), torch.arange(i, dtype=torch.int32))
    for i, t in enumerate(filled):
        assert torch.equal(t.cpu(), torch.full((64,), i, dtype=torch.int64))

