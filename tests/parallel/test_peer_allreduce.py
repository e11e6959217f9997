"""The peer-memory all-reduces (``--tp-allreduce one_shot`` and ``push``): the row-parallel
all-reduces fused with the residual add and RMSNorm after them (``fuse_all_reduce``), their kernels
chosen for decode token counts only when asked, recorded in the IR with their reasons, refused off
CUDA; the adapters fall back to NCCL where the runtime could not set up peer memory. The
collectives themselves run in ``tests/gpu/test_tp_gpu.py`` (two GPUs); the push kernel under the
interpreter in ``tests/kernels/test_push_all_reduce.py``."""

from __future__ import annotations

import pytest
import torch

import mxc
from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import compile_graph
from mxc.kernels import cuda_ops, peer_allreduce, torch_ref
from mxc.kernels.candidates import ONE_SHOT_MAX_TOKENS, WIDE_N
from mxc.kernels.context import ForwardContext
from mxc.models.registry import MODELS_DIR, bind_model, lookup

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5,
            architectures=["LlamaForCausalLM"])


REDUCING = ("all_reduce", "all_reduce_add", "all_reduce_add_rms_norm", "linear_all_reduce_add",
            "linear_all_reduce_add_rms_norm")


def _graph(dtype="bfloat16", **options):
    graph = bind_model(MODELS_DIR / "llama.yaml", TINY, dtype, lookup("LlamaForCausalLM"))
    return compile_graph(graph, BuildOptions(target="cuda", dtype=dtype, tp=2, **options))


def _all_reduces(dtype="bfloat16", **options):
    return [(n.op, n.attrs) for n, _ in _graph(dtype, **options).nodes() if n.op in REDUCING]


def test_all_reduces_fuse_with_the_add_and_norm_after_them():
    """The embedding's all-reduce stays; in the layer body the o projection's is fused with the
    residual add and RMSNorm, the down projection's with the residual add."""
    assert [op for op, _ in _all_reduces()] == ["all_reduce", "all_reduce_add_rms_norm", "all_reduce_add"]
    assert all(attrs["world"] == 2 for _, attrs in _all_reduces())
    unfused = _graph(disable_passes=("fuse_all_reduce",))
    assert [n.op for n, _ in unfused.nodes() if n.op in REDUCING] == ["all_reduce"] * 3
    graph = bind_model(MODELS_DIR / "llama.yaml", TINY, "float32", lookup("LlamaForCausalLM"))
    single = compile_graph(graph, BuildOptions(target="cpu", dtype="float32", tp=1))
    assert not [n for n, _ in single.nodes() if n.op in REDUCING]


def test_one_shot_serves_decode_token_counts_when_asked():
    composite = {"all_reduce_add": "cuda_ops.all_reduce_add", "all_reduce_add_rms_norm": "cuda_ops.all_reduce_add_rms_norm"}
    for op, attrs in _all_reduces(tp_allreduce="one_shot"):
        if op == "all_reduce":
            assert attrs["kernel"] == [[ONE_SHOT_MAX_TOKENS, "cuda_ops.all_reduce_one_shot"],
                                       [None, "torch_ref.all_reduce"]]
            assert "peer memory" in attrs["kernel_reason"] and "above: torch reference" in attrs["kernel_reason"]
        else:  # the all-reduce adapter (one-shot up to 32 rows, NCCL above), then the Triton add/norm
            assert attrs["kernel"] == composite[op]
    for op, attrs in _all_reduces(tp_allreduce="nccl"):
        assert attrs["kernel"] == composite.get(op, "torch_ref.all_reduce")
    for op, attrs in _all_reduces("float16", tp_allreduce="one_shot"):  # symm_mem sums bf16 and fp32 only
        assert attrs["kernel"] == composite.get(op, "torch_ref.all_reduce")


