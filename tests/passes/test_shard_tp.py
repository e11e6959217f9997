"""shard_tp on bound graphs: which weights split, which ops become collectives, and which splits are refused.

The end-to-end numbers (every rank's logits against transformers over gloo) are in
``tests/parallel/test_tensor_parallel.py``; these check the pass's output graph for the model-file variants
those builds do not reach: weights a model file keeps whole, replicated norms, q and k of different widths.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mxc.compiler.options import BuildOptions
from mxc.compiler.passes import eliminate_dead_code, fuse_moe, merge_gate_up, merge_qkv, shard_tp
from mxc.errors import MxcError
from mxc.ir import Graph, Repeat, ShardSpec, verify

MOE = dict(num_experts=4, num_experts_per_tok=2)


def layer(g: Graph) -> Repeat:
    return next(it for it in g.body if isinstance(it, Repeat))


def top_ops(g: Graph) -> list[str]:
    return [n.op for n in g.body if not isinstance(n, Repeat)]


def prepared(g: Graph) -> Graph:
    """The graph as shard_tp gets it in the pipeline: qkv and gate/up merged, experts fused."""
    for p in (merge_qkv, merge_gate_up, fuse_moe, eliminate_dead_code):
        g = p.run(g, None)
    return g


def reshard(g: Graph, layer_specs: dict | None = None, **top_specs) -> Graph:
    """``g`` with the shard specs of the named weights replaced (None: the model file declares no split)."""
    weights = {k: replace(w, shard=top_specs[k]) if k in top_specs else w for k, w in g.weights.items()}
    rep = layer(g)
    specs = layer_specs or {}
    rep_weights = {k: replace(w, shard=specs[k]) if k in specs else w for k, w in rep.weights.items()}
    body = tuple(rep.replace(weights=rep_weights) if it is rep else it for it in g.body)
    return g.replace(weights=weights, body=body)


def shard(g: Graph, tp: int = 2, target: str = "cpu") -> Graph:
    out = shard_tp.run(g, BuildOptions(tp=tp, target=target))
    verify(out)
    return out


def test_weights_a_model_file_keeps_whole_stay_whole(bind_arch):
    """An embedding without a split and an LM head declared ``replicated``: every rank holds them whole, so the
    lookup stays a plain embedding (no vocab slice, no all-reduce) and the logits need no gather."""
    g = reshard(prepared(bind_arch()), embed=None, lm_head=ShardSpec("replicated"))
    out = shard(g)
    assert out.weights["embed"].shape == (256, 64) and out.weights["lm_head"].shape == (256, 64)
    assert out.weights["lm_head"].shard == ShardSpec("replicated")
    assert top_ops(out) == ["embedding", "gather_rows", "rms_norm", "linear"]
    assert layer(out).weights["wqkv"].shape == (64, 64)  # the layers still split: q 32 + k 16 + v 16 rows a rank


def test_whole_attention_keeps_its_split_sizes(bind_arch):
    """A model file that replicates the attention (no split on its q/k/v/o weights) while the MLP splits: the qkv
    split keeps the global sizes and only the MLP's down projection is all-reduced."""
    specs = {k: None for k in ("wq", "wk", "wv", "wqkv", "wo")}
    out = shard(reshard(prepared(bind_arch()), specs))
    nodes = layer(out).body
    (split,) = [n for n in nodes if n.op == "split"]
    assert split.attrs["sizes"] == [64, 32, 32]
    reduced = [n.ins[0] for n in nodes if n.op == "all_reduce"]
    assert len(reduced) == 1 and next(n for n in nodes if n.outs[0] == reduced[0]).ins[1] == "w_down"


def test_unsplit_experts_are_not_all_reduced(bind_arch):
    """Expert stacks a model file keeps whole: every rank computes the whole MoE output, which an all-reduce would
    add up ``tp`` times; only split (row-parallel) down stacks make partial sums."""
    g = prepared(bind_arch("Qwen3MoeForCausalLM", **MOE, moe_intermediate_size=32))
    whole = reshard(g, {k: None for k in layer(g).weights if k.startswith("we_")})
    nodes = layer(shard(whole)).body
    (moe,) = [n for n in nodes if n.op == "fused_moe"]
    assert [n.op for n in nodes if moe.outs[0] in n.ins] == ["add"]
    assert layer(shard(whole)).weights["we_down"].shape == (4, 64, 32)
    split = layer(shard(g)).body  # as the model file declares them: the partial sums are all-reduced
    (moe,) = [n for n in split if n.op == "fused_moe"]
    assert [n.op for n in split if moe.outs[0] in n.ins] == ["all_reduce"]


