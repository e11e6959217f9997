"""The pipeline: one dump per pass, each loadable and verify()-clean; the whole build keeps the numbers."""

from __future__ import annotations

import pytest

from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import PIPELINE, check_disabled, compile_graph
from mxc.ir import load_graph, verify
from mxc.models.registry import MODELS_DIR


@pytest.mark.parametrize("arch, fields", [("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {}),
                                          ("Qwen3ForCausalLM", {"tie_word_embeddings": True})],
                         ids=["llama", "qwen2", "qwen3_tied"])
def test_dumps_one_file_per_pass(bind_arch, tmp_path, arch, fields):
    bound = bind_arch(arch, **fields)
    final = compile_graph(bound, BuildOptions(), dump_dir=tmp_path / "ir")
    names = ["00-bound.yaml"] + [f"{i:02d}-{name}.yaml" for i, (name, _) in enumerate(PIPELINE, start=1)]
    assert names[1:3] == ["01-merge_qkv.yaml", "02-merge_gate_up.yaml"]
    assert names[-1].endswith("-select_kernels.yaml")
    assert sorted(p.name for p in (tmp_path / "ir").iterdir()) == names
    graph = bound
    for i, name in enumerate(names):
        if i:
            graph = PIPELINE[i - 1][1](graph, BuildOptions())
        loaded = load_graph((tmp_path / "ir" / name).read_text())
        verify(loaded)
        assert loaded == graph, name
    assert graph == final


def test_compiled_layer(bind_arch):
    g = compile_graph(bind_arch("Qwen2ForCausalLM"), BuildOptions())
    (rep,) = g.repeats()
    assert sorted(rep.weights) == ["bqkv", "ln1", "ln2", "w_down", "w_gate_up", "wo", "wqkv"]
    ops = [n.op for n in rep.body]
    assert ops.count("linear") == 4 and "rms_norm_linear" not in ops  # qkv, o, gate_up, down (bf16: no norm fold)
    assert ops.count("add_rms_norm") == 1 and ops.count("rms_norm") == 1  # post-attention; input norm
    q = [n.op for n in compile_graph(bind_arch("Qwen2ForCausalLM"), BuildOptions(quant="fp8")).repeats()[0].body]
    assert q.count("qlinear") == 1 and q.count("rms_norm_qlinear") == 1  # o; qkv takes the input norm
    assert q.count("rms_norm_mlp") == 1  # the MLP with its norm and residual (fuse_mlp)
    assert "rms_norm" not in q and "add_rms_norm" not in q
    assert all("kernel" in n.attrs for n, _ in g.nodes())


def test_no_dump_dir_writes_nothing(bind_arch, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    compile_graph(bind_arch(), BuildOptions())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arch, fields", [("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {"mlp_bias": True}),
                                          ("Qwen3ForCausalLM", {"head_dim": 32})], ids=["llama", "qwen2", "qwen3"])
def test_compiled_graph_numerics(bind_arch, assert_same_logits, arch, fields):
    bound = bind_arch(arch, **fields)
    assert_same_logits(bound, compile_graph(bound, BuildOptions()))


REQUIRED = {"shard_tp", "quantize", "select_kernels"}


@pytest.mark.parametrize("name", [n for n, _ in PIPELINE if n not in REQUIRED])
def test_each_optimization_can_be_disabled(bind_arch, assert_same_logits, name):
    assert check_disabled([name]) == (name,)
    g = bind_arch()
    assert_same_logits(compile_graph(g, BuildOptions()), compile_graph(g, BuildOptions(disable_passes=(name,))))


@pytest.mark.parametrize("name", ["w", "L", "ctx", "layers"])
def test_value_named_like_the_forwards_own_names(bind_arch, assert_same_logits, tmp_path, name):
    text = (MODELS_DIR / "llama.yaml").read_text()
    edited = text.replace("- m = mul(", f"- {name} = mul(").replace("linear(m, w_down, b_down)",
                                                                     f"linear({name}, w_down, b_down)")
    assert edited.count(f"{name} = mul(") == 1
    path = tmp_path / "llama.yaml"
    path.write_text(edited)
    (tmp_path / "configs").symlink_to(MODELS_DIR / "configs")
    opts = BuildOptions(disable_passes=("merge_gate_up",))  # keep the renamed value in the compiled graph
    assert_same_logits(compile_graph(bind_arch(), opts), compile_graph(bind_arch(model_file=path), opts))


