"""Kernel candidates' checks (``mxc.kernels.candidates``): each GPU candidate declines, with its reason, exactly what
its kernel cannot take, at the limits the checks' own reasons state, and claims what it can."""

from __future__ import annotations

import pytest

from mxc.compiler.options import DTYPES, BuildOptions
from mxc.ir import Node, TensorType
from mxc.kernels import candidates
from mxc.kernels.candidates import CANDIDATES, ONE_SHOT_DTYPES, WIDE_N

CUDA = BuildOptions(target="cuda", dtype="bfloat16")


def _why(name: str, op: str, ins: list, attrs: dict | None = None, options: BuildOptions = CUDA, i: int = 0):
    """``why_not`` of the ``i``-th candidate called ``name`` for ``op`` on a node whose inputs have types ``ins``."""
    cand = [c for c in CANDIDATES[op] if c.name == name][i]
    node = Node(op, ("y",), tuple(f"in{j}" for j in range(len(ins))), attrs or {})
    return cand.why_not(node, ins, options)


def _t(*shape, dtype="bfloat16"):
    return TensorType(shape, dtype)


@pytest.mark.parametrize("op, weight_at", [("linear", 1), ("rms_norm_linear", 2)])
def test_gemv_at_17_to_32_tokens_declines_wide_weights(op, weight_at):
    """The 17..32-token GEMV declines weights of at least WIDE_N output rows, read from the op's own weight input
    (``rms_norm_linear``'s is its third: x, norm weight, weight), and takes narrower ones."""
    name = "triton_gemv.linear_small_m" if op == "linear" else "cuda_ops.rms_norm_linear_small_m"
    for n, declined in [(WIDE_N - 16, False), (WIDE_N, True), (2 * WIDE_N, True)]:
        ins = [_t("T", 4096), _t(4096), _t(n, 4096)]
        if op == "linear":
            ins = [ins[0], ins[2]]
        assert ins[weight_at].shape[0] == n
        why = _why(name, op, ins, {"eps": 1e-6} if op == "rms_norm_linear" else {}, i=1)
        assert (why is not None) == declined, (n, why)
        if declined:
            assert f"N={n} >= {WIDE_N}" in why
        assert _why(name, op, ins, {"eps": 1e-6} if op == "rms_norm_linear" else {}, i=0) is None  # <= 16 tokens


def test_gemv_declines_a_fused_prologue_and_non_float_dtypes():
    x, w = _t("T", 4096), _t(4096, 4096)
    assert _why("triton_gemv.linear_small_m", "linear", [x, w]) is None
    for i in (0, 1):  # at <= 16 and at 17..32 tokens
        why = _why("triton_gemv.linear_small_m", "linear", [x, w], {"prologue": "silu_mul"}, i=i)
        assert "takes no silu_mul prologue" in why
    assert "dtype int8" in _why("triton_gemv.linear_small_m", "linear", [_t("T", 4096, dtype="int8"), w])


@pytest.mark.parametrize("rotary_dim, why", [(128, None), (64, None), (66, None), (65, "odd rotary dim 65")])
def test_rope_kernel_takes_even_rotary_dims(rotary_dim, why):
    spec = {"type": "default", "rotary_dim": rotary_dim}
    got = _why("cuda_ops.qkv_rope_cache", "qkv_rope_cache", [_t("T", 1024)], {"spec": spec})
    assert got == why if why is None else why in got
    dynamic = _why("cuda_ops.qkv_rope_cache", "qkv_rope_cache", [_t("T", 1024)], {"spec": {**spec, "type": "dynamic"}})
    assert "dynamic-NTK" in dynamic


@pytest.mark.parametrize("experts, declined", [(1024, False), (1025, True), (128, False)])
def test_routers_hold_at_most_1024_scores(experts, declined):
    """The Triton router (one program a token) and the fused norm + router kernel hold at most 1024 expert scores."""
    route = _why("triton_route.route", "route", [_t("T", experts)], {"k": 8})
    fused = _why("triton_route.add_rms_norm_route", "add_rms_norm_route",
                 [_t("T", 2048), _t("T", 2048), _t(2048), _t(experts, 2048)], {"eps": 1e-6, "k": 8})
    unfused = _why("cuda_ops.add_rms_norm_route", "add_rms_norm_route",
                   [_t("T", 2048), _t("T", 2048), _t(2048), _t(experts, 2048)], {"eps": 1e-6, "k": 8})
    for why in (route, fused, unfused):
        assert (why is not None) == declined and (not declined or f"{experts} experts" in why), why


