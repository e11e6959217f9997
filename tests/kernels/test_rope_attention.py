"""The decode kernel that starts from the merged projection (``decode_rope_attention``: per-head q/k
norm + RoPE + KV-cache write + split-KV attention in one split kernel) against the two kernels it
replaces (``rope_qkv_write`` then ``decode_attention``), under the interpreter: the same output and
the same cache rows, bit for bit, over GQA/MQA/MHA, head sizes 16-64, partial rotary dims, per-head
q/k norms, sliding windows, split counts (including splits past the context) and ragged contexts
(1 to 29 rows, the new token's row inside any split)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mxc.kernels import triton_attention as ta
from mxc.kernels import triton_rope

_BF16_OK = torch.cuda.is_available() or Path(__file__).with_name("conftest.py").exists()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
L = 29


def _case(HQ, HKV, D, R, norm, dtype, kv_lens, seed):
    g = torch.Generator().manual_seed(seed)
    B = len(kv_lens)
    randn = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    qkv = randn(B, (HQ + 2 * HKV) * D)
    slots = torch.tensor(list(range(B))[::-1], dtype=torch.int32)  # permuted slots
    kv = torch.tensor(kv_lens, dtype=torch.int32)
    positions = (kv - 1).to(torch.int64)
    cache_loc = slots.to(torch.int64) * L + positions
    k_cache, v_cache = randn(B + 1, L, HKV, D), randn(B + 1, L, HKV, D)
    spec = {"type": "default", "theta": 10000.0, "rotary_dim": R, "head_dim": D}
    cos, sin = triton_rope.rope_tables(spec, L, "cpu")
    norms = (randn(D) + 1, randn(D) + 1) if norm else (None, None)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return [dev(t) for t in (qkv, positions, cos, sin, *norms, k_cache, v_cache, cache_loc, slots, kv)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("HQ,HKV,D,R,norm,window,splits,kv_lens", [
    (4, 2, 16, 16, False, None, 1, [1, 13, 29]),
    (4, 1, 32, 16, True, None, 2, [29, 2]),
    (2, 2, 16, 8, True, 5, 4, [17, 1, 6]),
    (8, 2, 64, 64, False, None, 3, [20]),
    (4, 4, 32, 32, True, 3, 8, [29, 9]),  # more splits than some contexts have rows
], ids=["gqa", "mqa-norm-partial", "mha-window", "d64-3splits", "splits-past-context"])
def test_matches_rope_write_then_attention(HQ, HKV, D, R, norm, window, splits, kv_lens, dtype):
    qkv, pos, cos, sin, qn, kn, kc, vc, loc, slots, kv = _case(HQ, HKV, D, R, norm, dtype, kv_lens, seed=HQ + D + R)
    kc2, vc2 = kc.clone(), vc.clone()
    q = triton_rope.rope_qkv_write(qkv, pos, cos, sin, kc, vc, loc, qn, kn, 1e-6)
    want = ta.decode_attention(q, kc, vc, slots, kv, D ** -0.5, window, num_splits=splits)
    got = ta.decode_rope_attention(qkv, pos, cos, sin, qn, kn, 1e-6, kc2, vc2, loc, slots, kv, D ** -0.5, window,
                                   num_splits=splits)
    assert not want.isnan().any()
    assert torch.equal(got, want)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # the new rows written as rope_qkv_write writes them


def test_rejects_whole_projection_norms():
    qkv, pos, cos, sin, qn, kn, kc, vc, loc, slots, kv = _case(4, 2, 16, 16, True, torch.float32, [3], seed=0)
    wide = torch.ones(4 * 16, device=qkv.device)
    with pytest.raises(AssertionError, match="per-head norm"):
        ta.decode_rope_attention(qkv, pos, cos, sin, wide, wide[:32].contiguous(), 1e-6, kc, vc, loc, slots, kv, 0.25)
