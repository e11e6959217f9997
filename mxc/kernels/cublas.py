"""cuBLAS GEMMs through torch: the candidate for linears at larger token counts."""

import torch.nn.functional as F


def linear(x, weight, bias=None):
    return F.linear(x, weight, bias)
