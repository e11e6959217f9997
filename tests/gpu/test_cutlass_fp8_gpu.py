"""The CUTLASS fp8 GEMM (mxc.kernels.cutlass_fp8) on the GPU against torch._scaled_mm.

Uses the libraries listed in $MXC_CUTLASS_SO (paths separated by ``os.pathsep``, built ahead of time with
``cutlass_fp8.compile_so``), else the prebuilt library $MXC_CUTLASS_LIBRARY names, else generates and compiles
the default configuration here (needs nvidia-cutlass and nvcc). Run with ``-s`` to see the error lines. Its speed
at M = 2048, plain and with the residual, against ``torch._scaled_mm``: ``bench/prefill_lab.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from mxc.kernels import cutlass_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FP8 = torch.float8_e4m3fn
SHAPES = [(6144, 4096), (4096, 14336)]  # (N, K): Llama-3-8B's fused QKV and down projections


_PREBUILT = [p for p in os.environ.get("MXC_CUTLASS_SO", "").split(os.pathsep) if p]


@pytest.fixture(scope="module", params=_PREBUILT or [None], ids=lambda p: os.path.basename(p) if p else "default")
def gemm(request, tmp_path_factory):
    path = request.param
    prebuilt = os.environ.get(cutlass_fp8.PREBUILT_ENV, "")
    if not path and os.path.isfile(prebuilt):  # the library a build would ship
        path = prebuilt
    if not path:
        why = cutlass_fp8.available()
        if why is not None:
            pytest.skip(f"no MXC_CUTLASS_SO and cannot build here: {why}")
        path = cutlass_fp8.compile_so(cutlass_fp8.generate(), tmp_path_factory.mktemp("cutlass") / "fp8.so")
    return cutlass_fp8.load(path)


def _quantized(rows, cols, gen):
    spread = 1 + torch.rand(rows, 1, device="cuda", generator=gen)  # rows of different magnitudes
    x = torch.randn(rows, cols, device="cuda", generator=gen) * spread
    scale = x.abs().amax(dim=1) / 448.0
    return (x / scale[:, None]).to(FP8), scale.float().contiguous()


def _run(gemm, xq, wq, sa, sb, out=None, ws=None):
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16) if out is None else out
    need = gemm.workspace_bytes(m, n, k)
    if ws is None or ws.numel() < need:
        ws = torch.empty(max(need, 1), device="cuda", dtype=torch.uint8)
    gemm(xq.data_ptr(), wq.data_ptr(), sa.data_ptr(), sb.data_ptr(), y.data_ptr(), m, n, k,
         stream=torch.cuda.current_stream().cuda_stream, workspace=ws.data_ptr(), workspace_bytes=need)
    return y


def _scaled_mm(xq, wq, sa, sb):
    return torch._scaled_mm(xq, wq.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 16, 64, 200, 256, 257, 2048, 1000])  # the small-M kernels serve M <= 256
def test_matches_scaled_mm(gemm, m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    xq, sa = _quantized(m, k, gen)
    wq, sb = _quantized(n, k, gen)
    y = _run(gemm, xq, wq, sa, sb)
    torch.cuda.synchronize()
    ref = _scaled_mm(xq, wq, sa, sb).float()
    exact = (xq.float() @ wq.float().t()) * sa[:, None] * sb[None, :]
    scale = float(exact.abs().max())
    err, err_ref = float((y.float() - exact).abs().max()) / scale, float((ref - exact).abs().max()) / scale
    print(f"\n{gemm.name} M={m} N={n} K={k}: max error / max |y|: CUTLASS {err:.2e}, _scaled_mm {err_ref:.2e}")
    # both round an fp32 result to bf16 (2^-8 relative); accumulation orders differ; FP8FastAccum
    # (no promotion of the tensor cores' accumulator) is allowed twice the error
    tol = 2e-2 if "fastaccum" in gemm.name else 1e-2
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(y.float(), exact, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (100, 4096, 4096), (1000, 4096, 14336), (2048, 4096, 4096)])
def test_residual_kernel(gemm, m, n, k):
    """The residual kernel: the plain kernel's output plus a bf16 residual added in fp32 and rounded, bit for
    bit (the unfused order), and far from the product alone."""
    if not gemm.has_residual:
        pytest.skip(f"{gemm.path} was built before the residual kernel")
    gen = torch.Generator(device="cuda").manual_seed(m + k)
    xq, sa = _quantized(m, k, gen)
    wq, sb = _quantized(n, k, gen)
    r = (torch.randn(m, n, device="cuda", generator=gen) * 50).to(torch.bfloat16)
    plain = _run(gemm, xq, wq, sa, sb)
    y = torch.empty_like(plain)
    need = gemm.workspace_bytes(m, n, k, residual=True)
    ws = torch.empty(max(need, 1), device="cuda", dtype=torch.uint8)
    gemm(xq.data_ptr(), wq.data_ptr(), sa.data_ptr(), sb.data_ptr(), y.data_ptr(), m, n, k,
         stream=torch.cuda.current_stream().cuda_stream, workspace=ws.data_ptr(), workspace_bytes=need,
         residual=r.data_ptr())
    torch.cuda.synchronize()
    unfused = (plain.float() + r.float()).to(torch.bfloat16)
    torch.testing.assert_close(y, unfused, rtol=0, atol=0)
    assert float((y.float() - plain.float()).abs().max()) > 0.5 * float(r.float().abs().max())


def test_cutlass_linear_folds_the_residual(gemm, monkeypatch):
    """fp8_gemm.cutlass with a residual and no bias runs the residual kernel (no torch add) and gives the
    unfused result (the plain kernel, then the add) bit for bit."""
    from mxc.kernels import fp8_gemm
    from mxc.loaders.quantize import quantize_fp8

    if not gemm.has_residual:
        pytest.skip(f"{gemm.path} was built before the residual kernel")
    monkeypatch.setattr(cutlass_fp8, "_ACTIVE", [gemm])
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(300, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    q, s = quantize_fp8(torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02, "channel")
    r = torch.randn(300, 1024, device="cuda", generator=gen).to(torch.bfloat16)
    fused = fp8_gemm.cutlass(x, q, s, residual=r)
    unfused = r + fp8_gemm.cutlass(x, q, s)
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)
    monkeypatch.setattr(gemm, "has_residual", False)  # an older library: the torch add after the GEMM
    torch.testing.assert_close(fp8_gemm.cutlass(x, q, s, residual=r), unfused, rtol=0, atol=0)


def _silu_pair(gemm, xq, w, sa, sb):
    m, k = xq.shape
    n = w.shape[0]
    h = torch.empty(m, n // 2, device="cuda", dtype=torch.bfloat16)
    pmax = torch.empty(m, n // (2 * gemm.pair_block), device="cuda", dtype=torch.float32)
    need = gemm.workspace_bytes(m, n, k, kind="silu_pair")
    ws = torch.empty(max(need, 1), device="cuda", dtype=torch.uint8)
    gemm.silu_pair(xq.data_ptr(), w.data_ptr(), sa.data_ptr(), sb.data_ptr(), h.data_ptr(), pmax.data_ptr(), m, n, k,
                   stream=torch.cuda.current_stream().cuda_stream, workspace=ws.data_ptr(), workspace_bytes=need)
    return h, pmax


# (M, I, K): the small-M kernel (M <= 256) and the main one, ragged M, several tiles and one, Llama-3-8B's gate/up
@pytest.mark.parametrize("m,i,k", [(1, 64, 256), (33, 192, 512), (256, 1024, 4096), (257, 512, 4096),
                                   (1000, 2048, 1024), (2048, 14336, 4096)])
def test_silu_pair_matches_the_chain(gemm, m, i, k):
    """h, its row maxima a tile and the down input quantized from them: the plain GEMM over the halves weight, then
    the SiLU kernel and the SiLU-quantize, bit for bit."""
    from mxc.kernels import triton_elementwise, triton_fp8_quant
    from mxc.loaders.convert import interleave_rows

    if not gemm.has_silu_pair:
        pytest.skip(f"{gemm.path} has no SiLU-pair kernels")
    block = gemm.pair_block
    gen = torch.Generator(device="cuda").manual_seed(m + i)
    xq, sa = _quantized(m, k, gen)
    wq, sb = _quantized(2 * i, k, gen)  # [gate; up]
    gate_up = _run(gemm, xq, wq, sa, sb)
    want = triton_elementwise.silu_mul(gate_up)
    h, pmax = _silu_pair(gemm, xq, interleave_rows(wq, block).contiguous(), sa, interleave_rows(sb, block).contiguous())
    torch.cuda.synchronize()
    assert torch.equal(h, want)
    assert torch.equal(pmax, want.float().abs().reshape(m, -1, block).amax(dim=2))
    hq, hs = triton_fp8_quant.quantize_max(h, pmax)
    rq, rs = triton_fp8_quant._prequantize(gate_up, m, i, True, triton_fp8_quant._quant_block(i))
    assert torch.equal(hs, rs) and torch.equal(hq.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("m", [40, 300, 2048])
def test_interleaved_mlp_runs_the_silu_pair_and_equals_the_chain(gemm, m, monkeypatch):
    """cuda_ops.rms_norm_mlp_cutlass on the interleaved weight (the SiLU-pair GEMM, quantize_max, the down GEMM)
    against the chain on the halves weight and on the interleaved one (SILU_PAIR off): the same bits."""
    from mxc.kernels import cuda_ops, fp8_gemm
    from mxc.loaders.convert import interleave_rows
    from mxc.loaders.quantize import quantize_fp8

    if not gemm.has_silu_pair:
        pytest.skip(f"{gemm.path} has no SiLU-pair kernels")
    monkeypatch.setattr(cutlass_fp8, "_ACTIVE", [gemm])
    block, hidden, inter = gemm.pair_block, 1024, 1536
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(torch.bfloat16)
    w_gu, s_gu = quantize_fp8(torch.randn(2 * inter, hidden, device="cuda", generator=gen) * 0.03, "channel")
    w_d, s_d = quantize_fp8(torch.randn(hidden, inter, device="cuda", generator=gen) * 0.03, "channel")
    w_gi, s_gi = interleave_rows(w_gu, block).contiguous(), interleave_rows(s_gu, block).contiguous()
    calls = []
    monkeypatch.setattr(fp8_gemm, "silu_pair", lambda *a, _f=fp8_gemm.silu_pair, **kw: calls.append(1) or _f(*a, **kw))
    got = cuda_ops.rms_norm_mlp_cutlass(x, norm, w_gi, s_gi, w_d, s_d, 1e-5, "channel", block)
    assert calls == [1]
    want = cuda_ops.rms_norm_mlp_cutlass(x, norm, w_gu, s_gu, w_d, s_d, 1e-5, "channel")
    assert torch.equal(got, want)
    # a tensor-parallel rank's part: no residual
    part = cuda_ops.rms_norm_mlp_cutlass(x, norm, w_gi, s_gi, w_d, s_d, 1e-5, "channel", block, residual=False)
    assert torch.equal(part, cuda_ops.rms_norm_mlp_cutlass(x, norm, w_gu, s_gu, w_d, s_d, 1e-5, "channel",
                                                           residual=False))
    assert not torch.equal(part, want) and calls == [1, 1]
    monkeypatch.setattr(cuda_ops, "SILU_PAIR", False)
    assert torch.equal(cuda_ops.rms_norm_mlp_cutlass(x, norm, w_gi, s_gi, w_d, s_d, 1e-5, "channel", block), want)
    assert calls == [1, 1]
    assert torch.equal(cuda_ops.rms_norm_mlp_scaled_mm(x, norm, w_gi, s_gi, w_d, s_d, 1e-5, "channel", block),
                       cuda_ops.rms_norm_mlp_scaled_mm(x, norm, w_gu, s_gu, w_d, s_d, 1e-5, "channel"))


def test_cuda_graph_replay(gemm):
    gen = torch.Generator(device="cuda").manual_seed(1)
    xq, sa = _quantized(64, 4096, gen)
    wq, sb = _quantized(6144, 4096, gen)
    y = _run(gemm, xq, wq, sa, sb)  # eager first: the library's runtime initialises outside capture
    torch.cuda.synchronize()
    expected = y.clone()
    y.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(gemm, xq, wq, sa, sb, out=y)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_rejects_misaligned_k(gemm):
    with pytest.raises(RuntimeError, match="status 1"):
        gemm(0, 0, 0, 0, 0, 16, 4096, 4100)


@pytest.mark.skipif(cutlass_fp8.available() is not None,
                    reason=f"a build here cannot have the CUTLASS library: {cutlass_fp8.available()}")
def test_fp8_artifact_with_cutlass_matches_scaled_mm_and_cpu(hf_checkpoint, tmp_path, monkeypatch):
    """An fp8 artifact whose prefill (80 tokens, above the GEMV's 32) runs the CUTLASS GEMM against the same
    build with torch._scaled_mm ($MXC_CUTLASS_LIBRARY=none) and the CPU fp8 artifact."""
    import mxc

    ckpt, _ = hf_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=4)
    kw = dict(quant="fp8", dtype="bfloat16", progress=False, log=lambda m: None)
    with_cutlass = mxc.build(str(ckpt), out=tmp_path / "cutlass", target="cuda", max_batch=4, max_seq_len=64, **kw)
    assert "cutlass" in json.loads((with_cutlass / "manifest.json").read_text())
    gpu = mxc.load(with_cutlass, device="cuda")
    halves = mxc.build(str(ckpt), out=tmp_path / "halves", target="cuda", max_batch=4, max_seq_len=64,
                       disable_passes=("interleave_gate_up",), **kw)
    monkeypatch.setenv(cutlass_fp8.PREBUILT_ENV, "none")
    plain = mxc.build(str(ckpt), out=tmp_path / "plain", target="cuda", max_batch=4, max_seq_len=64, **kw)
    assert "cutlass" not in json.loads((plain / "manifest.json").read_text())
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    got = gpu.logits(ids).float().cpu()
    plain_logits = mxc.load(plain, device="cuda").logits(ids).float().cpu()
    cpu_logits = mxc.load(mxc.build(str(ckpt), out=tmp_path / "cpu", **kw)).logits(ids).float()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    # the same build without the interleaved gate/up (the chain: no SiLU-pair GEMM): the same logits, bit for bit
    assert "interleave=64" in (with_cutlass / "graph.yaml").read_text()
    assert torch.equal(mxc.load(halves, device="cuda").logits(ids).float().cpu(), got)
    print(f"\nfp8 logits, CUTLASS against _scaled_mm {rel(got, plain_logits):.2e}, against CPU {rel(got, cpu_logits):.2e}")
    assert rel(got, plain_logits) < 2e-2  # fast accumulation and bf16 rounding; both quantize alike
    assert rel(got, cpu_logits) < 5e-2  # as test_fp8_gpu: fp8 roundings flip on last-bit differences
