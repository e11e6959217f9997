"""PDL ordering on the GPU: a kernel launched under PDL sees what the kernel ahead of it writes.

The kernel ahead here (``_late_copy``) passes its wait, lets the next kernel launch, and only then, after
spinning for tens of microseconds, writes its output: a kernel behind it that reads that output before its
own ``griddepcontrol.wait`` reads the old bytes. The decode split kernel did so with q until 2026-12-02
(``mxc.codegen.pdl_check`` now refuses such a kernel at build time). On the H200 (Triton 3.6), that kernel
failed the attention test here (output off by 1.78 and 0.41: q read as the zeros before the copy) and the fixed one
passes; the control shows the launches overlap, so the test can fail.
"""

import pytest
import torch
import triton
import triton.language as tl

from mxc.kernels import launch
from mxc.kernels import triton_attention as ta
from mxc.kernels.pdl import pdl_enter


@triton.jit
def _now(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _late_copy(src_ptr, dst_ptr, n, SPIN_NS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)  # the next kernel may launch from here on
    zero = tl.program_id(0) * 0
    start = _now(zero)
    t = start
    while t - start < SPIN_NS:
        t = _now(zero)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _early_copy(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """The control: reads its input before its wait, as the race did."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n)
    pdl_enter(USE_PDL)
    tl.store(dst_ptr + offs, x, mask=offs < n)


def _late_then(q_new, q, second):
    """``_late_copy`` of q_new into q (zeros before), then ``second()``, both launched for PDL."""
    q.zero_()
    torch.cuda.synchronize()
    with launch.using(launch.jit_launch_pdl):
        n = q.numel()
        launch.launch(_late_copy, (triton.cdiv(n, 1024),), [q_new, q, n], dict(SPIN_NS=SPIN_NS, BLOCK=1024),
                      num_warps=4, num_stages=1)
        out = second()
    torch.cuda.synchronize()
    return out


SPIN_NS = 2_000_000  # 2 ms: far longer than the host takes to launch the kernel behind


def test_the_control_reads_before_the_kernel_ahead_writes():
    """Without it the test below could not fail: a kernel that reads before its wait sees the old bytes, so
    the two launches do overlap (PDL is on) and the kernel ahead writes late enough."""
    q_new = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.empty_like(q_new)
    seen = torch.empty_like(q_new)
    n = q.numel()
    stale = 0
    for _ in range(5):
        _late_then(q_new, q, lambda: launch.launch(_early_copy, (triton.cdiv(n, 1024),), [q, seen, n],
                                                   dict(BLOCK=1024), num_warps=4, num_stages=1))
        stale += int((seen == 0).all().item())
    assert stale > 0, "PDL launches did not overlap: this file's race test cannot observe a read before the wait"


def _reference(q, kc, vc, slot, kv_len, scale):
    k = kc[slot, :kv_len].float()  # [n, HKV, D]
    v = vc[slot, :kv_len].float()
    group = q.shape[1] // kc.shape[2]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("hd,nhd->hn", q[0].float(), k) * scale
    return torch.einsum("hn,nhd->hd", s.softmax(-1), v)[None]


@pytest.mark.parametrize("kv_len", [2, 150])  # not 1: one row's softmax ignores q
def test_decode_attention_reads_q_after_the_kernel_ahead_wrote_it(kv_len):
    HQ, HKV, D, L = 32, 8, 128, 4096
    q_new = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(2, L, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(2, L, HKV, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([1], dtype=torch.int32, device="cuda")
    kv_lens = torch.tensor([kv_len], dtype=torch.int32, device="cuda")
    scale = D ** -0.5
    want = _reference(q_new, kc, vc, 1, kv_len, scale)
    q = torch.empty_like(q_new)
    for _ in range(5):
        out = _late_then(q_new, q, lambda: ta.decode_attention(q, kc, vc, slots, kv_lens, scale,
                                                               early_dependents=True))
        err = (out.float() - want).abs().max().item()
        assert err < 2e-2, f"attention output off by {err}: q read before the kernel ahead wrote it"
