"""Large host buffers for the weight conversion, backed by transparent huge pages where the kernel offers them.

Every tensor a build reads, merges, casts or generates is a fresh allocation of up to a GB, which glibc maps anew
each time: the kernel then faults it in 4 KiB page by page, which cost as much as the copy that fills it (reading 2
GB of a checkpoint into fresh ``torch.empty`` buffers took 1.1 s, into buffers advised ``MADV_HUGEPAGE`` 0.5 s).
``empty`` maps such a buffer itself and asks for huge pages; its memory is returned when the last tensor viewing it
goes, as a ``torch.empty`` buffer's is. Below ``HUGE_BYTES``, or where the advice does not exist (not Linux), it is
``torch.empty``; where the kernel has THP turned off the advice fails and the map keeps 4 KiB pages.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_BYTES = 4 << 20


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, as ``torch.empty(shape, dtype=dtype)``."""
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape) * dtype.itemsize
    if size < HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    try:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no room for the map: the allocator says so in its own words
        return torch.empty(shape, dtype=dtype)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off or not built into this kernel: 4 KiB pages
        pass
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
