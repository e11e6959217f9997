"""Make Triton's interpreter convert floats the way the GPU does (``patch_interpreter``, which the root
``tests/conftest.py`` applies for every test where it sets ``TRITON_INTERPRET=1``, i.e. without CUDA).

Under ``TRITON_INTERPRET=1`` Triton 3.9's interpreter converts floats bit by bit in
``interpreter._convert_float``: downcasts truncate instead of rounding to
nearest even, and fp8 does not saturate. bf16/fp8 values are held as raw
integer bits, so ``create_dot`` multiplies bf16 bit patterns as integers. Here
``_convert_float`` goes through torch's casts (round to nearest even; fp8
saturates to its largest finite value, like the GPU's ``satfinite``
conversions), and ``create_dot`` upcasts bf16 operands to fp32 first. With both
in place, kernels that cast after loading match the GPU bit for bit on
bf16/fp16/fp8 conversions. It also keeps the interpreter from patching ``triton.language`` again at every
helper call inside a launch (``_skip_repatching_in_helper_calls``: speed only) and from building its numpy dtype
table at every call (``_memoize_np_dtypes``: speed only). Nothing is changed when kernels run
on a GPU. (Until the sixty-sixth session this was ``tests/kernels/conftest.py``, so kernels run from other folders'
tests alone got the broken conversions.)
"""

from __future__ import annotations

import numpy as np
import torch

# Triton dtype name -> torch dtype; fp8e4b15 has no torch counterpart and keeps the original conversion.
_TORCH_FLOATS = {
    "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64,
    "fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2,
    "fp8e4b8": torch.float8_e4m3fnuz, "fp8e5b16": torch.float8_e5m2fnuz,
}
# Same-width signed integer dtypes to move raw bits between numpy and torch.
_BITS = {8: (np.int8, torch.int8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32),
         64: (np.int64, torch.int64)}


_patched = False


def bf16_ok() -> bool:
    """Whether bf16 kernels give the GPU's results here: on a GPU, or in the interpreter once patched."""
    return torch.cuda.is_available() or _patched


def patch_interpreter() -> None:
    """Replace the interpreter's float conversion and dot with the GPU-faithful ones (module docstring)."""
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    original_convert_float = interpreter._convert_float
    original_create_dot = interpreter.InterpreterBuilder.create_dot

    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        """``input``: numpy array holding ``input_dtype`` bits -> numpy uint array of ``output_dtype`` bits."""
        src, dst = _TORCH_FLOATS.get(input_dtype.name), _TORCH_FLOATS.get(output_dtype.name)
        if src is None or dst is None or rounding_mode == ir.ROUNDING_MODE.RTZ:
            return original_convert_float(input, input_dtype, output_dtype, rounding_mode)
        np_in, torch_in = _BITS[input_dtype.primitive_bitwidth]
        np_out, torch_out = _BITS[output_dtype.primitive_bitwidth]
        shape = np.shape(input)
        bits = np.ascontiguousarray(input).reshape(-1).view(np_in)
        value = torch.from_numpy(bits.copy()).view(src)
        if dst.itemsize == 1:  # fp8 saturates (NaN stays NaN, inf becomes the largest finite value)
            top = torch.finfo(dst).max
            value = value.to(torch.float32).clamp(-top, top)
        out = value.to(dst).view(torch_out).numpy()
        return out.view(getattr(np, f"uint{output_dtype.primitive_bitwidth}")).reshape(shape)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_create_dot(self, _upcast_bf16(a), _upcast_bf16(b), d, input_precision,
                                   max_num_imprecise_acc)

    def _upcast_bf16(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = _convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    global _patched
    interpreter._convert_float = _convert_float
    interpreter.InterpreterBuilder.create_dot = create_dot
    _skip_repatching_in_helper_calls(interpreter, tl)
    _memoize_np_dtypes(interpreter, tl)
    _patched = True


def _memoize_np_dtypes(interpreter, tl) -> None:
    """Triton's ``interpreter._get_np_dtype`` builds its table of twenty numpy dtypes at every call (60,000 calls,
    2 s of a 24 s MoE program test): here each scalar dtype's answer is kept after its first call, and a block's is
    its element's, as there (speed only)."""
    if not hasattr(interpreter, "_get_np_dtype"):
        return  # another interpreter layout: left as it is
    original, known = interpreter._get_np_dtype, {}

    def _get_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):  # answered before the table is built (and not hashable)
            return original(key)
        if key not in known:
            known[key] = original(key)
        return known[key]

    interpreter._get_np_dtype = _get_np_dtype


def _skip_repatching_in_helper_calls(interpreter, tl) -> None:
    """Triton's interpreter patches ``triton.language`` again (``inspect.getmembers`` over ``tl``, ``tl.math``,
    ``tl.tensor``) at every call of a ``@triton.jit`` helper (``tl.sum`` and ``tl.zeros`` among them), though the
    running launch or an earlier helper patched the same modules already: a third of the time of kernels that call
    helpers in their loops. Within a launch, a helper that sees no language module not patched yet skips it; the
    patches it would make are the same."""
    if not (hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "GridExecutor")):
        return  # another interpreter layout: left as it is
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: list[set[int] | None] = []  # the language modules each running launch patched (None: not yet)
    seen: dict = {}  # function -> the language modules among its globals

    def langs(fn) -> frozenset[int]:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return seen[fn]

    def _patch_lang(fn):
        mods = langs(fn)
        if patched and patched[-1] is None:  # the launch's own call: its scope restores the modules at the end
            patched[-1] = set(mods)
        elif patched and mods <= patched[-1]:
            return None  # a helper's call, whose scope nothing restores
        elif patched:  # a helper seeing another module (tl.sum's tl.core): patched from here on, never restored
            patched[-1] |= mods
        return patch_lang(fn)

    def __call__(self, *args, **kwargs):
        patched.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = __call__
