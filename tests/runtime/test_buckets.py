"""Batch buckets: powers of two up to the first that holds max_batch (the runtime pads a batch to one)."""

import pytest

from mxc.runtime_buckets import batch_bucket, batch_buckets


def test_buckets_cover_max_batch():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(5) == (1, 2, 4, 8)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert [batch_bucket(n, 64) for n in (1, 3, 33, 64)] == [1, 4, 64, 64]
    assert batch_bucket(5, 5) == 8
    with pytest.raises(ValueError, match="max_batch 64"):
        batch_bucket(65, 64)