def test_push_serves_decode_token_counts_when_asked():
    """Under push the row-parallel linears join their all-reduces (the GEMV pushes its rows); each op's
    push kernel serves up to 32 tokens, a composite the rest."""
    ops = _all_reduces(tp_allreduce="push")
    assert [op for op, _ in ops] == ["all_reduce", "linear_all_reduce_add_rms_norm", "linear_all_reduce_add"]
    for op, attrs in ops:
        fallback = "torch_ref.all_reduce" if op == "all_reduce" else f"cuda_ops.{op}"
        assert attrs["kernel"] == [[ONE_SHOT_MAX_TOKENS, f"cuda_ops.{op}_push"], [None, fallback]]
        assert "push" in attrs["kernel_reason"]
    for op, attrs in _all_reduces("float32", tp_allreduce="push"):  # 16-bit values only
        assert not isinstance(attrs["kernel"], list) and "_push" not in attrs["kernel"]


def test_linear_joins_the_all_reduce_only_under_push_and_not_fp8():
    """fuse_linear_all_reduce: only under push, not fp8, and not when disabled."""
    for options in (dict(tp_allreduce="one_shot"), dict(tp_allreduce="nccl"),
                    dict(tp_allreduce="push", quant="fp8"),
                    dict(tp_allreduce="push", disable_passes=("fuse_linear_all_reduce",))):
        assert not [op for op, _ in _all_reduces(**options) if op.startswith("linear_")], options
    assert not [op for op, _ in _all_reduces("float32", tp_allreduce="push") if op.startswith("linear_")]
    assert [op for op, _ in _all_reduces("float16", tp_allreduce="push") if op.startswith("linear_")]
    graph = _graph(tp_allreduce="push")
    node = next(n for n, _ in graph.nodes() if n.op == "linear_all_reduce_add")
    assert node.ins[1] == "w_down" and node.ins[2] == "x_1"
    in_layers = [n.op for n, rep in graph.nodes() if rep is not None]
    assert in_layers.count("linear") == 2  # qkv and gate/up: the o and down projections joined their all-reduces


def test_auto_is_push_on_cuda_with_tp():
    from mxc.builder import resolve_tp_allreduce

    assert resolve_tp_allreduce("auto", "cuda", 2) == "push"
    assert resolve_tp_allreduce("auto", "cuda", 2, "float16") == "push"
    assert resolve_tp_allreduce("auto", "cuda", 2, "float32") == "one_shot"
    assert resolve_tp_allreduce("auto", "cuda", 1) == "nccl"
    assert resolve_tp_allreduce("auto", "cpu", 4) == "nccl"
    assert resolve_tp_allreduce("nccl", "cuda", 2) == "nccl"


def test_build_refuses_one_shot_off_cuda(tmp_path):
    for choice in ("one_shot", "push"):
        with pytest.raises(mxc.MxcError, match=f"--tp-allreduce {choice}: the peer-memory all-reduce needs --target cuda"):
            mxc.build("llama.yaml", out=tmp_path / "a", tp=2, tp_allreduce=choice, progress=False, log=lambda m: None)
    with pytest.raises(mxc.MxcError, match="expected auto, nccl, one_shot or push"):
        mxc.build("llama.yaml", out=tmp_path / "a", tp=2, tp_allreduce="ring", progress=False, log=lambda m: None)
    assert not (tmp_path / "a").exists()


def test_one_shot_refuses_float16(tmp_path):
    """torch's one-shot all-reduce (symm_mem) sums bf16 and fp32 only: a float16 build asking for it is refused
    (its composite all-reduces would otherwise hand float16 rows to it on the GPU), and the runtime's collective
    refuses float16 before any rendezvous (so ``model._peer_allreduce`` falls back to NCCL on every rank)."""
    with pytest.raises(mxc.MxcError, match="--tp-allreduce one_shot: torch's one-shot all-reduce sums bfloat16 or "
                                           "float32, not float16; use push"):
        mxc.build("llama.yaml", out=tmp_path / "a", target="cuda", dtype="float16", tp=2, tp_allreduce="one_shot",
                  progress=False, log=lambda m: None)
    assert not (tmp_path / "a").exists()
    from mxc.kernels.peer_allreduce import OneShotAllReduce

    with pytest.raises(RuntimeError, match="sums bf16 or fp32, not torch.float16"):
        OneShotAllReduce(None, 64, torch.float16, torch.device("cpu"))


