"""The streaming converter's helpers, at sizes the tiny test models do not reach."""

from __future__ import annotations

import torch

from mxc.loaders.convert import _same_values


class _Tensors:
    """The two calls ``_same_values`` makes of a checkpoint."""

    def __init__(self, tensors):
        self.tensors = tensors

    def shape(self, name):
        return self.tensors[name].shape

    def get(self, name):
        return self.tensors[name]


def test_tied_weights_are_compared_in_every_chunk():
    """A tied LM head is compared with the embedding a chunk of rows at a time (real vocabularies are 100k+ rows):
    a difference in the last chunk counts."""
    a = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b[9, 1] += 1
    ckpt = _Tensors({"a": a, "b": b, "c": a.clone(), "d": a[:9].clone()})
    assert _same_values(ckpt, "a", "c", rows=4)
    assert not _same_values(ckpt, "a", "b", rows=4)
    assert not _same_values(ckpt, "a", "d", rows=4)
