"""Weight quantization to fp8 e4m3 at conversion time (one tensor at a time).

``quantize_fp8(w, granularity, segments)`` returns the fp8 values and the
float32 scales with ``w ~= q * scale``: ``channel`` one scale per output row,
``tensor`` one per merged part (q, k and v keep their own) stored repeated
per row, ``block128`` one per 128x128 tile. Scales are amax / 448 so the
largest value of each group lands on e4m3's largest finite value. The runtime
side (dequantization, activation quantization) is ``kernels/fp8_ref.py``.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_TINY = 1e-12


def _q(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_fp8(w: torch.Tensor, granularity: str, segments: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    if w.dim() == 3:  # an expert stack: each expert on its own -> ([E, N, K], [E, ...] scales)
        pairs = [quantize_fp8(e, granularity, segments) for e in w]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    w = w.float()
    if granularity == "channel":
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_TINY)
        return _q(w, scale[:, None]), scale
    if granularity == "tensor":
        parts = []
        for part in w.split(list(segments or (w.shape[0],)), dim=0):
            parts.append(((part.abs().amax() / FP8_MAX).clamp(min=_TINY)).expand(part.shape[0]))
        scale = torch.cat(parts).contiguous()
        return _q(w, scale[:, None]), scale
    if granularity == "block128":
        n, k = w.shape
        nb, kb = -(-n // 128), -(-k // 128)
        padded = torch.zeros(nb * 128, kb * 128, device=w.device)
        padded[:n, :k] = w
        tiles = padded.view(nb, 128, kb, 128)
        scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_TINY)
        q = _q(tiles, scale[:, None, :, None]).view(nb * 128, kb * 128)[:n, :k].contiguous()
        return q, scale
    raise ValueError(f"unknown fp8 granularity {granularity!r}")
