"""The artifact's on-disk contract, shared by the builder and the runtime.

An artifact is a directory: ``manifest.json``, ``graph.yaml`` (the final IR),
``code/forward.py`` (the generated program), ``weights/rank{r}.safetensors``,
for ``--target cuda`` ``code/kernels/`` (cubins) and, where the build chose the CUTLASS fp8 GEMM,
``code/cutlass/fp8_gemm.so`` (the manifest's ``cutlass`` entry), with ``--mlp-pair``
``code/mlp_pair/mlp_pair_fp8.so`` (the manifest's ``mlp_pair`` entry; optional, so no new schema), and optionally
``tokenizer/``. The manifest lists the sha256 of every other file (and, ``file_chunks``, of each 64 MiB piece of
the larger ones, which a load hashes in parallel), and its own sha256 over the rest of it (``manifest_digest``): a
hand-edited manifest is refused as a whole, as an edited file is. ``SCHEMA_VERSION`` changes when this layout
changes incompatibly.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

# The dtypes weights are stored in (graph.yaml's weight dtypes): the model's, and fp8 for quantized linears
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float8_e4m3fn": torch.float8_e4m3fn}

# 2: kernels rendered from templates, their sources in code/kernels/src/; 3: the RoPE kernel's kv-group grid,
# the tiled fp8 quantize and the push all-reduce (older artifacts lack those cubins); 4: the MoE norm + router
# kernel, the GEMV's push arguments; 5: the CUTLASS fp8 GEMM library and the manifest's cutlass entry; 6: no
# layout change, but every PDL kernel checked for what it reads before its wait (``mxc.codegen.pdl_check``): the
# decode attention stored in schema-5 artifacts read q before its wait, a race with the RoPE kernel, so they
# must be rebuilt; 7: the fp8 MLP's gate/up weight stored interleaved (``interleave`` in graph.yaml: an older runtime
# would read it as halves) and the fp8 quantize and GEMV kernels keyed by a new constexpr (``PAIR_BLOCK``); 8: the MoE
# routers' bitonic top-k at two warps a program (``triton_route.TOPK``: older cuda MoE artifacts lack those cubins); 9:
# the MoE gate/up pair kernel's K loop unrolled (``triton_moe_decode.PairConfig.UNROLL``: a new constexpr, so older
# cuda MoE artifacts lack that cubin); 10: fp8 experts' pair kernels unrolled too (``UNROLL_SCALED``: older fp8 cuda
# MoE artifacts lack those cubins); 11: the manifest's own sha256 (``manifest_sha256``), checked at every read; 12: the
# MoE routers' ``fp32_weights`` (Mixtral's routing weights kept float32, as transformers 5 keeps them: an older
# runtime cannot run the new forward.py, and an older Mixtral artifact rounds them to bf16); 13: the sorted fused MoE's
# prefill tiles from a sweep (``triton_moe.config_for`` past 16 rows an expert: older cuda MoE artifacts lack those
# cubins); 14: the fp8 experts' decode tile (row scales, up to 16 rows an expert: 256-element K steps) and the bf16
# experts' prefill down GEMM on a tile of its own (``MoeConfig.DOWN``): older cuda MoE artifacts lack those cubins;
# 15: the fused norm + router kernel on a (router rows, token) grid, each token routed by the last of its programs
# (``triton_route.norm_route_kernel``: the same arguments and constexprs, so an older cuda MoE artifact's cubin, which
# takes every token in each program, would be launched on the new grid); 16: the fused norm + router kernel without
# its one-column grid (``triton_route.norm_route_kernel``: arguments T and TOKEN_GRID gone, so an older cuda MoE
# artifact's cubin takes other arguments), and sent at most 16 tokens (``candidates.NORM_ROUTE_MAX_TOKENS``, was 32);
# 17: decode batches' MoE sort in one program (``triton_moe.ONE_CHUNK_SORT``) and Qwen3-30B-A3B's 8-row fp8 attention
# GEMV tiles (``triton_fp8_gemv.MEASURED``): older cuda MoE artifacts lack those cubins; 18: the fp8 wgmma GEMVs that
# split K in one slice at 5 stages (``triton_fp8_gemv.SWAP_AB_ONE_SLICE``): older cuda fp8 artifacts lack those cubins
SCHEMA_VERSION = 18


def safetensors_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header: (its length in bytes, the parsed JSON object; tensor data starts at 8 + length).
    Raises OSError or ValueError where it cannot be read (a length past 100 MiB, not JSON, not an object)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little")
        if len(prefix) < 8 or not 0 < length <= 100 * 2**20:
            raise ValueError(f"a header length of {length} bytes")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("a header that is not a JSON object")
    return length, header


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's fields but ``manifest_sha256`` itself, as canonical JSON (sorted keys): what the
    builder records and every reader recomputes (JSON numbers and strings read back as written)."""
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def is_artifact(path: Path) -> bool:
    """Whether ``path`` holds an artifact (a manifest.json of mxc's, any schema): what a build may replace. Any
    other directory, one with some other program's manifest.json included, is the user's."""
    try:
        manifest = json.loads((Path(path) / "manifest.json").read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deeply to parse
        return False
    return isinstance(manifest, dict) and "schema_version" in manifest and "mxc_version" in manifest


def sha256_file(path: Path, chunk: int = 1 << 24, start: int = 0, length: int | None = None) -> str:
    """sha256 of a file's bytes, or of ``length`` of them from ``start`` (to its end where the file is shorter)."""
    h = hashlib.sha256()
    left = length
    with open(path, "rb") as f:
        f.seek(start)
        while (left is None or left > 0) and (block := f.read(chunk if left is None else min(chunk, left))):
            h.update(block)
            left = None if left is None else left - len(block)
    return h.hexdigest()


# The manifest's ``file_chunks``: the sha256 of each CHUNK_BYTES piece of every file larger than one, which the loader
# hashes on all cores at once (one core hashes ~1.4 GB/s: 11 s for an 8B model's bf16 weights). Optional: an artifact
# without it, or a file it does not list, is verified by the file's whole sha256 (``files``), which it keeps for
# sha256sum.
CHUNK_BYTES = 64 << 20


def chunk_count(size: int, chunk: int) -> int:
    """Pieces of ``chunk`` bytes a file of ``size`` bytes is hashed in (one for an empty file)."""
    return max(1, -(-size // chunk))


def file_chunks(pieces: dict[str, list[str]]) -> dict:
    """The manifest's ``file_chunks`` entry for files' pieces (relative path -> each piece's sha256), the files of
    one piece left out (their sha256 in ``files`` is as fast to check); {} where none is left."""
    listed = {rel: digests for rel, digests in sorted(pieces.items()) if len(digests) > 1}
    return {"file_chunks": {"chunk_bytes": CHUNK_BYTES, "sha256": listed}} if listed else {}


class ChunkHasher:
    """sha256 of each ``chunk``-byte piece of a byte stream fed in order (``update``)."""

    def __init__(self, chunk: int | None = None):
        self.chunk = chunk or CHUNK_BYTES
        self._pieces: list[str] = []
        self._piece = hashlib.sha256()
        self._filled = 0

    def update(self, data) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            take = min(len(data), self.chunk - self._filled)
            self._piece.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self.chunk:
                self._pieces.append(self._piece.hexdigest())
                self._piece, self._filled = hashlib.sha256(), 0

    def pieces(self) -> list[str]:
        """The pieces' digests so far, the last partial one included (as ``chunk_count`` counts them)."""
        return self._pieces + ([self._piece.hexdigest()] if self._filled or not self._pieces else [])


def listed_files(root: Path) -> list[str]:
    """Relative paths of every file under ``root`` the manifest lists (all but itself and caches)."""
    return sorted(rel for p in root.rglob("*") if p.is_file() and is_listed_file(rel := p.relative_to(root).as_posix()))


def file_digests(root: Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """sha256 of every listed file under ``root``, by relative path (``known``: ones already computed)."""
    known = known or {}
    return {rel: known.get(rel) or sha256_file(root / rel) for rel in listed_files(root)}


def is_listed_file(rel: str) -> bool:
    return rel != "manifest.json" and "__pycache__" not in rel.split("/")
