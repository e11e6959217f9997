"""The streaming converter's helpers, at sizes the tiny test models do not reach."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mxc.errors import MxcError
from mxc.ir import Graph, QuantSpec, Repeat, ShardSpec, Weight
from mxc.loaders.convert import (_check_finite, _check_stored_dtypes, _ignored, _part_scales, _same_values, check_names,
                                 check_tied, rank_tensor, read_full, weight_bytes, write_weights)
from mxc.loaders.quantize import quantize_fp8


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

    def names(self):
        return sorted(self.tensors)


def _graph(top=(), layers=(), count=2, tied=()):
    """A bound graph holding just weights: ``top`` at the top level, ``layers`` in a repeat of ``count`` ({i})."""
    body = (Repeat(count, "i", {w.name: w for w in layers}, (), {}),) if layers else ()
    return Graph("t", "float32", {}, {}, {w.name: w for w in top}, body, (), source="t.yaml", tied=tied)


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
    scales = torch.arange(1.0, 7.0)
    assert torch.equal(_part_scales(w, ("s",), (6, 8), _Tensors({"s": scales})), scales)
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


def test_missing_tensors_are_named_and_counted():
    """The first missing tensor is named with its shape and weight; "(and N more)" only when there are more."""
    graph = _graph([Weight(n, (2, 3), "float32", (f"{n}.weight",)) for n in ("a", "b", "c")])
    full = {f"{n}.weight": torch.zeros(2, 3) for n in "abc"}
    for drop, tail in ((["b.weight", "c.weight"], " (and 1 more)"), (["c.weight"], "")):
        ckpt = _Tensors({k: v for k, v in full.items() if k not in drop})
        with pytest.raises(MxcError) as e:
            check_names(graph, ckpt)
        want = f"ckpt: missing tensor '{drop[0]}' (expected shape [2, 3], for weight {drop[0][0]}){tail}"
        assert str(e.value) == want


def _prequantized_layer():
    w = Weight("l{i}.w", (4, 8), "float8_e4m3fn", ("m.{i}.w.weight",),
               quant=QuantSpec("fp8_e4m3", "channel", prequantized=True))
    return w, Weight("l{i}.w_scale", (4,), "float32", ("m.{i}.w.weight_scale",), scale_of="l{i}.w")


def test_a_missing_layer_scale_does_not_blame_quant_lm_head():
    """A layer's fp8 scale missing: the checkpoint does not store that weight in fp8; --quant-lm-head is named only
    for a top-level weight (the LM head)."""
    graph = _graph(layers=_prequantized_layer(), count=1)
    ckpt = _Tensors({"m.0.w.weight": torch.zeros(4, 8).to(torch.float8_e4m3fn)})
    with pytest.raises(MxcError, match=r"missing tensor 'm\.0\.w\.weight_scale' \(the checkpoint's fp8 scales, for "
                                       r"weight l0\.w_scale\): the checkpoint does not store that weight in fp8 with "
                                       r"scales$"):
        check_names(graph, ckpt)


def test_a_scale_left_out_of_the_index_gets_only_the_stale_index_hint(tmp_path):
    """A scale tensor that is in a shard but not in the index: the hint says so, not that the weight is not fp8."""
    graph = _graph(layers=_prequantized_layer(), count=1)
    ckpt = _Tensors({"m.0.w.weight": torch.zeros(4, 8).to(torch.float8_e4m3fn)})
    ckpt.unindexed = {"m.0.w.weight_scale": tmp_path / "model-00001-of-00001.safetensors"}
    ckpt.index = tmp_path / "model.safetensors.index.json"
    with pytest.raises(MxcError) as e:
        check_names(graph, ckpt)
    assert str(e.value).endswith(": it is in model-00001-of-00001.safetensors, but model.safetensors.index.json does "
                                 "not list it (a stale index? add it to the index's weight_map)")


def test_a_stray_scale_of_no_weight_is_an_unexpected_tensor():
    """A scale-named tensor beside no weight the graph maps is reported as unexpected, not a KeyError."""
    graph = _graph([Weight("a", (2, 3), "float32", ("a.weight",))])
    ckpt = _Tensors({"a.weight": torch.zeros(2, 3), "b.weight_scale": torch.ones(2)})
    with pytest.raises(MxcError, match=r"unexpected tensor 'b\.weight_scale': the t\.yaml definition neither maps"):
        check_names(graph, ckpt)


def test_a_tied_weight_stored_with_other_values_is_refused():
    graph = _graph([Weight("embed", (4, 3), "float32", ("embed.weight",))],
                   tied=(("head.weight", "embed.weight", "tie_word_embeddings"),))
    e = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    check_tied(graph, _Tensors({"embed.weight": e, "head.weight": e.clone()}))
    check_tied(graph, _Tensors({"embed.weight": e}))
    with pytest.raises(MxcError, match=r"head\.weight differs from embed\.weight, which config\.json ties it to"):
        check_tied(graph, _Tensors({"embed.weight": e, "head.weight": e + 1}))


def _write(graph, ckpt, paths):
    return write_weights(graph, ckpt, paths, progress=False)


def test_quantized_weights_are_written_with_their_scales_and_digests(tmp_path):
    """An fp8 weight and its scale land in the file as quantize_fp8 makes them, each scale right after its weight
    (header order), so the returned sha256 is the file's."""
    w = Weight("w", (6, 8), "float8_e4m3fn", ("w.weight",), quant=QuantSpec("fp8_e4m3", "channel"))
    scale = Weight("w_scale", (6,), "float32", (), scale_of="w")
    graph = _graph([w, Weight("n", (8,), "float32", ("n.weight",)), scale])
    g = torch.Generator().manual_seed(0)
    src = {"w.weight": torch.randn(6, 8, generator=g), "n.weight": torch.randn(8, generator=g)}
    path = tmp_path / "rank0.safetensors"
    digests = _write(graph, _Tensors(src), [path])
    got = load_file(path)
    q, s = quantize_fp8(src["w.weight"], "channel")
    assert torch.equal(got["w"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got["w_scale"], s)
    assert torch.equal(got["n"], src["n.weight"])
    assert digests == {path: (hashlib.sha256(path.read_bytes()).hexdigest(),
                              [hashlib.sha256(path.read_bytes()).hexdigest()])}  # one piece: smaller than a chunk
    assert weight_bytes(graph) == sum(t.numel() * t.element_size() for t in got.values())  # the disk check's count


def test_a_failed_write_leaves_no_rank_file_open(tmp_path):
    """A weight that fails while converting (here an integer tensor) aborts every rank's file: none is still open
    while the caller handles the error (and deletes the files)."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("needs /proc/self/fd")
    graph = _graph([Weight("a", (2, 3), "float32", ("a.weight",)), Weight("b", (2, 3), "float32", ("b.weight",))])
    ckpt = _Tensors({"a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(2, 3, dtype=torch.int32)})
    paths = [tmp_path / "rank0.safetensors", tmp_path / "rank1.safetensors"]
    with pytest.raises(MxcError, match="b.weight is stored as torch.int32") as error:
        _write(graph, ckpt, paths)
    assert error.traceback  # the error, with its frames, is still held here, as by a caller's except clause
    open_paths = {os.path.realpath(fds / fd) for fd in os.listdir(fds)}
    assert not open_paths & {str(p.resolve()) for p in paths}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.5])
@pytest.mark.parametrize("granularity, shape", [("channel", (6,)), ("tensor", ()), ("block128", (1, 1))])
def test_checkpoint_scales_must_be_finite_and_positive(bad, granularity, shape):
    """An fp8 checkpoint's scale that is NaN, infinite, zero or negative is refused by name: a NaN or inf scale
    makes its rows NaN, a zero one zeroes them, a negative one flips their sign."""
    w = _fp8_weight((6, 8), granularity)
    scales = torch.rand(shape) + 0.1
    scales.view(-1)[-1] = bad
    with pytest.raises(MxcError, match=re.escape(f"ckpt: s holds 1 fp8 scale(s) that are not finite and positive "
                                                 f"(e.g. {bad}); the checkpoint is damaged")):
        _part_scales(w, ("s",), (6, 8), _Tensors({"s": scales}))


def test_values_past_the_dtype_are_refused_and_nothing_is_left_open(tmp_path):
    """A float32 checkpoint value past float16's range would be cast to inf: refused naming the tensor, in every
    part of a merged weight, before the weight is written."""
    w = Weight("wqk", (4, 3), "float16", ("q.weight", "k.weight"), segments=(2, 2))
    ckpt = _Tensors({"q.weight": torch.ones(2, 3), "k.weight": torch.tensor([[1.0, 7e4, 1.0], [1.0, -3e5, 1.0]])})
    with pytest.raises(MxcError, match=re.escape("ckpt: k.weight holds values up to 3e+05, past float16's largest "
                                                 "6.55e+04 (weight wqk); build with a wider --dtype "
                                                 "(bfloat16 or float32)")):
        _write(_graph([w]), ckpt, [tmp_path / "rank0.safetensors"])
    ckpt.tensors["k.weight"] = torch.full((2, 3), 65519.0)  # rounds to float16's largest: kept
    _write(_graph([w]), ckpt, [tmp_path / "rank0.safetensors"])
    assert load_file(tmp_path / "rank0.safetensors")["wqk"].float().max() == 65504


def test_a_tied_weight_stored_with_other_values_is_refused_when_writing(tmp_path):
    """write_weights checks the tied weights too (``check_checkpoint``), before anything is written."""
    graph = replace(_graph([Weight("embed", (4, 3), "float32", ("embed.weight",))],
                           tied=(("head.weight", "embed.weight", "tie_word_embeddings"),)), ignore=("head.weight",))
    e = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    _write(graph, _Tensors({"embed.weight": e, "head.weight": e.clone()}), [tmp_path / "rank0.safetensors"])
    (tmp_path / "rank0.safetensors").unlink()
    with pytest.raises(MxcError, match=r"head\.weight differs from embed\.weight, which config\.json ties it to"):
        _write(graph, _Tensors({"embed.weight": e, "head.weight": e + 1}), [tmp_path / "rank0.safetensors"])
    assert not (tmp_path / "rank0.safetensors").exists()


@pytest.mark.parametrize("quant", [None, QuantSpec("fp8_e4m3", "channel")])
def test_float64_values_past_float32_are_refused_with_no_dtype_to_suggest(tmp_path, quant):
    """A float64 checkpoint value past float32's range: no --dtype holds it. fp8 weights are quantized in float32,
    so theirs is float32's range too, not fp8's (where the scale takes the magnitude)."""
    dtype = "float32" if quant is None else "float8_e4m3fn"
    w = Weight("w", (2, 3), dtype, ("w.weight",), quant=quant)
    weights = [w] + ([Weight("w_scale", (2,), "float32", (), scale_of="w")] if quant else [])
    ckpt = _Tensors({"w.weight": torch.tensor([[1.0, 1e300, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)})
    with pytest.raises(MxcError) as e:
        _write(_graph(weights), ckpt, [tmp_path / "rank0.safetensors"])
    assert str(e.value) == ("ckpt: w.weight holds values up to 1e+300, past float32's largest 3.403e+38 (weight w); "
                            "no --dtype holds it")


def test_nothing_to_check_in_an_empty_tensor():
    """No values, none that is not finite (torch.aminmax refuses an empty tensor)."""
    w = Weight("w", (0, 3), "float32", ("w.weight",))
    assert _check_finite(w, _Tensors({"w.weight": torch.empty(0, 3)}), torch.empty(0, 3)) is None


@pytest.mark.parametrize("granularity, scales", [("channel", torch.tensor([1.0, 1e36])), ("tensor", torch.tensor(1e36)),
                                                 ("block128", torch.tensor([[1e36]]))])
def test_fp8_values_past_float32_once_scaled_are_refused(tmp_path, granularity, scales):
    """An fp8 weight times its (finite, positive) scale past float32's largest: refused naming both tensors. The
    same scales over small enough values pass (the bound is only the first look)."""
    w = _fp8_weight((2, 3), granularity)
    graph = _graph([w, Weight("w_scale", (1, 1) if granularity == "block128" else (2,), "float32", ("w.weight_scale",),
                              scale_of="w")])
    values = torch.tensor([[1.0, 2.0, 1.0], [1.0, 448.0, 1.0]])
    ckpt = _Tensors({"w.weight": values.to(torch.float8_e4m3fn), "w.weight_scale": scales})
    with pytest.raises(MxcError, match=r"ckpt: w\.weight times its scales w\.weight_scale \(up to 1e\+36\) is past "
                                       r"float32's largest 3\.403e\+38 \(weight w\); the checkpoint is damaged"):
        _write(graph, ckpt, [tmp_path / "rank0.safetensors"])
    ckpt.tensors["w.weight"] = (values / 448).to(torch.float8_e4m3fn)
    _write(graph, ckpt, [tmp_path / "rank0.safetensors"])


def test_fp8_experts_are_quantized_within_the_model_dtype(tmp_path):
    """``--quant fp8`` of an expert stack in a float16 build: the experts are dequantized into the model dtype at run
    time, so a value past float16's largest is refused naming the expert's tensor, as it is without --quant (it was
    quantized and then ran as infinity); a dense fp8 weight is dequantized in float32 and keeps it, and a value that
    rounds to float16's largest passes."""
    quant = QuantSpec("fp8_e4m3", "channel")
    experts = Weight("we", (2, 2, 3), "float8_e4m3fn", ("e.{e}.w",), stack="e", quant=quant)
    dense = Weight("wd", (2, 3), "float8_e4m3fn", ("d.w",), quant=quant)
    graph = replace(_graph([experts, Weight("we_scale", (2, 2), "float32", (), scale_of="we", stack="e"), dense,
                            Weight("wd_scale", (2,), "float32", (), scale_of="wd")]), dtype="float16")
    big = torch.tensor([[1.0, 7e4, 1.0], [1.0, -2.0, 1.0]])
    ckpt = _Tensors({"e.0.w": torch.ones(2, 3), "e.1.w": big, "d.w": big})
    with pytest.raises(MxcError) as e:
        _write(graph, ckpt, [tmp_path / "rank0.safetensors"])
    assert str(e.value) == ("ckpt: e.1.w holds values up to 7e+04, past float16's largest 6.55e+04 (weight we); "
                            "build with a wider --dtype (bfloat16 or float32)")
    ckpt.tensors["e.1.w"] = torch.full((2, 3), 65519.0)  # rounds to float16's largest: kept
    _write(graph, ckpt, [tmp_path / "rank0.safetensors"])
    got = load_file(tmp_path / "rank0.safetensors")
    assert got["wd"].float().max() * got["wd_scale"].max() == pytest.approx(7e4)


def test_a_nan_copied_into_a_tied_weight_is_not_a_difference():
    """A tied head holding the embedding's NaN where the embedding has it is the same tensor (NaN != NaN would call it
    different and advise untying); the NaN check then names the damage."""
    e = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    e[1, 2] = float("nan")
    other = e.clone()
    other[3, 0] = float("nan")
    ckpt = _Tensors({"embed.weight": e, "head.weight": e.clone(), "other.weight": other})
    assert _same_values(ckpt, "embed.weight", "head.weight")
    assert not _same_values(ckpt, "embed.weight", "other.weight")


def test_a_merged_weight_is_filled_one_part_at_a_time():
    """A merged weight ([q; k; v], [gate; up]) holds one of its checkpoint parts at a time besides itself: with all of
    them read, then concatenated, a 4096x14336 Llama's gate/up took twice its size (the bf16 build's peak rose by
    its 235 MB once tensors were read into buffers of their own). The parts keep torch.cat's promoted dtype."""
    import weakref

    class Counting(_Tensors):
        live = most = 0

        def get(self, name):
            t = self.tensors[name].clone()
            Counting.live += 1
            Counting.most = max(Counting.most, Counting.live)
            weakref.finalize(t, lambda: setattr(Counting, "live", Counting.live - 1))
            return t

    g = torch.Generator().manual_seed(0)
    parts = {"q": torch.randn(4, 3, generator=g).to(torch.bfloat16), "k": torch.randn(2, 3, generator=g),
             "v": torch.randn(2, 3, generator=g).to(torch.bfloat16)}
    w = Weight("wqkv", (8, 3), "float32", ("q", "k", "v"), segments=(4, 2, 2))
    full = read_full(w, Counting(parts))
    assert Counting.most == 1 and Counting.live == 0
    assert full.dtype == torch.float32 and torch.equal(full, torch.cat(list(parts.values())))


def test_a_merged_weight_asked_in_a_dtype_casts_each_part_in_its_copy():
    """A weight the build stores unquantized is read in its dtype: each part is cast as it is copied in, never merged
    in float32 first, and the bytes are those of the merged (promoted) weight cast as a whole, parts of mixed dtypes
    included; dummy weights are generated in that dtype, with the same bytes."""
    from mxc.loaders.dummy import DummyCheckpoint

    g = torch.Generator().manual_seed(0)
    parts = {"q": torch.randn(4, 3, generator=g).to(torch.bfloat16), "k": torch.randn(2, 3, generator=g) * 1e3,
             "v": torch.randn(2, 3, generator=g).half()}
    w = Weight("wqkv", (8, 3), "float16", ("q", "k", "v"), segments=(4, 2, 2))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        got = read_full(w, _Tensors(parts), dtype)
        want = read_full(w, _Tensors(parts)).to(dtype)
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    big = Weight("wgu", (2 * 700, 512), "bfloat16", ("g.weight", "u.weight"), segments=(700, 700))
    dummy = DummyCheckpoint(_graph([big]))
    got = read_full(big, dummy, torch.bfloat16)
    assert torch.equal(got.view(torch.uint8), read_full(big, dummy).to(torch.bfloat16).view(torch.uint8))


def test_weights_cast_to_the_build_dtype_are_the_tensors_cast(tmp_path):
    """A weight stored in another dtype than the build's is cast into a buffer of its own (huge pages, past a few
    MiB): the file holds the bytes of ``tensor.to(dtype)``, for a single tensor and a merged one."""
    g = torch.Generator().manual_seed(0)
    src = {"a.weight": torch.randn(1100, 1024, generator=g).to(torch.bfloat16),  # 4.3 MiB as float32
           "q.weight": torch.randn(600, 1024, generator=g), "k.weight": torch.randn(500, 1024, generator=g).half()}
    graph = _graph([Weight("a", (1100, 1024), "float32", ("a.weight",)),
                    Weight("qk", (1100, 1024), "bfloat16", ("q.weight", "k.weight"), segments=(600, 500))])
    path = tmp_path / "rank0.safetensors"
    _write(graph, _Tensors(src), [path])
    got = load_file(path)
    assert torch.equal(got["a"], src["a.weight"].float())
    want = torch.cat([src["q.weight"], src["k.weight"].float()]).to(torch.bfloat16)
    assert torch.equal(got["qk"].view(torch.uint8), want.view(torch.uint8))
