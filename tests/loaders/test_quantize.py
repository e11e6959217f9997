"""fp8 weight quantization round trips against an independent torch reference, per granularity."""

from __future__ import annotations

import pytest
import torch

from mxc.kernels.fp8_ref import dequantize_weight, quantize_rows
from mxc.loaders.quantize import quantize_fp8

FP8 = torch.float8_e4m3fn


def _w(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 1, n)[:, None]


def test_channel_scales_are_row_amax_over_448():
    w = _w(40, 72)
    q, s = quantize_fp8(w, "channel")
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (40,)
    assert torch.equal(s, w.abs().amax(1) / 448)
    assert torch.equal(q, (w / s[:, None]).to(FP8))
    assert (q.float().abs().amax(1) == 448).all()  # every row's largest value hits e4m3's max


def test_tensor_scales_are_per_merged_part():
    w = _w(96, 64)
    q, s = quantize_fp8(w, "tensor", segments=(64, 16, 16))
    for part, (lo, hi) in zip(w.split([64, 16, 16]), [(0, 64), (64, 80), (80, 96)]):
        assert torch.equal(s[lo:hi], (part.abs().amax() / 448).expand(hi - lo))


def test_block128_scales_per_tile_with_ragged_edges():
    w = _w(200, 300)
    q, s = quantize_fp8(w, "block128")
    assert s.shape == (2, 3) and q.shape == (200, 300)
    for i in range(2):
        for j in range(3):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert s[i, j] == tile.abs().amax() / 448


@pytest.mark.parametrize("granularity", ["channel", "tensor", "block128"])
def test_round_trip_error_is_within_e4m3_precision(granularity):
    w = _w(160, 200, seed=3)
    q, s = quantize_fp8(w, granularity, segments=(160,))
    back = dequantize_weight(q, s, granularity)
    scale_full = dequantize_weight(torch.ones_like(q, dtype=torch.float32).to(FP8), s, granularity)
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4; subnormals below 2^-6 * scale
    err = (back - w).abs()
    assert (err <= w.abs() * 2 ** -4 + scale_full * 2 ** -9).all()
    assert float((back - w).norm() / w.norm()) < 0.04


def test_activation_quantization_per_token():
    x = torch.randn(5, 33) * torch.tensor([1e-3, 1.0, 10.0, 100.0, 0.5])[:, None]
    xq, xs = quantize_rows(x)
    assert torch.equal(xs, x.abs().amax(1) / 448)
    assert float(((xq.float() * xs[:, None]) - x).norm() / x.norm()) < 0.04


@pytest.mark.parametrize("granularity", ["channel", "tensor", "block128"])
def test_tiny_weights_keep_their_amax_scales(granularity):
    """Weights near 1e-7 (a layer scaled down, padding rows) still get amax / 448 scales, not the clamp's."""
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) * 1e-7
    q, s = quantize_fp8(w, granularity)
    first = w[0] if granularity == "channel" else (w[:128, :128] if granularity == "block128" else w)
    assert s.flatten()[0] == first.abs().amax() / 448
    assert float((dequantize_weight(q, s, granularity) - w).norm() / w.norm()) < 0.04


@pytest.mark.parametrize("granularity", ["channel", "tensor", "block128"])
def test_all_zero_groups_quantize_to_zero_with_finite_scales(granularity):
    """A row, merged part or tile of zeros (pruned rows, padding) gets a positive finite scale and zero codes, not
    0/0 = NaN."""
    w = _w(256, 256)
    w[128:] = 0  # channel: zero rows; tensor: a zero part; block128: zero tiles
    q, s = quantize_fp8(w, granularity, segments=(128, 128))
    assert torch.isfinite(s).all() and (s > 0).all()
    assert not q.float().isnan().any() and (q[128:].float() == 0).all()
    assert torch.equal(dequantize_weight(q, s, granularity)[128:], w[128:])


