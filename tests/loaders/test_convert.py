"""The streaming converter's helpers, at sizes the tiny test models do not reach."""

from __future__ import annotations

import re

import pytest
import torch

from mxc.errors import MxcError
from mxc.ir import QuantSpec, ShardSpec, Weight
from mxc.loaders.convert import _check_stored_dtypes, _ignored, _part_scales, _same_values, rank_tensor


class _Tensors:
    """The calls the converter's helpers make of a checkpoint."""

    directory = "ckpt"

    def __init__(self, tensors):
        self.tensors = tensors

    def shape(self, name):
        return self.tensors[name].shape

    def get(self, name):
        return self.tensors[name]

    def dtype(self, name):
        return self.tensors[name].dtype


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


def _fp8_weight(shape, granularity, segments=(), hf=("w.weight",), prequantized=True):
    return Weight("w", shape, "float8_e4m3fn", hf, segments=segments,
                  quant=QuantSpec("fp8_e4m3", granularity, prequantized=prequantized))


@pytest.mark.parametrize("n, k", [(256, 512), (200, 300), (129, 128), (1, 1)])
def test_block_scales_cover_partial_blocks(n, k):
    """A 128x128-block checkpoint holds one scale a block, the last row and column blocks partial (transformers'
    FP8Linear: ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]); a count rounded down is refused."""
    blocks = [-(-n // 128), -(-k // 128)]
    w = _fp8_weight((n, k), "block128")
    scales = torch.rand(*blocks)
    assert torch.equal(_part_scales(w, ("s",), (n, k), _Tensors({"s": scales})), scales)
    if n % 128:
        with pytest.raises(MxcError, match=re.escape(f"expected {blocks}")):
            _part_scales(w, ("s",), (n, k), _Tensors({"s": torch.rand(n // 128, blocks[1])}))


def test_merged_block_scaled_parts_must_be_whole_blocks():
    """Parts merged along the rows keep their own scale blocks only if each is whole 128-row blocks."""
    w = _fp8_weight((256 + 128, 256), "block128", segments=(256, 128), hf=("a.weight", "b.weight"))
    ckpt = _Tensors({"a": torch.rand(2, 2), "b": torch.rand(1, 2)})
    assert _part_scales(w, ("a", "b"), (384, 256), ckpt).shape == (3, 2)
    ragged = _fp8_weight((200 + 128, 256), "block128", segments=(200, 128), hf=("a.weight", "b.weight"))
    with pytest.raises(MxcError, match="merged part of 200 rows is not whole 128-row blocks"):
        _part_scales(ragged, ("a", "b"), (328, 256), _Tensors({"a": torch.rand(2, 2), "b": torch.rand(1, 2)}))


def test_row_scales_must_be_one_per_row():
    w = _fp8_weight((6, 8), "channel")
    assert torch.equal(_part_scales(w, ("s",), (6, 8), _Tensors({"s": torch.arange(6.0)})), torch.arange(6.0))
    for count in (5, 7):
        with pytest.raises(MxcError, match=f"has {count} scales, expected one per row \\(6\\)"):
            _part_scales(w, ("s",), (6, 8), _Tensors({"s": torch.rand(count)}))


@pytest.mark.parametrize("stored", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_tensors_are_refused_where_not_imported_with_scales(stored):
    """A weight mxc keeps in the model dtype cannot come from fp8 values of either format (a cast drops the scales);
    an e4m3 checkpoint is imported as is where its quantization_config says so, an e5m2 one never."""
    plain = Weight("w", (4, 8), "bfloat16", ("w.weight",))
    ckpt = _Tensors({"w.weight": torch.zeros(4, 8).to(stored)})
    with pytest.raises(MxcError, match="mxc does not import it as fp8"):
        _check_stored_dtypes(plain, ckpt)
    fp8 = _fp8_weight((4, 8), "channel")
    if stored == torch.float8_e4m3fn:
        _check_stored_dtypes(fp8, ckpt)
    else:
        with pytest.raises(MxcError, match="holds float8_e4m3fn weights"):
            _check_stored_dtypes(fp8, ckpt)
    _check_stored_dtypes(plain, _Tensors({"w.weight": torch.zeros(4, 8, dtype=torch.bfloat16)}))


def test_ignored_names_match_whole_with_numbers_for_indices():
    """A definition's ``ignore`` patterns name whole checkpoint tensors, "{i}" (and "{e}") standing for any number."""
    ignored = _ignored(("model.layers.{i}.self_attn.rotary_emb.inv_freq", "lm_head.bias"))
    assert ignored.match("model.layers.0.self_attn.rotary_emb.inv_freq")
    assert ignored.match("model.layers.31.self_attn.rotary_emb.inv_freq") and ignored.match("lm_head.bias")
    for name in ("model.layers.x.self_attn.rotary_emb.inv_freq", "model.layers.1.self_attn.rotary_emb.inv_freq_x",
                 "lm_head.bias.extra", "xlm_head.bias", "model.layers..self_attn.rotary_emb.inv_freq",
                 "model.layers.1.2.self_attn.rotary_emb.inv_freq"):
        assert not ignored.match(name), name
    assert not _ignored(()).match("anything") and not _ignored(()).match("")


def test_replicated_weights_are_whole_on_every_rank():
    """A weight a model definition declares ``shard: replicated`` is stored whole in every rank's file (the sharding
    pass keeps its shape), and one without a shard spec too; a column-sharded one is split."""
    full = torch.arange(24.0).reshape(8, 3)
    for shard in (ShardSpec("replicated"), None):
        w = Weight("n", (8, 3), "float32", ("n.weight",), shard=shard)
        for rank in range(2):
            assert torch.equal(rank_tensor(full, w, 2, rank), full), (shard, rank)
    column = Weight("c", (4, 3), "float32", ("c.weight",), shard=ShardSpec("column"))
    assert torch.equal(torch.cat([rank_tensor(full, column, 2, r) for r in range(2)]), full)
    assert rank_tensor(full, column, 2, 1).shape == (4, 3)