def test_one_shot_runtime_refusal_names_its_dtypes(monkeypatch):
    """The runtime collective's refusal names the dtypes its check reads (ONE_SHOT_DTYPES), not a fixed pair."""
    monkeypatch.setattr(peer_allreduce, "ONE_SHOT_DTYPES", ("float32",))
    with pytest.raises(RuntimeError, match=r"^torch's one-shot all-reduce sums fp32, not torch\.bfloat16$"):
        peer_allreduce.OneShotAllReduce(None, 64, torch.bfloat16, torch.device("cpu"))


def test_push_refusals_name_their_dtypes(monkeypatch):
    """The push collective and its launcher refuse what PUSH_DTYPES does not name (a float32 row, then bf16 once the
    list leaves it out), before any rendezvous or launch."""
    with pytest.raises(RuntimeError, match=r"^the push all-reduce sums bf16 or fp16, not torch\.float32$"):
        peer_allreduce.PushAllReduce(None, 4, 64, torch.float32, torch.device("cpu"))
    bufs, state = torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int32)
    with pytest.raises(AssertionError, match="contiguous bf16/fp16, got torch.float32"):
        peer_allreduce.push_all_reduce(torch.zeros(1, 64), bufs, state, 0, 128, 2)
    monkeypatch.setattr(peer_allreduce, "PUSH_DTYPES", ("float16",))
    with pytest.raises(RuntimeError, match=r"^the push all-reduce sums fp16, not torch\.bfloat16$"):
        peer_allreduce.PushAllReduce(None, 4, 64, torch.bfloat16, torch.device("cpu"))


class _FakeOneShot:
    """Stands in for ``OneShotAllReduce``: twice this rank's partial, for up to ``max_rows`` rows."""

    def __init__(self, max_rows=4):
        self.calls, self.max_rows = [], max_rows

    def fits(self, x):
        return x.shape[0] <= self.max_rows

    def __call__(self, x):
        assert self.fits(x), "called with rows that do not fit"
        self.calls.append(x.shape)
        return x * 2


def _nccl_stand_in(monkeypatch):
    """torch_ref.all_reduce without a process group: three times the partial, so a test sees which ran."""
    calls = []
    monkeypatch.setattr(cuda_ops.torch_ref, "all_reduce",
                        lambda x, bias=None, ctx=None: calls.append(x.shape) or 3 * x + (0 if bias is None else bias))
    return calls


def test_adapter_uses_the_runtime_collective_or_falls_back(monkeypatch):
    fake = _FakeOneShot()
    calls = fake.calls
    x, b = torch.ones(3, 8), torch.full((8,), 0.5)
    ctx = ForwardContext([1] * 3, [0] * 3, [0, 1, 2], world_size=2, peer_allreduce=fake)
    torch.testing.assert_close(cuda_ops.all_reduce_one_shot(x, b, ctx), torch.full((3, 8), 2.5))
    assert calls == [(3, 8)]
    nccl = _nccl_stand_in(monkeypatch)  # more rows than the buffer takes (a prefill): NCCL
    torch.testing.assert_close(cuda_ops.all_reduce_one_shot(torch.ones(5, 8), b, ctx), torch.full((5, 8), 3.5))
    assert calls == [(3, 8)] and nccl == [(5, 8)]
    monkeypatch.undo()
    single = ForwardContext([1], [0], [0])  # world size 1, no collective: the input (+ bias)
    torch.testing.assert_close(cuda_ops.all_reduce_one_shot(x, b, single), torch.full((3, 8), 1.5))
    meta = torch.empty(3, 8, device="meta")  # the build's shape-only trace never calls the collective
    assert cuda_ops.all_reduce_one_shot(meta, None, ctx).device.type == "meta" and len(calls) == 1


