"""The quantize pass on bound graphs: which block128 tensor-parallel splits its scales can follow (and which block
scales each rank then loads), the LM head under --quant-lm-head, expert stacks, and what an fp8 checkpoint keeps
unquantized or leaves to ignore. The numbers of quantized models are in tests/models/test_fp8.py and the shards of
fp8 builds in tests/parallel/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import PIPELINE
from mxc.errors import MxcError
from mxc.ir import Graph, Repeat, verify
from mxc.ir.sharding import rank_slices

BLOCK = dict(quant="fp8", quant_granularity="block128")
UNMERGED = ("merge_qkv", "merge_gate_up")


def layer(g: Graph) -> Repeat:
    return next(it for it in g.body if isinstance(it, Repeat))


def through_quantize(bind_arch, tp: int, disable=(), arch="LlamaForCausalLM", options=None, **fields) -> Graph:
    """The tiny model of ``fields`` through the pipeline up to and including quantize."""
    opts = BuildOptions(tp=tp, disable_passes=tuple(disable), **{**BLOCK, **(options or {})})
    g = bind_arch(arch, **fields)
    for name, run in PIPELINE:
        if name not in opts.disable_passes:
            g = run(g, opts)
        if name == "quantize":
            return g
    raise AssertionError("no quantize pass")


def blocks_needed(w, tp: int, rank: int) -> list[int]:
    """The 128-blocks (along the split dimension) that ``rank``'s rows of ``w`` lie in, one entry per local block."""
    total = sum(w.shard.segments)
    out = []
    for start, n in rank_slices(w.shard, total, tp, rank):
        for b in range(start // 128, (start + n - 1) // 128 + 1):
            out.append(b)
    return out


def blocks_held(scale, tp: int, rank: int) -> list[int]:
    """The block rows (or columns) of ``scale`` that ``rank`` loads."""
    held = rank_slices(scale.shard, sum(scale.shard.segments), tp, rank)
    return [b for start, n in held for b in range(start, start + n)]


# (fields, tp, passes disabled): each rank's rows of every part are whole 128-blocks, or (one part) lie inside one
BLOCKS_FOLLOW = {
    # MQA: the one KV head (128 rows, one block) replicated on both ranks, q's 256 rows split in whole blocks
    "kv-head-copied": (dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                            intermediate_size=256), 2, ()),
    # unmerged: q, o, gate, up, down each split into 64 rows (or columns) a rank, inside one block per rank
    "inside-one-block": (dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              intermediate_size=256), 4, UNMERGED),
    # heads of 320 rows (2.5 blocks), two a rank: 640 rows, 5 whole blocks, split in single blocks
    "heads-of-2.5-blocks-two-a-rank": (dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                            head_dim=320, intermediate_size=256), 2, ()),
    # one KV head of 256 rows copied on both ranks: its scales split in units of 2 blocks, both on each rank
    "kv-head-of-two-blocks-copied": (dict(hidden_size=512, num_attention_heads=2, num_key_value_heads=1,
                                          head_dim=256, intermediate_size=256), 2, ()),
}


@pytest.mark.parametrize("case", list(BLOCKS_FOLLOW))
def test_block_scales_follow_splits_of_whole_blocks_or_inside_one(case, bind_arch):
    fields, tp, disable = BLOCKS_FOLLOW[case]
    g = through_quantize(bind_arch, tp, disable, **fields)
    verify(g)
    quantized = [w for w in layer(g).weights.values() if w.quant is not None]
    assert len(quantized) >= 4 and all(w.quant.granularity == "block128" for w in quantized)
    for w in quantized:
        scale = layer(g).weights[f"{w.name.split('.')[-1]}_scale"]
        assert scale.shard is not None and scale.shard.kind == w.shard.kind
        for rank in range(tp):  # the block scales a rank loads are those of the blocks its rows lie in, in order
            assert blocks_held(scale, tp, rank) == blocks_needed(w, tp, rank), (w.name, rank)


# (fields, tp, passes disabled, the weight refused)
BLOCKS_REFUSED = {
    # 2 KV heads of 64 rows over 4 ranks: each rank's k and v rows (64 each, one merged weight) inside one block
    # apiece, but the rank's local rows of k and v would share one local block, and its scale
    "kv-heads-copied-into-a-merged-weight": (dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                                  head_dim=64, intermediate_size=512), 4, (), "wqkv"),
    # heads of 320 rows (2.5 blocks), one a rank: rank 1's rows start at row 320, inside block 2
    "heads-of-2.5-blocks-one-a-rank": (dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                            head_dim=320, intermediate_size=256), 4, (), "w"),
    # one part of 384 rows over 4 ranks: 96 rows a rank, straddling blocks
    "straddling-blocks": (dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                               intermediate_size=384), 4, UNMERGED, "w_gate"),
    # one part of 320 rows (2.5 blocks) over 5 ranks: 64 rows a rank, but 3 scale rows cannot split 5 ways
    "partial-block-over-5": (dict(hidden_size=640, num_attention_heads=5, num_key_value_heads=5, head_dim=128,
                                  intermediate_size=320), 5, UNMERGED, "w_gate"),
}


