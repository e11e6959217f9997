"""select_kernels: every node is claimed by the first willing candidate, or the build fails listing why not."""

from __future__ import annotations

import re
import types

import pytest
import torch

from mxc.codegen.render import render_forward
from mxc.compiler.options import BuildOptions
from mxc.compiler.passes import select_kernels
from mxc.compiler.pipeline import compile_graph
from mxc.errors import MxcError
from mxc.ir import Graph, Repeat, verify
from mxc.kernels.candidates import CANDIDATES, HOST_READING, Candidate


def strip_kernels(graph: Graph) -> Graph:
    def strip(n):
        return n.replace(attrs={k: v for k, v in n.attrs.items() if k not in ("kernel", "kernel_reason")})

    return graph.replace(body=tuple(it.replace(body=tuple(map(strip, it.body))) if isinstance(it, Repeat) else strip(it)
                                    for it in graph.body))


def test_every_node_gets_a_kernel_cpu(bind_arch):
    g = bind_arch("Qwen2ForCausalLM")
    out = select_kernels.run(g, BuildOptions(target="cpu"))
    verify(out)
    torch_ref = {c.op: c for cands in CANDIDATES.values() for c in cands if c.name.startswith("torch_ref.")}
    for n, _ in out.nodes():
        assert n.attrs["kernel"] == f"torch_ref.{n.op}"
        assert n.attrs["kernel_reason"] == torch_ref[n.op].reason
    assert strip_kernels(out) == g  # only attributes were added


def test_every_node_gets_a_kernel_cuda(bind_arch):
    """On cuda a node records one kernel, or [max_tokens, kernel] buckets ending unbounded (None)."""
    g = compile_graph(bind_arch("Qwen3ForCausalLM"), BuildOptions(target="cuda"))
    for n, _ in g.nodes():
        kernel, reason = n.attrs["kernel"], n.attrs["kernel_reason"]
        names = [kernel] if isinstance(kernel, str) else [name for _, name in kernel]
        if not isinstance(kernel, str):
            his = [hi for hi, _ in kernel]
            assert his[-1] is None and his[:-1] == sorted(his[:-1])
        assert all(name in {c.name for c in CANDIDATES[n.op]} for name in names), n
        assert isinstance(reason, str) and reason