@pytest.mark.parametrize("granularity", ["channel", "tensor", "block128"])
def test_bf16_weights_get_float32_scales_as_computed_in_float32(granularity):
    """Checkpoints are mostly bf16: their amax and scales are computed in float32, as for the same values given in
    float32 (a bf16 scale would round the scale itself)."""
    w = _w(200, 300).bfloat16()
    q, s = quantize_fp8(w, granularity)
    q32, s32 = quantize_fp8(w.float(), granularity)
    assert s.dtype == torch.float32 and torch.equal(s, s32) and torch.equal(q.view(torch.uint8), q32.view(torch.uint8))


def test_block128_scales_of_whole_blocks_and_small_ragged_tiles():
    """Whole 128-blocks get exactly one scale each; a ragged tile's scale is its own values' amax / 448, the padding
    of the grid counting for nothing (values far below 1 show it)."""
    w = _w(256, 128) * 1e-3
    q, s = quantize_fp8(w, "block128")
    assert s.shape == (2, 1)
    small = _w(130, 140) * 1e-3
    q, s = quantize_fp8(small, "block128")
    assert s.shape == (2, 2) and s[1, 1] == small[128:, 128:].abs().amax() / 448
    assert s[0, 1] == small[:128, 128:].abs().amax() / 448


def test_expert_stacks_are_quantized_expert_by_expert():
    """A [E, N, K] stack: every expert its own scales, as if quantized alone."""
    w = torch.stack([_w(64, 32, seed=e) * (e + 1) for e in range(3)])
    for granularity in ("channel", "tensor", "block128"):
        q, s = quantize_fp8(w, granularity)
        for e in range(3):
            qe, se = quantize_fp8(w[e], granularity)
            assert torch.equal(s[e], se) and torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)), granularity


def test_unknown_granularity_is_an_error():
    with pytest.raises(ValueError, match="unknown fp8 granularity 'row'"):
        quantize_fp8(_w(4, 4), "row")


@pytest.mark.parametrize("granularity", ["channel", "tensor", "block128"])
def test_quantizing_holds_float32_a_chunk_of_rows_at_a_time(granularity, monkeypatch):
    """The float32 arithmetic runs a chunk of rows at a time: over a whole 4096x14336 Llama build's gate/up weight
    (235 MB in bf16) its copies and temporaries held 1.7 GB (1.2 GB more than the chunked build), for the same
    values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import mxc.loaders.quantize as quantize

    class LargestFloat32(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    LargestFloat32.largest = max(LargestFloat32.largest, t.untyped_storage().nbytes())
            return out

    w = _w(1000, 300).to(torch.bfloat16)
    whole = quantize_fp8(w, granularity, segments=(600, 400))
    monkeypatch.setattr(quantize, "CHUNK_BYTES", 128 * 300 * 4, raising=False)  # 128 rows of float32
    with LargestFloat32():
        q, s = quantize_fp8(w, granularity, segments=(600, 400))
    assert LargestFloat32.largest <= 128 * 384 * 4  # a chunk (block128: padded to whole blocks), not 1000 rows
    assert torch.equal(q.view(torch.uint8), whole[0].view(torch.uint8)) and torch.equal(s, whole[1])


@pytest.mark.parametrize("granularity", ["channel", "tensor", "block128"])
def test_the_default_chunks_give_the_values_of_one_chunk(granularity, monkeypatch):
    """The default chunk (a few MiB of float32 rows, for the cache) splits a real weight into many chunks, ragged last
    one and a merged part's boundary inside a chunk included: the bytes are those of quantizing it in one piece."""
    import mxc.loaders.quantize as quantize

    w = _w(3000, 640).to(torch.bfloat16)  # 7.3 MiB as float32: 3 chunks of 4 MiB
    segments = (1800, 600, 600)
    got = quantize_fp8(w, granularity, segments=segments)
    assert quantize.CHUNK_BYTES < 3000 * 640 * 4
    monkeypatch.setattr(quantize, "CHUNK_BYTES", 1 << 40)
    whole = quantize_fp8(w, granularity, segments=segments)
    assert torch.equal(got[0].view(torch.uint8), whole[0].view(torch.uint8)) and torch.equal(got[1], whole[1])
