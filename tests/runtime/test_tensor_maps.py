"""``tensor_maps.TensorMaps``: a descriptor's TMA map encoded with the arguments Triton's own launcher gives
``cuTensorMapEncodeTiled`` (triton/backends/nvidia: ``make_tensordesc_arg`` and ``fill_tma_descriptor_tiled``),
and kept per (tensor, shape, strides, padding, kernel entry). A stand-in driver records the calls (no GPU)."""

from __future__ import annotations

import ctypes
import types

import pytest
import torch
from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

from mxc.errors import MxcError
from mxc.runtime import tensor_maps
from mxc.runtime.tensor_maps import TensorMaps


class _Driver:
    def __init__(self, code=0):
        self.calls, self.code = [], code

    def cuTensorMapEncodeTiled(self, at, dtype, rank, base, dims, strides, box, elem_strides, interleave, swizzle,
                               l2, fill):
        self.calls.append(dict(at=at.value, dtype=dtype, rank=rank, base=base.value, dims=list(dims),
                               strides=list(strides)[:max(rank - 1, 0)], box=list(box), elem_strides=list(elem_strides),
                               interleave=interleave, swizzle=swizzle, l2=l2, fill=fill))
        return self.code


def _desc(t: torch.Tensor, block, padding="zero"):
    return types.SimpleNamespace(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=list(block),
                                 padding=padding)


META = dict(elem_size=2, elem_type=10, block_size=[1, 2, 64], swizzle=3)


@pytest.mark.parametrize("padding, fill", [("zero", 0), ("nan", 1)])
def test_encodes_as_triton_s_launcher(padding, fill):
    """Dimensions innermost first; strides in bytes, the innermost left out; the box reversed; element strides 1;
    no interleave, 128-byte L2 promotion; NaN fill for a "nan" descriptor; the element type mapped to the host's
    enum as Triton maps it."""
    drv = _Driver()
    maps = TensorMaps(drv)
    t = torch.zeros(4, 6, 256, dtype=torch.bfloat16)[:, :, :128]  # a row stride wider than the row
    at = maps.address(_desc(t, META["block_size"], padding), META)
    (call,) = drv.calls
    assert at == call["at"] and at % 64 == 0
    assert call == dict(at=at, dtype=TMA_DTYPE_DEVICE_TO_HOST[10], rank=3, base=t.data_ptr(), dims=[128, 6, 4],
                        strides=[256 * 2, 6 * 256 * 2], box=[64, 2, 1], elem_strides=[1, 1, 1], interleave=0,
                        swizzle=3, l2=2, fill=fill)


def test_element_types_map_as_triton_s():
    drv = _Driver()
    maps = TensorMaps(drv)
    t = torch.zeros(8, 16, dtype=torch.float16)
    for elem_type in range(16):
        maps.address(_desc(t, [8, 16]), dict(META, elem_type=elem_type, block_size=[8, 16]))
    assert [c["dtype"] for c in drv.calls] == [TMA_DTYPE_DEVICE_TO_HOST[e] for e in range(16)]


def test_maps_are_kept_by_what_they_hold():
    drv = _Driver()
    maps = TensorMaps(drv)
    t = torch.zeros(4, 64, dtype=torch.float16)
    meta = dict(META, block_size=[2, 64])
    first = maps.address(_desc(t, [2, 64]), meta)
    assert maps.address(_desc(t, [2, 64]), meta) == first and len(drv.calls) == 1  # the kept map
    maps.address(_desc(t[:2], [2, 64]), meta)  # another shape
    maps.address(_desc(t, [2, 64], "nan"), meta)  # another padding
    maps.address(_desc(t, [2, 64]), dict(meta))  # another kernel entry
    maps.address(_desc(torch.zeros(4, 64, dtype=torch.float16), [2, 64]), meta)  # another tensor
    assert len(drv.calls) == 5
    # the map's address stays valid while it is kept: its bytes are the kept buffer's
    assert ctypes.addressof(maps._maps[(t.data_ptr(), (4, 64), (64, 1), "zero", id(meta))][0]) <= first


def test_keeps_at_most_keep_maps(monkeypatch):
    monkeypatch.setattr(tensor_maps, "_KEEP", 3)
    drv = _Driver()
    maps = TensorMaps(drv)
    meta = dict(META, block_size=[1, 64])
    tensors = [torch.zeros(2, 64, dtype=torch.float16) for _ in range(5)]
    for t in tensors:
        maps.address(_desc(t, [1, 64]), meta)
        assert len(maps._maps) <= 3
    maps.address(_desc(tensors[-1], [1, 64]), meta)
    assert len(drv.calls) == 5  # the newest is still kept


def test_refuses_a_non_contiguous_last_dimension_and_reports_driver_errors():
    t = torch.zeros(64, 8, dtype=torch.float16).t()
    with pytest.raises(MxcError, match="last dimension must be contiguous"):
        TensorMaps(_Driver()).address(_desc(t, [8, 8]), dict(META, block_size=[8, 8]))
    with pytest.raises(RuntimeError, match="CUDA driver error 1 encoding a tensor map"):
        TensorMaps(_Driver(code=1)).address(_desc(torch.zeros(8, 8), [8, 8]), dict(META, block_size=[8, 8]))