class _FakePush:
    """Stands in for ``PushAllReduce``: the sum over two ranks is twice this rank's partial, for up to
    ``max_rows`` rows."""

    def __init__(self, max_rows=4):
        self.calls, self.max_rows = [], max_rows

    def fits(self, x):
        return x.shape[0] <= self.max_rows

    def __call__(self, x, bias=None):
        assert self.fits(x), "called with rows that do not fit"
        self.calls.append("sum")
        return 2 * x if bias is None else 2 * x + bias

    def add(self, x, residual, bias=None):
        self.calls.append("add")
        return residual + self(x, bias)

    def add_rms_norm(self, x, residual, weight, eps, bias=None):
        self.calls.append("add_rms_norm")
        s = self.add(x, residual, bias)
        return s, torch_ref.rms_norm(s, weight, eps)

    def linear_add(self, x, w, residual, bias=None):
        self.calls.append("linear_add")
        return self.add(torch_ref.linear(x, w), residual, bias)

    def linear_add_rms_norm(self, x, w, residual, weight, eps, bias=None):
        self.calls.append("linear_add_rms_norm")
        return self.add_rms_norm(torch_ref.linear(x, w), residual, weight, eps, bias)


def test_push_adapters_use_the_runtime_collective_or_fall_back():
    x, r, w, b = torch.ones(3, 8), torch.full((3, 8), 0.25), torch.linspace(0.5, 1.5, 8), torch.full((8,), 0.5)
    push = _FakePush()
    ctx = ForwardContext([1] * 3, [0] * 3, [0, 1, 2], world_size=2, peer_allreduce=push)
    torch.testing.assert_close(cuda_ops.all_reduce_push(x, b, ctx, world=2), torch.full((3, 8), 2.5))
    torch.testing.assert_close(cuda_ops.all_reduce_add_push(x, r, b, ctx, world=2), torch.full((3, 8), 2.75))
    s, h = cuda_ops.all_reduce_add_rms_norm_push(x, r, w, b, ctx, eps=1e-6, world=2)
    torch.testing.assert_close(h, torch_ref.rms_norm(torch.full((3, 8), 2.75), w, 1e-6))
    assert push.calls[0] == "sum" and "add" in push.calls and "add_rms_norm" in push.calls
    # a one-shot object (no add/add_rms_norm) or none: the all-reduce adapter, then the add (+ norm)
    one_shot_comm = _FakeOneShot()
    calls = one_shot_comm.calls
    one_shot = ForwardContext([1] * 3, [0] * 3, [0, 1, 2], world_size=2, peer_allreduce=one_shot_comm)
    add = cuda_ops.all_reduce_add
    cuda_ops.triton_elementwise, saved = type("E", (), {"add": staticmethod(torch.add)}), cuda_ops.triton_elementwise
    try:
        torch.testing.assert_close(add(x, r, b, one_shot), torch.full((3, 8), 2.75))
        torch.testing.assert_close(cuda_ops.all_reduce_add_push(x, r, b, one_shot, world=2), torch.full((3, 8), 2.75))
    finally:
        cuda_ops.triton_elementwise = saved
    assert len(calls) == 2


def test_push_sends_rows_that_do_not_fit_to_nccl(monkeypatch):
    """A prefill's rows exceed the push buffer: NCCL sums them and the push object is never called (its
    kernel would refuse them)."""
    push = _FakePush(max_rows=4)
    nccl = _nccl_stand_in(monkeypatch)
    monkeypatch.setattr(cuda_ops.triton_elementwise, "add", torch.add)
    monkeypatch.setattr(cuda_ops.triton_norm, "add_rms_norm",
                        lambda t, r, w, eps: (r + t, torch_ref.rms_norm(r + t, w, eps)))
    x, r, w = torch.ones(6, 8), torch.full((6, 8), 0.25), torch.linspace(0.5, 1.5, 8)
    ctx = ForwardContext([1] * 6, [0] * 6, list(range(6)), world_size=2, peer_allreduce=push)
    torch.testing.assert_close(cuda_ops.all_reduce_push(x, None, ctx, world=2), torch.full((6, 8), 3.0))
    torch.testing.assert_close(cuda_ops.all_reduce_add_push(x, r, None, ctx, world=2), torch.full((6, 8), 3.25))
    s, h = cuda_ops.all_reduce_add_rms_norm_push(x, r, w, None, ctx, eps=1e-6, world=2)
    torch.testing.assert_close(s, torch.full((6, 8), 3.25))
    torch.testing.assert_close(h, torch_ref.rms_norm(s, w, 1e-6))
    assert push.calls == [] and nccl == [(6, 8)] * 3


