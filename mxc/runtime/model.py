"""A loaded model: full-sequence logits and KV-cached generation.

``Model`` wraps the artifact's generated ``forward`` with the runtime's side
of the contract: flattening a ``[batch, seq]`` batch (or prompts of different
lengths) into the IR's token list, building the
``ForwardContext`` (sequence lengths, KV cache) and choosing which rows need
logits. ``generate`` prefills the prompt, then
decodes one token per step over a preallocated KV cache; ``check_capacity``
holds both to the ``--max-seq-len`` (and on a GPU ``--max-batch``) the artifact
was built for.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from pathlib import Path

import torch

from mxc.errors import MxcError, first_line, size_text
from mxc.kernels.context import ForwardContext, to_device
from mxc.runtime.sampling import check_generate_args, sample

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# input_ids' dtypes: any integer one (not bool), cast to int64 once in the vocabulary
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64)


def on_device(device: torch.device):
    """Make ``device`` the current CUDA device for a block (streams, graphs, the precompiled kernels' context and
    Triton's launches follow the current device, not the tensors'); nothing for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


_CALLS = threading.RLock()  # one forward at a time in a process: see _on_own_device


def _on_own_device(method):
    """Run a ``Model`` method with the model's GPU current (a model on cuda:1 called while cuda:0 is current), one
    call at a time in the process: the kernels' launcher is process-wide (``launch.using``) and a GPU model's KV
    cache and CUDA graphs are its own, so calls from several threads (two models, or one) take turns. A server
    batches requests instead."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with _CALLS, on_device(self.device):
            return method(self, *args, **kwargs)
    return wrapped


class Model:
    def __init__(self, forward, weights: dict[str, torch.Tensor], manifest: dict, device: torch.device, path: Path,
                 launcher=None, rank: int = 0, world_size: int = 1):
        self._forward = forward
        self._launcher = launcher  # precompiled-kernel launcher (cuda artifacts), else Triton's JIT
        self.manifest = manifest
        self.device = device
        self.path = path
        info = manifest["runtime"]
        self.vocab_size: int = info["vocab_size"]
        self.dtype = DTYPES[info["dtype"]]
        self.eos_token_ids: list[int] = list(info["eos_token_id"])  # a copy: editing it leaves the manifest alone
        self.pad_token_id: int | None = info.get("pad_token_id")  # absent in artifacts built before mxc wrote it
        self._kv = info["kv_cache"]
        self._top, self._layers = _split_layers(weights, info.get("layers"))
        self.rank, self.world_size = rank, world_size
        self._dist = dict(rank=rank, world_size=world_size, group=None)  # None = the default process group
        options = manifest["options"]
        if world_size > 1 and options.get("tp_allreduce") in ("one_shot", "push"):
            self._dist["peer_allreduce"] = _peer_allreduce(manifest, options["tp_allreduce"], self.dtype, device)
        self._decoder = None
        if options["target"] == "cuda" and self.device.type == "cuda":
            from mxc.runtime.decode_graphs import CudaDecoder

            self._decoder = CudaDecoder(self._bound_forward, launcher, self._kv, self.dtype, self.device,
                                        options["max_batch"], options["max_seq_len"], self._dist,
                                        options.get("prefill_graph_tokens", 0))

    def _bound_forward(self, ctx, tokens, positions, rows):
        return self._forward(self._top, self._layers, ctx, tokens, positions, rows)

    # --- input checks -------------------------------------------------------------
    def _ids(self, input_ids) -> torch.Tensor:
        """A [batch, seq] batch of ids, checked (integers in the vocabulary), as int64 on the model's device."""
        try:
            ids = torch.as_tensor(input_ids)
        except (ValueError, TypeError, RuntimeError) as e:  # ragged lists, non-numbers, None
            raise MxcError(f"input_ids must be a [batch, seq] integer tensor, or prompts of different lengths as a "
                           f"list of lists or of 1-D tensors; {e}") from None
        _check_layout(ids, "give a plain tensor or a list of lists")
        if ids.dim() != 2 or ids.dtype not in INT_DTYPES or 0 in ids.shape:
            raise MxcError(f"input_ids must be a [batch, seq] integer tensor with batch, seq >= 1, got "
                           f"{list(ids.shape)} {ids.dtype}")
        return self._in_vocab(ids, lambda i: list(divmod(i, ids.shape[1]))).reshape(ids.shape)

    def _prompts(self, input_ids) -> tuple[torch.Tensor, list[int], bool]:
        """``generate``'s prompts: a [batch, seq] batch (as ``_ids`` takes), or a list of prompts of different
        lengths, each a list or 1-D tensor of ids (or a nested tensor of them). Returns every prompt's ids one
        after another [T] (int64, on the model's device), each prompt's length, and whether they were given as
        prompts of their own (not one [batch, seq] batch)."""
        rows = _ragged_rows(input_ids)
        if rows is None:
            ids = self._ids(input_ids)
            return ids.reshape(-1), [ids.shape[1]] * ids.shape[0], False
        tensors = []
        for n, row in enumerate(rows):
            try:
                t = torch.as_tensor(row)
            except (ValueError, TypeError, RuntimeError) as e:
                raise MxcError(f"input_ids[{n}] must be a list or 1-D tensor of integer token ids; {e}") from None
            _check_layout(t, "give a plain tensor or a list", f"input_ids[{n}]")
            if t.dim() != 1 or t.dtype not in INT_DTYPES or t.numel() == 0:
                raise MxcError(f"input_ids[{n}] must be a 1-D integer tensor or list of at least one token id, got "
                               f"{list(t.shape)} {t.dtype}")
            # checked in the row's own dtype (a uint64 id past int64's range is named by its own value)
            tensors.append(self._check_vocab(t.cpu(), lambda i, n=n: [n, i]))
        wide = torch.cat(tensors)
        return to_device(self.device, wide.numpy())[0], [t.numel() for t in tensors], True

    def _in_vocab(self, ids: torch.Tensor, where) -> torch.Tensor:
        """``ids`` as int64 on the model's device, or a one-line error naming the first id outside the vocabulary
        (``where``: a flat index's place in the input, as a list)."""
        wide = self._check_vocab(ids, where)
        return to_device(self.device, wide.numpy())[0] if wide.device.type == "cpu" else wide.to(self.device)

    def _check_vocab(self, ids: torch.Tensor, where) -> torch.Tensor:
        """``ids`` as int64 (on their device), or a one-line error naming the first id outside the vocabulary."""
        # compared as int64: as uint8, the vocabulary size would wrap, and torch compares no uint16 to uint64 (a
        # uint64 id past int64's range reads negative, and is named by its own value)
        wide = ids.to(torch.int64)
        bad = (wide < 0) | (wide >= self.vocab_size)
        if bad.any():
            flat = int(bad.reshape(-1).nonzero()[0])
            raise MxcError(f"token id {ids.reshape(-1)[flat].item()} at {where(flat)} is outside the vocabulary "
                           f"(0..{self.vocab_size - 1})")
        return wide

    def _run(self, ctx: ForwardContext, tokens, positions, logit_rows) -> torch.Tensor:
        from mxc.kernels import launch

        with torch.inference_mode(), launch.using(self._launcher or launch.jit_launch):
            return self._forward(self._top, self._layers, ctx, tokens, positions, logit_rows)

    def _agree(self, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """Under tensor parallelism every rank continues with rank 0's sampled tokens."""
        if self.world_size > 1 and temperature:
            import torch.distributed as dist

            dist.broadcast(tokens, src=0)
        return tokens

    def _check_capacity(self, b: int, s: int, new: int = 0) -> None:
        if self._decoder is not None:  # the GPU decoder's cache: --max-batch slots of --max-seq-len rows
            check_capacity(b, s, new, self._decoder.max_len, self._decoder.max_batch)
        else:
            check_capacity(b, s, new, self.manifest["options"].get("max_seq_len"))

    # --- API ----------------------------------------------------------------------
    @_on_own_device
    def logits(self, input_ids) -> torch.Tensor | list[torch.Tensor]:
        """[batch, seq] token ids -> [batch, seq, vocab] float32 logits (causal, no cache). Prompts of different
        lengths (as ``generate`` takes them) -> a list of [seq, vocab] float32 logits, one a prompt, in one forward
        with no padding."""
        tokens, lens, ragged = self._prompts(input_ids)
        b, s, t = len(lens), max(lens), len(tokens)
        self._check_capacity(b, s)
        if self._decoder is None:  # every row's logits, in the model's dtype and as float32, beside the KV cache
            self._check_host_memory(self._cache_bytes(b, s) + t * self.vocab_size * (self.dtype.itemsize + 4),
                                    f"a logits call of {b} x {s} tokens needs at least",
                                    "give fewer or shorter prompts a call")
        rows = torch.arange(t, device=self.device)
        k_cache, v_cache = (self._decoder.k_cache, self._decoder.v_cache) if self._decoder else self.new_cache(b, s)
        ctx = ForwardContext.build(lens, [0] * b, list(range(b)), k_cache, v_cache, self.device, **self._dist)
        out = self._run(ctx, tokens, ctx.positions, rows)
        self._check_peers()
        return list(out.float().split(lens)) if ragged else out.float().reshape(b, s, -1)

    def _check_peers(self) -> None:
        """A push all-reduce that gave up waiting for a rank (``peer_allreduce``) makes the result wrong: say so."""
        comm = self._dist.get("peer_allreduce")
        if hasattr(comm, "check"):
            comm.check()

    def new_cache(self, batch: int, max_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A KV cache for ``batch`` sequences of ``max_len`` tokens (the CPU path's, allocated per call: one past the
        host's available memory is refused in one line, where zeroing it would have the process killed)."""
        kv = self._kv
        shape = (batch, max_len, kv["kv_heads"], kv["head_dim"])
        self._check_host_memory(self._cache_bytes(batch, max_len), f"the KV cache of {batch} x {max_len} tokens takes",
                                "give a shorter prompt or fewer new tokens")
        make = lambda: [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(kv["layers"])]
        return make(), make()

    def _cache_bytes(self, batch: int, max_len: int) -> int:
        return kv_cache_bytes(self._kv, batch, max_len, self.dtype)

    def _check_host_memory(self, need: int, what: str, fix: str) -> None:
        """On the CPU, ``need`` bytes fit the host's available memory, or a one-line error (``what`` takes how much,
        then ``fix``) before the allocation, which past it would have the process killed rather than raise."""
        available = host_memory_available() if self.device.type == "cpu" else None
        if available is not None and need > available:
            raise MxcError(f"{what} {size_text(need)}, more than the {size_text(available)} of memory available; "
                           f"{fix}")

    @_on_own_device
    def generate(self, input_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop_at_eos: bool = False) -> torch.Tensor:
        """Prefill, then decode one token per step over a KV cache. Returns the new ids [batch, <=max_new_tokens].

        ``input_ids``: a [batch, seq] batch, or a list of prompts of different lengths (each a list or 1-D tensor of
        ids, or a nested tensor of them): each prompt continues as if it ran alone, with no padding.
        With ``stop_at_eos``, a sequence that produced an end-of-sequence token is padded with ``pad_token_id`` (the
        checkpoint's, else the first end-of-sequence id, as transformers' generate pads), and generation ends when
        every sequence has stopped.
        """
        max_new_tokens, temperature, top_k, top_p, seed = check_generate_args(max_new_tokens, temperature, top_k,
                                                                              top_p, seed)  # as int and float
        tokens, lens, _ = self._prompts(input_ids)
        gen = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        b = len(lens)
        self._check_capacity(b, max(lens), max_new_tokens)
        if self._decoder is not None:
            sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
            with torch.inference_mode():
                out = self._decoder.generate(tokens, max_new_tokens, sampling, gen, self._agree,
                                             stop_ids=self.eos_token_ids if stop_at_eos else (), lens=lens).cpu()
            self._check_peers()
            return _stop_at_eos(out, self.eos_token_ids, self.pad_token_id) if stop_at_eos else out
        k_cache, v_cache = self.new_cache(b, max(lens) + max_new_tokens)
        slots = list(range(b))
        eos = torch.tensor(self.eos_token_ids or [-1], device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)  # rows that produced an eos id

        ctx = ForwardContext.build(lens, [0] * b, slots, k_cache, v_cache, self.device, **self._dist)
        logits = self._run(ctx, tokens, ctx.positions, ctx.last_rows)
        out = []
        for step in range(max_new_tokens):
            nxt = self._agree(sample(logits, temperature, top_k, top_p, gen), temperature)
            out.append(nxt)
            done |= torch.isin(nxt, eos)
            if step == max_new_tokens - 1 or (stop_at_eos and bool(done.all())):
                break
            ctx = ForwardContext.build([1] * b, [n + step for n in lens], slots, k_cache, v_cache, self.device,
                                       **self._dist)
            logits = self._run(ctx, nxt, ctx.positions, ctx.last_rows)
        out = torch.stack(out, dim=1).cpu()
        # as the GPU decoder's tokens
        return _stop_at_eos(out, self.eos_token_ids, self.pad_token_id) if stop_at_eos else out


def _check_layout(ids: torch.Tensor, fix: str, name: str = "input_ids") -> None:
    """``ids`` is a plain (strided) tensor with values (not on the meta device), or a one-line error."""
    if ids.is_nested or ids.layout != torch.strided:  # what the checks after cannot index
        layout = "nested" if ids.is_nested else str(ids.layout).removeprefix("torch.")
        kind = "[batch, seq] integer tensor" if name == "input_ids" else "1-D integer tensor"
        raise MxcError(f"{name} must be a {kind} of the default (strided) layout, got a {layout} tensor; {fix}")
    if ids.device.type == "meta":
        raise MxcError(f"{name} are on the meta device, which holds no values; give ids on the cpu or the model's "
                       f"device")


def _ragged_rows(input_ids) -> list | None:
    """The prompts of a list or tuple of sequences that differ in length or are not all lists (1-D tensors, arrays),
    or of a nested tensor, else None (one [batch, seq] batch, or something ``Model._ids`` names)."""
    if isinstance(input_ids, torch.Tensor):
        return list(input_ids.unbind()) if input_ids.is_nested and input_ids.dim() == 2 else None
    if not isinstance(input_ids, (list, tuple)) or not input_ids:
        return None
    try:
        lens = {len(row) for row in input_ids}
    except TypeError:  # an item without a length (a number): not a list of prompts
        return None
    # prompts of one length as lists make one [batch, seq] tensor; a tensor or array among them does not (torch
    # makes no tensor of a list of tensors): the prompts one by one
    return list(input_ids) if len(lens) > 1 or not all(isinstance(row, (list, tuple)) for row in input_ids) else None


def kv_cache_bytes(kv: dict, slots: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache (the manifest's ``runtime.kv_cache``: keys and values of every layer) of ``slots``
    sequences of ``max_len`` rows in ``dtype``."""
    return 2 * kv["layers"] * slots * max_len * kv["kv_heads"] * kv["head_dim"] * dtype.itemsize


def host_memory_available() -> int | None:
    """The bytes of memory the host can give without swapping (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_capacity(b: int, s: int, new: int, max_len: int | None, max_batch: int | None = None) -> None:
    """``b`` sequences of ``s`` prompt tokens and ``new`` new ones fit what the artifact was built for: at most
    ``max_len`` (``--max-seq-len``) tokens a sequence on every device (a GPU's KV cache has no rows for more; the
    CPU's cache is allocated per call, but to no more than the length the artifact was built for) and, given
    ``max_batch`` (the GPU decoder's slots), at most that many sequences. Else a one-line error before any work
    (``mxc generate`` checks here before a tensor-parallel artifact's ranks start). ``max_len=None``: no limit."""
    total = s + new
    over_batch = max_batch is not None and b > max_batch
    if not over_batch and (max_len is None or total <= max_len):
        return
    limits = f"--max-seq-len {max_len}" if max_batch is None else f"--max-batch {max_batch}, --max-seq-len {max_len}"
    # a rebuild is worth suggesting only for a length its KV cache can have (the cuda kernels' 32-bit rows)
    rebuild = f", or rebuild with --max-seq-len {total}" if total < 2**31 else ""
    if over_batch:
        fix = f"run at most {max_batch} sequences a call, or rebuild with --max-batch {b}"
    elif new and s < max_len:
        fix = f"ask for at most {max_len - s} new tokens{rebuild}"
    elif max_len > 1 or not new:
        fix = f"give at most {max_len - 1 if new else max_len} prompt tokens{rebuild}"
    else:  # an artifact built before --max-seq-len 1 was refused: no prompt fits beside a new token
        fix = "rebuild with --max-seq-len 2 or more"
    tokens = f"{total} tokens ({s} prompt + {new} new)" if new else f"{total} tokens"
    raise MxcError(f"batch {b} x {tokens} exceeds what the artifact was built for ({limits}); {fix}")


def _peer_allreduce(manifest: dict, kind: str, dtype: torch.dtype, device: torch.device):
    """The peer-memory all-reduce the artifact asked for (``--tp-allreduce one_shot`` or ``push``), or
    None (NCCL) with a warning where peer memory is not usable here. Collective: every rank calls it
    at load."""
    from mxc.kernels import peer_allreduce
    from mxc.kernels.candidates import ONE_SHOT_MAX_TOKENS

    why = peer_allreduce.available(device)
    if why is None:
        try:
            hidden = int(manifest.get("config", {}).get("hidden_size") or 8192)
            if kind == "push":
                return peer_allreduce.PushAllReduce(None, ONE_SHOT_MAX_TOKENS, hidden, dtype, device)
            return peer_allreduce.OneShotAllReduce(None, ONE_SHOT_MAX_TOKENS * hidden, dtype, device)
        except RuntimeError as e:  # e.g. no peer access between these GPUs
            why = first_line(e)
    print(f"mxc: {kind} all-reduce unavailable ({why}); using NCCL", file=sys.stderr)
    return None


def _stop_at_eos(out: torch.Tensor, eos_ids: list[int], pad_id: int | None) -> torch.Tensor:
    """``stop_at_eos``'s result, on either path, from the tokens generated (which may end early once every row
    has stopped): after each row's first end-of-sequence token, ``pad_id``, else ``eos_ids[0]`` (Hugging Face's
    padding); trimmed after the column where the last row stops."""
    if not eos_ids:
        return out
    is_eos = torch.isin(out, torch.tensor(eos_ids))
    count = is_eos.cumsum(dim=1)
    pad = eos_ids[0] if pad_id is None else pad_id
    out = torch.where(count - is_eos.long() > 0, pad, out)  # an eos earlier in the row
    stopped = (count > 0).all(0)
    if bool(stopped.any()):
        out = out[:, : int(stopped.float().argmax()) + 1]
    return out


def _split_layers(weights: dict, layers: dict | None):
    """Split flat tensor names into top-level weights and per-layer dicts by local name."""
    if not layers:
        return weights, []
    prefix = layers["prefix"]
    head, _, tail = prefix.partition("{" + layers["index"] + "}")
    per_layer = [{} for _ in range(layers["count"])]
    top = {}
    for name, t in weights.items():
        if name.startswith(head) and name[len(head):].split(".")[0].isdigit():
            idx, _, local = name[len(head):].partition(tail if tail else ".")
            per_layer[int(idx)][local] = t
        else:
            top[name] = t
    return top, per_layer
