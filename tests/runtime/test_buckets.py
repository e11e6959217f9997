"""Buckets: decode batches in powers of two up to the first that holds max_batch, and short prompts in powers
of two up to the build's limit (the runtime pads a batch, or a prompt, to one)."""

import re
from pathlib import Path

import pytest

from mxc.runtime_buckets import (PREFILL_GRAPH_TOKENS, batch_bucket, batch_buckets, padded_prefill,
                                  prefill_graph_bucket, prefill_graph_buckets)


def test_buckets_cover_max_batch():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(5) == (1, 2, 4, 8)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert [batch_bucket(n, 64) for n in (1, 3, 33, 64)] == [1, 4, 64, 64]
    assert batch_bucket(5, 5) == 8
    with pytest.raises(ValueError, match="max_batch 64"):
        batch_bucket(65, 64)
    for bad in (0, -1):  # no bucket holds no sequence
        with pytest.raises(ValueError, match=f"max_batch must be >= 1, got {bad}"):
            batch_buckets(bad)


def test_default_prefill_graph_limit_is_the_documented_one():
    """The builds' default largest prompt bucket is what the README's ``--prefill-graphs`` says."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (default,) = re.findall(r"`--prefill-graphs` tokens \(`--target cuda` only; default (\d+);", readme)
    assert PREFILL_GRAPH_TOKENS == int(default)


def test_prefill_graph_buckets():
    """Powers of two from 16, then steps of 256 past 512, up to the build's limit, none longer than a cache slot;
    a prompt's bucket is the smallest that holds it, and its padding (a second sequence in the scratch slot) fits
    a slot."""
    assert prefill_graph_buckets(512, 4096) == (16, 32, 64, 128, 256, 512)
    assert prefill_graph_buckets(2048, 4096) == (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert prefill_graph_buckets(2048, 1500)[-1] == 1280 and prefill_graph_buckets(1000, 4096)[-1] == 768
    assert [prefill_graph_bucket(s, 2048, 4096) for s in (513, 768, 769, 1793, 2048, 2049)] == [768, 768, 1024, 2048,
                                                                                               2048, None]
    assert prefill_graph_buckets(600, 4096)[-1] == 512 and prefill_graph_buckets(512, 100) == (16, 32, 64)
    assert prefill_graph_buckets(0, 4096) == () == prefill_graph_buckets(512, 15)
    assert [prefill_graph_bucket(s, 512, 4096) for s in (1, 16, 17, 64, 65, 512, 513)] == [16, 16, 32, 64, 128, 512,
                                                                                           None]
    assert prefill_graph_bucket(65, 512, 100) is None
    for s in range(1, 129):
        t = prefill_graph_bucket(s, 128, 128)
        seq_lens, past_lens, slots = padded_prefill(s, t, 4)
        assert seq_lens == [s, t - s] and past_lens == [0, 0] and slots == [0, 4] and t - s < t <= 128
