"""What a forward call knows besides its tensors: sequences and the KV cache.

The IR's tokens are all sequences flattened into one ``[T]`` batch.
``ForwardContext`` says how they split and where their keys and values live:

- host lists (read by the torch reference): ``seq_lens[b]`` new tokens of
  sequence b, ``past_lens[b]`` tokens already cached, ``slots[b]`` its cache row;
- the same on the device (read by GPU kernels, fixed addresses under CUDA
  graphs): ``cache_loc [T] int64`` = slot * max_len + position of each token,
  ``kv_lens [B] int32`` = past + new, ``slots_t [B] int32``, ``q_start [B+1]
  int32`` (prefix sums of seq_lens), ``max_q_len`` and ``decode`` (every
  sequence has exactly one new token); ``positions [T]`` and ``last_rows [B]``
  (int64), the forward's position and logit-row inputs;
- ``k_cache[layer]``/``v_cache[layer]``: ``[slots, max_len, kv_heads, head_dim]``;
- ``rope_tables``: RoPE cos/sin tables prepared at load, by spec;
- ``memo``: values shared by every layer of one call (``counters``: the zeroed
  counts of kernels whose last program finishes the work, and leaves them at 0);
- ``rank``, ``world_size``, ``group``: the tensor-parallel process group;
  ``peer_allreduce``: the runtime's all-reduce over peer memory (one-shot or push), or None.

Kernels read it; the runtime builds it. ``host_arrays`` and ``to_device`` make its sequence tables;
``StaticInputs`` refills them in place at fixed addresses with one pinned copy (the CUDA-graph buckets'
inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class ForwardContext:
    seq_lens: list[int]
    past_lens: list[int]
    slots: list[int]
    k_cache: list[torch.Tensor] | None = None
    v_cache: list[torch.Tensor] | None = None
    cache_loc: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None
    slots_t: torch.Tensor | None = None
    q_start: torch.Tensor | None = None
    max_q_len: int = 0
    decode: bool = False
    rope_tables: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict)
    rank: int = 0  # tensor parallelism: this process's rank, the world size, the process group
    world_size: int = 1
    group: object = None
    peer_allreduce: object = None  # ``peer_allreduce.OneShotAllReduce`` or ``PushAllReduce``, as the artifact asks
    positions: torch.Tensor | None = None  # [T] int64: each token's position (``build`` fills it)
    last_rows: torch.Tensor | None = None  # [B] int64: each sequence's last token row (``build`` fills it)

    def counters(self, name: str, n: int, device) -> torch.Tensor:
        """int32 zeros [>= n] on ``device`` for kernels that count their finished programs and leave the
        counts at 0 again (the last program does the rest of the work): one tensor per name, made on the
        context's first use (for a CUDA graph, its warm-up call, outside the capture) and shared by every
        layer and later call, which rely on the kernels leaving it at 0. ``cuda`` and ``cuda:<current>`` are one
        device (one tensor)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = ("counters", name, str(device))
        t = self.memo.get(key)
        if t is None or t.numel() < n:
            t = self.memo[key] = torch.zeros(n, dtype=torch.int32, device=device)
        return t

    @classmethod
    def build(cls, seq_lens: list[int], past_lens: list[int], slots: list[int], k_cache, v_cache,
              device, **extra) -> "ForwardContext":
        """A context with both the host lists and their device tensors, plus ``positions`` [T] int64 (each token's
        position: past + its index in the sequence) and ``last_rows`` [B] int64 (each sequence's last token row).
        The device tensors are computed on the host by numpy (a few microseconds: torch's CPU ops cost ~10 us
        each, a per-token Python list ~100 us at 2048 tokens) and reach the device in one copy (``to_device``):
        a prefill's first kernel waits for them."""
        max_len = k_cache[0].shape[1] if k_cache else 0
        arrays = host_arrays(seq_lens, past_lens, slots, max_len)
        t = dict(zip(arrays, to_device(device, *arrays.values())))
        return cls(list(seq_lens), list(past_lens), list(slots), k_cache, v_cache,
                   cache_loc=t["cache_loc"], kv_lens=t["kv_lens"], slots_t=t["slots"], q_start=t["q_start"],
                   max_q_len=max(seq_lens), decode=all(n == 1 for n in seq_lens), positions=t["positions"],
                   last_rows=t["last_rows"], **extra)


