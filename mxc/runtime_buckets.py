"""Batch-size buckets shared by the build (which compiles kernels for them) and the runtime (which
captures one CUDA graph per bucket and pads a batch up to the next one): powers of two, up to the
first one that holds ``max_batch`` (padding rows write only to the KV cache's scratch slot)."""


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
