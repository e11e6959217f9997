"""The Triton kernels at real shapes in bf16 on the GPU, against their torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mxc.kernels import cuda_ops, torch_ref, triton_attention, triton_elementwise, triton_gemv, triton_norm
from mxc.kernels.context import ForwardContext

BF16 = torch.bfloat16


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


@pytest.mark.parametrize("m", [1, 3, 8, 17, 32])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
def test_gemv_llama8b_shapes(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
    ref = F.linear(x.float(), w.float())
    assert _rel(triton_gemv.linear_small_m(x, w), ref) < 1e-2


@pytest.mark.parametrize("m", [1, 8])
def test_gemv_residual(m):
    k, n = 14336, 4096  # the down projection
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
    r = torch.randn(m, n, device="cuda", dtype=BF16)
    ref = torch_ref.linear(x.float(), w.float(), None, r.float())
    assert _rel(triton_gemv.linear_small_m(x, w, None, r), ref) < 2e-2


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (128256, 4096)])  # qkv, gate_up, LM head
def test_rms_norm_linear_llama8b_shapes(m, n, k):
    """rms_norm_linear's GPU kernels (a bf16 LM head under fp8): RMSNorm + GEMV, RMSNorm + cuBLAS."""
    x = torch.randn(m, k, device="cuda", dtype=BF16) * 3
    g = (1 + 0.1 * torch.randn(k, device="cuda")).to(BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
    ref = torch_ref.rms_norm_linear(x.float(), g.float(), w.float(), None, 1e-5)
    fn = cuda_ops.rms_norm_linear_small_m if m <= 32 else cuda_ops.rms_norm_linear
    assert _rel(fn(x, g, w, None, eps=1e-5), ref) < 1e-2


@pytest.mark.parametrize("t", [1, 7, 256])
def test_norms(t):
    x = torch.randn(t, 4096, device="cuda", dtype=BF16)
    r = torch.randn(t, 4096, device="cuda", dtype=BF16)
    w = torch.randn(4096, device="cuda", dtype=BF16)
    assert _rel(triton_norm.rms_norm(x, w, 1e-5), torch_ref.rms_norm(x, w, 1e-5)) < 2e-2
    s, h = triton_norm.add_rms_norm(x, r, w, 1e-5)
    s_ref, h_ref = torch_ref.add_rms_norm(x, r, w, 1e-5)
    assert _rel(s, s_ref) < 1e-2 and _rel(h, h_ref) < 2e-2


def test_silu_mul_embedding():
    x = torch.randn(9, 2 * 14336, device="cuda", dtype=BF16)
    assert _rel(triton_elementwise.silu_mul(x), torch_ref.silu_mul(x)) < 1e-2
    table = torch.randn(128256, 4096, device="cuda", dtype=BF16)
    ids = torch.randint(0, 128256, (33,), device="cuda")
    assert torch.equal(triton_elementwise.embedding(ids, table), table[ids])


@pytest.mark.parametrize("lens", [[1, 300, 2048], [4096]])
def test_attention_llama8b_heads(lens):
    hq, hkv, d, L = 32, 8, 128, 4096
    b = len(lens)
    k_cache = torch.randn(b + 1, L, hkv, d, device="cuda", dtype=BF16)
    v_cache = torch.randn(b + 1, L, hkv, d, device="cuda", dtype=BF16)
    slots = list(range(1, b + 1))
    # decode: one new token per sequence
    q = torch.randn(b, hq, d, device="cuda", dtype=BF16)
    ctx = ForwardContext([1] * b, [n - 1 for n in lens], slots, [k_cache], [v_cache])
    ref = torch_ref.cached_attention(q, ctx, scale=d ** -0.5, layer=0)
    out = triton_attention.decode_attention(q, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32, device="cuda"),
                                            torch.tensor(lens, dtype=torch.int32, device="cuda"), d ** -0.5, None)
    assert _rel(out, ref) < 2e-2
    # prefill of the last 64 tokens of each sequence (chunked: the rest is cached)
    n = [min(64, x) for x in lens]
    qp = torch.randn(sum(n), hq, d, device="cuda", dtype=BF16)
    ctx = ForwardContext(n, [x - m for x, m in zip(lens, n)], slots, [k_cache], [v_cache])
    ref = torch_ref.cached_attention(qp, ctx, scale=d ** -0.5, layer=0)
    starts = torch.tensor([0] + list(torch.tensor(n).cumsum(0)), dtype=torch.int32, device="cuda")
    out = triton_attention.prefill_attention(qp, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32, device="cuda"),
                                             torch.tensor(lens, dtype=torch.int32, device="cuda"), starts, max(n),
                                             d ** -0.5, None)
    assert _rel(out, ref) < 2e-2




@pytest.mark.parametrize("case", [([2048], [0], [0], 2049), ([3, 1, 4], [0, 6, 2], [2, 0, 1], 16),
                                  ([1, 1, 1], [7, 0, 3], [1, 2, 0], 9)])
def test_context_build_on_cuda_equals_the_cpu_build(case):
    """One pinned, asynchronous copy for every device tensor: the same values as on the CPU, each tensor at a
    16-byte boundary (the kernels' vector loads), and still right after the host buffer is reused."""
    seq_lens, past_lens, slots, max_len = case
    cache = [torch.zeros(len(slots), max_len, 1, 2)]
    names = ("cache_loc", "positions", "last_rows", "kv_lens", "slots_t", "q_start")
    want = ForwardContext.build(seq_lens, past_lens, slots, cache, cache, torch.device("cpu"))
    ctxs = [ForwardContext.build(seq_lens, past_lens, slots, cache, cache, torch.device("cuda")) for _ in range(3)]
    torch.cuda.synchronize()
    for ctx in ctxs:
        for name in names:
            got = getattr(ctx, name)
            assert got.device.type == "cuda" and got.data_ptr() % 16 == 0, name
            assert torch.equal(got.cpu(), getattr(want, name)), name