def test_check_disabled_sorts_and_dedupes():
    assert check_disabled(["fuse_mlp", "merge_qkv", "fuse_mlp", "eliminate_dead_code"]) == (
        "eliminate_dead_code", "fuse_mlp", "merge_qkv")
    assert check_disabled([]) == ()


def test_disable_pass_error_lists_every_optional_pass():
    from mxc.errors import MxcError

    with pytest.raises(MxcError) as exc:
        check_disabled(["merge_qkv", "select_kernels"])  # every name is checked, not only the first
    listed = str(exc.value).split("passes that can be disabled: ", 1)[1].split(", ")
    assert listed == [n for n, _ in PIPELINE if n not in REQUIRED]


def test_dump_dir_is_created_with_its_parents(bind_arch, tmp_path):
    compile_graph(bind_arch(), BuildOptions(), dump_dir=tmp_path / "a" / "b" / "ir")
    assert (tmp_path / "a" / "b" / "ir" / "00-bound.yaml").is_file()


def test_dump_dir_that_cannot_be_made_is_a_user_error(bind_arch, tmp_path):
    from mxc.errors import MxcError

    (tmp_path / "afile").write_text("x")
    with pytest.raises(MxcError, match="--dump-ir .*afile.*: cannot create the directory"):
        compile_graph(bind_arch(), BuildOptions(), dump_dir=tmp_path / "afile" / "ir")


def test_verifier_runs_after_every_pass(bind_arch, monkeypatch):
    """A pass that leaves the graph inconsistent (here: drops the layers' first node) is caught right after it:
    the next pass never runs."""
    from mxc.compiler import pipeline
    from mxc.ir import VerifyError

    def broken(graph, options):
        (rep,) = graph.repeats()
        return graph.replace(body=tuple(rep.replace(body=rep.body[1:]) if it is rep else it for it in graph.body))
    ran = []
    (name, run), rest = PIPELINE[3], PIPELINE[4:]
    monkeypatch.setattr(pipeline, "PIPELINE", [*PIPELINE[:3], ("broken", broken),
                                               (name, lambda g, o: ran.append(name) or run(g, o)), *rest])
    with pytest.raises(VerifyError):
        compile_graph(bind_arch(), BuildOptions())
    assert ran == []


def test_dumps_of_an_earlier_build_do_not_stay(bind_arch, tmp_path):
    """A second build into the same --dump-ir directory with a pass disabled: the first build's dump of that pass is
    gone (it would read as this build's: wqkv merged where this build never merged); other files stay."""
    ir = tmp_path / "ir"
    compile_graph(bind_arch(), BuildOptions(), dump_dir=ir)
    assert (ir / "01-merge_qkv.yaml").is_file()
    (ir / "notes.txt").write_text("mine")
    (ir / "01-mine.yaml").write_text("mine")
    final = compile_graph(bind_arch(), BuildOptions(disable_passes=("merge_qkv",)), dump_dir=ir)
    names = sorted(p.name for p in ir.iterdir())
    assert names == ["00-bound.yaml", "01-mine.yaml"] + [f"{i:02d}-{name}.yaml" for i, (name, _) in
                                                         enumerate(PIPELINE, start=1) if name != "merge_qkv"] + \
        ["notes.txt"]
    assert "wqkv" not in (ir / names[-2]).read_text() and load_graph((ir / names[-2]).read_text()) == final


def test_a_pass_that_breaks_the_graph_leaves_its_dump_last(bind_arch, tmp_path, monkeypatch):
    """--dump-ir is for debugging passes: the graph a pass broke is dumped before the verifier refuses it, and is the
    last file (no later pass's dump, from this build or an earlier one, follows it)."""
    from mxc.compiler import pipeline
    from mxc.ir import VerifyError

    ir = tmp_path / "ir"
    compile_graph(bind_arch(), BuildOptions(), dump_dir=ir)  # an earlier build's dumps of every pass

    def broken(graph, options):
        (rep,) = graph.repeats()
        return graph.replace(body=tuple(rep.replace(body=rep.body[1:]) if it is rep else it for it in graph.body))
    name = PIPELINE[3][0]
    monkeypatch.setattr(pipeline, "PIPELINE", [*PIPELINE[:3], (name, broken), *PIPELINE[4:]])
    with pytest.raises(VerifyError):
        compile_graph(bind_arch(), BuildOptions(), dump_dir=ir)
    names = sorted(p.name for p in ir.iterdir())
    assert names[-1] == f"04-{name}.yaml" and len(names) == 5, names
    with pytest.raises(VerifyError):
        verify(load_graph((ir / names[-1]).read_text()))
