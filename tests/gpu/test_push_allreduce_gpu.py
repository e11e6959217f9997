"""The push all-reduce (``peer_allreduce.PushAllReduce``) on two GPUs: against NCCL + the Triton add and
RMSNorm, eagerly and replayed from a CUDA graph many times, with row counts that change from call to
call (the slot reset follows them) and one rank held back (its peer must wait, not read stale rows);
also with the rows pushed by the GEMV before it (``linear_add``, ``linear_add_rms_norm``)."""

from __future__ import annotations

import pytest
import torch

from mxc.runtime.ranks import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def _worker(rank, world_size, device, out):
    import torch.distributed as dist

    from mxc.kernels import torch_ref
    from mxc.kernels.peer_allreduce import PushAllReduce

    H = 4096
    comm = PushAllReduce(None, 32, H, torch.bfloat16, torch.device(device))
    g = torch.Generator(device).manual_seed(rank)
    weight = (1 + 0.1 * torch.randn(H, generator=torch.Generator(device).manual_seed(9), device=device)).bfloat16()
    rows = [1, 8, 3, 32, 1, 2]
    xs = [torch.randn(t, H, generator=g, device=device).bfloat16() for t in rows]
    res = [torch.randn(t, H, generator=torch.Generator(device).manual_seed(7 + i), device=device).bfloat16()
           for i, t in enumerate(rows)]
    K = 2048  # the o projection's per-rank K at tp=2 (Llama-3-8B)
    w_lin = (torch.randn(H, K, generator=g, device=device) * K ** -0.5).bfloat16()
    ins = [torch.randn(t, K, generator=g, device=device).bfloat16() for t in rows]
    want, want_lin = [], []
    for x, r, a in zip(xs, res, ins):
        total = x.clone()
        dist.all_reduce(total)  # NCCL in bf16; the push kernel sums in fp32 and rounds once
        want.append(torch_ref.add_rms_norm(r, total, weight, 1e-5))
        part = torch.nn.functional.linear(a, w_lin)  # this rank's rounded partial, as the GEMV rounds it
        dist.all_reduce(part)
        want_lin.append(torch_ref.add_rms_norm(r, part, weight, 1e-5))

    def once():
        outs = []
        for i, (x, r) in enumerate(zip(xs, res)):
            if rank == 1 and i == 2:
                torch.cuda._sleep(2_000_000)  # rank 1 late: rank 0 must wait for its rows
            outs.append(comm.add_rms_norm(x, r, weight, 1e-5))
            outs.append((comm.add(x, r), comm(x)))
            outs.append((comm.linear_add_rms_norm(ins[i], w_lin, r, weight, 1e-5), comm.linear_add(ins[i], w_lin, r)))
        return outs

    errors, linear_errors = [], []

    def check(outs):
        for i in range(len(rows)):
            (s, h), (s2, _), ((ls, lh), ls2) = outs[3 * i], outs[3 * i + 1], outs[3 * i + 2]
            errors.append(max(float((s - want[i][0]).abs().max()), float((h - want[i][1]).abs().max()),
                              float((s2 - want[i][0]).abs().max())))
            # the pushing GEMV: its fp32 sums may round a partial an ulp apart from cuBLAS's
            linear_errors.append(max(float((ls - want_lin[i][0]).abs().max()), float((lh - want_lin[i][1]).abs().max()),
                              float((ls2 - want_lin[i][0]).abs().max())))
            # same bits on every rank
            gathered = [torch.empty_like(h) for _ in range(world_size)]
            dist.all_gather(gathered, h)
            assert all(torch.equal(gathered[0], o) for o in gathered)

    check(once())
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        once()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = [once() for _ in range(20)]
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    for outs in captured:
        check(outs)
    comm.check()  # nobody gave up waiting
    if rank == 0:
        torch.save({"max_error": max(errors), "max_linear_error": max(linear_errors), "state": comm.state.tolist()},
                   out)


def test_push_all_reduce_two_gpus(tmp_path):
    run_ranks(_worker, 2, "cuda", str(tmp_path / "out.pt"))
    result = torch.load(tmp_path / "out.pt", weights_only=True)
    # bf16 rounding of one sum (NCCL rounds the same sum, maybe another way at a tie) through the norm
    assert result["max_error"] < 0.07, result
    # and the partials' own rounding (GEMV against cuBLAS) besides: a wrong row would be off by ~1 or more
    assert result["max_linear_error"] < 0.2, result
    assert result["state"][3] == 0
