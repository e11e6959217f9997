"""Kernel candidates: who can run each IR op, for which target and token counts, and why not.

Pure data and small checks; no torch or triton import. The ``select_kernels``
pass walks ``CANDIDATES[op]`` in order for every node: a candidate claims the
token-count range it serves (``tokens=(lo, hi)``, ``hi=None`` = unbounded)
unless ``why_not`` gives a reason; the first claims win until every token
count from 1 up is covered. The node records each choice and its reason. When
some range stays unclaimed, the build fails listing every rejection.
A tuning cache plugs in here later: a candidate's reason becomes "measured".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mxc.ir.ops import OPS

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Candidate:
    name: str  # "module.function" under mxc.kernels, as generated code calls it
    op: str
    targets: tuple[str, ...]
    reason: str  # why it is chosen when it claims a node
    tokens: tuple[int, int | None] = (1, None)  # token counts (rows of the op's first input) it serves
    check: Callable | None = None  # (node, in_types, options) -> reason it cannot, or None

    def why_not(self, node, in_types, options) -> str | None:
        if options.target not in self.targets:
            return f"{self.name}: runs on {', '.join(self.targets)}, not {options.target}"
        if self.check is not None:
            why = self.check(node, in_types, options)
            return f"{self.name}: {why}" if why else None
        return None


def _dtype_ok(node, in_types, options):
    dtype = in_types[0].dtype
    return None if dtype in FLOAT_DTYPES else f"dtype {dtype} is not one of {FLOAT_DTYPES}"


def _rope_ok(node, in_types, options):
    spec = node.attrs["spec"]
    if spec["type"] == "dynamic":
        return "dynamic-NTK RoPE needs per-call frequency tables (not in the Triton kernel yet)"
    if spec["rotary_dim"] % 2:
        return f"odd rotary dim {spec['rotary_dim']}"
    return _dtype_ok(node, in_types, options)


def _attention_ok(node, in_types, options):
    if not node.attrs.get("causal", True):
        return "non-causal attention: the Triton kernels mask every query's later keys (causal only)"
    d = node.attrs.get("head_dim") or in_types[0].shape[-1]  # q [T, heads, head_dim] for cached_attention
    if d % 16 or not 16 <= d <= 256:
        return f"head_dim {d} is not a multiple of 16 in 16..256"
    return _dtype_ok(node, in_types, options)


def _fp8_weights(node, in_types):
    """The fp8 weights' types of a quantized op: one, or the gate/up and down of ``rms_norm_mlp``."""
    at = {"qlinear": (1,), "rms_norm_qlinear": (2,), "rms_norm_mlp": (2, 4)}[node.op]
    return [in_types[i] for i in at]


def _scaled_mm_ok(node, in_types, options):
    if node.attrs["granularity"] == "block128":
        return "torch._scaled_mm takes row-wise scales here, not 128x128 blocks"
    for weight in _fp8_weights(node, in_types):
        n, k = weight.shape
        if n % 16 or k % 16:
            return f"N={n} and K={k} must be multiples of 16"
    return None if in_types[0].dtype in ("bfloat16", "float16") else f"needs a bf16/fp16 output, not {in_types[0].dtype}"


WIDE_N = 16384  # output features above which cuBLAS beats the GEMV at 17..32 tokens


def _gemv_ok(node, in_types, options):
    if node.attrs.get("prologue"):
        return f"takes no {node.attrs['prologue']} prologue (measured slower fused: mxc.kernels.triton_gemv)"
    return _dtype_ok(node, in_types, options)


def _gemv_wide_ok(node, in_types, options):
    """At 17..32 tokens the GEMV's tensor-core tile loses to cuBLAS on very wide weights: measured on
    the H200 (Triton 3.6) at 32 tokens, 28672 x 4096: GEMV 67.6 us, cuBLAS 58.7 us."""
    n = in_types[2 if node.op == "rms_norm_linear" else 1].shape[0]
    if n >= WIDE_N:
        return f"N={n} >= {WIDE_N}: cuBLAS measured faster at 17..32 tokens (67.6 vs 58.7 us, 28672 x 4096)"
    return _gemv_ok(node, in_types, options)