def test_a_norm_declared_replicated_is_gathered_like_an_unsplit_one(bind_arch):
    """OLMoE's q/k norm weights span every head: declared ``replicated`` (rather than left without a split) they
    are still whole on every rank, so the norm still needs the gathered row."""
    g = prepared(bind_arch("OlmoeForCausalLM", **MOE, num_key_value_heads=4))
    specs = {"q_norm_full": ShardSpec("replicated"), "k_norm_full": ShardSpec("replicated")}
    for graph in (g, reshard(g, specs)):
        nodes = layer(shard(graph)).body
        normed = [n for n in nodes if n.op == "rms_norm" and n.ins[1] in specs]
        assert len(normed) == 2
        for n in normed:
            src = next(m for m in nodes if n.ins[0] in m.outs)
            user = next(m for m in nodes if n.outs[0] in m.ins)
            assert src.op == "all_gather" and user.op == "rank_slice", (src.op, user.op)


def test_q_and_k_norms_of_different_widths_gather_their_own_columns(bind_arch):
    """OLMoE with 4 query heads and 2 KV heads at --tp 2: each rank holds 32 of q's 64 columns and 16 of k's 32, so
    both norms gather (k's is not refused as if k had q's width)."""
    g = prepared(bind_arch("OlmoeForCausalLM", **MOE, num_key_value_heads=2))
    nodes = layer(shard(g)).body
    (split,) = [n for n in nodes if n.op == "split"]
    assert split.attrs["sizes"] == [32, 16, 16]
    gathered = {n.ins[0]: n.outs[0] for n in nodes if n.op == "all_gather"}
    assert set(gathered) == {"q", "k"}
    assert [n.ins[1] for n in nodes if n.op == "rms_norm" and n.ins[0] in gathered.values()] == ["q_norm_full",
                                                                                                  "k_norm_full"]


def test_row_weight_with_fewer_columns_than_ranks_is_refused_by_its_field(bind_arch):
    """A row-parallel weight of single columns (the MLP's down projection) that has fewer columns than ranks: each
    rank would hold copies the all-reduce adds up. The error names the field and its size, with no units (they
    are single columns)."""
    with pytest.raises(MxcError) as e:
        shard(prepared(bind_arch(intermediate_size=2)), tp=4)
    assert str(e.value) == ("cannot shard weight layers.{i}.w_down (row) across --tp 4: `intermediate_size` = 2 makes "
                            "2 parts, fewer than the ranks; use a --tp that the parts divide into")
    with pytest.raises(MxcError) as e:
        shard(prepared(bind_arch(intermediate_size=1)), tp=2)
    assert str(e.value) == ("cannot shard weight layers.{i}.w_down (row) across --tp 2: `intermediate_size` = 1 makes "
                            "1 part, fewer than the ranks; use a --tp that the parts divide into")


def test_a_model_that_splits_inconsistently_is_refused_as_a_user_error(bind_arch):
    """The o projection declared whole while the q heads it reads split: the graph no longer holds together, which is
    the model file's doing: a one-line MxcError naming --tp, not a VerifyError from the pipeline."""
    g = reshard(prepared(bind_arch()), {"wo": None})
    with pytest.raises(MxcError, match=r"^--tp 2: this model cannot be split as its definition stands: ") as e:
        shard_tp.run(g, BuildOptions(tp=2))
    assert "\n" not in str(e.value)


def test_identity_at_tp_1(bind_arch):
    g = prepared(bind_arch())
    assert shard_tp.run(g, BuildOptions(tp=1)) is g


def test_unfused_experts_are_all_reduced(bind_arch):
    """With ``--disable-pass fuse_moe`` the experts op reaches shard_tp as it is: its down stack is row-parallel
    too, so its output is a partial sum that must be all-reduced, as the fused op's is."""
    g = bind_arch("Qwen3MoeForCausalLM", **MOE, moe_intermediate_size=32)
    g = eliminate_dead_code.run(merge_gate_up.run(merge_qkv.run(g, None), None), None)
    out = shard(g)
    nodes = layer(out).body
    (moe,) = [n for n in nodes if n.op == "experts"]
    (user,) = [n for n in nodes if moe.outs[0] in n.ins]
    assert user.op == "all_reduce" and user.attrs == {"world": 2}
    assert layer(out).weights["we_down"].shape == (4, 64, 16)