def test_linear_push_adapters_use_the_runtime_collective_or_fall_back(monkeypatch):
    """The GEMV pushes when the push all-reduce takes its rows; else the GEMV, then the push adapter (and
    that one's NCCL fallback for rows the buffers cannot take)."""
    g = torch.Generator().manual_seed(0)
    bf16 = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731  (pushed: 16-bit)
    w, nw = bf16(8, 16), torch.linspace(0.5, 1.5, 8).to(torch.bfloat16)
    push = _FakePush(max_rows=4)
    nccl = _nccl_stand_in(monkeypatch)
    monkeypatch.setattr(cuda_ops.triton_gemv, "linear_small_m", torch_ref.linear)
    monkeypatch.setattr(cuda_ops.triton_elementwise, "add", torch.add)
    monkeypatch.setattr(cuda_ops.triton_norm, "add_rms_norm",
                        lambda t, r, w_, eps: (r + t, torch_ref.rms_norm(r + t, w_, eps)))
    for rows, pushed in ((3, True), (6, False)):
        push.calls.clear()
        x, r = bf16(rows, 16), bf16(rows, 8)
        ctx = ForwardContext([1] * rows, [0] * rows, list(range(rows)), world_size=2, peer_allreduce=push)
        factor = 2 if pushed else 3  # the fake push doubles the partial, the NCCL stand-in triples it
        y = torch_ref.linear(x, w)
        torch.testing.assert_close(cuda_ops.linear_all_reduce_add_push(x, w, r, None, ctx, world=2), r + factor * y)
        s_, h = cuda_ops.linear_all_reduce_add_rms_norm_push(x, w, r, nw, None, ctx, eps=1e-6, world=2)
        torch.testing.assert_close(s_, r + factor * y)
        torch.testing.assert_close(h, torch_ref.rms_norm(s_, nw, 1e-6))
        assert push.calls == (["linear_add", "add", "sum", "linear_add_rms_norm", "add_rms_norm", "add", "sum"]
                              if pushed else [])
    assert nccl == [(6, 8)] * 2


def test_push_records_its_kernel_at_build_time():
    """On ``meta`` (the build's trace) the push adapters launch the kernel for the recorder, without a
    process group: the artifact carries the kernel's cubin."""
    from mxc.kernels.launch import Recorder, using

    rec = Recorder()
    meta = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device="meta")  # noqa: E731
    ctx = ForwardContext([1], [0], [0])  # the build traces at world size 1
    with using(rec):
        assert cuda_ops.all_reduce_push(meta(4, 64), None, ctx, world=2).device.type == "meta"
        cuda_ops.all_reduce_add_push(meta(4, 64), meta(4, 64), None, ctx, world=2)
        s, h = cuda_ops.all_reduce_add_rms_norm_push(meta(4, 64), meta(4, 64), meta(64), None, ctx, eps=1e-6,
                                                     world=2)
    assert h.shape == (4, 64)
    kernels = sorted(spec["kernel"].split(":")[0].split(".")[1].rsplit("_", 1)[0] for spec in rec.specs.values())
    # the push kernels, and the fallback's add and add + RMSNorm (a runtime without peer memory uses NCCL)
    assert kernels == ["add", "push_all_reduce", "push_all_reduce", "push_all_reduce", "rms_norm"], kernels
    # the pushing GEMV: its kernel with PUSH_WORLD, the wait kernels, and the unfused path's kernels
    rec = Recorder()
    with using(rec):
        cuda_ops.linear_all_reduce_add_push(meta(4, 32), meta(64, 32), meta(4, 64), None, ctx, world=2)
        cuda_ops.linear_all_reduce_add_rms_norm_push(meta(4, 32), meta(64, 32), meta(4, 64), meta(64), None, ctx,
                                                     eps=1e-6, world=2)
    consts = [spec["constexprs"] for spec in rec.specs.values() if spec["kernel"].endswith("_gemv_kernel")]
    assert sorted(c.get("PUSH_WORLD", 0) for c in consts) == [0, 2]  # plain GEMV (fallback), pushing GEMV
    pushed = [spec for spec in rec.specs.values() if "push_all_reduce" in spec["kernel"]]
    assert len(pushed) == 4 and sum("x_ptr" not in spec["signature"] for spec in pushed) == 2