MOE_PAIR_MAX_TOKENS = 4  # decode token counts the per-pair MoE kernels serve (experts then get one row)
ONE_SHOT_MAX_TOKENS = 32  # rows the peer-memory all-reduces serve (decode): <= 32 x hidden, their buffers
# what torch's one-shot all-reduce sums (symm_mem's kernel dispatches float and bfloat16 only: no float16)
ONE_SHOT_DTYPES = ("bfloat16", "float32")
PUSH_DTYPES = ("bfloat16", "float16")  # what the push all-reduce sums (16-bit values: -0.0 is one int16 pattern)
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def dtypes_named(dtypes) -> str:
    """``dtypes`` as messages name them: ONE_SHOT_DTYPES reads "bf16 or fp32", from the constant itself."""
    return " or ".join(SHORT_DTYPES.get(d, d) for d in dtypes)


def _one_shot_ok(node, in_types, options):
    if getattr(options, "tp_allreduce", "nccl") != "one_shot":
        return "not asked for (--tp-allreduce one_shot)"
    dtype = in_types[0].dtype
    if dtype in ONE_SHOT_DTYPES:
        return None
    return f"peer-memory all-reduce takes {dtypes_named(ONE_SHOT_DTYPES)}, not {dtype}"


def _push_ok(node, in_types, options):
    if getattr(options, "tp_allreduce", "nccl") != "push":
        return "not asked for (--tp-allreduce push)"
    dtype = in_types[0].dtype
    return None if dtype in PUSH_DTYPES else f"the push all-reduce sums {dtypes_named(PUSH_DTYPES)}, not {dtype}"


def _route_ok(node, in_types, options):
    e = in_types[3].shape[0] if node.op == "add_rms_norm_route" else in_types[0].shape[-1]
    if isinstance(e, int) and e > 1024:
        return f"{e} experts: the one-program-per-token router holds at most 1024 scores"
    return _dtype_ok(node, in_types, options)


# the fused norm + router kernel's token counts: each token's programs read the whole router, so past ~20 tokens the
# three kernels (one cuBLAS GEMM reading it once) win. Qwen3-30B-A3B's router on an H100 (bench/moe_lab.py, 2026-12-06):
# fused 7.7 / 8.3 / 8.8 / 10.5 / 11.9 us at 12 / 16 / 20 / 24 / 32 tokens against 9.0 / 9.2 / 9.9 / 9.8 / 9.9
NORM_ROUTE_MAX_TOKENS = 16


def _norm_route_ok(node, in_types, options):
    e, h = in_types[3].shape
    if e > 1024:
        return f"{e} experts: the router holds at most 1024 scores"
    if h > 8192:
        return f"hidden size {h}: the fused kernel holds a row in registers, at most 8192"
    return _dtype_ok(node, in_types, options)


def _cutlass_ok(node, in_types, options):
    if node.attrs["granularity"] == "block128":
        return "its epilogue takes row-wise scales, not 128x128 blocks"
    if getattr(options, "arch", 90) != 90:
        return f"its kernel is built for sm_90a only, not sm_{options.arch}"
    for weight in _fp8_weights(node, in_types):
        n, k = weight.shape
        if n % 8 or k % 16:
            return f"N={n} must be a multiple of 8 and K={k} of 16 (16-byte TMA rows)"
    if in_types[0].dtype != "bfloat16":
        return f"writes bf16, the model computes in {in_types[0].dtype}"
    from mxc.kernels.cutlass_fp8 import available  # imports no CUDA or torch at module level

    return available()


MLP_PAIR_MAX_TOKENS = 8  # token counts the persistent fp8 MLP kernel serves (the mma's N)


def _mlp_pair_ok(node, in_types, options):
    if not getattr(options, "mlp_pair", False):
        return "not asked for (--mlp-pair)"
    if getattr(options, "arch", 90) != 90:
        return f"its kernel is built for sm_90a only, not sm_{options.arch}"
    if node.attrs["granularity"] == "block128":
        return "takes one weight scale a row, not 128x128 blocks"
    if node.attrs.get("interleave"):
        return "reads the gate/up weight as halves, not interleaved (interleave_gate_up)"
    if not node.attrs.get("residual", True):
        return "adds the residual; a tensor-parallel rank's part has none (the all-reduce adds it)"
    if in_types[0].dtype != "bfloat16":
        return f"computes in bf16, the model in {in_types[0].dtype}"
    from mxc.kernels import mlp_pair_fp8  # the check runs at build time only

    h, i = in_types[4].shape
    return mlp_pair_fp8.supports(1, h, i) or mlp_pair_fp8.available()