def host_arrays(seq_lens, past_lens, slots, max_len: int) -> dict[str, np.ndarray]:
    """The device tensors of a context, as numpy arrays: ``cache_loc``, ``positions``, ``last_rows`` [T] / [B]
    int64 and ``kv_lens``, ``slots``, ``q_start`` int32."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    past = np.asarray(past_lens, dtype=np.int64)
    slots_h = np.asarray(slots, dtype=np.int64)
    starts = np.zeros(len(seq_lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=starts[1:])
    # token t of sequence b: position past[b] + (t - starts[b]), cache row slot[b] * max_len + position
    positions = np.arange(starts[-1], dtype=np.int64) + np.repeat(past - starts[:-1], lens)
    cache_loc = positions + np.repeat(slots_h * max_len, lens)
    return dict(cache_loc=cache_loc, positions=positions, last_rows=starts[1:] - 1,
                kv_lens=(past + lens).astype(np.int32), slots=slots_h.astype(np.int32), q_start=starts.astype(np.int32))


_ALIGN = 16  # bytes: each tensor of a staged copy starts where a kernel's vector loads may assume it does


def to_device(device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Tensors on ``device`` with the values, shapes and dtypes of host ``arrays`` (numpy). On CUDA, packed into one
    pinned host buffer (each at a 16-byte boundary) and sent by one asynchronous copy: nothing waits for the
    GPU (a copy from pageable memory makes the host wait until the stream is idle), and a few small arrays
    cost one copy, not one each. The pinned buffer comes from torch's caching host allocator, which keeps it
    until the copy is done."""
    device = torch.device(device)
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
    offsets, size = _packing(arrays)
    dev = _staged(arrays, offsets, size).to(device, non_blocking=True)
    return _views(dev, arrays, offsets)


class StaticInputs:
    """Device tensors at fixed addresses (a CUDA graph's inputs), refilled from host arrays by one copy.

    Made from example arrays (their names, shapes and dtypes fix the layout); ``fill`` takes arrays of the
    same shapes and dtypes, packs them as ``to_device`` does and copies them into place asynchronously on
    the current stream. ``tensors`` maps each name to its view of the one device buffer."""

    def __init__(self, device, **arrays: np.ndarray):
        self.device = torch.device(device)
        self._spec = {k: (a.shape, a.dtype) for k, a in arrays.items()}
        self._offsets, size = _packing(arrays.values())
        self._buffer = torch.zeros(size, dtype=torch.uint8, device=self.device)
        self.tensors = dict(zip(arrays, _views(self._buffer, arrays.values(), self._offsets)))
        self.fill(**arrays)

    def fill(self, **arrays: np.ndarray) -> None:
        assert {k: (a.shape, a.dtype) for k, a in arrays.items()} == self._spec, "inputs differ from the layout"
        stage = _staged(arrays.values(), self._offsets, self._buffer.numel(), pin=self.device.type == "cuda")
        self._buffer.copy_(stage, non_blocking=True)


def _packing(arrays) -> tuple[list[int], int]:
    """Each array's byte offset in one buffer (each at a 16-byte boundary) and the buffer's size."""
    offsets, size = [], 0
    for a in arrays:
        offsets.append(size)
        size += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, max(size, _ALIGN)


def _staged(arrays, offsets, size: int, pin: bool = True) -> torch.Tensor:
    """A host uint8 buffer (pinned: from torch's caching host allocator) holding ``arrays`` at ``offsets``."""
    stage = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    host = stage.numpy()
    for a, off in zip(arrays, offsets):
        host[off:off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
    return stage


def _views(buffer: torch.Tensor, arrays, offsets) -> list[torch.Tensor]:
    return [buffer[off:off + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]


_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}
