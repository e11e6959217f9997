"""What a build writes: manifest, graph.yaml, code/forward.py, weights, and --dump-ir."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

import mxc
from mxc.compiler.pipeline import PIPELINE
from mxc.ir import dump_graph, load_graph, verify


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    art = mxc.build("llama.yaml", out=root / "art", dump_ir=root / "ir", progress=False, log=lambda m: None)
    return art, root / "ir"


def _manifest(art):
    return json.loads((art / "manifest.json").read_text())


def test_manifest_keys_and_file_hashes(built):
    art, _ = built
    m = _manifest(art)
    for key in ("schema_version", "mxc_version", "architecture", "config", "options", "target",
                "ir_sha256", "files", "kernels"):
        assert key in m, key
    assert m["mxc_version"] == mxc.__version__
    assert m["architecture"] == "LlamaForCausalLM"
    assert m["options"]["target"] == "cpu" and m["options"]["dtype"] == "float32"
    on_disk = {p.relative_to(art).as_posix() for p in art.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(m["files"]) == on_disk
    assert {"graph.yaml", "code/forward.py", "weights/rank0.safetensors"} <= on_disk
    for rel, digest in m["files"].items():
        assert hashlib.sha256((art / rel).read_bytes()).hexdigest() == digest, rel
    assert m["kernels"] and all(row["kernel"] for row in m["kernels"])


def test_graph_yaml_matches_manifest_and_loads(built):
    art, _ = built
    text = (art / "graph.yaml").read_text()
    assert hashlib.sha256(text.encode()).hexdigest() == _manifest(art)["ir_sha256"]
    graph = load_graph(text)
    verify(graph)
    assert dump_graph(graph) == text


def test_forward_py_names_nodes_and_model_file_lines(built):
    art, _ = built
    m = _manifest(art)
    code = (art / "code" / "forward.py").read_text()
    assert m["ir_sha256"] in code
    assert "llama.yaml:" in code
    compile(code, "forward.py", "exec")
    for row in m["kernels"]:
        assert row["loc"].startswith("llama.yaml:")
        assert f"# {row['loc']}: {row['node']} = " in code, row


def test_weights_file(built):
    art, _ = built
    with safe_open(art / "weights" / "rank0.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert "embed" in names and "lm_head" in names
        assert f.get_tensor("embed").shape == (256, 64)


def test_dump_ir_writes_one_file_per_pass(built):
    art, ir = built
    files = sorted(p.name for p in ir.iterdir())
    assert files == ["00-bound.yaml"] + [f"{i:02d}-{name}.yaml" for i, (name, _) in enumerate(PIPELINE, start=1)]
    for name in files:
        verify(load_graph((ir / name).read_text()))
    assert (ir / files[-1]).read_text() == (art / "graph.yaml").read_text()


def test_disable_pass_skips_it_and_keeps_the_math(built, tmp_path):
    """--disable-pass leaves the graph unfused (no dump for the skipped passes), records the choice in
    the manifest, and the program computes the same logits."""
    art, _ = built
    plain = mxc.build("llama.yaml", out=tmp_path / "plain", dump_ir=tmp_path / "ir", progress=False,
                      log=lambda m: None, disable_passes=["merge_qkv", "merge_gate_up"])
    assert _manifest(plain)["options"]["disable_passes"] == ["merge_gate_up", "merge_qkv"]
    names = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert not any("merge_qkv" in n or "merge_gate_up" in n for n in names)
    graph = (plain / "graph.yaml").read_text()
    assert "wqkv" not in graph and "w_gate_up" not in graph and "wqkv" in (art / "graph.yaml").read_text()
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mxc.load(plain).logits(ids), mxc.load(art).logits(ids), rtol=1e-5, atol=1e-5)


def test_manifest_runtime_block_describes_the_config(built):
    """The runtime reads the KV cache geometry, vocabulary, stop tokens and layer naming from the manifest, not the
    IR: each must be what the definition's tiny config (the build's config.json) says."""
    from mxc.models import MODELS_DIR

    art, _ = built
    config = json.loads((MODELS_DIR / "configs" / "tiny-llama.json").read_text())
    runtime = _manifest(art)["runtime"]
    assert runtime["vocab_size"] == config["vocab_size"]
    assert runtime["inputs"] == ["tokens", "positions", "logit_rows"]
    assert runtime["kv_cache"] == {"layers": config["num_hidden_layers"], "kv_heads": config["num_key_value_heads"],
                                   "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    assert runtime["max_position_embeddings"] == config["max_position_embeddings"]
    assert runtime["eos_token_id"] == [config["eos_token_id"]]
    layers = runtime["layers"]
    assert layers["count"] == config["num_hidden_layers"]
    # every per-layer tensor of the weight file is the prefix, its index filled in, then a local name
    with safe_open(art / "weights" / "rank0.safetensors", framework="pt") as f:
        names = set(f.keys())
    locals_ = {n.split(".", 2)[2] for n in names if n.startswith("layers.")}
    assert locals_
    want = {layers["prefix"].replace("{" + layers["index"] + "}", str(i)) + local
            for i in range(layers["count"]) for local in locals_}
    assert want == {n for n in names if n.startswith("layers.")}