# References that read sequence layout or expert ids on the host: right on the CPU, wrong inside a
# captured CUDA graph (the values would be frozen at capture), so they do not claim nodes on cuda.
HOST_READING = {"attention", "rope", "qkv_rope_cache", "cached_attention", "experts"}
# The optional passes that replace the unfused ones on cuda (their fused ops have kernels there), with
# eliminate_dead_code, which removes what they replaced: a build skipping one is told so (``select_kernels``).
FUSED_ON_CUDA = {"rope": ("merge_qkv", "fuse_rope_cache"), "attention": ("merge_qkv", "fuse_rope_cache"),
                 "experts": ("fuse_moe",)}


def _torch_ref(op: str) -> Candidate:
    if op in HOST_READING:
        return Candidate(f"torch_ref.{op}", op, ("cpu",),
                         "torch reference (reads sequence/expert layout on the host: CPU only)")
    return Candidate(f"torch_ref.{op}", op, ("cpu", "cuda"), "torch reference")


GPU = ("cuda",)


def _push_or_not(op: str, pushed: str, otherwise: str) -> list[Candidate]:
    """The push all-reduce's kernel of ``op`` for decode token counts (when asked for), and ``cuda_ops.<op>``
    for the rest and where it is not."""
    return [Candidate(f"cuda_ops.{op}_push", op, GPU, f"{pushed} at <= {ONE_SHOT_MAX_TOKENS} tokens",
                      tokens=(1, ONE_SHOT_MAX_TOKENS), check=_push_ok),
            Candidate(f"cuda_ops.{op}", op, GPU, otherwise, check=_dtype_ok)]
GEMV_MAX_TOKENS = 32
CUTLASS_KERNELS = ("fp8_gemm.cutlass", "cuda_ops.rms_norm_qlinear_cutlass",
                   "cuda_ops.rms_norm_mlp_cutlass")  # the build ships their library
MLP_PAIR_KERNEL = "cuda_ops.rms_norm_mlp_pair"  # the build ships mxc.kernels.mlp_pair_fp8's library
CUTLASS_REASON = ("measured: CUTLASS fp8 GEMM (cutlass_fp8.BUILD_CONFIG, built into the artifact), 1435-1462 "
                  "TFLOP/s against torch._scaled_mm's 1316-1395 at 2048 tokens on the H200; its 64x128 kernels "
                  "at <= 256 tokens 1.10-1.51x as fast as the 128x128 one")

