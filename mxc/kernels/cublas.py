"""cuBLAS GEMMs through torch: the candidate for linears at larger token counts.

A residual without a bias goes into the GEMM's epilogue (``addmm``, beta = 1:
the sum is rounded once, from fp32, instead of after the GEMM and again after
the add); a fused prologue, or a residual with a bias, runs as separate torch
ops around the GEMM.
"""

import torch

from mxc.kernels import torch_ref


def linear(x, weight, bias=None, residual=None, prologue=None):
    if residual is not None and bias is None and prologue is None:
        return torch.addmm(residual, x, weight.t())
    return torch_ref.linear(x, weight, bias, residual, prologue)
