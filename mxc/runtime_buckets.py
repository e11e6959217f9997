"""Batch-size buckets shared by the build (which compiles kernels for them) and the runtime (which
captures one CUDA graph per bucket and pads a batch up to the next one)."""

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)


def batch_bucket(n: int) -> int:
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"batch {n} exceeds the largest bucket {BATCH_BUCKETS[-1]}")
