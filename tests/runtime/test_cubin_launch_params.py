"""The cubin launcher's argument packing, with a stand-in for the CUDA driver (no GPU needed): the
parameter array the driver would read holds each tensor's address, each number, and NULL for
Triton's trailing scratch pointers, launch after launch (the values are reused in place)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from mxc.errors import MxcError
from mxc.runtime import cuda_launch


class _Driver:
    """Records what a launch passes: grid, threads and the parameter values read through the pointers."""

    def __init__(self, kinds):
        self.kinds, self.launches, self.configs = kinds, [], []

    def cuModuleLoadData(self, *_):
        return 0

    def cuModuleGetFunction(self, *_):
        return 0

    def cuFuncSetAttribute(self, *_):
        return 0

    def _read(self, params):
        types = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}
        return [ctypes.cast(params[i], ctypes.POINTER(types[k])).contents.value for i, k in enumerate(self.kinds)]

    def cuLaunchKernel(self, func, gx, gy, gz, tx, ty, tz, shared, stream, params, extra):
        self.launches.append(("plain", (gx, gy, gz), tx, self._read(params)))
        return 0

    def cuLaunchKernelEx(self, config, func, params, extra):
        c = ctypes.cast(config, ctypes.POINTER(cuda_launch._LaunchConfig)).contents
        self.launches.append(("pdl", (c.gridDimX, c.gridDimY, c.gridDimZ), c.blockDimX, self._read(params)))
        self.configs.append((c.blockDimY, c.blockDimZ, c.sharedMemBytes, c.hStream, c.numAttrs, c.attrs[0].id,
                             c.attrs[0].value.programmaticStreamSerializationAllowed))
        return 0


@pytest.fixture
def binary(monkeypatch):
    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    kinds = ["ptr", "ptr", "i32", "f32", "ptr", "ptr"]  # two tensors, an int, a float, two scratch pointers
    entry = {"kernel": "m:k", "entry": "k", "pdl": True, "shared": 0, "num_warps": 4, "params": kinds,
             "args": ["*bf16", "*bf16", "i32", "fp32"]}
    driver = _Driver(kinds)
    return cuda_launch._Binary(driver, b"", entry), driver


def test_parameters_reach_the_driver(binary):
    b, driver = binary
    x, y = torch.empty(8), torch.empty(4)
    b.launch((3, 2), [x, y, 7, 0.5], pdl=True)
    b.launch((5,), [y, x, -1, 2.0], pdl=False)
    assert driver.launches[0] == ("pdl", (3, 2, 1), 128, [x.data_ptr(), y.data_ptr(), 7, 0.5, None, None])
    assert driver.launches[1] == ("plain", (5, 1, 1), 128, [y.data_ptr(), x.data_ptr(), -1, 2.0, None, None])


def test_the_pdl_config_is_reused_with_each_launch_s_grid_and_stream(binary, monkeypatch):
    """The PDL launch's config is built once a thread and refilled in place: every launch still gets its own
    grid and stream, one block of threads, and the programmatic-serialization attribute."""
    b, driver = binary
    x = torch.empty(8)
    for grid, stream in (((3, 2), 0x10), ((7,), 0x20), ((1, 2, 3), 0x30)):
        monkeypatch.setattr(cuda_launch, "stream_handle", lambda s=stream: s)
        b.launch(grid, [x, x, 1, 1.0], pdl=True)
    assert [g for _, g, _, _ in driver.launches] == [(3, 2, 1), (7, 1, 1), (1, 2, 3)]
    assert [c[3] for c in driver.configs] == [0x10, 0x20, 0x30]
    assert {c[:3] + c[4:] for c in driver.configs} == {(1, 1, 0, 1, cuda_launch._PROGRAMMATIC_STREAM_SERIALIZATION, 1)}


def test_misaligned_tensor_is_refused(binary):
    b, _ = binary
    base = torch.empty(16)
    with pytest.raises(MxcError, match="not 16-byte aligned"):
        b.launch((1,), [base[1:], base, 1, 1.0])
