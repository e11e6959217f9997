"""The push all-reduce kernel (``peer_allreduce.push_all_reduce``) under the interpreter, ranks simulated
in one process: each rank's buffer is an ordinary tensor and the pointer table holds their addresses.

A real rank waits for its peers' pushes; here the calls run one rank after another (0, 1, ...), so
before each call the test writes the rows of the ranks that run later into the buffers of those that
run earlier, as their pushes would; every other row arrives by a kernel's own push. Checked against the torch reference: the sum in rank order rounded to the
model dtype, + bias, + residual, RMSNorm; every rank gets the same bits; the slots rotate and the
previous one is reset; a peer that never arrives sets the state's flag instead of hanging.
"""

from __future__ import annotations

import pytest
import torch

from mxc.kernels import torch_ref
from mxc.kernels.peer_allreduce import push_all_reduce

pytestmark = pytest.mark.interpreter  # ranks run one after another, which only the interpreter allows

EMPTY = -32768


class Ranks:
    def __init__(self, world, H, max_tokens, dtype):
        self.world, self.H, self.dtype = world, H, dtype
        self.slot = world * max_tokens * H
        self.bufs = [torch.full((3 * self.slot,), EMPTY, dtype=torch.int16) for _ in range(world)]
        self.ptrs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64)
        self.states = [torch.zeros(4, dtype=torch.int32) for _ in range(world)]

    def deliver(self, xs, skip=()):
        """Write the rows of each rank into the current slot of the ranks that run before it (lower
        ranks), as its push will; the lower ranks' kernels push theirs themselves."""
        T = xs[0].shape[0]
        for src, x in enumerate(xs):
            bits = x.contiguous().view(torch.int16).reshape(-1).clone()
            bits[bits == EMPTY] = 0
            for dst in range(src):
                if (src, dst) not in skip:
                    at = int(self.states[dst][0]) * self.slot + src * T * self.H
                    self.bufs[dst][at:at + T * self.H] = bits

    def call(self, xs, **kw):
        # a row that never arrives ends the wait after a few reads (the late flag, wrong sums), not a hang
        return [push_all_reduce(xs[r], self.ptrs, self.states[r], r, self.slot, self.world, max_spins=8, **kw)
                for r in range(self.world)]


def _reference_sum(xs):
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("what", ["sum", "sum+bias", "add", "add_rms_norm", "add_rms_norm+bias"])
def test_push_all_reduce_matches_reference(world, dtype, what):
    H = 96  # ragged: a block of 128 lanes
    g = torch.Generator().manual_seed(world)
    ranks = Ranks(world, H, max_tokens=4, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(H, generator=g)).to(dtype) if "bias" in what else None
    for call, T in enumerate([3, 1, 4, 2]):  # the reset region follows each call's row count
        xs = [torch.randn(T, H, generator=g).to(dtype) for _ in range(world)]
        xs[0][0, :4] = -0.0  # sent as +0.0: never mistaken for "not written yet"
        residual = torch.randn(T, H, generator=g).to(dtype)
        flags = [int(s[0]) for s in ranks.states]
        ranks.deliver(xs)
        kw = {"bias": bias}
        if what.startswith("add"):
            kw["residual"] = residual
        if what.startswith("add_rms_norm"):
            kw.update(weight=weight, eps=1e-5)
        outs = ranks.call(xs, **kw)
        t = _reference_sum(xs) if bias is None else (_reference_sum(xs).float() + bias.float()).to(dtype)
        if what.startswith("add_rms_norm"):
            want = torch_ref.add_rms_norm(residual, t, weight, 1e-5)
        elif what == "add":
            want = torch_ref.add(residual, t)
        else:
            want = t
        for r, out in enumerate(outs):
            got = out if isinstance(out, tuple) else (out,)
            want_t = want if isinstance(want, tuple) else (want,)
            for a, b in zip(got, want_t):
                assert torch.equal(a, b), (call, r, what)
        for r in range(world):
            state = ranks.states[r].tolist()
            assert state[0] == (flags[r] + 1) % 3 and state[1:] == [world * T * H, 0, 0], (call, r, state)
            if call:  # the previous call's slot is back to "not written yet"
                prev = (flags[r] + 2) % 3
                assert bool((ranks.bufs[r][prev * ranks.slot:(prev + 1) * ranks.slot] == EMPTY).all())
            for src in range(world):  # this call's pushes landed where the peers read them
                if src != r:
                    at = flags[r] * ranks.slot + src * T * H
                    sent = xs[src].contiguous().view(torch.int16).reshape(-1)
                    got = ranks.bufs[r][at:at + T * H]
                    assert torch.equal(torch.where(sent == EMPTY, 0, sent), got)


