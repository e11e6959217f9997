"""fp8 GEMMs through vendor libraries: cuBLASLt via ``torch._scaled_mm``, and CUTLASS where it builds.

``scaled_mm`` quantizes activations per token (on the GPU with
``triton_fp8_quant``'s quantize kernel, the SiLU-and-mul prologue folded in), then runs the fp8 x fp8 GEMM
with row-wise scaling (activation scale per row, weight scale per output
channel) and bf16/fp16 output: the compute-bound path for prefill. It serves
``channel`` and ``tensor`` scales (both stored per row); K and N must be
multiples of 16.
"""

from __future__ import annotations

import torch

from mxc.kernels import torch_ref, triton_fp8_quant
from mxc.kernels.fp8_ref import quantize_rows


def scaled_mm(x, weight, scale, bias=None, residual=None, granularity="channel", prologue=None, norm_weight=None,
              eps=1e-6):
    m, k = x.shape[0], weight.shape[1]
    if x.device.type == "cpu":
        if prologue == "silu_mul":
            gate, up = x.chunk(2, dim=-1)
            x = torch.nn.functional.silu(gate) * up
        elif prologue == "rms_norm":
            x = torch_ref.rms_norm(x, norm_weight, eps)
        xq, xs = quantize_rows(x)
    else:  # one Triton kernel: the prologue and the per-token quantization, the row read once
        xq, xs = triton_fp8_quant._prequantize(x, m, k, prologue == "silu_mul", triton_fp8_quant._quant_block(k),
                                         norm_weight if prologue == "rms_norm" else None, eps)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs[:, None], scale_b=scale[None, :].float(), out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y


def cutlass_available() -> str | None:
    """None when the CUTLASS Python interface can generate kernels here, else why not."""
    try:
        import cutlass_cppgen  # noqa: F401  (package nvidia-cutlass)
    except ImportError:
        return "the CUTLASS Python interface (package nvidia-cutlass, module cutlass_cppgen) is not installed"
    return "CUTLASS fp8 kernel generation is not wired into the AOT build yet"
