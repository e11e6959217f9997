"""The mma fp8 GEMV's contract on the CPU: what it refuses, and that its library compiles for sm_90a without
register spills (skipped without nvcc). The kernel itself runs in tests/gpu/test_cuda_fp8_gemv_gpu.py."""

from __future__ import annotations

import warnings

import pytest

from mxc.kernels import cuda_fp8_gemv, nvcc


@pytest.mark.parametrize("M, N, K, epilogue, why", [
    (0, 64, 64, None, "1 to 8"), (9, 64, 64, None, "1 to 8"), (1, 64, 96, None, "multiple of 64"),
    (1, 64, 32, None, "multiple of 64"), (1, 63, 64, "silu_mul", "even"), (8, 6144, 4096, None, None),
    (1, 28672, 4096, "silu_mul", None), (3, 1000, 640, None, None)])
def test_supports(M, N, K, epilogue, why):
    got = cuda_fp8_gemv.supports(M, N, K, epilogue)
    assert (got is None) if why is None else (why in got)


@pytest.mark.skipif(nvcc.find() is None, reason="nvcc not found")
def test_library_compiles_without_spills(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compile_so warns on a ptxas spill report
        so = nvcc.compile_so(cuda_fp8_gemv.source(), tmp_path / "gemv.so", what="fp8 mma GEMV")
    assert so.stat().st_size > 0
    lib = cuda_fp8_gemv.GemvFp8Mma(so)  # opens without a GPU (cudart is static)
    assert lib.path == so