def test_wide_weights_go_to_cublas_from_17_tokens(bind_arch):
    """The GEMV serves 1..32 tokens, except weights at least WIDE_N rows wide, which cuBLAS takes from 17."""
    from mxc.kernels.candidates import WIDE_N

    g = compile_graph(bind_arch(intermediate_size=WIDE_N // 2), BuildOptions(target="cuda"))  # gate_up: WIDE_N rows
    kernels = {n.ins[2] if n.op == "rms_norm_linear" else n.ins[1]: n.attrs for n, _ in g.nodes()
               if n.op in ("linear", "rms_norm_linear")}
    assert kernels["w_gate_up"]["kernel"] == [[16, "triton_gemv.linear_small_m"], [None, "cublas.linear"]]
    assert kernels["wo"]["kernel"] == [[16, "triton_gemv.linear_small_m"], [32, "triton_gemv.linear_small_m"],
                                       [None, "cublas.linear"]]


def test_first_willing_candidate_wins(bind_arch, monkeypatch):
    """A candidate that checks the weight's K sees the right input types, local and top-level."""
    seen = []

    def k_is_64(node, in_types, options):
        seen.append((node.outs[0], in_types[1].shape))
        return None if in_types[1].shape[1] == 64 else f"K={in_types[1].shape[1]} is not 64"

    picky = Candidate("gemm64.linear", "linear", ("cpu",), "K=64 GEMM", check=k_is_64)
    cuda = Candidate("cublas.linear", "linear", ("cuda",), "cuBLAS")
    monkeypatch.setitem(CANDIDATES, "linear", [cuda, picky, *CANDIDATES["linear"]])
    out = select_kernels.run(bind_arch(), BuildOptions())
    chosen = {n.ins[1]: (n.attrs["kernel"], n.attrs["kernel_reason"]) for n, _ in out.nodes() if n.op == "linear"}
    # K = 96: the reason says which candidate for cpu declined and why; the cuda one (another target) is not news
    assert chosen.pop("w_down") == ("torch_ref.linear",
                                    CANDIDATES["linear"][-1].reason + " [declined: gemm64.linear: K=96 is not 64]")
    assert set(chosen) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "lm_head"}
    assert set(chosen.values()) == {("gemm64.linear", "K=64 GEMM")}
    (down,) = [n.outs[0] for n, _ in out.nodes() if n.op == "linear" and n.ins[1] == "w_down"]
    assert ("logits", (256, 64)) in seen and (down, (64, 96)) in seen


def test_no_kernel_lists_every_rejection(bind_arch, monkeypatch, loc_of):
    monkeypatch.setitem(CANDIDATES, "rms_norm", [
        Candidate("triton_norm.rms_norm", "rms_norm", ("cuda",), "fused"),
        Candidate("cpu_norm.rms_norm", "rms_norm", ("cpu",), "vectorised",
                  check=lambda node, in_types, options: f"needs H % 128 == 0, got {in_types[0].shape[-1]}"),
    ])
    with pytest.raises(MxcError) as e:
        compile_graph(bind_arch(), BuildOptions())
    msg = str(e.value)
    assert msg.startswith(f"no kernel for rms_norm -> h ({loc_of('- h = rms_norm(x, ln1, ')}) on target cpu: ")
    assert "triton_norm.rms_norm: runs on cuda, not cpu" in msg
    assert "needs H % 128 == 0, got 64" in msg and "cpu_norm.rms_norm" in msg


def test_no_candidates_registered(bind_arch, monkeypatch, loc_of):
    monkeypatch.setitem(CANDIDATES, "rope", [])
    at = loc_of("- q, k = rope(q, k, positions, ")
    with pytest.raises(MxcError, match=re.escape(f"no kernel for rope -> q_2, k_2 ({at}) on target cpu: "
                                                 "no candidates registered")):
        select_kernels.run(bind_arch(), BuildOptions())


def test_reselecting_is_stable(bind_arch):
    once = select_kernels.run(bind_arch(), BuildOptions())
    assert select_kernels.run(once, BuildOptions()) == once


@pytest.mark.parametrize("head_dim, why", [(80, None), (96, None), (48, None), (256, None), (24, "multiple of 16"),
                                           (320, "multiple of 16 in 16..256")])
def test_cuda_attention_head_sizes(bind_arch, head_dim, why):
    """The Triton attention kernels take any head size that is a multiple of 16 up to 256 (a wider head block, its
    extra lanes masked: tests/kernels/test_attention.py, test_cuda_program.py); others fail the build saying so."""
    g = bind_arch("LlamaForCausalLM", head_dim=head_dim)
    if why is None:
        out = compile_graph(g, BuildOptions(target="cuda"))
        kernels = {n.attrs["kernel"] for n, _ in out.nodes() if n.op == "cached_attention"}
        assert kernels == {"cuda_ops.cached_attention"}
    else:
        with pytest.raises(MxcError, match=f"head_dim {head_dim} is not a {why}"):
            compile_graph(g, BuildOptions(target="cuda"))


def test_host_reading_references_claim_no_cuda_node(bind_arch):
    """A torch reference that reads sequence layout or expert ids on the host would be frozen inside a CUDA graph:
    on cuda it claims nothing, so an op only it could run fails the build instead (here the MoE's unfused
    ``experts``, fuse_moe disabled)."""
    for op in HOST_READING:
        (ref,) = [c for c in CANDIDATES[op] if c.name == f"torch_ref.{op}"]
        assert "cuda" not in ref.targets, op
    g = bind_arch("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40)
    assert "experts" in {n.op for n, _ in g.nodes()}
    with pytest.raises(MxcError, match="no kernel for experts .* torch_ref.experts: runs on cpu, not cuda"):
        compile_graph(g, BuildOptions(target="cuda", disable_passes=("fuse_moe",)))


@pytest.mark.parametrize("arch,skipped,op", [
    ("LlamaForCausalLM", "merge_qkv", "rope"), ("LlamaForCausalLM", "fuse_rope_cache", "rope"),
    ("LlamaForCausalLM", "eliminate_dead_code", "rope"), ("Qwen3MoeForCausalLM", "fuse_moe", "experts"),
])
def test_a_skipped_fusion_cuda_needs_is_named(bind_arch, arch, skipped, op):
    """On cuda the host-reading ops run only as the fusions' ops: a build skipping one of those passes (or
    eliminate_dead_code, which leaves the replaced chain) is refused naming the ``--disable-pass`` to drop, not
    only the unfused op (a dead ``rope`` for ``--disable-pass eliminate_dead_code``); on the CPU it builds."""
    g = bind_arch(arch, **({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40}
                           if "Moe" in arch else {}))
    with pytest.raises(MxcError, match=f"no kernel for {op} .*runs on cpu, not cuda; on cuda {op} runs only fused "
                                       rf"\(passes .*\), which --disable-pass {skipped} skips: build without it$"):
        compile_graph(g, BuildOptions(target="cuda", disable_passes=(skipped,)))
    compile_graph(g, BuildOptions(target="cpu", disable_passes=(skipped,)))


def test_moe_decode_kernels_serve_only_their_token_counts(bind_arch):
    """On cuda the per-pair MoE kernels (weights read once per (token, expert) pair) serve only decode's few tokens
    (MOE_PAIR_MAX_TOKENS) and the fused norm + router kernel its NORM_ROUTE_MAX_TOKENS; the sorted, grouped MoE and
    the unfused router every larger count."""
    from mxc.kernels.candidates import MOE_PAIR_MAX_TOKENS, NORM_ROUTE_MAX_TOKENS

    g = compile_graph(bind_arch("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40),
                      BuildOptions(target="cuda"))
    kernels = {n.op: n.attrs["kernel"] for n, _ in g.nodes() if n.op in ("fused_moe", "add_rms_norm_route")}
    assert kernels == {"fused_moe": [[MOE_PAIR_MAX_TOKENS, "cuda_ops.fused_moe_pairs"], [None, "cuda_ops.fused_moe"]],
                       "add_rms_norm_route": [[NORM_ROUTE_MAX_TOKENS, "triton_route.add_rms_norm_route"],
                                              [None, "cuda_ops.add_rms_norm_route"]]}


CHOICE = [[2, "k_small.linear"], [4, "k_mid.linear"], [None, "k_big.linear"]]


class _Values(dict):
    """Every value the expression names: a tensor-like with ``rows`` rows."""

    def __init__(self, rows):
        super().__init__({m.split(".")[0]: types.SimpleNamespace(linear=lambda *a, _m=m, **k: _m)
                          for _, m in CHOICE})
        self.rows = rows

    def __missing__(self, key):  # a value, or the weights dict ``w`` (indexing it gives a value again)
        return self

    @property
    def shape(self):
        return (self.rows,)


def test_dispatch_picks_the_first_bucket_holding_the_rows(bind_arch):
    """A node whose kernel is chosen per token-count bucket ([max_tokens, kernel] entries, the last unbounded)
    calls, in the rendered forward, the first entry whose bound holds its input's rows (select_kernels' rule)."""
    g = select_kernels.run(bind_arch(), BuildOptions())
    (out,) = g.outputs
    body = tuple(n.replace(attrs={**n.attrs, "kernel": CHOICE}) if out in getattr(n, "outs", ()) else n for n in g.body)
    src = render_forward(g.replace(body=body), ir_hash="test")
    (line,) = [ln.strip() for ln in src.splitlines() if ln.strip().startswith(f"{out} = ")]
    expr = line.split(" = ", 1)[1]
    for rows in range(1, 7):
        want = next(name for hi, name in CHOICE if hi is None or rows <= hi)
        assert eval(expr, {"__builtins__": {}}, _Values(rows)) == want, (rows, expr)


def _renaming_graph() -> Graph:
    """Values named like Python keywords (``lambda``, ``class``), like the forward's own names (``L``, ``w``)
    and like a kernel module (``triton_norm``); two different dict attributes; a 3-layer repeat over a layer
    weight, carrying ``s``. Every node is an ``add`` whose kernel lives in a different module."""
    from mxc.ir import Node, Weight
    from mxc.ir.graph import Sym, TensorType

    t = TensorType((1,), "float32")
    add = lambda outs, ins, kernel, **attrs: Node("add", outs, ins, {"kernel": kernel, **attrs}, loc="toy.yaml:1")
    layer = Repeat(count=3, index="i", weights={"scale": Weight("layers.{i}.scale", (1,), "float32", ("s.{i}",))},
                   body=(add(("s2",), ("s", "scale"), "triton_rope.add", layer=Sym("i")),), carry={"s": "s2"})
    return Graph(family="toy", dtype="float32", config={}, inputs={"lambda": t, "L": t, "w": t},
                 weights={"bias": Weight("bias", (1,), "float32", ("bias",))},
                 body=(add(("triton_norm",), ("lambda", "L"), "triton_norm.add", spec={"a": 1}),
                       add(("s",), ("triton_norm", "w"), "torch_ref.add", spec={"b": 2}),
                       layer,
                       add(("s3",), ("s", "L"), "triton_elementwise.add"),
                       add(("class",), ("s3", "bias"), "triton_attention.add")),
                 outputs=("class",))


def test_values_named_like_a_later_or_bucketed_kernel_module_are_renamed():
    """A value named like a kernel module is renamed even when it is defined before that module's first call, or is
    an input, or the module is called only in a token-count bucket: the names never hide the modules. Kernels are
    integer adds: triton_norm=1, torch_ref=1+1=2, triton_fp8=2+1=3 (one row: the bucket <= 8), out=3+2=5."""
    from mxc.ir import Node
    from mxc.ir.graph import TensorType

    t = TensorType((1,), "float32")
    node = lambda outs, ins, kernel: Node("add", outs, ins, {"kernel": kernel}, loc="toy.yaml:1")
    graph = Graph(family="toy", dtype="float32", config={}, inputs={"triton_norm": t}, weights={},
                  body=(node(("torch_ref",), ("triton_norm", "triton_norm"), "triton_norm.add"),
                        node(("triton_fp8",), ("torch_ref", "triton_norm"), [(8, "triton_fp8.add"),
                                                                           (None, "triton_gemv.add")]),
                        node(("out",), ("triton_fp8", "torch_ref"), "torch_ref.add")),
                  outputs=("out",))
    src = render_forward(graph, ir_hash="test")
    namespace: dict = {}
    exec(compile(src, "<toy forward>", "exec"), namespace)
    for name in ("triton_norm", "torch_ref", "triton_fp8", "triton_gemv"):
        namespace[name] = types.SimpleNamespace(add=lambda a, b: a + b)
    assert namespace["forward"]({}, [], None, torch.ones(1)).tolist() == [5.0]


def test_rendered_forward_renames_clashing_values_and_runs_every_layer():
    """The rendered forward of ``_renaming_graph``, its kernels replaced by integer adds that record their
    attributes, computes by hand: lambda=1, L=2, w=4 give triton_norm=3, s=7; layer i adds 10**(i+1)
    (7+10+100+1000=1117); then + L (2) + bias (10000) = 11119."""
    src = render_forward(_renaming_graph(), ir_hash="test")
    imports = [ln.split()[-1] for ln in src.splitlines() if ln.startswith("from mxc.kernels import ")]
    assert imports == sorted(imports) and len(imports) == 5  # a set's order would vary with the hash seed
    namespace: dict = {}
    exec(compile(src, "<toy forward>", "exec"), namespace)
    calls = []

    def module(name):
        def add(a, b, **attrs):
            calls.append((name, attrs))
            return a + b

        return types.SimpleNamespace(add=add)

    namespace.update({name: module(name) for name in imports})
    layers = [{"scale": 10 ** (i + 1)} for i in range(3)]
    assert namespace["forward"]({"bias": 10000}, layers, None, 1, 2, 4) == 11119
    assert calls == [("triton_norm", {"spec": {"a": 1}}), ("torch_ref", {"spec": {"b": 2}}),
                     *[("triton_rope", {"layer": i}) for i in range(3)], ("triton_elementwise", {}),
                     ("triton_attention", {})]


# --- mutation sweep additions --------------------------------------------------------

def _norm_kernels(bind_arch, monkeypatch, candidates):
    """(kernel, kernel_reason) of every rms_norm once ``candidates`` are its only ones (cpu)."""
    monkeypatch.setitem(CANDIDATES, "rms_norm", candidates)
    out = select_kernels.run(bind_arch(), BuildOptions())
    return {(n.attrs["kernel"] if isinstance(n.attrs["kernel"], str) else tuple(map(tuple, n.attrs["kernel"])),
             n.attrs["kernel_reason"]) for n, _ in out.nodes() if n.op == "rms_norm"}


def _cand(name, reason, tokens=(1, None), targets=("cpu",)):
    return Candidate(name, "rms_norm", targets, reason, tokens)


def test_candidates_adding_no_tokens_are_skipped(bind_arch, monkeypatch):
    """Once 1..16 tokens are claimed, another 1..16 (or 1..8) candidate adds nothing; the next unbounded one
    takes the rest. The reason names each bucket."""
    got = _norm_kernels(bind_arch, monkeypatch, [
        _cand("small.rms_norm", "small", (1, 16)), _cand("other.rms_norm", "other", (1, 16)),
        _cand("tiny.rms_norm", "tiny", (1, 8)), _cand("big.rms_norm", "big")])
    assert got == {(((16, "small.rms_norm"), (None, "big.rms_norm")), "<= 16 tokens: small; above: big")}


def test_each_bucket_names_the_candidates_declined_for_it(bind_arch, monkeypatch):
    """A decline is reported in the bucket it was asked for, not the next; a candidate skipped for a gap or for
    adding nothing was never asked."""
    no = lambda why: lambda node, in_types, options: why  # noqa: E731
    got = _norm_kernels(bind_arch, monkeypatch, [
        Candidate("fast.rms_norm", "rms_norm", ("cpu",), "fast", (1, 16), check=no("off")),
        _cand("small.rms_norm", "small", (1, 16)), _cand("late.rms_norm", "late", (17, None)),
        Candidate("wide.rms_norm", "rms_norm", ("cpu",), "wide", check=no("H too small")),
        _cand("gpu.rms_norm", "gpu", targets=("cuda",)), _cand("big.rms_norm", "big")])
    assert got == {(((16, "small.rms_norm"), (None, "late.rms_norm")),
                    "<= 16 tokens: small [declined: fast.rms_norm: off]; above: late")}
    got = _norm_kernels(bind_arch, monkeypatch, [
        _cand("small.rms_norm", "small", (1, 16)),
        Candidate("wide.rms_norm", "rms_norm", ("cpu",), "wide", check=no("H too small")),
        _cand("gpu.rms_norm", "gpu", targets=("cuda",)), _cand("big.rms_norm", "big")])
    assert got == {(((16, "small.rms_norm"), (None, "big.rms_norm")),
                    "<= 16 tokens: small; above: big [declined: wide.rms_norm: H too small]")}


def test_a_candidate_leaving_a_gap_is_skipped(bind_arch, monkeypatch):
    """A candidate for 17.. tokens listed before any candidate for 1..16 would leave 1..16 unserved: skipped."""
    got = _norm_kernels(bind_arch, monkeypatch, [_cand("large.rms_norm", "large", (17, None)),
                                                 _cand("all.rms_norm", "all")])
    assert got == {("all.rms_norm", "all")}


def test_no_kernel_above_the_claimed_tokens(bind_arch, monkeypatch, loc_of):
    monkeypatch.setitem(CANDIDATES, "rms_norm", [_cand("small.rms_norm", "small", (1, 16)),
                                                 _cand("gpu.rms_norm", "gpu", targets=("cuda",))])
    at = loc_of("- h = rms_norm(x, ln1, ")
    with pytest.raises(MxcError, match=re.escape(f"no kernel for rms_norm -> h ({at}) on target cpu above 16 tokens: "
                                                 "gpu.rms_norm: runs on cuda, not cpu")):
        select_kernels.run(bind_arch(), BuildOptions())


def test_fp8_gemm_reason_says_cutlass_was_turned_off(bind_arch, monkeypatch):
    """With the CUTLASS fp8 GEMM turned off, the prefill GEMMs' reason in the IR says so, beside the cuBLASLt choice
    (README: "the build takes cuBLASLt and the IR says why")."""
    from mxc.models.registry import MODELS_DIR, bind_model, lookup
    from tests.passes.conftest import TINY

    monkeypatch.setenv("MXC_CUTLASS_LIBRARY", "none")
    bound = bind_model(MODELS_DIR / "llama.yaml", {**TINY, "architectures": ["LlamaForCausalLM"]}, "bfloat16",
                       lookup("LlamaForCausalLM"))
    g = compile_graph(bound, BuildOptions(target="cuda", quant="fp8", dtype="bfloat16"))
    reasons = [n.attrs["kernel_reason"] for n, _ in g.nodes() if n.op.startswith(("rms_norm_q", "qlinear",
                                                                                    "rms_norm_mlp"))]
    assert reasons and all("cuBLASLt fp8" in r.split("above: ")[-1] and "[declined: " in r and
                           "turned off ($MXC_CUTLASS_LIBRARY=none)" in r for r in reasons), reasons
