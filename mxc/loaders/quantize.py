"""Weight quantization to fp8 e4m3 at conversion time (one tensor at a time).

``quantize_fp8(w, granularity, segments)`` returns the fp8 values and the
float32 scales with ``w ~= q * scale``: ``channel`` one scale per output row,
``tensor`` one per merged part (q, k and v keep their own) stored repeated
per row, ``block128`` one per 128x128 tile of the (merged) weight. Where a
part's rows are not whole 128-row blocks (k and v of 96 rows), a tile spans two
parts, which then share its scale; an fp8 checkpoint's per-part blocks cannot be
merged that way, so the loader refuses those merges (``convert``). Scales are amax / 448,
so the largest value of each group lands on e4m3's largest finite value. The
runtime side (dequantization, activation quantization) is ``kernels/fp8_ref.py``.

The float32 arithmetic runs ``CHUNK_BYTES`` of rows at a time (whole 128-row blocks for ``block128``) into
outputs allocated once: over the whole tensor, its float32 copy and temporaries held about seven times a bf16
weight (1.7 GB of a 4096x14336 Llama build's 235 MB gate/up weight), for the same values. The chunks are small
(4 MiB): each of their five or six elementwise passes then reads the last one's result from the CPU's cache, and
their temporaries are reused from the heap, where 64 MiB ones were each freshly mapped (page faults) and went
through memory six times: quantizing a 2048x16384 bf16 weight took 0.19 s with 64 MiB chunks, 0.04 s with 4 MiB.
"""

from __future__ import annotations

import torch

from mxc.loaders.buffers import empty

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_TINY = 1e-12


CHUNK_BYTES = 4 << 20  # float32 bytes of the rows quantized at a time (block128: at least 128 rows)


def _q(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def _row_chunks(n: int, k: int, multiple: int = 1):
    """(start, stop) of consecutive row ranges of about ``CHUNK_BYTES`` in float32, each a multiple of ``multiple``
    rows but the last."""
    rows = max(multiple, CHUNK_BYTES // (4 * max(k, 1)) // multiple * multiple)
    return [(r, min(r + rows, n)) for r in range(0, n, rows)]


def quantize_fp8(w: torch.Tensor, granularity: str, segments: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    if granularity not in ("channel", "tensor", "block128"):
        raise ValueError(f"unknown fp8 granularity {granularity!r}")
    if w.dim() == 3:  # an expert stack: each expert on its own -> ([E, N, K], [E, ...] scales)
        q = empty(w.shape, FP8) if w.device.type == "cpu" else torch.empty(w.shape, dtype=FP8, device=w.device)
        scales = []
        for e in range(w.shape[0]):
            q[e], s = quantize_fp8(w[e], granularity, segments)
            scales.append(s)
        return q, torch.stack(scales)
    n, k = w.shape
    q = empty((n, k), FP8) if w.device.type == "cpu" else torch.empty((n, k), dtype=FP8, device=w.device)
    if granularity == "channel":
        scale = torch.empty(n, dtype=torch.float32, device=w.device)
        for lo, hi in _row_chunks(n, k):
            rows = w[lo:hi].float()
            scale[lo:hi] = (rows.abs().amax(dim=1) / FP8_MAX).clamp(min=_TINY)
            q[lo:hi] = _q(rows, scale[lo:hi, None])
        return q, scale
    if granularity == "tensor":
        parts, lo = [], 0
        for size in segments or (n,):  # each part's amax over its rows, a chunk at a time
            amax = torch.zeros((), dtype=torch.float32, device=w.device)
            for a, b in _row_chunks(size, k):
                amax = torch.maximum(amax, w[lo + a:lo + b].float().abs().amax())
            parts.append(((amax / FP8_MAX).clamp(min=_TINY)).expand(size))
            lo += size
        scale = torch.cat(parts).contiguous()
        for lo, hi in _row_chunks(n, k):
            q[lo:hi] = _q(w[lo:hi].float(), scale[lo:hi, None])
        return q, scale
    kb = -(-k // 128)
    blocks = []
    for lo, hi in _row_chunks(n, kb * 128, multiple=128):
        nb = -(-(hi - lo) // 128)
        padded = torch.zeros(nb * 128, kb * 128, device=w.device)
        padded[:hi - lo, :k] = w[lo:hi]
        tiles = padded.view(nb, 128, kb, 128)
        scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_TINY)
        q[lo:hi] = _q(tiles, scale[:, None, :, None]).view(nb * 128, kb * 128)[:hi - lo, :k]
        blocks.append(scale)
    return q, torch.cat(blocks) if blocks else torch.empty(0, kb, device=w.device)