def test_missing_peer_sets_the_late_flag():
    """A rank whose peer never pushes gives up after ``max_spins`` reads and flags it in state[3]; the
    runtime's check then raises, at every later call too."""
    from mxc.errors import MxcError
    from mxc.kernels.peer_allreduce import PushAllReduce

    ranks = Ranks(2, 64, max_tokens=2, dtype=torch.bfloat16)
    xs = [torch.randn(2, 64, dtype=torch.bfloat16) for _ in range(2)]
    ranks.deliver(xs, skip={(1, 0)})  # rank 1's rows never reach rank 0
    push_all_reduce(xs[0], ranks.ptrs, ranks.states[0], 0, ranks.slot, 2, max_spins=3)
    assert ranks.states[0].tolist() == [1, 2 * 2 * 64, 0, 1]
    comm = object.__new__(PushAllReduce)  # its check alone (no process group: this rank's flag)
    comm.world, comm.state = 1, ranks.states[0]
    for _ in range(2):
        with pytest.raises(MxcError, match="did not deliver its partial sums"):
            comm.check()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("what", ["add", "add_rms_norm+bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # --tp-allreduce auto picks push for both
def test_pushing_gemv_then_the_wait_kernel(world, what, dtype):
    """The row-parallel GEMV pushes its rows into every rank's buffer itself (``linear_small_m_push``) and
    the wait kernel (``pushed=True``) sums them: the same as the GEMV's rounded partials all-reduced,
    over rotating slots; the previous slot is reset. Every GEMV runs before any wait here (one process),
    so no row is missing when a wait reads it."""
    from mxc.kernels.triton_gemv import linear_small_m_push

    H, K = 96, 80
    g = torch.Generator().manual_seed(world)
    ranks = Ranks(world, H, max_tokens=4, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(H, generator=g)).to(dtype) if "bias" in what else None
    ws = [(torch.randn(H, K, generator=g) * K ** -0.5).to(dtype) for _ in range(world)]
    for call, T in enumerate([3, 1, 4]):
        xs = [torch.randn(T, K, generator=g).to(dtype) for _ in range(world)]
        residual = torch.randn(T, H, generator=g).to(dtype)
        flags = [int(s[0]) for s in ranks.states]
        for r in range(world):
            linear_small_m_push(xs[r], ws[r], ranks.ptrs, ranks.states[r], r, ranks.slot, world)
        kw = dict(residual=residual, bias=bias)
        if what.startswith("add_rms_norm"):
            kw.update(weight=weight, eps=1e-5)
        rows = torch.empty((T, H), dtype=dtype, device="meta")
        outs = [push_all_reduce(rows, ranks.ptrs, ranks.states[r], r, ranks.slot, world, max_spins=8, pushed=True,
                                **kw) for r in range(world)]
        partials = [torch_ref.linear(x.float(), w.float()).to(dtype) for x, w in zip(xs, ws)]
        t = _reference_sum(partials) if bias is None else (_reference_sum(partials).float() + bias.float()).to(dtype)
        want = torch_ref.add_rms_norm(residual, t, weight, 1e-5) if "rms_norm" in what else torch_ref.add(residual, t)
        for r, out in enumerate(outs):
            got = out if isinstance(out, tuple) else (out,)
            want_t = want if isinstance(want, tuple) else (want,)
            for a, b in zip(got, want_t):
                # the GEMV's fp32 sums may round an ulp apart from torch's in the partials
                torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
            assert torch.equal(got[0], outs[0][0] if isinstance(outs[0], tuple) else outs[0])  # the same bits
        for r in range(world):
            assert ranks.states[r].tolist()[:3] == [(flags[r] + 1) % 3, world * T * H, 0]
            if call:
                prev = (flags[r] + 2) % 3
                assert bool((ranks.bufs[r][prev * ranks.slot:(prev + 1) * ranks.slot] == EMPTY).all())


def test_host_checks_refuse_before_launching():
    """push_all_reduce's host checks (a slot holds every rank's rows; the RMSNorm needs the residual; x
    contiguous), the runtime's dtype rule and ``fits`` (PushAllReduce, OneShotAllReduce)."""
    from mxc.kernels.peer_allreduce import OneShotAllReduce, PushAllReduce

    ranks = Ranks(2, 64, max_tokens=2, dtype=torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    def call(x, slot=ranks.slot, **kw):  # max_spins=1: a launch a check let through ends at once
        return push_all_reduce(x, ranks.ptrs, ranks.states[0], 0, slot, 2, max_spins=1, **kw)
    with pytest.raises(AssertionError, match="exceed a slot"):
        call(x, slot=2 * 64 * 2 - 1)  # T * H fits, T * H * world does not
    with pytest.raises(AssertionError, match="RMSNorm follows the residual"):
        call(x, weight=torch.ones(64, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="contiguous"):
        call(torch.randn(64, 2, dtype=torch.bfloat16).t())
    assert ranks.states[0].tolist() == [0, 0, 0, 0]  # nothing launched (a launch advances the slot)
    with pytest.raises(RuntimeError, match="bf16 or fp16"):
        PushAllReduce(None, 2, 64, torch.float32, torch.device("cpu"))
    comm = object.__new__(PushAllReduce)
    comm.max_tokens, comm.hidden, comm.dtype = 2, 64, torch.bfloat16
    assert comm.fits(x) and comm.fits(x[:1]) and not comm.fits(torch.cat([x, x[:1]]))
    assert not comm.fits(x.half()) and not comm.fits(x[:, :32]) and not comm.fits(x[0])
    one = object.__new__(OneShotAllReduce)
    one.buffer = torch.empty(128, dtype=torch.bfloat16)
    assert one.fits(x) and not one.fits(x.float()) and not one.fits(torch.cat([x, x[:1]]))


def test_check_flag_from_a_peer_sticks(monkeypatch):
    """A peer's late flag (all-reduced over the ranks) makes this rank's check raise, and keep raising after."""
    import torch.distributed as dist

    from mxc.errors import MxcError
    from mxc.kernels.peer_allreduce import PushAllReduce

    comm = object.__new__(PushAllReduce)
    comm.world, comm.group, comm.state = 2, None, torch.zeros(4, dtype=torch.int32)
    peer_late = [1]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: t.fill_(max(int(t), peer_late[0])))
    with pytest.raises(MxcError, match="did not deliver"):
        comm.check()
    peer_late[0] = 0
    with pytest.raises(MxcError, match="did not deliver"):
        comm.check()


def test_runtime_methods_pass_their_arguments_through():
    """``PushAllReduce``'s methods (what the ``cuda_ops`` adapters call) on one rank, its buffer an ordinary
    tensor (the set-up is collective and needs CUDA): the sum (+ bias), the residual add, the RMSNorm with the
    given eps, and the pushing GEMV's ``linear_add`` / ``linear_add_rms_norm``, each against the torch reference;
    the slot advances each call."""
    from mxc.kernels.peer_allreduce import PushAllReduce

    H, K, T, dtype = 96, 80, 3, torch.bfloat16
    g = torch.Generator().manual_seed(21)
    ranks = Ranks(1, H, max_tokens=4, dtype=dtype)
    comm = object.__new__(PushAllReduce)
    comm.world, comm.rank, comm.max_tokens, comm.hidden, comm.dtype = 1, 0, 4, H, dtype
    comm.slot_elems, comm.bufs, comm.state = ranks.slot, ranks.ptrs, ranks.states[0]
    x, r = torch.randn(T, H, generator=g).to(dtype), torch.randn(T, H, generator=g).to(dtype)
    bias, weight = (torch.randn(H, generator=g)).to(dtype), (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    xk, w = torch.randn(T, K, generator=g).to(dtype), (torch.randn(H, K, generator=g) * K ** -0.5).to(dtype)
    eps = 0.5  # far from the default: a dropped eps shows
    with_bias = (x.float() + bias.float()).to(dtype)
    assert torch.equal(comm(x), x)
    assert torch.equal(comm(x, bias), with_bias)
    assert torch.equal(comm.add(x, r, bias), torch_ref.add(r, with_bias))
    s, h = comm.add_rms_norm(x, r, weight, eps, bias)
    want_s, want_h = torch_ref.add_rms_norm(r, with_bias, weight, eps)
    assert torch.equal(s, want_s) and torch.equal(h, want_h)
    y = torch_ref.linear(xk.float(), w.float()).to(dtype)  # the GEMV's rounded rows (an ulp apart at most)
    y_b = (y.float() + bias.float()).to(dtype)
    torch.testing.assert_close(comm.linear_add(xk, w, r, bias).float(), torch_ref.add(r, y_b).float(),
                               atol=2e-2, rtol=2e-2)
    s, h = comm.linear_add_rms_norm(xk, w, r, weight, eps, bias)
    want_s, want_h = torch_ref.add_rms_norm(r, y_b, weight, eps)
    torch.testing.assert_close(s.float(), want_s.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(h.float(), want_h.float(), atol=2e-2, rtol=2e-2)
    assert comm.state.tolist() == [6 % 3, T * H, 0, 0]
    comm.check()  # no peer was late
    assert comm.fits(x) and not comm.fits(x.view(T, H, 1)) and not comm.fits(x[0, :4])  # rows of H only
