"""The persistent fp8 MLP pair's library on the CPU: it compiles for sm_90a, opens without a GPU, and its host-side
entry points (the static schedule, the shape check, the shared-memory layout) say what the kernel will do.

Skipped without nvcc. The kernel itself runs in tests/gpu/test_mlp_pair_fp8_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from mxc.kernels import mlp_pair_fp8, nvcc

pytestmark = pytest.mark.skipif(nvcc.find() is None, reason="nvcc not found")

H100_SMEM_OPTIN = 232448  # bytes a block may opt into on sm_90 (227 KB)
LLAMA3_8B = (4096, 14336)
SHAPES = [LLAMA3_8B, (1024, 2048), (2048, 5120)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    so = nvcc.compile_so(mlp_pair_fp8.source(), tmp_path_factory.mktemp("mlp_pair") / "mlp_pair_fp8.so",
                         what="fp8 MLP pair kernel")
    return mlp_pair_fp8.MlpPairFp8(so)


@pytest.mark.parametrize("H, I", SHAPES)
@pytest.mark.parametrize("G", [1, 7, 64, 132, 1000])
def test_schedule_runs_every_unit_once_and_balances_bytes(pair, G, H, I):
    up, down = pair.schedule(G, H, I)
    assert len(up) == I // 16 and len(down) == H // 32
    assert all(0 <= b < G for b in up + down)  # -1 would be a unit nobody runs
    up_count = [up.count(b) for b in range(G)]
    down_count = [down.count(b) for b in range(G)]
    assert max(up_count) - min(up_count) <= 1 and max(down_count) - min(down_count) <= 1
    # bytes a CTA streams: a gate/up unit is 32 rows of H, a down unit 32 rows of I; the CTAs with fewer gate/up
    # units take the down units first, so no CTA is more than one unit above the mean
    load = [32 * H * u + 32 * I * d for u, d in zip(up_count, down_count)]
    assert max(load) <= sum(load) / G + 32 * max(H, I)
    if len(down) < G:  # every CTA with a down unit has the fewest gate/up units, where there are enough of those
        fewest = [b for b in range(G) if up_count[b] == min(up_count)]
        if len(fewest) >= len(down):
            assert {down[v] for v in range(len(down))} <= set(fewest)


def test_supports_matches_python_check(pair):
    for M in (0, 1, 8, 9):
        for H, I in [*SHAPES, (4096, 11008), (1000, 2048), (4096, 1536)]:
            assert pair.supports(M, H, I) == (mlp_pair_fp8.supports(M, H, I) is None), (M, H, I)
    assert "tokens" in mlp_pair_fp8.supports(9, *LLAMA3_8B)
    assert "multiples of 1024" in mlp_pair_fp8.supports(1, 4096, 11008)


def test_ring_fits_an_sm90_block(pair):
    """Llama-3-8B's pair keeps a ring of at least 3 stages beside the activations at every M (the whole h
    quantized, M x (I + 16) bytes, shares the block), and more at batch 1."""
    H, I = LLAMA3_8B
    stage = pair.smem(1, H, I, 3) - pair.smem(1, H, I, 2)
    assert stage == 32 * (1024 + 16)
    for M in range(1, mlp_pair_fp8.MAX_M + 1):
        assert pair.smem(M, H, I, 3) <= H100_SMEM_OPTIN, M
        assert pair.smem(M, H, I, 2) >= M * (I + 16)
    stages_at_1 = max(s for s in range(2, 9) if pair.smem(1, H, I, s) <= H100_SMEM_OPTIN)
    assert stages_at_1 >= 6  # ~200 KB of weights in flight an SM: the boundary's wait is covered
    assert math.isclose(stages_at_1 * stage / 1024, 195, rel_tol=0.05)


def test_library_exports_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(mlp_pair_fp8.PREBUILT_ENV, raising=False)
    logs = []
    first = mlp_pair_fp8.library(log=logs.append)
    assert first.is_file() and first.parent == tmp_path / "cache" / "mxc" / "mlp_pair" and len(logs) == 1
    copy = mlp_pair_fp8.library(tmp_path / "artifact" / "code" / "mlp_pair_fp8.so", log=logs.append)
    assert copy.read_bytes() == first.read_bytes() and len(logs) == 1  # the second call compiled nothing
    monkeypatch.setenv(mlp_pair_fp8.PREBUILT_ENV, str(first))
    assert mlp_pair_fp8.library(log=logs.append) == first and "prebuilt" in logs[-1]
    shipped = mlp_pair_fp8.library(tmp_path / "other" / "code" / "mlp_pair" / "lib.so", log=logs.append)
    assert shipped.read_bytes() == first.read_bytes()
    monkeypatch.setenv(mlp_pair_fp8.PREBUILT_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(RuntimeError, match="MXC_MLP_PAIR_LIBRARY"):
        mlp_pair_fp8.library()


def test_operands_are_checked_before_any_launch(pair):
    """Shapes, dtypes and the token count are refused with the tensor's name, on any device (nothing launches)."""
    H = I = 1024  # noqa: E741
    fp8 = mlp_pair_fp8.FP8
    w_gu, s_gu = torch.zeros(2 * I, H, dtype=fp8), torch.ones(2 * I)
    w_d, s_d = torch.zeros(H, I, dtype=fp8), torch.ones(H)
    ws = mlp_pair_fp8.Workspace.new(I, "cpu")
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    xq, xs = torch.zeros(1, H, dtype=fp8), torch.ones(1)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="9 tokens"):
        pair(torch.zeros(9, H, dtype=fp8), torch.ones(9), w_gu, s_gu, w_d, s_d, None, out, ws)
    with pytest.raises(ValueError, match=r"w_d must be contiguous \[1024, 1024\]"):
        pair(xq, xs, w_gu, s_gu, w_d.t().contiguous().t(), s_d, None, out, ws)
    with pytest.raises(ValueError, match=r"xs must be contiguous \[1\] torch.float32"):
        pair(xq, xs.double(), w_gu, s_gu, w_d, s_d, None, out, ws)
    with pytest.raises(ValueError, match="norm_weight must be contiguous"):
        pair.rms_norm_pair(x, torch.ones(H), 1e-5, w_gu, s_gu, w_d, s_d, x, out, ws)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        pair.rms_norm_pair(x, torch.ones(H, dtype=torch.bfloat16), 1e-5, w_gu, s_gu, w_d, s_d, x.float(), out, ws)


def test_pdl_active_follows_the_launcher(tmp_path):
    """The pair (a ctypes launch, outside ``launch``) asks ``launch.pdl_active`` whether to launch for PDL: yes
    under a PDL artifact's launcher outside its plain-launch buckets and under ``jit_launch_pdl``, else no."""
    from mxc.kernels import launch
    from mxc.runtime.cuda_launch import CubinLauncher

    (tmp_path / "index.json").write_text("{}")
    assert not launch.pdl_active()  # the JIT launcher
    with launch.using(launch.jit_launch_pdl):
        assert launch.pdl_active()
    for built_with_pdl in (False, True):
        launcher = CubinLauncher(tmp_path, pdl=built_with_pdl, driver=object())
        with launch.using(launcher):
            assert launch.pdl_active() == built_with_pdl
            with launcher.plain():  # buckets past PDL_MAX_BUCKET
                assert not launch.pdl_active()
