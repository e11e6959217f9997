"""Buckets shared by the build (which compiles kernels for them) and the runtime (which captures one CUDA
graph per bucket and pads up to it; padding rows write only to the KV cache's scratch slot): decode batch
sizes, powers of two up to the first one that holds ``max_batch``, and batch-1 prompt lengths, powers of two
from 16 to 512, then every 256 tokens, up to the build's ``prefill_graph_tokens`` (none above ``max_seq_len``)."""


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    buckets = [1]
    while buckets[-1] < max_batch:
        buckets.append(2 * buckets[-1])
    return tuple(buckets)


def batch_bucket(n: int, max_batch: int) -> int:
    for b in batch_buckets(max_batch):
        if n <= b:
            return b
    raise ValueError(f"batch {n} exceeds max_batch {max_batch}")


# The builds' default largest prompt bucket (``--prefill-graphs``). A bucket pays for its padding and wins while the
# replay beats the eager prefill. H200, Llama-3-8B fp8 (2026-12-01, bench/prefill_host.py): the 512 bucket's replay
# took 7.5-7.7 ms against 8.9-14.5 ms eager; with power-of-two buckets the 1024 bucket lost at its bottom (768
# tokens: 14.7 ms against 14.2 eager). With buckets every 256 tokens past 512 (2026-12-03, bench/prefill_host.py
# and bench/prefill_gaps.py --bucket-ab, 16 lengths from 768 to 4096 tokens, the bottoms of buckets included) the
# replay took 0-6% less than the eager prefill at every length (2048 tokens: 29.43 against 30.23 ms). Past 2048
# the gain is 1-3% and each bucket's first prompt pays its capture, hence 2048.
PREFILL_GRAPH_TOKENS = 2048

# The smallest prompt bucket captured as a CUDA graph: below it the GPU time is the weights' read whatever
# the length, so smaller buckets would only add captures.
PREFILL_GRAPH_MIN = 16


# Above PREFILL_GRAPH_STEP_FROM tokens the buckets step by PREFILL_GRAPH_STEP instead of doubling: a prompt then
# pads by less than PREFILL_GRAPH_STEP tokens.
PREFILL_GRAPH_STEP_FROM = 512
PREFILL_GRAPH_STEP = 256


def prefill_graph_buckets(limit: int, max_seq_len: int) -> tuple[int, ...]:
    """Prompt lengths (powers of two from 16 to PREFILL_GRAPH_STEP_FROM, then every PREFILL_GRAPH_STEP, up to
    ``limit``, none above ``max_seq_len``) whose batch-1 prefill the runtime replays as a CUDA graph; a prompt
    of ``s`` tokens runs in the smallest bucket holding it, padded by a second sequence in the KV cache's
    scratch slot (at most bucket - 1 rows: they fit a slot)."""
    buckets, t = [], PREFILL_GRAPH_MIN
    while t <= min(limit, max_seq_len):
        buckets.append(t)
        t = 2 * t if t < PREFILL_GRAPH_STEP_FROM else t + PREFILL_GRAPH_STEP
    return tuple(buckets)


def prefill_graph_bucket(s: int, limit: int, max_seq_len: int) -> int | None:
    """The bucket a batch-1 prompt of ``s`` tokens replays in, or None (eager) when none holds it."""
    return next((t for t in prefill_graph_buckets(limit, max_seq_len) if s <= t), None)


def padded_prefill(s: int, size: int, scratch_slot: int) -> tuple[list[int], list[int], list[int]]:
    """(seq_lens, past_lens, slots) of a prompt bucket of ``size`` tokens holding a prompt of ``s`` in slot 0:
    the prompt, then ``size - s`` padding tokens (possibly none) in the scratch slot."""
    return [s, size - s], [0, 0], [0, scratch_slot]