_TRITON = [
    Candidate("triton_elementwise.embedding", "embedding", GPU, "Triton row gather"),
    Candidate("triton_norm.rms_norm", "rms_norm", GPU, "Triton one-pass RMSNorm", check=_dtype_ok),
    Candidate("triton_norm.add_rms_norm", "add_rms_norm", GPU, "Triton residual add fused with RMSNorm",
              check=_dtype_ok),
    Candidate("triton_elementwise.silu_mul", "silu_mul", GPU, "Triton fused SiLU-and-mul", check=_dtype_ok),
    Candidate("triton_elementwise.add", "add", GPU, "Triton elementwise add", check=_dtype_ok),
    Candidate("cuda_ops.qkv_rope_cache", "qkv_rope_cache", GPU,
              "Triton split + q/k norm + RoPE + KV-cache write in one pass", check=_rope_ok),
    Candidate("cuda_ops.cached_attention", "cached_attention", GPU,
              "Triton flash attention (prefill, varlen) / split-KV flash decoding", check=_attention_ok),
    Candidate("triton_gemv.linear_small_m", "linear", GPU,
              "Triton GEMV/split-K: bandwidth-bound at <= 16 tokens", tokens=(1, 16), check=_gemv_ok),
    Candidate("triton_gemv.linear_small_m", "linear", GPU,
              f"Triton GEMV/split-K: bandwidth-bound at <= {GEMV_MAX_TOKENS} tokens", tokens=(17, GEMV_MAX_TOKENS),
              check=_gemv_wide_ok),
    Candidate("cublas.linear", "linear", GPU, "cuBLAS through torch: compute-bound GEMM at larger token counts"),
    Candidate("cuda_ops.rms_norm_linear_small_m", "rms_norm_linear", GPU,
              "Triton RMSNorm, then the Triton GEMV, at <= 16 tokens", tokens=(1, 16), check=_dtype_ok),
    Candidate("cuda_ops.rms_norm_linear_small_m", "rms_norm_linear", GPU,
              f"Triton RMSNorm, then the Triton GEMV, at <= {GEMV_MAX_TOKENS} tokens", tokens=(17, GEMV_MAX_TOKENS),
              check=_gemv_wide_ok),
    Candidate("cuda_ops.rms_norm_linear", "rms_norm_linear", GPU, "Triton RMSNorm, then cuBLAS through torch",
              check=_dtype_ok),
    # fp8 (qlinear); a tuning cache will turn these "default" reasons into measured ones
    Candidate("triton_fp8.qlinear_small_m", "qlinear", GPU,
              f"default: Triton fp8-weight GEMV, half the bytes of bf16, at <= {GEMV_MAX_TOKENS} tokens (one "
              f"token on CUDA cores: x unquantized, no quantize kernel)",
              tokens=(1, GEMV_MAX_TOKENS), check=_dtype_ok),
    Candidate(CUTLASS_KERNELS[0], "qlinear", GPU, CUTLASS_REASON, check=_cutlass_ok),
    Candidate("fp8_gemm.scaled_mm", "qlinear", GPU, "default: cuBLASLt fp8 GEMM (torch._scaled_mm), row-wise scales",
              check=_scaled_mm_ok),
    Candidate("triton_fp8.qlinear_gemm", "qlinear", GPU, "default: Triton fp8 GEMM (block scales)", check=_dtype_ok),
    Candidate("cuda_ops.rms_norm_qlinear_small_m", "rms_norm_qlinear", GPU,
              f"default: the RMSNorm inside the activation-quantize kernel, then the Triton fp8 GEMV, at <= "
              f"{GEMV_MAX_TOKENS} tokens", tokens=(1, GEMV_MAX_TOKENS), check=_dtype_ok),
    Candidate(CUTLASS_KERNELS[1], "rms_norm_qlinear", GPU,
              "the RMSNorm inside the activation-quantize kernel, then " + CUTLASS_REASON, check=_cutlass_ok),
    Candidate("cuda_ops.rms_norm_qlinear_scaled_mm", "rms_norm_qlinear", GPU,
              "default: the RMSNorm inside the activation-quantize kernel, then cuBLASLt fp8 (torch._scaled_mm)",
              check=_scaled_mm_ok),
    Candidate("cuda_ops.rms_norm_qlinear_gemm", "rms_norm_qlinear", GPU,
              "default: the RMSNorm inside the activation-quantize kernel, then the Triton fp8 GEMM (block scales)",
              check=_dtype_ok),
    # the fp8 MLP as one op (fuse_mlp): one persistent launch at decode, else the unfused nodes' kernels
    Candidate(MLP_PAIR_KERNEL, "rms_norm_mlp", GPU,
              f"the persistent fp8 MLP kernel (mlp_pair_fp8: RMSNorm, quantize, gate/up, SiLU, quantize, down and "
              f"the residual in one launch) at <= {MLP_PAIR_MAX_TOKENS} tokens", tokens=(1, MLP_PAIR_MAX_TOKENS),
              check=_mlp_pair_ok),
    Candidate("cuda_ops.rms_norm_mlp_small_m", "rms_norm_mlp", GPU,
              f"default: the RMSNorm-quantize, the Triton fp8 GEMV with SiLU-and-mul in its epilogue, then the "
              f"Triton fp8 GEMV with the residual, at <= {GEMV_MAX_TOKENS} tokens", tokens=(1, GEMV_MAX_TOKENS),
              check=_dtype_ok),
    Candidate(CUTLASS_KERNELS[2], "rms_norm_mlp", GPU,
              "the RMSNorm-quantize kernel, the gate/up GEMM (with interleave: SiLU-and-mul in its epilogue, then "
              "the quantize from its row maxima; else the SiLU-quantize kernel after it), the down GEMM; each linear "
              "the " + CUTLASS_REASON, check=_cutlass_ok),
    Candidate("cuda_ops.rms_norm_mlp_scaled_mm", "rms_norm_mlp", GPU,
              "default: the RMSNorm-quantize and SiLU-quantize kernels, each linear cuBLASLt fp8 (torch._scaled_mm)",
              check=_scaled_mm_ok),
    Candidate("cuda_ops.rms_norm_mlp_gemm", "rms_norm_mlp", GPU,
              "default: the RMSNorm-quantize and SiLU-quantize kernels, each linear the Triton fp8 GEMM (block "
              "scales)", check=_dtype_ok),
    # tensor parallelism
    Candidate("cuda_ops.all_reduce_one_shot", "all_reduce", GPU,
              f"one-shot all-reduce over peer memory (torch symmetric memory) at <= {ONE_SHOT_MAX_TOKENS} tokens: "
              f"one kernel, no NCCL latency", tokens=(1, ONE_SHOT_MAX_TOKENS), check=_one_shot_ok),
    Candidate("cuda_ops.all_reduce_push", "all_reduce", GPU,
              f"push all-reduce over peer memory at <= {ONE_SHOT_MAX_TOKENS} tokens: one kernel, no barrier",
              tokens=(1, ONE_SHOT_MAX_TOKENS), check=_push_ok),
    *_push_or_not("all_reduce_add", "push all-reduce and the residual add in one kernel",
                  "the all-reduce (one-shot over peer memory or NCCL), then the Triton add"),
    *_push_or_not("all_reduce_add_rms_norm", "push all-reduce, the residual add and RMSNorm in one kernel",
                  "the all-reduce (one-shot over peer memory or NCCL), then the Triton add + RMSNorm"),
    *_push_or_not("linear_all_reduce_add",
                  "the row-parallel GEMV pushes its rows into the peers' memory, one kernel waits and adds",
                  "cuBLAS, then the all-reduce and the Triton add"),
    *_push_or_not("linear_all_reduce_add_rms_norm",
                  "the row-parallel GEMV pushes its rows into the peers' memory, one kernel waits, adds and "
                  "normalises", "cuBLAS, then the all-reduce and the Triton add + RMSNorm"),
    # mixture of experts
    Candidate("triton_route.route", "route", GPU,
              "Triton router: softmax or sigmoid, top-k and renormalisation in one kernel", check=_route_ok),
    Candidate("triton_route.add_rms_norm_route", "add_rms_norm_route", GPU,
              f"Triton residual add, RMSNorm, router GEMV and router in one kernel at <= {NORM_ROUTE_MAX_TOKENS} "
              f"tokens (3 launches fewer)", tokens=(1, NORM_ROUTE_MAX_TOKENS), check=_norm_route_ok),
    Candidate("cuda_ops.add_rms_norm_route", "add_rms_norm_route", GPU,
              "Triton add + RMSNorm, cuBLAS router GEMM, Triton router", check=_route_ok),
    Candidate("cuda_ops.fused_moe_pairs", "fused_moe", GPU,
              f"Triton fused MoE for <= {MOE_PAIR_MAX_TOKENS} tokens: a GEMV per (token, expert) pair and the top-k "
              f"sum in the down kernel, no sort (2 launches instead of 6)", tokens=(1, MOE_PAIR_MAX_TOKENS),
              check=_dtype_ok),
    Candidate("cuda_ops.fused_moe", "fused_moe", GPU,
              "Triton fused MoE: tokens sorted and block-aligned by expert, grouped GEMMs", check=_dtype_ok),
]

CANDIDATES: dict[str, list[Candidate]] = {op: [] for op in OPS}
for _c in _TRITON:
    CANDIDATES[_c.op].append(_c)
for _op in OPS:
    CANDIDATES[_op].append(_torch_ref(_op))
