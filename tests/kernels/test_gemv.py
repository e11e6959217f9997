"""Triton small-M linear (``triton_gemv.linear_small_m``) against ``F.linear`` in fp32, then cast.

Runs under TRITON_INTERPRET=1 on the CPU (the interpreter costs ~0.4 ms per Triton op per
program), so the cases pass small explicit configs: ragged N and K (not block multiples),
every kernel version (v1 M = 1, v2 M = 2..8, v3 tl.dot), SPLIT_K 1 and ragged SPLIT_K > 1,
with and without bias, fp32/fp16/bf16. One case writes into a view of a NaN-filled buffer to
catch stores outside y; a meta-device test checks that grids and constexprs depend only on
the M bucket. The residual epilogue is checked against the unfused ``torch_ref`` composition
and, bit for bit, against the kernel without it followed by ``torch_ref.add``.
"""

from __future__ import annotations

import textwrap
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from mxc.kernels import gemv_tuning
from mxc.kernels import launch as launch_mod
from mxc.kernels import torch_ref
from mxc.kernels import triton_gemv as tg
from mxc.kernels.triton_gemv import GemvConfig
from tests.sm90_compile import run_compile_script
from tests.triton_interpreter import bf16_ok

# bf16 needs the interpreter's float conversions fixed (tests/triton_interpreter.py) off the GPU
_BF16_OK = bf16_ok()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _BF16_OK else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(M, N, K, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def _reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _check(y, ref, dtype):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert not y.isnan().any()
    torch.testing.assert_close(y.cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def _run(M, N, K, dtype, bias, cfg, seed=0):
    x, w, b = _inputs(M, N, K, dtype, bias, seed)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    y = tg.linear_small_m(dev(x), dev(w), dev(b), config=cfg)
    _check(y, _reference(x, w, b), dtype)


FMA = GemvConfig(BLOCK_N=16, BLOCK_K=32)
DOT = GemvConfig(BLOCK_N=16, BLOCK_K=32, USE_DOT=True)
# (N, K, bias, SPLIT_K): N=40, K=72 -> 3 N tiles (last ragged), 3 K steps (last ragged);
# N=96, K=200, SPLIT_K=3 -> slices of 96: 0-96, 96-192, 192-200 (partial).
SHAPES = [(40, 72, False, 1), (96, 200, True, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,K,bias,split", SHAPES, ids=["40x72", "96x200-bias-split3"])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 16, 17])
def test_linear_small_m(M, N, K, bias, split, dtype):
    base = DOT if tg.bucket(M) >= 16 else FMA  # v1 at M=1, v2 at 2..8, v3 at 16, 32
    _run(M, N, K, dtype, bias, replace(base, SPLIT_K=split), seed=M)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,split,bias", [(1, 2, True), (3, 1, True), (5, 2, False)])
def test_dot_on_small_buckets(M, split, bias, dtype):
    """v3 padded to a 16-row tile for buckets below 16 (tune may pick it)."""
    _run(M, 40, 72, dtype, bias, GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split, USE_DOT=True), seed=7)


@pytest.mark.parametrize("M,base", [(1, FMA), (3, FMA), (17, DOT)], ids=["v1", "v2", "v3"])
@pytest.mark.parametrize("K,split", [(96, 2), (160, 3)])
def test_split_k_whole_steps_past_k(M, base, K, split):
    """K a whole number of BLOCK_K steps but not of SPLIT_K * BLOCK_K: the last slice runs past K (96 in 2 slices
    of 64: 64-128; 160 in 3 of 64: 128-192), so its steps must be masked although K % BLOCK_K == 0. Under
    ``guarded``: columns past K read NaN, and nothing is written outside y or the scratch."""
    from tests.kernels.guarded import guarded

    x, w, b = _inputs(M, 40, K, torch.float32, True, seed=K + M)
    with guarded():
        y = tg.linear_small_m(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), config=replace(base, SPLIT_K=split))
    _check(y, _reference(x, w, b), torch.float32)


@pytest.mark.parametrize("n,k", [(24, 4200), (256, 4096), (512, 4096), (512, 1024), (1024, 14336), (96, 768)])
@pytest.mark.parametrize("m_bucket", [1, 2, 32])
def test_config_rules(m_bucket, n, k):
    """``config_for``'s documented rules: a K split keeps >= 2 BLOCK_K steps a slice and stops once the programs
    fill the GPU; tl.dot configs run a tile of >= 16 rows (``_tile_m``), the FMA versions the bucket itself."""
    cfg = tg.config_for(m_bucket, n, k, torch.bfloat16)
    programs = -(-n // cfg.BLOCK_N)
    if cfg.SPLIT_K > 1:
        assert k >= 2 * cfg.SPLIT_K * cfg.BLOCK_K, cfg
        assert programs * cfg.SPLIT_K // 2 < tg.NUM_SMS, cfg  # the last doubling was still short of the SMs
    tile_m = tg._tile_m(m_bucket, cfg)
    assert tile_m == (max(16, m_bucket) if cfg.USE_DOT else m_bucket)
    for use_dot in (False, True):
        assert tg._tile_m(m_bucket, replace(cfg, USE_DOT=use_dot)) >= (16 if use_dot else m_bucket)


@pytest.mark.parametrize("M", [1, 4, 32])
def test_default_config(M):
    """config_for's choice runs (its large tiles), with the split K it picks for a small N."""
    cfg = tg.config_for(tg.bucket(M), 24, 4200, torch.float16)
    assert cfg == tg.config_for(tg.bucket(M), 24, 4200, torch.float16) and cfg.SPLIT_K > 1
    _run(M, 24, 4200, torch.float16, True, None, seed=3)


def test_writes_only_inside_out():
    """Through ``out=``: a contiguous view inside a NaN buffer; nothing around it is touched."""
    M, N, K, dtype = 3, 40, 72, torch.float16
    x, w, b = _inputs(M, N, K, dtype, bias=True, seed=11)
    for split in (1, 2):
        buf = torch.full((M * N + 64,), float("nan"), dtype=dtype, device=DEVICE)
        out = buf[32:32 + M * N].view(M, N)
        y = tg.linear_small_m(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), out=out,
                              config=GemvConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split))
        assert y.data_ptr() == out.data_ptr()
        _check(y, _reference(x, w, b), dtype)
        assert buf[:32].isnan().all() and buf[32 + M * N:].isnan().all()


def test_config_table():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for mb in tg.M_BUCKETS:
            for n, k in gemv_tuning.LLAMA3_8B_SHAPES.values():
                cfg = tg.config_for(mb, n, k, dtype)
                assert cfg.BLOCK_K * torch.empty((), dtype=dtype).element_size() % 512 == 0  # whole warps of 16 B
                assert cfg.USE_DOT == (mb > 1)  # v1 at M = 1, tensor cores from 2 (measured on H200)
                assert cfg.SPLIT_K == 1  # 4096+ rows fill 132 SMs without splitting K
    small = tg.config_for(1, 512, 4096, torch.bfloat16)  # a TP shard: 32 tiles -> split K
    assert small.BLOCK_N == 8 and small.SPLIT_K > 1
    assert -(-512 // small.BLOCK_N) * small.SPLIT_K >= tg.NUM_SMS // 2
    assert [tg.bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 32]
    with pytest.raises(ValueError):
        tg.bucket(33)
    assert all(c.USE_DOT for c in gemv_tuning.candidates(32, torch.bfloat16))
    assert {c.USE_DOT for c in gemv_tuning.candidates(4, torch.bfloat16)} == {False, True}



def test_tuning_candidates_by_bucket():
    """``gemv_tuning.candidates``: v1 (no tl.dot) only at M = 1, keeping BLOCK_N * BLOCK_K fp32 accumulators within
    128 registers a thread (and dropping only what does not fit: a tile that fits 4 warps is tried with 4 too);
    v2 and v3 (tl.dot) both at M = 2..8, v3 only from 16."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        one = gemv_tuning.candidates(1, dtype)
        assert one and not any(c.USE_DOT for c in one)
        assert all(c.BLOCK_N * c.BLOCK_K <= 128 * 32 * c.num_warps for c in one)
        tiles = {(c.BLOCK_N, c.BLOCK_K, c.num_warps) for c in one}
        assert all((bn, bk, 4) in tiles for bn, bk, nw in tiles if nw == 8 and bn * bk <= 128 * 32 * 4), dtype
        assert any(bn * bk == 128 * 32 * nw for bn, bk, nw in tiles)  # tiles reach the budget exactly: all kept
        for m in (2, 4, 8):
            assert {c.USE_DOT for c in gemv_tuning.candidates(m, dtype)} == {False, True}, (m, dtype)
        for m in (16, 32):
            assert all(c.USE_DOT for c in gemv_tuning.candidates(m, dtype)), (m, dtype)
        for m in tg.M_BUCKETS:  # what tune picks config_for may return: whole warps of 16 B, as test_config_table asks
            assert all(c.BLOCK_K * torch.empty((), dtype=dtype).element_size() % 512 == 0
                       for c in gemv_tuning.candidates(m, dtype)), (m, dtype)


def test_best_times_each_candidate_with_and_without_split_k(monkeypatch):
    """``_best`` (no GPU: the run and the timer are stand-ins): each base with SPLIT_K 1 and with ``split_k_for``'s
    choice for its row tiles (``fixed`` fields set), each config once; a wrong result or a failure skips it; the
    fastest of the rest wins."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    good, wrong, failing = GemvConfig(16, 256), GemvConfig(32, 256), GemvConfig(64, 256)
    runs = []

    def run(x, w, cfg):
        runs.append(cfg)
        if cfg.BLOCK_N == failing.BLOCK_N:
            raise RuntimeError("out of resources")
        return torch.tensor(float(cfg.BLOCK_N == wrong.BLOCK_N))  # 0: right

    def time_us(fn, x, ws):
        fn(x, ws[0])
        return 0.5 if runs[-1].BLOCK_N == wrong.BLOCK_N else 10 / runs[-1].SPLIT_K  # the wrong one is fastest

    monkeypatch.setattr(gemv_tuning, "time_us", time_us)
    n, k = 512, 4096
    split = tg.split_k_for(-(-n // good.BLOCK_N), k, good.BLOCK_K)
    assert split > 1  # 32 row tiles do not fill the GPU
    best = gemv_tuning._best([good, wrong, failing, good], n, k, run, lambda y: y.item() == 0, None,
                             [torch.empty(1)], False, num_stages=2)
    assert best == (replace(good, SPLIT_K=split, num_stages=2), 10 / split)
    timed = [c for c in runs if c.BLOCK_N == good.BLOCK_N]  # each once checked, once timed
    assert timed == [replace(good, SPLIT_K=s, num_stages=2) for s in (1, 1, split, split)]


def test_weight_copies_cover_four_times_the_l2():
    """``copies_for``: the fewest copies whose bytes reach 4x the L2 (so cycling through them reads HBM), at least 1."""
    budget = 4 * gemv_tuning.L2_BYTES
    for nbytes in (1, 4096 * 4096 * 2, budget // 3, budget // 3 + 1, budget - 1, budget, budget + 1, 10 * budget):
        c = gemv_tuning.copies_for(nbytes)
        assert c >= 1 and c * nbytes >= budget and (c == 1 or (c - 1) * nbytes < budget), nbytes


def test_rejects_bad_inputs():
    x, w, b = _inputs(2, 8, 16, torch.float16, bias=True)
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w.float())
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w[:, :8])
    with pytest.raises(ValueError):
        tg.linear_small_m(x, w, b[:4])
    with pytest.raises(ValueError):
        tg.linear_small_m(torch.randn(40, 16).half(), w)
    with pytest.raises(ValueError):
        tg.linear_small_m(x.t().contiguous().t(), w)


def test_meta_recording():
    """On meta tensors: nothing runs; grids depend on the bucket only; M=3 and M=4 share bucket 4's
    binary (same constexprs, M passed as a dynamic argument)."""
    launches = []

    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        launches.append((kernel, grid, args, constexprs, num_warps, num_stages))

    N, K, dtype = 4096, 4096, torch.bfloat16
    w = torch.empty(N, K, dtype=dtype, device="meta")
    b = torch.empty(N, dtype=dtype, device="meta")
    seen = {}
    with launch_mod.using(record):
        for M in (1, 2, 3, 4, 5, 8, 17, 32):
            launches.clear()
            y = tg.linear_small_m(torch.empty(M, K, dtype=dtype, device="meta"), w, b)
            assert y.shape == (M, N) and y.device.type == "meta"
            (kernel, grid, args, consts, nw, ns), = launches
            assert args[5] == M and args[6:] == [None] * 4 and consts["BLOCK_M"] >= tg.bucket(M)
            seen[M] = (grid, consts, nw, ns)
        # split K (a small N): two launches, same grids for every M of a bucket
        w_small = torch.empty(256, K, dtype=dtype, device="meta")
        grids = []
        for M in (3, 4):
            launches.clear()
            tg.linear_small_m(torch.empty(M, K, dtype=dtype, device="meta"), w_small)
            assert len(launches) == 2
            grids.append([(grid, consts) for _, grid, _, consts, _, _ in launches])
    assert seen[3] == seen[4] and seen[5] == seen[8] and seen[17] == seen[32]
    assert seen[1] != seen[2]
    assert grids[0] == grids[1]


# ----------------------------------------------------------------------------------------------
# residual epilogue


def _fused_inputs(M, N, K, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w, b = _inputs(M, N, K, dtype, bias, seed)
    return x, w, b, torch.randn(M, N, generator=g).to(dtype)


FMA_V2 = GemvConfig(BLOCK_N=16, BLOCK_K=32)  # v2 at buckets 2..8 (v1 at M = 1)
# (M, K, config, split, bias): N = 40 (3 tiles, last ragged); K = 72 is ragged for every split
# (2: slices 0-64, 64-72; 3: 0-32, 32-64, 64-72), K = 64 is EVEN_K.
FUSED = [
    (1, 72, FMA, 1, True),
    (1, 64, FMA, 2, False),
    (1, 72, FMA, 3, False),
    (1, 72, DOT, 2, True),
    (3, 64, FMA_V2, 1, True),
    (3, 72, FMA_V2, 2, True),
    (3, 72, DOT, 1, False),
    (3, 72, DOT, 3, True),
    (17, 64, DOT, 1, True),
    (17, 72, DOT, 3, False),
]


def _fused_id(case):
    M, K, cfg, split, bias = case
    version = "v3" if cfg.USE_DOT else "v1" if M == 1 else "v2"
    return "-".join([f"M{M}", f"K{K}", version, f"split{split}"] + ["bias"] * bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,cfg,split,bias", FUSED, ids=[_fused_id(c) for c in FUSED])
def test_residual_epilogue(M, K, cfg, split, bias, dtype):
    """residual + linear against the torch reference composition, and bit for bit against the
    same kernel without the residual followed by ``torch_ref.add`` (the same two roundings)."""
    N = 40
    cfg = replace(cfg, SPLIT_K=split)
    x, w, b, r = _fused_inputs(M, N, K, dtype, bias, seed=M + K + split)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    y = tg.linear_small_m(dev(x), dev(w), dev(b), dev(r), config=cfg)
    _check(y, torch_ref.add(r, _reference(x, w, b)), dtype)
    unfused = torch_ref.add(dev(r), tg.linear_small_m(dev(x), dev(w), dev(b), config=cfg))
    assert torch.equal(y.cpu(), unfused.cpu())


def test_residual_in_place():
    """``out=residual`` (each element is read, then written, by one program) and nothing is
    written outside it, with and without split K."""
    M, N, K, dtype = 3, 40, 72, torch.float16
    x, w, b, r = _fused_inputs(M, N, K, dtype, True, seed=13)
    ref = torch_ref.add(r, _reference(x, w, b))
    for split in (1, 2):
        buf = torch.full((M * N + 64,), float("nan"), dtype=dtype, device=DEVICE)
        res = buf[32:32 + M * N].view(M, N)
        res.copy_(r)
        y = tg.linear_small_m(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), res, out=res,
                              config=replace(FMA_V2, SPLIT_K=split))
        assert y.data_ptr() == res.data_ptr()
        _check(y, ref, dtype)
        assert buf[:32].isnan().all() and buf[32 + M * N:].isnan().all()


def test_residual_rejects_bad_inputs():
    x, w, b, r = _fused_inputs(2, 8, 16, torch.float16, True, seed=1)
    for bad in (r[:1], r.float(), r.t().contiguous().t()):
        with pytest.raises(ValueError):
            tg.linear_small_m(x, w, b, bad)


@pytest.mark.parametrize("M", [1, 3])
def test_rms_norm_linear_adapter(M):
    """cuda_ops.rms_norm_linear_small_m (a bf16 LM head under fp8): the RMSNorm kernel, then the
    GEMV, against the reference composition."""
    from mxc.kernels import cuda_ops, triton_norm

    N, K, dtype = 24, 64, torch.float16
    x, w, b = _inputs(M, N, K, dtype, True, seed=M)
    g = (1 + 0.1 * torch.randn(K, generator=torch.Generator().manual_seed(3))).to(dtype)
    launches = []
    real = launch_mod._launcher

    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        launches.append(kernel)
        return real(kernel, grid, args, constexprs, num_warps, num_stages)

    with launch_mod.using(record):
        y = cuda_ops.rms_norm_linear_small_m(x.to(DEVICE), g.to(DEVICE), w.to(DEVICE), b.to(DEVICE), eps=1e-6)
    assert launches[0] is triton_norm.norm_kernel(K, False) and tg._gemv_kernel in launches
    torch.testing.assert_close(y.cpu(), torch_ref.rms_norm_linear(x, g, w, b, 1e-6), atol=8e-3, rtol=8e-3)


def test_meta_recording_residual():
    """The residual is in the constexprs (HAS_RESIDUAL) and its pointer; grids are those of the
    plain linear; with split K the reduce kernel adds the residual."""
    launches = []

    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        launches.append((kernel, grid, args, constexprs, num_warps, num_stages))

    K, dtype = 4096, torch.bfloat16
    meta = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    with launch_mod.using(record):
        for M in (1, 3, 17):
            for N in (4096, 256):  # 256 rows: split K
                w, b, r = meta(N, K), meta(N), meta(M, N)
                launches.clear()
                tg.linear_small_m(meta(M, K), w, b)
                plain = list(launches)
                launches.clear()
                y = tg.linear_small_m(meta(M, K), w, b, r)
                fused = list(launches)
                assert y.shape == (M, N) and y.device.type == "meta"
                assert [grid for _, grid, *_ in fused] == [grid for _, grid, *_ in plain]
                for (kernel, _, args, consts, nw, ns), (_, _, _, pconsts, _, _) in zip(fused, plain):
                    assert (args[5] if kernel is tg._gemv_kernel else args[-1]) == M
                    spec = launch_mod.spec_of(kernel, args, consts, nw, ns)
                    assert spec["signature"]["r_ptr"] in ("*bf16", "constexpr")
                    assert pconsts["HAS_RESIDUAL"] is False
                    assert {k: v for k, v in consts.items() if k != "HAS_RESIDUAL"} \
                        == {k: v for k, v in pconsts.items() if k != "HAS_RESIDUAL"}
                gemv = fused[0]
                assert gemv[0] is tg._gemv_kernel
                if N == 4096:
                    assert len(fused) == 1 and gemv[3]["HAS_RESIDUAL"] is True and gemv[2][3] is r
                else:
                    assert len(fused) == 2 and gemv[3]["SPLIT_K"] > 1
                    assert gemv[3]["HAS_RESIDUAL"] is False and gemv[2][3] is None
                    kernel, _, args, consts, _, _ = fused[1]
                    assert kernel is tg._splitk_reduce_kernel and consts["HAS_RESIDUAL"] is True
                    assert args[2] is r


_COMPILE_SCRIPT = textwrap.dedent("""
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mxc.kernels import launch as L, triton_gemv as tg

    specs = []
    def record(kernel, grid, args, constexprs, num_warps, num_stages):
        specs.append((kernel, L.spec_of(kernel, args, constexprs, num_warps, num_stages)))
    with L.using(record):
        for M, dtype in [(1, torch.bfloat16), (2, torch.bfloat16), (8, torch.bfloat16),
                         (32, torch.bfloat16), (32, torch.float32)]:
            x = torch.empty(M, 4096, dtype=dtype, device="meta")
            w = torch.empty(4096, 4096, dtype=dtype, device="meta")
            tg.linear_small_m(x, w, torch.empty(4096, dtype=dtype, device="meta"))
        x = torch.empty(1, 4096, dtype=torch.bfloat16, device="meta")
        tg.linear_small_m(x, torch.empty(512, 4096, dtype=torch.bfloat16, device="meta"))  # split K
        # residual epilogue: v1, v3, v2 (a tune config) and split K (+ reduce)
        for M, N, cfg in [(1, 4096, None), (32, 4096, None), (4, 4096, tg.GemvConfig(32, 256)),
                          (1, 512, None)]:
            meta = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device="meta")
            tg.linear_small_m(meta(M, 4096), meta(N, 4096), meta(N), meta(M, N), config=cfg)
    for fn, spec in specs:
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n, t in spec["signature"].items() if t.startswith("*")}
        src = ASTSource(fn, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]})
        ptx = k.asm["ptx"]
        assert "ld.global.v4" in ptx or "cp.async.cg.shared.global" in ptx, "no 16-byte weight loads"
        print(fn.__name__, spec["constexprs"].get("BLOCK_M"), "smem", k.metadata.shared, "ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_compiles_for_sm90():
    """The default configs, fused or not, compile for Hopper (sm_90) and load weights 16 bytes at a time."""
    out = run_compile_script(_COMPILE_SCRIPT)
    assert out.count(" ok") == 12, out