@pytest.mark.parametrize("hidden, declined", [(8192, False), (8193, True), (4096, False)])
def test_fused_norm_route_holds_rows_of_at_most_8192(hidden, declined):
    ins = [_t("T", hidden), _t("T", hidden), _t(hidden), _t(128, hidden)]
    why = _why("triton_route.add_rms_norm_route", "add_rms_norm_route", ins, {"eps": 1e-6, "k": 8})
    assert (why is not None) == declined and (not declined or f"hidden size {hidden}" in why)
    assert _why("cuda_ops.add_rms_norm_route", "add_rms_norm_route", ins, {"eps": 1e-6, "k": 8}) is None
    ints = [_t("T", hidden, dtype="int8"), *ins[1:]]
    why = _why("triton_route.add_rms_norm_route", "add_rms_norm_route", ints, {"eps": 1e-6, "k": 8})
    assert declined or "dtype int8" in why


@pytest.mark.parametrize("n, k, why", [(4096, 4096, None), (4104, 4096, "N=4104 and K=4096 must be multiples of 16"),
                                       (4096, 4104, "N=4096 and K=4104 must be multiples of 16")])
def test_scaled_mm_needs_multiples_of_16(n, k, why):
    ins = [_t("T", k), _t(n, k, dtype="float8_e4m3fn"), _t(n, dtype="float32")]
    got = _why("fp8_gemm.scaled_mm", "qlinear", ins, {"granularity": "channel"})
    assert got == why if why is None else why in got
    assert "128x128 blocks" in _why("fp8_gemm.scaled_mm", "qlinear", ins, {"granularity": "block128"})


def test_cutlass_needs_n_a_multiple_of_8_only(monkeypatch):
    """The CUTLASS GEMM's TMA rows are 16 bytes: K (fp8, 1 byte) a multiple of 16, N (bf16 output, 2 bytes) of 8."""
    from mxc.kernels import cutlass_fp8

    monkeypatch.setattr(cutlass_fp8, "available", lambda: None)
    for n, ok in [(4104, True), (4100, False)]:
        ins = [_t("T", 4096), _t(n, 4096, dtype="float8_e4m3fn"), _t(n, dtype="float32")]
        assert (_why("fp8_gemm.cutlass", "qlinear", ins, {"granularity": "channel"}) is None) == ok, n


