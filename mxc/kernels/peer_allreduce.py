"""One-shot all-reduce over peer memory, for the small all-reduces of tensor-parallel decode.

At tp=2 on two H200s an 8 KB NCCL all-reduce took 14.2 us inside a CUDA graph, 65 of them a
token: 0.92 ms of a 3.12 ms step. A one-shot all-reduce is one kernel: each rank copies its
partial into a buffer every rank can address (NVLink peer memory), a barrier on signal pads,
then each rank reads every peer's buffer and sums; a closing barrier lets the buffer be reused
by the next call. PyTorch ships it as ``torch.ops.symm_mem.one_shot_all_reduce_copy_out`` over
symmetric memory (``torch.distributed._symmetric_memory``), which CUDA graphs capture.

``OneShotAllReduce`` owns the rank's symmetric buffer (allocated and exchanged once, at load:
the rendezvous is collective) and falls back to ``dist.all_reduce`` for what it cannot take
(more elements than its buffer, another dtype). ``available`` says why peer memory is not usable
on this machine, or None.

``PushAllReduce`` (``--tp-allreduce push``) needs no barrier: each rank stores its partial rows
straight into a slot of every peer's buffer, and a peer knows a row has arrived when none of its
values is still -0.0, the mark every slot is reset to after use (a real -0.0 is sent as +0.0),
as TensorRT-LLM's "Lamport" all-reduce does. One kernel (``push_all_reduce_kernel``, rendered from
``kernels/templates/push_all_reduce.py.j2``) pushes, waits, sums in rank order and goes on
with what the graph does next: the residual add (``all_reduce_add``) and the RMSNorm
(``all_reduce_add_rms_norm``), which the ``fuse_all_reduce`` pass makes. Three slots rotate,
advanced by the kernel itself in a small device-side state (``state[0]`` the slot, ``[1]`` how many
values of the previous slot to reset, ``[2]`` a program counter, ``[3]`` set when a peer never
arrived), so it needs nothing from the host between calls and replays inside CUDA graphs: every
rank makes the same sequence of calls, so no rank gets more than one call ahead of another. A
kernel that waited ``MAX_SPINS`` reads (seconds) for a peer gives up rather than hang; the runtime
then raises on every rank at the end of the call, and at every later one (``check``).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from mxc.errors import MxcError
from mxc.kernels import kernel_templates, triton_gemv
from mxc.kernels.candidates import ONE_SHOT_DTYPES, PUSH_DTYPES, dtypes_named
from mxc.kernels.launch import launch, next_pow2
from mxc.kernels.triton_norm import row_warps


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> "bfloat16", as ``mxc.kernels.candidates`` names dtypes."""
    return str(dtype).removeprefix("torch.")


def available(device: torch.device) -> str | None:
    """None when peer-memory all-reduce can run here, else why not."""
    if device.type != "cuda":
        return f"needs CUDA devices, not {device.type}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch.distributed._symmetric_memory is missing ({e})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_out"
    return None


def _symmetric_buffer(group, numel: int, dtype: torch.dtype, device: torch.device, fill: int | None = None):
    """A buffer of ``numel`` values every rank of ``group`` can address (torch symmetric memory), its
    bits set to ``fill`` (int16) if given; returns it and the rendezvous handle. Collective."""
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, a no-op since
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
    buffer = symm_mem.empty(numel, dtype=dtype, device=device)
    if fill is not None:
        buffer.view(torch.int16).fill_(fill)
    return buffer, symm_mem.rendezvous(buffer, group.group_name)


