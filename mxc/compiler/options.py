"""Build options: resolved once, up front, and passed to every pass frozen."""

from __future__ import annotations

from dataclasses import asdict, dataclass

TARGETS = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class BuildOptions:
    target: str = "cpu"
    dtype: str = "float32"
    tp: int = 1
    quant: str | None = None  # "fp8"
    quant_granularity: str = "channel"  # fp8 weight scales: "channel" | "tensor" | "block128"
    quant_lm_head: bool = False
    quant_scale_suffix: str | None = None  # checkpoint already fp8: its scale tensors' name suffix
    quant_unquantized: tuple[str, ...] = ()  # checkpoint already fp8: the layers' linear weights (checkpoint
    # name templates) it stores in the model dtype, which stay so (``loaders.prequantized``)
    max_batch: int = 32  # cuda: sequences decoded together (KV-cache slots, CUDA-graph buckets)
    max_seq_len: int = 4096  # cuda: KV-cache length per sequence
    prefill_graph_tokens: int = 0  # cuda: batch-1 prompts up to this many tokens replay a CUDA graph per
    # length bucket (``runtime_buckets.prefill_graph_buckets``, ``runtime.prefill_graphs``); 0: every prefill eager
    disable_passes: tuple[str, ...] = ()  # optional passes skipped (``--disable-pass``)
    pdl: bool = False  # cuda: programmatic dependent launch between kernels (``mxc.kernels.pdl``)
    arch: int = 90  # cuda: the compute capability kernels are compiled for (sm_90)
    tp_allreduce: str = "nccl"  # cuda, tp > 1: decode all-reduces by "nccl", "one_shot" or "push" (peer
    # memory; push also fuses the residual add and RMSNorm); the builder resolves its "auto" default
    mlp_pair: bool = False  # fp8: each layer's MLP op (``fuse_mlp``) run on cuda as one persistent launch at
    # <= 8 tokens (``mxc.kernels.mlp_pair_fp8``); off by default: measured slower on an H200

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quant not in (None, "fp8") or self.quant_granularity not in ("channel", "tensor", "block128"):
            raise ValueError(f"quant must be None or 'fp8' with granularity channel|tensor|block128, got "
                             f"{self.quant!r}/{self.quant_granularity!r}")

    def to_dict(self) -> dict:
        return asdict(self)
