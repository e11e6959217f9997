"""``nvcc.compile_so``: a library compiled twice from one source is the same bytes (the artifacts that ship one are
reproducible), and its exported functions stay callable through ctypes. ``nvcc.cached_library``: one compile of a
source however many ask for it at once."""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mxc.kernels import nvcc


SOURCE = """
__global__ void scale(float* x, float a) { x[threadIdx.x] *= a; }
extern "C" int launch_scale(float* x, float a) { scale<<<1, 32>>>(x, a); return 0; }
extern "C" int answer() { return 42; }
"""


@pytest.mark.skipif(nvcc.find() is None, reason="nvcc not found")
def test_two_compiles_of_one_source_are_the_same_bytes(tmp_path):
    """nvcc's temporary file name (tmpxft_<pid>_...) reached the library's local symbols: two compiles differed."""
    a = nvcc.compile_so(SOURCE, tmp_path / "a" / "lib.so", what="test library")
    b = nvcc.compile_so(SOURCE, tmp_path / "b" / "lib.so", what="test library")
    assert a.read_bytes() == b.read_bytes()
    assert b"tmpxft" not in a.read_bytes()
    lib = ctypes.CDLL(str(a))  # loads without a GPU; a host function runs
    assert lib.answer() == 42 and hasattr(lib, "launch_scale")


def test_cached_library_compiles_a_source_once_when_asked_twice_at_once(tmp_path, monkeypatch):
    """Two callers at once (two builds, two test workers): one compiles, the other waits for its library."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MXC_TEST_PREBUILT", raising=False)
    compiles, logs = [], []

    def compile(text, path):
        compiles.append(text)
        deadline = time.monotonic() + 30  # until the other caller waits on the lock (whichever of the two came first)
        while not any(m.startswith("waiting for") for m in logs) and time.monotonic() < deadline:
            time.sleep(0.01)
        Path(path).write_text(text)

    def get():
        return nvcc.cached_library("test library", "test", lambda: "source", compile, "MXC_TEST_PREBUILT",
                                   log=logs.append)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(get)
        time.sleep(0.1)
        second = pool.submit(get)
        paths = [first.result(), second.result()]
    assert compiles == ["source"] and paths[0] == paths[1] and paths[0].read_text() == "source"
    assert any(m.startswith("waiting for another process compiling the test library") for m in logs), logs
