"""The op table: every op has a rule, a torch reference and a kernel candidate; every rule
accepts a valid example, rejects a bad one with RuleError, and agrees with the reference on shapes."""

from __future__ import annotations

import inspect

import pytest
import torch

from mxc.ir.graph import TensorType
from mxc.ir.ops import OPS, RuleError, infer, n_outputs
from mxc.kernels import torch_ref
from mxc.kernels.candidates import CANDIDATES
from mxc.kernels.context import ForwardContext
from mxc.models.rope_config import normalize_rope


def tt(*shape, dtype="float32"):
    return TensorType(tuple(shape), dtype)


ROPE = normalize_rope({"rope_theta": 10000.0, "max_position_embeddings": 64}, 16)
QKV_ATTRS = {"heads": 4, "kv_heads": 2, "head_dim": 16, "spec": ROPE, "layer": 0}
FP8 = "float8_e4m3fn"
# rms_norm_mlp over hidden 64, intermediate 96: x, norm, gate/up [192, 64] and its row scales, down [64, 96] and its
MLP_INS = [tt("T", 64), tt(64), tt(192, 64, dtype=FP8), tt(192), tt(64, 96, dtype=FP8), tt(64)]
MLP_ATTRS = {"eps": 1e-5, "granularity": "channel"}
# fused_moe over 8 experts, top 2, hidden 64, intermediate 96: x, weights, ids, then the stacks
MOE_INS = [tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64")]

# op -> (valid (inputs, attrs), expected output types, bad examples (inputs, attrs, message fragment))
EXAMPLES = {
    "embedding": (([tt("T", dtype="int64"), tt(256, 64)], {}), [tt("T", 64)], [
        ([tt("T"), tt(256, 64)], {}, "ids must be [T] int64"),
        ([tt("T", dtype="int64"), tt(256)], {}, "table must be [vocab, hidden]"),
    ]),
    "gather_rows": (([tt("T", 64), tt("R", dtype="int64")], {}), [tt("R", 64)], [
        ([tt("T", 64), tt("R")], {}, "rows must be [R] int64"),
    ]),
    "add": (([tt("T", 64), tt("T", 64)], {}), [tt("T", 64)], [
        ([tt("T", 64), tt("T", 32)], {}, "inputs differ"),
        ([tt("T", 64), tt("T", 64, dtype="bfloat16")], {}, "inputs differ"),
    ]),
    "mul": (([tt("T", 96), tt("T", 96)], {}), [tt("T", 96)], [
        ([tt("T", 96), tt("R", 96)], {}, "inputs differ"),
    ]),
    "silu": (([tt("T", 96)], {}), [tt("T", 96)], [
        ([tt("T", 96), tt("T", 96)], {}, "takes at most 1 inputs"),
        ([tt("T", 96)], {"alpha": 1.0}, "unknown attribute(s) alpha"),
    ]),
    "sigmoid": (([tt("T", 1)], {}), [tt("T", 1)], [
        ([tt("T", 1), tt("T", 1)], {}, "takes at most 1 inputs"),
        ([tt("T", 1)], {"beta": 1.0}, "unknown attribute(s) beta"),
    ]),
    "scale_rows": (([tt("T", 64), tt("T", 1)], {}), [tt("T", 64)], [
        ([tt("T", 64), tt("T")], {}, "scale [T] float32 must be [T, 1]"),
        ([tt("T", 64), tt("T", 64)], {}, "scale [T, 64] float32 must be [T, 1]"),
        ([tt("T", 64), tt("R", 1)], {}, "scale [R, 1] float32 must be [T, 1]"),
    ]),
    "silu_mul": (([tt("T", 192)], {}), [tt("T", 96)], [
        ([tt("T", 191)], {}, "expects [T, 2*I]"),
        ([tt("T", 4, 48)], {}, "expects [T, 2*I]"),
    ]),
    "rms_norm": (([tt("T", 64), tt(64)], {"eps": 1e-5}), [tt("T", 64)], [
        ([tt("T", 64), tt(32)], {"eps": 1e-5}, "does not match the last dim"),
        ([tt("T", 64), tt(64)], {"eps": 0.0}, "eps must be > 0"),
        ([tt("T", 64), tt(64)], {}, "missing attribute(s) eps"),
        ([tt("T", 64), tt(64, 64)], {"eps": 1e-5}, "does not match the last dim"),  # the weight is [H]
    ]),
    "linear": (([tt("T", 64), tt(128, 64), tt(128)], {}), [tt("T", 128)], [
        ([tt("T", 64), tt(128, 48)], {}, "disagree on K"),
        ([tt("T", 64), tt(128, 64), tt(64)], {}, "bias [64] float32 must be [128]"),
        ([tt("T", 4, 16), tt(128, 64)], {}, "expects x [T, K] and w [N, K]"),
        ([tt("T", 64), None], {}, "input 'weight' is required"),
        ([tt("T", 128), tt(128, 64)], {"prologue": "gelu"}, "prologue must be None or 'silu_mul', got 'gelu'"),
        ([tt("T", 129), tt(128, 64)], {"prologue": "silu_mul"}, "(after silu_mul) and weight"),  # odd: no halves
    ]),
    "heads": (([tt("T", 64)], {"size": 16}), [tt("T", 4, 16)], [
        ([tt("T", 64)], {"size": 24}, "cannot split"),
        ([tt("T", 4, 16)], {"size": 16}, "cannot split"),
    ]),
    "flatten_heads": (([tt("T", 4, 16)], {}), [tt("T", 64)], [
        ([tt("T", 64)], {}, "expects [T, heads, head_dim]"),
    ]),
    "split": (([tt("T", 128)], {"sizes": [64, 32, 32]}), [tt("T", 64), tt("T", 32), tt("T", 32)], [
        ([tt("T", 128)], {"sizes": [64, 32]}, "do not add up"),
    ]),
    "rope": (([tt("T", 4, 16), tt("T", 2, 16), tt("T", dtype="int64")], {"spec": ROPE}),
             [tt("T", 4, 16), tt("T", 2, 16)], [
        ([tt("T", 4, 16), tt("T", 2, 8), tt("T", dtype="int64")], {"spec": ROPE}, "must be [T, heads, head_dim]"),
        ([tt("T", 4, 16), tt("T", 2, 16), tt("T", dtype="int32")], {"spec": ROPE}, "must be [T] int64"),
        ([tt("T", 4, 16), tt("T", 2, 16), tt("T", dtype="int64")], {"spec": {**ROPE, "rotary_dim": 32}},
         "rotary_dim 32 exceeds head_dim 16"),
    ]),
    "attention": (([tt("T", 4, 16), tt("T", 2, 16), tt("T", 2, 16)], {"scale": 0.25, "layer": 0}),
                  [tt("T", 4, 16)], [
        ([tt("T", 3, 16), tt("T", 2, 16), tt("T", 2, 16)], {"scale": 0.25, "layer": 0}, "not a multiple"),
        ([tt("T", 4, 16), tt("T", 2, 16), tt("T", 2, 8)], {"scale": 0.25, "layer": 0}, "expects q, k, v"),
        ([tt("T", 4, 8), tt("T", 2, 16), tt("T", 2, 16)], {"scale": 0.25, "layer": 0}, "disagree"),
        ([tt("T", 4, 16), tt("T", 2, 16), tt("T", 2, 16)], {"scale": 0.25}, "missing attribute(s) layer"),
        ([tt("T", 4, 16), tt("R", 2, 16), tt("R", 2, 16)], {"scale": 0.25, "layer": 0}, "disagree"),
        ([tt("T", 4, 16), tt("T", 0, 16), tt("T", 0, 16)], {"scale": 0.25, "layer": 0}, "not a multiple of 0 kv"),
    ]),
    # fused ops
    "add_rms_norm": (([tt("T", 64), tt("T", 64), tt(64)], {"eps": 1e-5}), [tt("T", 64), tt("T", 64)], [
        ([tt("T", 64), tt("T", 32), tt(64)], {"eps": 1e-5}, "inputs differ"),
        ([tt("T", 64), tt("T", 64), tt(32)], {"eps": 1e-5}, "does not match the last dim"),
        ([tt("T", 64), tt("T", 64), tt(64)], {"eps": -1.0}, "eps must be > 0"),
        ([tt("T", 64), tt("T", 64, dtype="bfloat16"), tt(64)], {"eps": 1e-5}, "inputs differ"),
    ]),
    "add_rms_norm_route": (([tt("T", 64), tt("T", 64), tt(64), tt(8, 64)], {"eps": 1e-5, "k": 2}),
                           [tt("T", 64), tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64")], [
        ([tt("T", 64), tt("T", 32), tt(64), tt(8, 64)], {"eps": 1e-5, "k": 2}, "inputs differ"),
        ([tt("T", 64), tt("T", 64), tt(64), tt(8, 32)], {"eps": 1e-5, "k": 2}, "router weight"),
        ([tt("T", 64), tt("T", 64), tt(64), tt(8, 64)], {"eps": 1e-5, "k": 9}, "k=9 must be in 1..8"),
        ([tt("T", 64), tt("T", 64), tt(64), tt(8, 64)], {"eps": 1e-5}, "missing attribute(s) k"),
        ([tt("T", 64), tt("T", 64), tt(64), tt(8, 64)], {"eps": 1e-5, "k": 2, "fp32_weights": "yes"},
         "fp32_weights='yes' must be true or false"),
    ]),
    "rms_norm_linear": (([tt("T", 64), tt(64), tt(128, 64), tt(128)], {"eps": 1e-5}), [tt("T", 128)], [
        ([tt("T", 64), tt(32), tt(128, 64)], {"eps": 1e-5}, "disagree on K"),
        ([tt("T", 64), tt(64), tt(128, 48)], {"eps": 1e-5}, "disagree on K"),
        ([tt("T", 64), tt(64), tt(128, 64), tt(64)], {"eps": 1e-5}, "bias [64] float32 must be [128]"),
        ([tt("T", 64), tt(64), tt(128, 64)], {"eps": 0.0}, "eps must be > 0"),
    ]),
    "qkv_rope_cache": (([tt("T", 128), tt("T", dtype="int64"), tt(16), tt(16)], QKV_ATTRS | {"eps": 1e-5}),
                       [tt("T", 4, 16)], [
        ([tt("T", 120), tt("T", dtype="int64")], QKV_ATTRS, "must be [T, 128] for 4+2*2 heads of 16"),
        ([tt("T", 128), tt("T", dtype="int32")], QKV_ATTRS, "must be [T] int64"),
        ([tt("T", 128), tt("T", dtype="int64"), tt(32), tt(32)], QKV_ATTRS, "must be [16]"),
        ([tt("T", 128), tt("T", dtype="int64"), tt(16)], QKV_ATTRS, "q_norm and k_norm come together"),
        ([tt("T", 128), tt("R", dtype="int64")], QKV_ATTRS, "must be [T] int64"),
        ([tt("T", 128), tt("T", dtype="int64"), tt(16), tt(32)], QKV_ATTRS, "must be [16] each"),
        # whole-projection norms are as wide as q (4 heads) and k (2 kv heads): [64] and [32]
        ([tt("T", 128), tt("T", dtype="int64"), tt(64), tt(64)], QKV_ATTRS, "or [64] and [32]"),
        ([tt("T", 128), tt("T", dtype="int64")], {**QKV_ATTRS, "sizes": [1]}, "unknown attribute(s) sizes"),
    ]),
    "cached_attention": (([tt("T", 4, 16)], {"scale": 0.25, "layer": 0}), [tt("T", 4, 16)], [
        ([tt("T", 4, 16), tt("T", 2, 16)], {"scale": 0.25, "layer": 0}, "takes at most 1 inputs"),
        ([tt("T", 4, 16)], {"layer": 0}, "missing attribute(s) scale"),
    ]),
    "qlinear": (([tt("T", 64), tt(32, 64, dtype="float8_e4m3fn"), tt(32)], {"granularity": "channel"}),
                [tt("T", 32)], [
        ([tt("T", 64), tt(32, 64), tt(32)], {"granularity": "channel"}, "must be float8_e4m3fn"),
        ([tt("T", 64), tt(32, 64, dtype="float8_e4m3fn"), tt(16)], {"granularity": "channel"}, "channel scale"),
        ([tt("T", 64), tt(32, 64, dtype="float8_e4m3fn"), tt(32)], {"granularity": "block128"}, "block128 scale"),
        ([tt("T", 64), tt(32, 64, dtype=FP8), tt(32, dtype="bfloat16")], {"granularity": "channel"},
         "must be float32"),
        ([tt("T", 64), tt(32, 64, dtype=FP8), tt(1, 1)], {"granularity": "row"}, "unknown granularity 'row'"),
    ]),
    "rms_norm_qlinear": (([tt("T", 64), tt(64), tt(32, 64, dtype="float8_e4m3fn"), tt(32)],
                          {"eps": 1e-5, "granularity": "channel"}), [tt("T", 32)], [
        ([tt("T", 64), tt(32), tt(32, 64, dtype="float8_e4m3fn"), tt(32)], {"eps": 1e-5, "granularity": "channel"},
         "does not match the last dim"),
        ([tt("T", 64), tt(64), tt(32, 64), tt(32)], {"eps": 1e-5, "granularity": "channel"}, "must be float8_e4m3fn"),
        ([tt("T", 64), tt(64), tt(32, 64, dtype="float8_e4m3fn"), tt(16)], {"eps": 1e-5, "granularity": "channel"},
         "channel scale"),
    ]),
    "rms_norm_mlp": (([tt("T", 64), tt(64), tt(192, 64, dtype="float8_e4m3fn"), tt(192),
                       tt(64, 96, dtype="float8_e4m3fn"), tt(64)], {"eps": 1e-5, "granularity": "channel"}),
                     [tt("T", 64)], [
        ([tt("T", 64), tt(64), tt(191, 64, dtype="float8_e4m3fn"), tt(191), tt(64, 96, dtype="float8_e4m3fn"),
          tt(64)], {"eps": 1e-5, "granularity": "channel"}, "even number of rows"),
        ([tt("T", 64), tt(64), tt(192, 64, dtype="float8_e4m3fn"), tt(192), tt(64, 95, dtype="float8_e4m3fn"),
          tt(64)], {"eps": 1e-5, "granularity": "channel"}, "disagree on K"),
        ([tt("T", 64), tt(64), tt(192, 64, dtype="float8_e4m3fn"), tt(192), tt(32, 96, dtype="float8_e4m3fn"),
          tt(32)], {"eps": 1e-5, "granularity": "channel"}, "must match the output"),
        (MLP_INS, {**MLP_ATTRS, "interleave": 64}, "interleave=64 must be 0 or a block size dividing half"),  # of 96
        (MLP_INS, {**MLP_ATTRS, "residual": 1}, "residual=1 must be true or false"),
    ]),
    # mixture of experts: 8 experts, top 2, hidden 64, expert intermediate 96
    "route": (([tt("T", 8)], {"k": 2, "scoring": "softmax", "renormalize": True}),
              [tt("T", 2), tt("T", 2, dtype="int64")], [
        ([tt("T", 2, 4)], {"k": 2}, "router logits must be [T, experts]"),
        ([tt("T", 8)], {"k": 0}, "k=0 must be in 1..8"),
        ([tt("T", 8)], {"k": 9}, "k=9 must be in 1..8"),
        ([tt("T", 8)], {"k": 2.0}, "k=2.0 must be in 1..8"),
        ([tt("T", 8)], {"k": 2, "scoring": "tanh"}, "scoring must be softmax or sigmoid, got 'tanh'"),
        ([tt("T", 8)], {}, "missing attribute(s) k"),
        ([tt("T", 8)], {"k": 2, "topk": 2}, "unknown attribute(s) topk"),
        ([tt("T", 8)], {"k": 2, "fp32_weights": 1}, "fp32_weights=1 must be true or false"),
    ]),
    "experts": (([tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64"), tt(8, 96, 64), tt(8, 96, 64), tt(8, 64, 96)], {}),
                [tt("T", 64)], [
        ([tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64"), tt(8, 96, 64), tt(8, 80, 64), tt(8, 64, 96)], {},
         "gate [8, 96, 64] float32 and up [8, 80, 64] float32 stacks differ"),
        ([tt("T", 64), tt("T", 2), tt("T", 2), tt(8, 96, 64), tt(8, 96, 64), tt(8, 64, 96)], {},
         "expects x [T, H], weights and ids [T, k]"),
        ([tt("T", 64), tt("T", 2), tt("T", 1, dtype="int64"), tt(8, 96, 64), tt(8, 96, 64), tt(8, 64, 96)], {},
         "expects x [T, H], weights and ids [T, k]"),
        ([tt("T", 64), tt("R", 2), tt("R", 2, dtype="int64"), tt(8, 96, 64), tt(8, 96, 64), tt(8, 64, 96)], {},
         "expects x [T, H], weights and ids [T, k]"),
        ([tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64"), tt(8, 96, 32), tt(8, 96, 32), tt(8, 64, 96)], {},
         "do not fit x [T, 64] float32"),
        ([tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64"), tt(8, 96, 64), tt(8, 96, 64), tt(4, 64, 96)], {},
         "expert stacks [8, 96, 64] float32 / [4, 64, 96] float32 do not fit"),
        ([tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64"), tt(8, 96, 64), tt(8, 96, 64), tt(8, 64, 48)], {},
         "do not fit"),
        ([tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64"), tt(8, 96, 64), tt(8, 96, 64)], {},
         "input 'w_down' is required"),
        ([tt("T", 64), tt("T", 2, dtype="bfloat16"), tt("T", 2, dtype="int64"), tt(8, 96, 64), tt(8, 96, 64),
          tt(8, 64, 96)], {}, "routing weights [T, 2] bfloat16 must be in x's dtype (float32) or float32"),
    ]),
    "fused_moe": (([tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64"), tt(8, 192, 64), tt(8, 64, 96)], {}),
                  [tt("T", 64)], [
        ([tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64"), tt(8, 96, 64), tt(8, 64, 96)], {},
         "expert stacks [8, 96, 64] float32 / [8, 64, 96] float32 do not fit x [T, 64] float32"),
        ([tt("T", 64), tt("T", 2), tt("T", 2, dtype="int64"), tt(8, 192, 64), tt(8, 32, 96)], {}, "do not fit"),
        ([tt("T", 64), tt("T", 2), tt("T", 2, dtype="int32"), tt(8, 192, 64), tt(8, 64, 96)], {},
         "expects x [T, H], weights and ids [T, k]"),
        ([tt("T", 4, 16), tt("T", 2), tt("T", 2, dtype="int64"), tt(8, 192, 64), tt(8, 64, 96)], {},
         "expects x [T, H], weights and ids [T, k]"),
        (MOE_INS + [tt(8, 192, 64, dtype=FP8), tt(8, 64, 96, dtype=FP8), tt(8, 192)], {},
         "fp8 expert scales come together"),
        (MOE_INS + [tt(8, 192, 64), tt(8, 64, 96), tt(8, 192), tt(8, 64)], {}, "scaled stacks must be fp8"),
        (MOE_INS + [tt(8, 192, 64), tt(8, 64, 96), None, None, tt("T", 32)], {}, "must match the output"),
    ]),
    # tensor parallelism (the single-process reference: world_size 1, rank 0)
    "vocab_embedding": (([tt("T", dtype="int64"), tt(256, 64)], {}), [tt("T", 64)], [
        ([tt("T"), tt(256, 64)], {}, "ids must be [T] int64"),
    ]),
    "all_reduce": (([tt("T", 64), tt(64)], {}), [tt("T", 64)], [
        ([tt("T", 64), tt(32)], {}, "bias [32] float32 must match the last dim"),
    ]),
    "all_reduce_add": (([tt("T", 64), tt("T", 64), tt(64)], {"world": 2}), [tt("T", 64)], [
        ([tt("T", 64), tt("T", 32)], {}, "inputs differ"),
        ([tt("T", 64), tt("T", 64), tt(32)], {}, "bias [32] float32 must match the last dim"),
    ]),
    "linear_all_reduce_add": (([tt("T", 32), tt(64, 32), tt("T", 64), tt(64)], {"world": 2}), [tt("T", 64)], [
        ([tt("T", 32), tt(64, 16), tt("T", 64)], {}, "disagree on K"),
        ([tt("T", 32), tt(64, 32), tt("T", 48)], {}, "inputs differ"),
    ]),
    "linear_all_reduce_add_rms_norm": (([tt("T", 32), tt(64, 32), tt("T", 64), tt(64)], {"eps": 1e-5, "world": 2}),
                                       [tt("T", 64), tt("T", 64)], [
        ([tt("T", 32), tt(64, 32), tt("T", 64), tt(32)], {"eps": 1e-5}, "does not match the last dim"),
        ([tt("T", 32), tt(64, 32), tt("T", 64), tt(64)], {}, "missing attribute(s) eps"),
    ]),
    "all_reduce_add_rms_norm": (([tt("T", 64), tt("T", 64), tt(64)], {"eps": 1e-5, "world": 2}),
                                [tt("T", 64), tt("T", 64)], [
        ([tt("T", 64), tt("T", 64), tt(32)], {"eps": 1e-5}, "does not match the last dim"),
        ([tt("T", 64), tt("T", 64), tt(64)], {}, "missing attribute(s) eps"),
    ]),
    "all_gather": (([tt("T", 32)], {"world": 1}), [tt("T", 32)], [
        ([tt("T", 32)], {"world": 0}, "world must be a positive integer"),
        ([tt("T", 32)], {}, "missing attribute(s) world"),
        ([tt("T", 32)], {"world": 2, "size": 32}, "size must be an integer in (32, 64]"),
        ([tt("T", 32)], {"world": 2, "size": 65}, "size must be an integer in (32, 64]"),
    ]),
    "rank_slice": (([tt("T", 64)], {"world": 2}), [tt("T", 32)], [
        ([tt("T", 64)], {"world": 0}, "world must be a positive integer"),
        ([tt("T", 64)], {"world": 3}, "does not split into 3 equal slices"),
    ]),
}

BAD = [pytest.param(op, ins, attrs, msg, id=f"{op}-{k}")
       for op, (_, _, bads) in EXAMPLES.items() for k, (ins, attrs, msg) in enumerate(bads)]


def test_every_op_has_examples():
    assert set(EXAMPLES) == set(OPS)


@pytest.mark.parametrize("op", sorted(OPS))
def test_op_is_complete(op):
    """Adding an op = an OpDef with a rule, a torch reference, and a candidate (ops.py docstring)."""
    d = OPS[op]
    assert d.name == op and callable(d.rule)
    assert callable(getattr(torch_ref, op, None)), f"torch_ref has no function {op}"
    assert CANDIDATES.get(op), f"no kernel candidate claims {op}"
    assert all(c.op == op for c in CANDIDATES[op])
    assert any(c.name == f"torch_ref.{op}" for c in CANDIDATES[op])


@pytest.mark.parametrize("op", sorted(OPS))
def test_torch_ref_signature_matches_codegen_calls(op):
    """Generated code calls ``torch_ref.op(inputs..., [ctx,] attr=...)``: parameter names must line up."""
    d = OPS[op]
    params = list(inspect.signature(getattr(torch_ref, op)).parameters)
    want = [n.rstrip("?") for n in d.inputs] + (["ctx"] if d.uses_context else [])
    assert params[:len(want)] == want
    assert set(params[len(want):]) == set(d.attrs) | set(d.optional_attrs)


@pytest.mark.parametrize("op", sorted(OPS))
def test_rule_accepts_valid_example(op):
    (ins, attrs), want, _ = EXAMPLES[op]
    outs = infer(op, ins, attrs)
    assert list(outs) == want
    assert len(outs) == n_outputs(op, attrs)


@pytest.mark.parametrize("op, ins, attrs, msg", BAD)
def test_rule_rejects_bad_example(op, ins, attrs, msg):
    with pytest.raises(RuleError) as e:
        infer(op, ins, attrs)
    assert msg in str(e.value)


def test_kernel_attrs_are_always_allowed():
    (ins, attrs), want, _ = EXAMPLES["linear"]
    assert list(infer("linear", ins, {"kernel": "torch_ref.linear", "kernel_reason": "r"})) == want


def test_optional_input_may_be_absent():
    assert infer("linear", [tt("T", 64), tt(128, 64), None], {}) == (tt("T", 128),)
    assert infer("linear", [tt("T", 64), tt(128, 64)], {}) == (tt("T", 128),)


def test_route_weights_take_the_logits_dtype():
    """Routing weights come back in the logits' dtype (the reference scores in float32), ids are int64; with
    fp32_weights (Mixtral's) in float32, unrounded, for route and the fused add_rms_norm_route alike."""
    assert infer("route", [tt("T", 8, dtype="bfloat16")], {"k": 2}) == (tt("T", 2, dtype="bfloat16"),
                                                                      tt("T", 2, dtype="int64"))
    assert infer("route", [tt("T", 8, dtype="bfloat16")], {"k": 2, "fp32_weights": True}) == (
        tt("T", 2, dtype="float32"), tt("T", 2, dtype="int64"))
    bf16 = [tt("T", 64, dtype="bfloat16")] * 2 + [tt(64, dtype="bfloat16"), tt(8, 64, dtype="bfloat16")]
    for fp32, want in ((False, "bfloat16"), (True, "float32")):
        out = infer("add_rms_norm_route", bf16, {"eps": 1e-5, "k": 2, "fp32_weights": fp32})
        assert [t.dtype for t in out] == ["bfloat16", "bfloat16", want, "int64"]
    logits = torch.randn(5, 8, dtype=torch.bfloat16)
    for scoring in ("softmax", "sigmoid"):
        w, ids = torch_ref.route(logits, k=2, scoring=scoring)
        assert (w.dtype, w.shape, ids.dtype, ids.shape) == (torch.bfloat16, (5, 2), torch.int64, (5, 2))
        w32, ids32 = torch_ref.route(logits, k=2, scoring=scoring, renormalize=True, fp32_weights=True)
        assert w32.dtype == torch.float32 and torch.equal(ids32, ids)
        assert torch.equal(w32.to(torch.bfloat16), torch_ref.route(logits, k=2, scoring=scoring, renormalize=True)[0])
        assert not torch.equal(w32, w32.to(torch.bfloat16).float())  # not bf16 values: the rounding is skipped
    a, b, nw, rw = (torch.randn(3, 64).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16),
                    torch.ones(64, dtype=torch.bfloat16), torch.randn(8, 64).to(torch.bfloat16))
    *_, w32, _ = torch_ref.add_rms_norm_route(a, b, nw, rw, eps=1e-5, k=2, fp32_weights=True)
    assert w32.dtype == torch.float32


@pytest.mark.parametrize("op, ins, attrs", [
    ("heads", [tt("T", 64)], {"size": 0}),
    ("heads", [tt("T", 64)], {"size": 16.0}),
    ("heads", [tt("T", 64)], {"size": True}),  # a YAML `true` is no head size, though Python calls it 1
    ("split", [tt("T", 64)], {"sizes": [96, -32]}),
], ids=["heads-size0", "heads-float", "heads-bool", "split-negative"])
def test_rule_rejects_non_positive_int_sizes(op, ins, attrs):
    with pytest.raises(RuleError):
        infer(op, ins, attrs)


@pytest.mark.parametrize("op, ins, attrs, want", [
    # OLMoE's q/k norms over the whole projections: [heads * head_dim] and [kv_heads * head_dim]
    ("qkv_rope_cache", [tt("T", 128), tt("T", dtype="int64"), tt(64), tt(32)], QKV_ATTRS, [tt("T", 4, 16)]),
    # 128x128 block scales cover partial blocks: [ceil(200 / 128), ceil(64 / 128)] (HF fp8 weight_scale_inv)
    ("qlinear", [tt("T", 64), tt(200, 64, dtype=FP8), tt(2, 1)], {"granularity": "block128"}, [tt("T", 200)]),
    ("fused_moe", MOE_INS + [tt(8, 192, 64, dtype=FP8), tt(8, 64, 96, dtype=FP8), tt(8, 2, 1), tt(8, 1, 1)], {},
     [tt("T", 64)]),
    ("fused_moe", MOE_INS + [tt(8, 192, 64, dtype=FP8), tt(8, 64, 96, dtype=FP8), tt(8, 192), tt(8, 64)], {},
     [tt("T", 64)]),  # row scales: one per row of each expert
    # gate/up rows in blocks of 32: 32 divides the 96 rows of each half
    ("rms_norm_mlp", MLP_INS, {**MLP_ATTRS, "interleave": 32}, [tt("T", 64)]),
    # without the residual add the output need not be x's shape
    ("rms_norm_mlp", MLP_INS[:4] + [tt(32, 96, dtype=FP8), tt(32)], {**MLP_ATTRS, "residual": False}, [tt("T", 32)]),
    ("route", [tt("T", 8)], {"k": 8}, [tt("T", 8), tt("T", 8, dtype="int64")]),  # every expert
    # Mixtral's float32 routing weights with bf16 activations and stacks
    ("experts", [tt("T", 64, dtype="bfloat16"), tt("T", 2), tt("T", 2, dtype="int64")]
     + [tt(*s, dtype="bfloat16") for s in ((8, 96, 64), (8, 96, 64), (8, 64, 96))], {},
     [tt("T", 64, dtype="bfloat16")]),
    ("fused_moe", [tt("T", 64, dtype="bfloat16"), tt("T", 2), tt("T", 2, dtype="int64"),
                   tt(8, 192, 64, dtype=FP8), tt(8, 64, 96, dtype=FP8), tt(8, 192), tt(8, 64)], {},
     [tt("T", 64, dtype="bfloat16")]),
    # world 2 of 32 columns gather 64; a padded vocabulary keeps its first `size` columns, in (32, 64]
    ("all_gather", [tt("T", 32)], {"world": 2, "size": 64}, [tt("T", 64)]),
    ("all_gather", [tt("T", 32)], {"world": 2, "size": 50}, [tt("T", 50)]),
], ids=["qkv-whole-norms", "qlinear-partial-blocks", "fused_moe-block-scales", "fused_moe-row-scales",
        "mlp-interleave", "mlp-no-residual", "route-all-experts", "experts-fp32-weights", "fused_moe-fp8-fp32-weights",
        "all_gather-full", "all_gather-padded"])
def test_rule_accepts_edge_cases(op, ins, attrs, want):
    assert list(infer(op, ins, attrs)) == want


# --- the rule and the torch reference agree on output shapes and dtypes ----------------

SIZES = {"T": 5, "R": 3}
DTYPES = {"float32": torch.float32, "int64": torch.int64}


MOE_OPS = ("experts", "fused_moe")  # inputs x, weights, ids, ..., w_down [E, H, I]


def _tensor(t: TensorType, role: str, gen, n_experts: int | None = None) -> torch.Tensor:
    """A random tensor for input ``role``; ``n_experts``: an MoE op's expert count, for valid routing inputs."""
    shape = [SIZES.get(d, d) for d in t.shape]
    if n_experts is not None and role == "ids":  # top-k expert ids: distinct per token, each < E
        return torch.rand(shape[0], n_experts, generator=gen).argsort(dim=-1)[:, :shape[1]]
    if n_experts is not None and role == "weights":  # routing weights are positive
        return torch.rand(shape, generator=gen) + 0.1
    if t.dtype == "int64":
        hi = {"ids": 256, "rows": SIZES["T"], "positions": 8}[role]
        return torch.randint(0, hi, shape, generator=gen)
    if t.dtype == "float8_e4m3fn":
        return torch.randn(shape, generator=gen).to(torch.float8_e4m3fn)
    return torch.randn(shape, generator=gen)


@pytest.mark.parametrize("op", sorted(OPS))
def test_torch_ref_matches_rule(op):
    (ins, attrs), _, _ = EXAMPLES[op]
    gen = torch.Generator().manual_seed(0)
    names = [n.rstrip("?") for n in OPS[op].inputs]
    n_experts = ins[names.index("w_down")].shape[0] if op in MOE_OPS else None
    args = [_tensor(t, n, gen, n_experts) for t, n in zip(ins, names)]
    args += [None] * (len(names) - len(args))  # absent optional inputs, as generated code passes them
    if OPS[op].uses_context:  # one sequence, an empty KV cache of 2 kv heads of 16 for layer 0
        cache = lambda: [torch.zeros(1, 8, 2, 16)]
        args.append(ForwardContext.build([SIZES["T"]], [0], [0], cache(), cache(), torch.device("cpu")))
    got = getattr(torch_ref, op)(*args, **attrs)
    got = got if isinstance(got, tuple) else (got,)
    want = infer(op, ins, attrs)
    assert [tuple(g.shape) for g in got] == [tuple(SIZES.get(d, d) for d in w.shape) for w in want]
    assert [g.dtype for g in got] == [DTYPES[w.dtype] for w in want]


def test_rotary_dim_of_a_whole_head_is_exact_for_any_head_dim():
    """partial_rotary_factor 1 (or absent) rotates the whole head: exactly head_dim, even past a float's 53 bits
    (int(head_dim * 1.0) is not head_dim there, and the refusal of a partial factor named a wrong dim)."""
    for head_dim in (128, 2**60 + 2):
        spec = normalize_rope({"max_position_embeddings": 128}, head_dim)
        assert spec["rotary_dim"] == head_dim
