"""Positive control for `bash bench/gpu_session.sh sanitize`: a Triton kernel that reads one element past its input.

The sanitize part runs the kernel tests under compute-sanitizer's memcheck with PyTorch's caching allocator off, so
each tensor is its own cudaMalloc and a read past it falls outside every allocation. A clean report only means
something if memcheck catches this kernel's read under the same settings; the part checks that it does.

Run under memcheck: `python bench/sanitizer_control.py [--in-bounds]` (--in-bounds: the same kernel masked, which
must report nothing).
"""

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, OVERRUN: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    limit = n + OVERRUN  # OVERRUN = 1: the last lane reads x[n], one element past the tensor
    v = tl.load(x_ptr + offs, mask=offs < limit, other=0.0)
    tl.store(y_ptr + offs, v, mask=offs < n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-bounds", action="store_true", help="mask the read correctly (memcheck must be quiet)")
    args = parser.parse_args()
    n = 1000  # 4000 bytes: not a multiple of cudaMalloc's granularity, so the bytes past it are no allocation's
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    _copy_kernel[(1,)](x, y, n, BLOCK=1024, OVERRUN=0 if args.in_bounds else 1)
    torch.cuda.synchronize()
    assert torch.equal(x, y)
    print(f"control kernel ran ({'in bounds' if args.in_bounds else 'reading x[n]'})")


if __name__ == "__main__":
    main()