@pytest.mark.parametrize("case", list(BLOCKS_REFUSED))
def test_block_scales_that_cannot_follow_the_split_are_refused(case, bind_arch):
    fields, tp, disable, weight = BLOCKS_REFUSED[case]
    with pytest.raises(MxcError, match=rf"^block128 fp8 scales of layers\.\{{i\}}\.{weight}\w* cannot follow its "
                                       rf"tensor-parallel split \(parts \[.*--tp {tp}: a rank's rows are not whole "
                                       r"128-blocks\): use --quant-granularity channel$"):
        through_quantize(bind_arch, tp, disable, **fields)


# Two splits that block scales follow though the shard unit is not a whole number of blocks, or a part is under one
# block: every rank's fp8 values and block scales equal the --tp 1 build's (tests/models, at --tp 2 over gloo).


def test_block_scales_follow_whole_block_shares_of_96_row_heads(bind_arch):
    """8 heads of 96 rows at --tp 2: a rank's 4 heads are 384 rows (columns of the o projection), 3 whole blocks;
    the scales split 3 block rows a rank like those of 128-row heads."""
    g = through_quantize(bind_arch, 2, hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=96,
                         intermediate_size=256)
    for name in ("wqkv", "wo"):
        w, scale = layer(g).weights[name], layer(g).weights[f"{name}_scale"]
        for rank in range(2):
            assert blocks_held(scale, 2, rank) == blocks_needed(w, 2, rank), (name, rank)


def test_block_scales_follow_one_part_under_a_block(bind_arch):
    """The unmerged gate and up of 64 rows (and the down projection's 64 columns) at --tp 2: each rank's 32 rows lie
    inside block 0, whose scale both ranks hold a copy of (as a 128-row part split over 4 ranks does)."""
    g = through_quantize(bind_arch, 2, UNMERGED, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=128, intermediate_size=64)
    for name in ("w_gate", "w_up", "w_down"):
        w, scale = layer(g).weights[name], layer(g).weights[f"{name}_scale"]
        for rank in range(2):
            assert blocks_held(scale, 2, rank) == blocks_needed(w, 2, rank) == [0], (name, rank)


def test_block_scales_of_a_padded_vocabulary_cover_every_row(bind_arch):
    """An fp8 block128 LM head over 255 tokens at --tp 2: its scale grid is 2 x 2 blocks in all (the last block row
    partial), 1 block row a rank; the shard spec keeps that global size for the loader, as the weight's does."""
    from mxc.loaders.convert import full_shape

    g = through_quantize(bind_arch, 2, options=dict(quant_lm_head=True), vocab_size=255, hidden_size=256,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=128, intermediate_size=256)
    head, scale = g.weights["lm_head"], g.weights["lm_head_scale"]
    assert head.quant is not None and scale.scale_of == "lm_head"
    assert (full_shape(head), head.shape) == ((255, 256), (128, 256))
    assert (full_shape(scale), scale.shape) == ((2, 2), (1, 2))


def test_a_tied_lm_head_is_refused_at_any_tp(bind_arch):
    """--quant-lm-head over an LM head tied to the embedding: refused at --tp 2 too, where the lookup is a
    vocab-parallel one (``vocab_embedding``), as at --tp 1."""
    for tp in (1, 2):
        with pytest.raises(MxcError, match="^--quant-lm-head: the LM head is tied to the embedding table"):
            through_quantize(bind_arch, tp, arch="Qwen2ForCausalLM", options=dict(quant_lm_head=True,
                             quant_granularity="channel"), tie_word_embeddings=True)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("granularity", ["tensor", "block128"])
def test_experts_of_a_bf16_checkpoint_always_get_row_scales(granularity, bind_arch):
    """--quant-granularity applies to the dense linears; the fused MoE takes per-expert row scales ([E, rows]) of
    stacks quantized per channel whatever the granularity asked."""
    g = through_quantize(bind_arch, 1, arch="Qwen3MoeForCausalLM", options=dict(quant_granularity=granularity),
                         **MOE)
    ws = layer(g).weights
    assert ws["wqkv"].quant.granularity == granularity
    for name, rows in (("we_gate_up", 64), ("we_down", 64)):
        assert (ws[name].dtype, ws[name].quant.granularity, ws[name].quant.prequantized) == (
            "float8_e4m3fn", "channel", False)
        assert ws[f"{name}_scale"].shape == (4, rows) and ws[f"{name}_scale"].stack == "e"