def test_peer_memory_needs_cuda(capsys):
    from mxc.runtime.model import _peer_allreduce

    assert "needs CUDA" in peer_allreduce.available(torch.device("cpu"))
    for kind in ("one_shot", "push"):
        assert _peer_allreduce({"config": {"hidden_size": 64}}, kind, torch.bfloat16, torch.device("cpu")) is None
        assert f"{kind} all-reduce unavailable" in capsys.readouterr().err


def _upto(last: str, arch: str = "LlamaForCausalLM", dtype: str = "bfloat16", options: dict | None = None,
          **config):
    """The tiny model at ``--tp 2 --target cuda`` through the pipeline up to and including the pass ``last``."""
    from mxc.compiler.pipeline import PIPELINE

    opts = BuildOptions(target="cuda", dtype=dtype, tp=2, **(options or {}))
    graph = bind_model(MODELS_DIR / "llama.yaml", {**TINY, "architectures": [arch], **config}, dtype, lookup(arch))
    for name, run in PIPELINE:
        graph = run(graph, opts)
        if name == last:
            return graph, opts
    raise AssertionError(last)


def _layer(graph):
    (rep,) = graph.repeats()
    return rep


def _with_reader(graph, value: str):
    """``graph`` with one more node in the layer, right after ``value``'s producer, reading ``value``."""
    from mxc.ir import Node

    rep = _layer(graph)
    nodes = list(rep.body)
    at = next(i for i, n in enumerate(nodes) if value in n.outs)
    nodes.insert(at + 1, Node("silu", (f"{value}_probe",), (value,), {}, nodes[at].loc))
    return graph.replace(body=tuple(rep.replace(body=tuple(nodes)) if it is rep else it for it in graph.body))


def test_an_all_reduce_read_first_fuses_too():
    """Qwen2-MoE adds the shared expert to the all-reduced experts' output (``add(y, shared)``: the all-reduce is
    the add's first input): it fuses as the residual-first ones do, the experts' partial sum going in."""
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    graph, _ = _upto("fuse_all_reduce", "Qwen2MoeForCausalLM", **moe)
    nodes = _layer(graph).body
    (experts,) = [n for n in nodes if n.op == "fused_moe"]
    (user,) = [n for n in nodes if experts.outs[0] in n.ins]
    assert user.op == "all_reduce_add" and user.ins[0] == experts.outs[0] and user.attrs == {"world": 2}
    assert [n.op for n in nodes].count("all_reduce") == 1  # the shared expert's, read by its gate's scaling


def test_an_all_reduce_read_elsewhere_is_not_fused():
    """fuse_all_reduce: an all-reduce whose sum another node reads too stays, and so does the add after it; the
    other layer all-reduce still fuses."""
    from mxc.compiler.passes import fuse_all_reduce
    from mxc.ir import verify

    graph, opts = _upto("fuse_linear_io")
    (down,) = [n for n in _layer(graph).body if n.op == "all_reduce" and any(
        m.op == "add" and n.outs[0] in m.ins for m in _layer(graph).body)]
    fused = fuse_all_reduce.run(_with_reader(graph, down.outs[0]), opts)
    verify(fused)
    ops = [n.op for n in _layer(fused).body]
    assert down in _layer(fused).body and "add" in ops and "all_reduce_add" not in ops
    assert "all_reduce_add_rms_norm" in ops