class OneShotAllReduce:
    """Sum of ``x`` over the ranks of ``group`` (None: the default group), one-shot over peer memory."""

    def __init__(self, group, numel: int, dtype: torch.dtype, device: torch.device):
        if _dtype_name(dtype) not in ONE_SHOT_DTYPES:  # before the collective: every rank refuses
            raise RuntimeError(f"torch's one-shot all-reduce sums {dtypes_named(ONE_SHOT_DTYPES)}, not {dtype}")
        self.group = group if group is not None else dist.group.WORLD
        self.group_name = self.group.group_name
        self.buffer, _ = _symmetric_buffer(self.group, numel, dtype, device)
        self._copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
        torch.cuda.synchronize(device)
        dist.barrier(self.group)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` fits the buffer (the adapters in ``cuda_ops`` send anything else to NCCL)."""
        return x.numel() <= self.buffer.numel() and x.dtype == self.buffer.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        inp = self.buffer.narrow(0, 0, x.numel()).view(x.shape)
        out = torch.empty_like(x)
        if self._copy_out is not None:  # the kernel copies x into the buffer itself
            return self._copy_out(inp, x, "sum", self.group_name, out)
        inp.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce_out(inp, "sum", self.group_name, out)


MAX_SPINS = 1 << 22  # reads of a slot before a kernel gives up on a peer (seconds, not a hang)


def push_kernel(H: int, world: int, residual: bool, norm: bool, bias: bool, max_spins: int = MAX_SPINS,
                pushed: bool = False):
    return kernel_templates.kernel("push_all_reduce", "push_all_reduce_kernel", H=H,
                                   BLOCK_H=next_pow2(H), WORLD=world, RESIDUAL=residual, NORM=norm,
                                   BIAS=bias, MAX_SPINS=max_spins, PUSHED=pushed)


def push_all_reduce(x: torch.Tensor, bufs: torch.Tensor, state: torch.Tensor, rank: int, slot_elems: int,
                    world: int, residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, eps: float = 1e-6, max_spins: int = MAX_SPINS,
                    pushed: bool = False):
    """Launch the push all-reduce of ``x`` [T, H] (this rank's partial sums): returns the sum (+ bias),
    or ``residual +`` it with ``residual``, and with ``weight`` also its RMSNorm, as a pair.

    ``bufs`` [world] int64: each rank's symmetric buffer (``3 * slot_elems`` values of x's dtype,
    reset to -0.0) as addressed from this rank; ``state`` [4] int32 on this device, zeros at first.
    With ``pushed``, the GEMV before pushed this rank's rows already (``triton_gemv.linear_small_m_push``):
    ``x`` only gives the shape and dtype (a ``meta`` tensor will do). The outputs are on ``bufs``'s device;
    any device works for recording the launch (``meta`` at build time)."""
    T, H = x.shape
    assert _dtype_name(x.dtype) in PUSH_DTYPES and (pushed or x.is_contiguous()), (
        f"push all-reduce: x must be contiguous bf16/fp16, got {x.dtype}")
    assert T * H * world <= slot_elems, f"push all-reduce: {T} rows of {H} from {world} ranks exceed a slot"
    assert bufs.shape == (world,) and bufs.dtype == torch.int64, "push all-reduce: bufs must be [world] int64"
    assert state.shape == (4,) and state.dtype == torch.int32, "push all-reduce: state must be [4] int32"
    assert weight is None or residual is not None, "push all-reduce: the RMSNorm follows the residual add"
    out = torch.empty((T, H), dtype=x.dtype, device=bufs.device)
    norm_out = torch.empty_like(out) if weight is not None else None
    args = [None if pushed else x, residual, bias, weight, out, norm_out, bufs, state, int(rank), int(slot_elems)]
    args = [a for a in args if a is not None] + ([float(eps)] if weight is not None else [])
    launch(push_kernel(H, world, residual is not None, weight is not None, bias is not None, max_spins, pushed), (T,),
           args, {}, num_warps=row_warps(H), num_stages=1)
    return (out, norm_out) if weight is not None else out


class PushAllReduce:
    """The runtime's push all-reduce for ``group`` (None: the default group): up to ``max_tokens`` rows
    of ``hidden`` features (``fits``; the adapters in ``cuda_ops`` send anything else to NCCL)."""

    def __init__(self, group, max_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device):
        if _dtype_name(dtype) not in PUSH_DTYPES:  # 16-bit values: -0.0 is one int16 pattern
            raise RuntimeError(f"the push all-reduce sums {dtypes_named(PUSH_DTYPES)}, not {dtype}")
        self.group = group if group is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.max_tokens, self.hidden, self.dtype = max_tokens, hidden, dtype
        self.slot_elems = self.world * max_tokens * hidden
        # every value "not written yet" (-0.0)
        self.buffer, handle = _symmetric_buffer(self.group, 3 * self.slot_elems, dtype, device, fill=-32768)
        self.bufs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.state = torch.zeros(4, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(self.group)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] <= self.max_tokens and x.shape[1] == self.hidden and x.dtype == self.dtype

    def linear_add(self, x, w, residual, bias=None) -> torch.Tensor:
        """``residual + (sum over the ranks of x @ w^T + bias)``: the GEMV pushes its rows itself
        (``triton_gemv.linear_small_m_push``; shapes ``triton_gemv.pushes`` takes), one kernel waits."""
        return self._pushed(x, w, residual=residual.contiguous(), bias=bias)

    def linear_add_rms_norm(self, x, w, residual, weight, eps, bias=None):
        """``(s, rms_norm(s))`` of ``s = residual + (sum over the ranks of x @ w^T + bias)``, as ``linear_add``."""
        return self._pushed(x, w, residual=residual.contiguous(), weight=weight, bias=bias, eps=eps)

    def _pushed(self, x, w, **kw):
        triton_gemv.linear_small_m_push(x.contiguous(), w, self.bufs, self.state, self.rank, self.slot_elems,
                                        self.world)
        rows = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device="meta")
        return push_all_reduce(rows, self.bufs, self.state, self.rank, self.slot_elems, self.world, pushed=True, **kw)

    def _run(self, x, **kw):
        return push_all_reduce(x.contiguous(), self.bufs, self.state, self.rank, self.slot_elems, self.world, **kw)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of ``x`` over the ranks (+ bias)."""
        return self._run(x, bias=bias)

    def add(self, x, residual, bias=None) -> torch.Tensor:
        """``residual + (sum of x over the ranks + bias)``."""
        return self._run(x, residual=residual.contiguous(), bias=bias)

    def add_rms_norm(self, x, residual, weight, eps, bias=None):
        """``(s, rms_norm(s))`` of ``s = residual + (sum of x over the ranks + bias)``."""
        return self._run(x, residual=residual.contiguous(), weight=weight, bias=bias, eps=eps)

    def check(self) -> None:
        """Raise on every rank, now and at every later call, once a push all-reduce on any rank gave up
        waiting for a peer: its sum was wrong, and a peer's rows that land late can be read as a later
        call's, so this instance's results cannot be trusted again (load the model again)."""
        late = self.state[3:4].clone()
        if self.world > 1 and dist.is_initialized():
            dist.all_reduce(late, op=dist.ReduceOp.MAX, group=self.group)
        if int(late):
            self.state[3] = 1  # sticky
            raise MxcError("a tensor-parallel rank did not deliver its partial sums to the push all-reduce in "
                           "time (do all ranks run the same calls?); its results since cannot be trusted: "
                           "load the model again")