def test_static_input_scales_are_ignored_only_beside_fp8_weights(bind_arch):
    """An fp8 checkpoint's static ``input_scale`` tensors are skipped (mxc quantizes activations per token) for the
    linears it stores in fp8; the linears it keeps unquantized, the routers and the norms have none to skip."""
    kept = tuple(f"model.layers.{{i}}.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down"))
    g = through_quantize(bind_arch, 1, arch="Qwen2MoeForCausalLM", shared_expert_intermediate_size=48, **MOE,
                         options=dict(quant_granularity="channel", quant_scale_suffix="weight_scale",
                                      quant_unquantized=kept))
    ignored = [s for s in g.ignore if s.endswith("input_scale")]
    attn = [f"model.layers.{{i}}.self_attn.{p}_proj.input_scale" for p in "qkvo"]
    mlp = [f"model.layers.{{i}}.mlp.experts.{{e}}.{p}_proj.input_scale" for p in ("gate", "up", "down")]
    assert sorted(ignored) == sorted(attn + mlp)
    assert layer(g).weights["ws_down"].quant is None and layer(g).weights["we_down"].quant.prequantized


def test_experts_an_fp8_checkpoint_keeps_unquantized_stay_so(bind_arch):
    """An fp8 checkpoint that stores its experts in the model dtype (named in ``quant_unquantized``): the fused MoE
    keeps its bf16 stacks, without scales; the attention's linears are imported in fp8."""
    kept = tuple(f"model.layers.{{i}}.mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down"))
    g = through_quantize(bind_arch, 1, arch="Qwen3MoeForCausalLM", **MOE, options=dict(
        quant_granularity="channel", quant_scale_suffix="weight_scale", quant_unquantized=kept))
    ws = layer(g).weights
    assert ws["we_gate_up"].quant is None and ws["we_down"].quant is None and "we_down_scale" not in ws
    (moe,) = [n for n in layer(g).body if n.op == "fused_moe"]
    assert moe.ins[3:5] == ("we_gate_up", "we_down") and all(v is None for v in moe.ins[5:7])
    assert ws["wqkv"].quant.prequantized


def test_a_prequantized_checkpoints_blocks_that_cannot_follow_say_what_to_do(bind_arch):
    """The same refusal for an fp8 checkpoint's own block scales: its granularity cannot be changed, so the advice
    is another --tp or the bf16 checkpoint, not --quant-granularity channel."""
    fields = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256)
    with pytest.raises(MxcError) as e:
        through_quantize(bind_arch, 2, options=dict(quant_scale_suffix="weight_scale_inv"), **fields)
    assert str(e.value).startswith("block128 fp8 scales of layers.{i}.wqkv cannot follow its tensor-parallel split")
    assert str(e.value).endswith(": the checkpoint is fp8 with these block scales: use a --tp that leaves each rank "
                                 "whole 128-blocks, or build from the bf16 checkpoint with --quant fp8")


@pytest.mark.parametrize("options,says", [
    (dict(quant_granularity="channel"), "--quant fp8 quantizes the experts"),
    (dict(quant_granularity="channel", quant_scale_suffix="weight_scale"), "the checkpoint stores the experts in fp8")])
def test_unfused_experts_under_fp8_are_refused(options, says, bind_arch):
    """--disable-pass fuse_moe leaves the ``experts`` op, which takes no scales: under --quant fp8 its stacks stayed
    in the model dtype unsaid, and an fp8 checkpoint's experts were refused by the loader as fp8 tensors of a weight
    kept unquantized. The build now names the pass to keep; experts an fp8 checkpoint keeps unquantized still build."""
    with pytest.raises(MxcError) as e:
        through_quantize(bind_arch, 1, disable=("fuse_moe",), arch="Qwen3MoeForCausalLM", options=options, **MOE)
    assert str(e.value).startswith(f"{says}, and only the fused MoE op (pass fuse_moe) takes fp8 experts")
    assert str(e.value).endswith("build without --disable-pass fuse_moe") and "\n" not in str(e.value)
    if "quant_scale_suffix" in options:
        kept = tuple(f"model.layers.{{i}}.mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down"))
        g = through_quantize(bind_arch, 1, disable=("fuse_moe",), arch="Qwen3MoeForCausalLM",
                             options=dict(options, quant_unquantized=kept), **MOE)
        assert [n.op for n in layer(g).body if n.op in ("experts", "fused_moe")] == ["experts"]
        assert layer(g).weights["wqkv"].quant.prequantized