@pytest.mark.parametrize("way, dtypes, other", [("one_shot", ("bfloat16", "float32"), "push"),
                                                 ("push", ("bfloat16", "float16"), "nccl")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_custom_all_reduces_take_their_dtypes_when_asked(way, dtypes, other, dtype):
    """The one-shot all-reduce sums bf16 or fp32, the push one bf16 or fp16; each only where --tp-allreduce asks."""
    kernel, ok = f"cuda_ops.all_reduce_{way}", dtype in dtypes
    why = _why(kernel, "all_reduce", [_t("T", 4096, dtype=dtype)],
               options=BuildOptions(target="cuda", dtype="bfloat16", tp=2, tp_allreduce=way))
    assert (why is None) == ok and (ok or f"not {dtype}" in why)
    asked_not = _why(kernel, "all_reduce", [_t("T", 4096, dtype=dtype)],
                     options=BuildOptions(target="cuda", dtype="bfloat16", tp=2, tp_allreduce=other))
    assert f"not asked for (--tp-allreduce {way})" in asked_not


@pytest.mark.parametrize("dtypes", [ONE_SHOT_DTYPES, ("float16", "float32"), ("bfloat16",)])
def test_one_shot_reason_names_the_dtypes_it_takes(dtypes, monkeypatch):
    """The one-shot candidate's reason names the dtypes of ONE_SHOT_DTYPES, read from the constant (another set of
    dtypes there is the one named), and no dtype outside it."""
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    monkeypatch.setattr(candidates, "ONE_SHOT_DTYPES", dtypes)
    options = BuildOptions(target="cuda", dtype="bfloat16", tp=2, tp_allreduce="one_shot")
    for declined in sorted(set(DTYPES) - set(dtypes)):
        why = _why("cuda_ops.all_reduce_one_shot", "all_reduce", [_t("T", 4096, dtype=declined)], options=options)
        assert why.endswith(f"peer-memory all-reduce takes {' or '.join(short[d] for d in dtypes)}, "
                            f"not {declined}"), why
        assert {name for name in short.values() if name in why} == {short[d] for d in dtypes}, why


def test_mlp_pair_declines_interleaved_gate_up(monkeypatch):
    """The persistent MLP kernel reads the gate/up weight as [gate; up] halves: an interleaved one goes elsewhere."""
    from mxc.kernels import mlp_pair_fp8
    from mxc.kernels.candidates import MLP_PAIR_KERNEL

    monkeypatch.setattr(mlp_pair_fp8, "available", lambda: None)
    fp8 = "float8_e4m3fn"
    ins = [_t("T", 4096), _t(4096), _t(28672, 4096, dtype=fp8), _t(28672, dtype="float32"), _t(4096, 14336, dtype=fp8),
           _t(4096, dtype="float32")]
    options = BuildOptions(target="cuda", dtype="bfloat16", quant="fp8", mlp_pair=True)
    assert _why(MLP_PAIR_KERNEL, "rms_norm_mlp", ins, {"granularity": "channel"}, options) is None
    why = _why(MLP_PAIR_KERNEL, "rms_norm_mlp", ins, {"granularity": "channel", "interleave": 64}, options)
    assert "not interleaved" in why


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8"])
def test_rope_and_attention_kernels_take_float_dtypes_only(dtype):
    """The fused RoPE + cache kernel and the attention kernels decline a non-float model dtype after their shape
    checks pass; every float dtype they take."""
    ok = dtype in ("bfloat16", "float16", "float32")
    rope = _why("cuda_ops.qkv_rope_cache", "qkv_rope_cache", [_t("T", 1024, dtype=dtype)],
                {"spec": {"type": "default", "rotary_dim": 64}})
    attn = _why("cuda_ops.cached_attention", "cached_attention", [_t("T", 8, 128, dtype=dtype)], {"scale": 0.1})
    for why in (rope, attn):
        assert (why is None) == ok and (ok or f"dtype {dtype}" in why), why


@pytest.mark.parametrize("causal, ok", [(None, True), (True, True), (False, False)])
def test_attention_kernels_decline_non_causal_attention(causal, ok):
    """The op's optional ``causal`` attribute: the Triton kernels mask causally whatever it says, so a node with
    causal=False is declined with the reason (it computed causal attention before), and the adapter refuses it."""
    from mxc.kernels import cuda_ops

    attrs = {"scale": 0.1, "layer": 0} | ({} if causal is None else {"causal": causal})
    why = _why("cuda_ops.cached_attention", "cached_attention", [_t("T", 8, 128)], attrs)
    assert (why is None) == ok and (ok or "non-causal" in why), why
    if not ok:
        with pytest.raises(ValueError, match="causal only"):
            cuda_ops.cached_attention(None, None, 0.1, 0, causal=False)


@pytest.mark.parametrize("op", ["qlinear", "rms_norm_qlinear", "rms_norm_mlp"])
@pytest.mark.parametrize("dtype, ok", [("bfloat16", True), ("float16", True), ("float32", False)])
def test_scaled_mm_writes_bf16_or_fp16_only(op, dtype, ok):
    """torch._scaled_mm's fp8 GEMM writes a bf16 or fp16 output: an fp32 model goes elsewhere."""
    name = {"qlinear": "fp8_gemm.scaled_mm", "rms_norm_qlinear": "cuda_ops.rms_norm_qlinear_scaled_mm",
            "rms_norm_mlp": "cuda_ops.rms_norm_mlp_scaled_mm"}[op]
    why = _why(name, op, _fp8_inputs(op, 4096, 4096, 1024, dtype=dtype), {"granularity": "channel"})
    assert (why is None) == ok and (ok or f"not {dtype}" in why), why


def _fp8_inputs(op, n, k, down_k, dtype="bfloat16"):
    """Input types of a channel-scaled fp8 op: ``qlinear`` (x, w [n, k], scale), ``rms_norm_qlinear`` (x, norm weight,
    w, scale) or ``rms_norm_mlp`` (x, norm weight, gate/up [n, k], its scale, down [k, down_k], its scale)."""
    fp8 = "float8_e4m3fn"
    x, w, s = _t("T", k, dtype=dtype), _t(n, k, dtype=fp8), _t(n, dtype="float32")
    return {"qlinear": [x, w, s], "rms_norm_qlinear": [x, _t(k, dtype=dtype), w, s],
            "rms_norm_mlp": [x, _t(k, dtype=dtype), w, s, _t(k, down_k, dtype=fp8), _t(k, dtype="float32")]}[op]


@pytest.mark.parametrize("name", ["cuda_ops.rms_norm_mlp_scaled_mm", "cuda_ops.rms_norm_mlp_cutlass"])
def test_fp8_mlp_checks_its_down_weight_too(monkeypatch, name):
    """The fused fp8 MLP's GEMMs check both weights: a down projection whose K (the intermediate size, here 1032) is
    no multiple of 16 is declined even when the gate/up weight fits."""
    from mxc.kernels import cutlass_fp8

    monkeypatch.setattr(cutlass_fp8, "available", lambda: None)
    assert _why(name, "rms_norm_mlp", _fp8_inputs("rms_norm_mlp", 2048, 4096, 1024), {"granularity": "channel"}) is None
    why = _why(name, "rms_norm_mlp", _fp8_inputs("rms_norm_mlp", 2064, 4096, 1032), {"granularity": "channel"})
    assert why is not None and "K=1032" in why, why


def test_routers_decline_non_float_dtypes():
    """Within their expert limit, the Triton router and the unfused norm + router still decline a non-float dtype."""
    ints = [_t("T", 2048, dtype="int8"), _t("T", 2048, dtype="int8"), _t(2048, dtype="int8"),
            _t(128, 2048, dtype="int8")]
    route = _why("triton_route.route", "route", [_t("T", 128, dtype="int8")], {"k": 8})
    unfused = _why("cuda_ops.add_rms_norm_route", "add_rms_norm_route", ints, {"eps": 1e-6, "k": 8})
    for why in (route, unfused):
        assert why is not None and "dtype int8" in why, why


def test_only_the_torch_references_run_on_the_cpu():
    """Every Triton, CUDA or cuBLAS candidate declines a cpu build (its kernels need a GPU): on the CPU the torch
    references, and only they, claim nodes."""
    cpu = BuildOptions(target="cpu")
    for op, cands in CANDIDATES.items():
        for c in cands:
            why = c.why_not(Node(op, ("y",), ("x",), {}), [_t("T", 64)], cpu)
            if c.name.startswith("torch_ref."):
                assert why is None, c.name
            else:
                assert why is not None and why.endswith("not cpu"), (c.name, why)


@pytest.mark.parametrize("op", ["all_reduce_add", "all_reduce_add_rms_norm", "linear_all_reduce_add",
                                "linear_all_reduce_add_rms_norm"])
def test_fused_all_reduces_take_float_dtypes_without_push(op):
    """Where the push all-reduce is not asked for, each fused all-reduce op's own kernel takes the float dtypes and
    declines others."""
    opts = BuildOptions(target="cuda", dtype="bfloat16", tp=2)
    for dtype in ("bfloat16", "float16", "float32", "int8"):
        assert "not asked for" in _why(f"cuda_ops.{op}_push", op, [_t("T", 4096, dtype=dtype)], options=opts)
        why = _why(f"cuda_ops.{op}", op, [_t("T", 4096, dtype=dtype)], options=opts)
        assert (why is None) == (dtype != "int8") and (why is None or "dtype int8" in why), (dtype, why)


def test_mlp_pair_needs_the_residual_and_names_its_shape(monkeypatch):
    """The persistent MLP kernel adds the residual, so a tensor-parallel rank's part (no residual) goes elsewhere; a
    shape it cannot take is named as hidden (the down weight's rows) and intermediate (its columns)."""
    from mxc.kernels import mlp_pair_fp8
    from mxc.kernels.candidates import MLP_PAIR_KERNEL

    monkeypatch.setattr(mlp_pair_fp8, "available", lambda: None)
    options = BuildOptions(target="cuda", dtype="bfloat16", quant="fp8", mlp_pair=True)
    ins = _fp8_inputs("rms_norm_mlp", 2 * 14336, 4096, 14336)
    assert _why(MLP_PAIR_KERNEL, "rms_norm_mlp", ins, {"granularity": "channel", "residual": True}, options) is None
    why = _why(MLP_PAIR_KERNEL, "rms_norm_mlp", ins, {"granularity": "channel", "residual": False}, options)
    assert why is not None and "adds the residual" in why
    odd = _fp8_inputs("rms_norm_mlp", 2 * 11008, 4096, 11008)
    why = _why(MLP_PAIR_KERNEL, "rms_norm_mlp", odd, {"granularity": "channel"}, options)
    assert why is not None and "hidden 4096 and intermediate 11008" in why, why
