"""TMA tensor maps for the precompiled kernels' descriptor arguments, encoded through the CUDA driver.

A kernel compiled with a host tensor descriptor argument (``triton.tools.tensor_descriptor.TensorDescriptor``)
takes a 128-byte ``CUtensorMap`` by value, then the tensor's shape (i32) and strides (i64), one of each a
dimension. The map holds the tensor's address, shape and strides and what the compiled kernel fixed: the box
each TMA copy moves, its swizzle and element type (Triton's ``tensordesc_meta``, kept in the artifact's kernel
index). ``TensorMaps.address`` encodes one with ``cuTensorMapEncodeTiled``, as Triton's own launcher does, and
keeps it: a map depends only on those values, so the KV cache's maps are encoded once and every later launch
(and a CUDA graph's capture, which copies the parameters) reads the kept one.
"""

from __future__ import annotations

import ctypes

from mxc.errors import MxcError

_MAP_BYTES, _MAP_ALIGN = 128, 64
# Triton's element type enum on the device side -> the driver's CUtensorMapDataType (they differ at 8-10)
_DEVICE_TO_HOST_DTYPE = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}
_INTERLEAVE_NONE, _L2_PROMOTION_128B = 0, 2
_OOB_FILL_NONE, _OOB_FILL_NAN = 0, 1
_KEEP = 4096  # maps kept at most (a long-running process with ever new buffers starts over past it)


def supported(meta: dict) -> str | None:
    """Why the launcher cannot encode this descriptor's map (None: it can)."""
    if meta.get("is_im2col"):
        return "an im2col tensor descriptor"
    if meta.get("fp4_padded"):
        return "a padded fp4 tensor descriptor"
    return None


def _declare(lib) -> None:
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn = getattr(lib, "cuTensorMapEncodeTiled", None)
    if fn is not None and hasattr(fn, "argtypes"):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]


class TensorMaps:
    """Encoded maps, by everything a map holds."""

    def __init__(self, lib):
        self.lib = lib
        _declare(lib)
        self._maps: dict[tuple, tuple] = {}  # -> (buffer, the map's address in it, the meta its key names)

    def address(self, desc, meta: dict) -> int:
        """The host address of ``desc``'s map (64-byte aligned, kept while this object lives) for a kernel
        compiled with ``meta`` (one of the index's entries: kept by identity, and alive with its entry)."""
        base = desc.base.data_ptr()
        key = (base, tuple(desc.shape), tuple(desc.strides), desc.padding, id(meta))
        kept = self._maps.get(key)
        if kept is None:
            if len(self._maps) >= _KEEP:
                self._maps.clear()
            kept = self._maps[key] = self._encode(base, key[1], key[2], desc.padding, meta) + (meta,)
        return kept[1]

    def _encode(self, base: int, shape, strides, padding: str, meta: dict) -> tuple[ctypes.Array, int]:
        rank, size = len(shape), meta["elem_size"]
        if strides[-1] != 1:
            raise MxcError(f"a tensor descriptor's last dimension must be contiguous, strides {strides}")
        buf = ctypes.create_string_buffer(_MAP_BYTES + _MAP_ALIGN)
        at = -(-ctypes.addressof(buf) // _MAP_ALIGN) * _MAP_ALIGN
        # the driver lists dimensions innermost first; strides in bytes, the innermost (one element) left out
        dims = (ctypes.c_uint64 * rank)(*reversed(shape))
        byte_strides = (ctypes.c_uint64 * max(rank - 1, 1))(*[s * size for s in reversed(strides[:-1])])
        box = (ctypes.c_uint32 * rank)(*reversed(meta["block_size"]))
        ones = (ctypes.c_uint32 * rank)(*([1] * rank))
        code = self.lib.cuTensorMapEncodeTiled(
            ctypes.c_void_p(at), _DEVICE_TO_HOST_DTYPE[meta["elem_type"]], rank, ctypes.c_void_p(base), dims,
            byte_strides, box, ones, _INTERLEAVE_NONE, meta["swizzle"], _L2_PROMOTION_128B,
            _OOB_FILL_NAN if padding == "nan" else _OOB_FILL_NONE)
        if code != 0:
            raise RuntimeError(f"CUDA driver error {code} encoding a tensor map (shape {shape}, strides {strides}, "
                               f"box {meta['block_size']}, address {base:#x})")
        return buf, at