def test_a_partial_read_elsewhere_does_not_join_its_all_reduce():
    """fuse_linear_all_reduce: the down projection's partial sums read by another node too stay a linear of their
    own (the fused op would not make them); the o projection's still joins its all-reduce."""
    from mxc.compiler.passes import fuse_all_reduce, fuse_linear_all_reduce
    from mxc.ir import verify

    graph, opts = _upto("fuse_linear_io", options=dict(tp_allreduce="push"))
    (down,) = [n for n in _layer(graph).body if n.op == "linear" and n.ins[1] == "w_down"]
    graph = fuse_all_reduce.run(_with_reader(graph, down.outs[0]), opts)
    joined = fuse_linear_all_reduce.run(graph, opts)
    verify(joined)
    ops = [n.op for n in _layer(joined).body]
    assert down in _layer(joined).body and "all_reduce_add" in ops and "linear_all_reduce_add" not in ops
    assert "linear_all_reduce_add_rms_norm" in ops


def test_joined_linears_leave_no_linear_behind():
    """The joined linear is gone from the pass's own output (with ``--disable-pass eliminate_dead_code`` it would
    still run, its rows computed twice), and the fused ops keep the all-reduce's world and the norm's eps."""
    from mxc.compiler.passes import fuse_linear_all_reduce

    graph, opts = _upto("fuse_all_reduce", options=dict(tp_allreduce="push"))
    joined = fuse_linear_all_reduce.run(graph, opts)
    nodes = _layer(joined).body
    assert not [n for n in nodes if n.op == "linear" and n.ins[1] in ("wo", "w_down")]
    attrs = {n.op: n.attrs for n in nodes if n.op.startswith("linear_all_reduce")}
    assert attrs == {"linear_all_reduce_add_rms_norm": {"eps": 1e-5, "world": 2},
                     "linear_all_reduce_add": {"world": 2}}


@pytest.mark.parametrize("hidden,joined", [(WIDE_N, False), (WIDE_N - 64, True)])
def test_wide_outputs_do_not_join_their_all_reduce(hidden, joined):
    """Row-parallel linears with ``WIDE_N`` output features or more (the model's hidden size here; their input
    features are a rank's share of the heads or the intermediate size) stay apart from their all-reduce: cuBLAS
    serves their 17..32 tokens. Just below, they join."""
    graph, _ = _upto("fuse_linear_all_reduce", options=dict(tp_allreduce="push"), hidden_size=hidden,
                     intermediate_size=2 * WIDE_N)
    ops = [n.op for n in _layer(graph).body]
    assert ("linear_all_reduce_add" in ops) is joined and ("linear_all_reduce_add_rms_norm" in ops) is joined
    assert ("all_reduce_add" in ops) is not joined and ("all_reduce_add_rms_norm" in ops) is not joined


def test_peer_memory_that_fails_to_set_up_falls_back_to_nccl_in_one_line(monkeypatch, capsys):
    """Peer memory available but its setup raising (no peer access between the GPUs, say): NCCL, with the error's
    first line, or its type where it has none (an empty RuntimeError made the load fail with an IndexError)."""
    from mxc.runtime.model import _peer_allreduce

    monkeypatch.setattr(peer_allreduce, "available", lambda device: None)
    cases = ((RuntimeError(), "(RuntimeError)"), (RuntimeError("no peer access\nmore"), "(no peer access)"))
    for error, shown in cases:
        def fail(*a, error=error, **k):
            raise error

        monkeypatch.setattr(peer_allreduce, "OneShotAllReduce", fail)
        monkeypatch.setattr(peer_allreduce, "PushAllReduce", fail)
        for kind in ("one_shot", "push"):
            assert _peer_allreduce({"config": {"hidden_size": 64}}, kind, torch.bfloat16, torch.device("cpu")) is None
            assert capsys.readouterr().err == f"mxc: {kind} all-reduce unavailable {shown}; using NCCL\n"
