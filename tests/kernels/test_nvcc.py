"""``nvcc.compile_so``: a library compiled twice from one source is the same bytes (the artifacts that ship one are
reproducible), and its exported functions stay callable through ctypes."""

from __future__ import annotations

import ctypes

import pytest

from mxc.kernels import nvcc

pytestmark = pytest.mark.skipif(nvcc.find() is None, reason="nvcc not found")

SOURCE = """
__global__ void scale(float* x, float a) { x[threadIdx.x] *= a; }
extern "C" int launch_scale(float* x, float a) { scale<<<1, 32>>>(x, a); return 0; }
extern "C" int answer() { return 42; }
"""


def test_two_compiles_of_one_source_are_the_same_bytes(tmp_path):
    """nvcc's temporary file name (tmpxft_<pid>_...) reached the library's local symbols: two compiles differed."""
    a = nvcc.compile_so(SOURCE, tmp_path / "a" / "lib.so", what="test library")
    b = nvcc.compile_so(SOURCE, tmp_path / "b" / "lib.so", what="test library")
    assert a.read_bytes() == b.read_bytes()
    assert b"tmpxft" not in a.read_bytes()
    lib = ctypes.CDLL(str(a))  # loads without a GPU; a host function runs
    assert lib.answer() == 42 and hasattr(lib, "launch_scale")
