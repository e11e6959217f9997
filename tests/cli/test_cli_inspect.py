"""``mxc inspect``: what it prints for healthy artifacts (model, shapes, RoPE, options, kernels chosen, files and
sizes), and how it flags damaged or missing files."""

from __future__ import annotations

import json
import shutil

import pytest

import mxc
from mxc.cli import main
from tests.cli.helpers import signed


def test_inspect(artifact, capsys):
    assert main(["inspect", str(artifact)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out
    manifest = json.loads((artifact / "manifest.json").read_text())
    for rel in manifest["files"]:
        assert rel in out
    assert manifest["ir_sha256"][:16] in out
    assert "TRUNCATED" not in out and "MISSING" not in out



def test_inspect_flags_damaged_weight_files(tmp_path, capsys):
    """A weight file cut short (a partial copy) or grown shows in the listing, from its header: no hashing."""
    art = mxc.build("llama.yaml", out=tmp_path / "a", progress=False, log=lambda m: None)
    weights = art / "weights" / "rank0.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    assert main(["inspect", str(art)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "rank0.safetensors" in ln)
    assert "TRUNCATED" in line and "its header says" in line
    with open(weights, "ab") as f:
        f.write(b"\0" * 200)
    main(["inspect", str(art)])
    assert "OVERSIZED" in capsys.readouterr().out
    weights.write_bytes(b"not a safetensors file")
    main(["inspect", str(art)])
    assert "DAMAGED" in capsys.readouterr().out



def test_inspect_flags_a_damaged_kernel_index(tmp_path, capsys):
    """A cuda artifact's code/kernels/index.json that is damaged shows as DAMAGED, as a weight file does: no
    traceback (inspect reads the index whenever present, so a cpu artifact stands in for a cuda build here)."""
    art = mxc.build("llama.yaml", out=tmp_path / "a", progress=False, log=lambda m: None)
    (art / "code" / "kernels").mkdir()
    for damaged in ("{damaged", "[1]", '{"k": {"source": "x"}}', '{"k": 1}', b'{"\xff": 1}'):
        index = art / "code" / "kernels" / "index.json"
        index.write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
        assert main(["inspect", str(art)]) == 0
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err
        line = next(ln for ln in captured.out.splitlines() if ln.startswith("compiled"))
        assert "code/kernels/index.json  DAMAGED" in line, line
        assert "files" in captured.out.splitlines()



def test_inspect_heads_query_then_kv(tmp_path, capsys):
    """`mxc inspect` prints the heads as config.json names them: query heads / kv heads."""
    art = mxc.build("llama.yaml", out=tmp_path / "a", progress=False, log=lambda m: None)
    c = json.loads((art / "manifest.json").read_text())["config"]
    assert c["num_attention_heads"] != c["num_key_value_heads"]  # GQA: the order shows
    assert main(["inspect", str(art)]) == 0
    assert f"heads {c['num_attention_heads']}/{c['num_key_value_heads']} kv" in capsys.readouterr().out



def _inspect_copy(artifact, tmp_path, edit=None):
    """A copy of ``artifact`` (its manifest edited by ``edit``) and what `mxc inspect` prints for it."""
    art = tmp_path / "copy"
    shutil.copytree(artifact, art)
    if edit is not None:
        manifest = json.loads((art / "manifest.json").read_text())
        edit(manifest)
        (art / "manifest.json").write_text(json.dumps(signed(manifest)))
    return art



def _inspect_lines(art, capsys):
    assert main(["inspect", str(art)]) == 0
    return capsys.readouterr().out.splitlines()



def test_inspect_sizes_in_binary_units():
    from mxc.inspect import _size

    assert _size(0) == "0 B" and _size(1023) == "1023 B"
    assert _size(1024) == "1.0 KB" and _size(1536) == "1.5 KB"
    assert _size(1024**2) == "1.0 MB" and _size(5 * 1024**3) == "5.0 GB"
    assert _size(2048 * 1024**3) == "2048.0 GB"  # GB is the largest unit



def test_inspect_kernel_choice_per_token_bucket():
    from mxc.inspect import _kernel

    assert _kernel("triton.rms_norm") == "triton.rms_norm"
    assert _kernel([[16, "gemv"], [None, "gemm"]]) == "gemv (<= 16 tokens) / gemm"



def test_inspect_of_a_healthy_cpu_artifact(artifact, capsys):
    """A fresh cpu build: no kernel index line, no flag on any file, each file's size in KB; the build line says
    quant none, the rope line its theta, the weights line where they came from."""
    lines = _inspect_lines(artifact, capsys)
    manifest = json.loads((artifact / "manifest.json").read_text())
    rope = manifest["config"]["rope"]
    assert not any(ln.startswith("compiled") or ln.startswith("cuda ") for ln in lines), lines
    assert f"rope         {rope['type']} (theta {rope['theta']})" in lines
    max_seq_len = manifest["options"]["max_seq_len"]
    assert any(ln.startswith("build        target cpu,") and ln.endswith(f"quant none, max-seq-len {max_seq_len}")
               for ln in lines), lines
    assert "weights      dummy" in lines
    for rel in manifest["files"]:
        size = (artifact / rel).stat().st_size
        assert 1024 <= size < 1024**2, rel  # in KB: the tiny model's files
        line = next(ln for ln in lines if ln.split()[0] == rel)
        assert line.split()[1:] == [f"{size / 1024:.1f}", "KB"], line



def test_inspect_reads_a_weight_file_with_metadata(artifact, tmp_path, capsys):
    """A safetensors header's __metadata__ entry is no tensor: a file that has one is read as whole, not DAMAGED."""
    from safetensors.torch import load_file, save_file

    art = _inspect_copy(artifact, tmp_path)
    weights = art / "weights" / "rank0.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt"})
    line = next(ln for ln in _inspect_lines(art, capsys) if "rank0.safetensors" in ln)
    assert line.split()[1:] == [f"{weights.stat().st_size / 1024:.1f}", "KB"], line



def test_inspect_marks_a_missing_file(artifact, tmp_path, capsys):
    art = _inspect_copy(artifact, tmp_path)
    (art / "graph.yaml").unlink()
    lines = _inspect_lines(art, capsys)
    assert next(ln for ln in lines if "graph.yaml" in ln).split() == ["graph.yaml", "MISSING"]



def test_inspect_names_the_checkpoint_the_weights_came_from(artifact, tmp_path, capsys):
    source = {"weights": "checkpoint", "checkpoint": "/ck/pt"}
    art = _inspect_copy(artifact, tmp_path, lambda m: m.update(source=source))
    assert "weights      checkpoint from /ck/pt" in _inspect_lines(art, capsys)



def test_inspect_shows_a_cuda_artifacts_runtime_options(artifact, tmp_path, capsys):
    """A --target cuda manifest (a cpu artifact relabelled: inspect reads only the manifest and the index): the KV
    cache size, the prefill graphs and PDL."""
    def cuda(**options):
        def edit(m):
            m["target"] = {**m["target"], "name": "cuda", "arch": "sm_90"}
            m["options"].update(target="cuda", max_batch=4, max_seq_len=256, **options)
        return edit

    art = _inspect_copy(artifact, tmp_path, cuda(prefill_graph_tokens=0, pdl=False))
    assert ("cuda         KV cache 4 x 256 tokens (decode graphs per batch bucket), prefill graphs off, PDL off"
            in _inspect_lines(art, capsys))
    shutil.rmtree(art)
    art = _inspect_copy(artifact, tmp_path, cuda(prefill_graph_tokens=64, pdl=True))
    assert ("cuda         KV cache 4 x 256 tokens (decode graphs per batch bucket), prefill graphs up to 64 tokens, "
            "PDL on" in _inspect_lines(art, capsys))



def test_inspect_shows_only_the_prefill_buckets_the_kv_cache_holds(artifact, tmp_path, capsys):
    """--prefill-graphs 2048 with --max-seq-len 300: the largest bucket is 256 (none past the cache's length)."""
    def edit(m):
        m["target"] = {**m["target"], "name": "cuda", "arch": "sm_90"}
        m["options"].update(target="cuda", max_batch=4, max_seq_len=300, prefill_graph_tokens=2048, pdl=True)

    art = _inspect_copy(artifact, tmp_path, edit)
    assert ("cuda         KV cache 4 x 300 tokens (decode graphs per batch bucket), prefill graphs up to 256 tokens, "
            "PDL on" in _inspect_lines(art, capsys))


def test_inspect_shows_experts_and_fp8_options(artifact, tmp_path, capsys):
    """A mixture of experts shows its experts and routing, not the dense intermediate_size it does not use; fp8
    shows its scales' granularity and whether the LM head is quantized."""
    def edit(m):
        m["config"].update(moe=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           norm_topk_prob=True, moe_scoring="softmax", shared_expert_intermediate_size=64)
        m["options"].update(quant="fp8", quant_granularity="block128", quant_lm_head=True)

    art = _inspect_copy(artifact, tmp_path, edit)
    lines = _inspect_lines(art, capsys)
    shape = next(ln for ln in lines if ln.startswith("shape"))
    assert shape.endswith(", 8 experts of mlp 32 (top-2 softmax, renormalised) + a shared expert of mlp 64, "
                          "vocab 256"), shape
    build = next(ln for ln in lines if ln.startswith("build"))
    assert "quant fp8 (block128 scales, LM head too), max-seq-len 512" in build, build


def test_inspect_flags_a_file_the_manifest_does_not_list(artifact, tmp_path, capsys):
    art = _inspect_copy(artifact, tmp_path)
    (art / "code" / "notes.txt").write_text("mine")
    line = next(ln for ln in _inspect_lines(art, capsys) if "notes.txt" in ln)
    assert line.split()[0] == "code/notes.txt" and "EXTRA (not in manifest.json: loading refuses the artifact" in line
    import pytest

    with pytest.raises(mxc.MxcError, match="code/notes.txt is not part of the artifact"):
        mxc.load(art)


def test_inspect_lists_the_kernels_rendered_from_templates(artifact, tmp_path, capsys):
    """The kernel index: every cubin counted, the rendered sources listed by template name with sorted params."""
    art = _inspect_copy(artifact, tmp_path)
    (art / "code" / "kernels").mkdir()
    (art / "code" / "kernels" / "index.json").write_text(json.dumps({
        "k1": {"file": "k1.cubin"},
        "k2": {"file": "k2.cubin", "source": "src/zeta.py", "template": "zeta", "template_params": {"b": 2, "a": 1}},
        "k3": {"file": "k3.cubin", "source": "src/alpha.py", "template": "alpha", "template_params": {}},
    }))
    lines = _inspect_lines(art, capsys)
    at = next(i for i, ln in enumerate(lines) if ln.startswith("compiled"))
    assert lines[at:at + 3] == ["compiled     3 cubins (2 kernel modules rendered from templates)",
                                "  alpha()  code/kernels/src/alpha.py",
                                "  zeta(a=1, b=2)  code/kernels/src/zeta.py"]



@pytest.mark.parametrize("header", [b"[1]", b"{not json", b'{"w": {"dtype": "F32"}}', b'{"w": {"data_offsets": 5}}'],
                         ids=["not-an-object", "not-json", "no-offsets", "offsets-not-a-list"])
def test_inspect_flags_a_weight_file_whose_header_is_not_an_object(header, artifact, tmp_path, capsys):
    import struct

    art = _inspect_copy(artifact, tmp_path)
    (art / "weights" / "rank0.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    line = next(ln for ln in _inspect_lines(art, capsys) if "rank0.safetensors" in ln)
    assert "DAMAGED (no readable safetensors header)" in line



def test_inspect_a_manifest_whose_kernel_is_null(artifact, tmp_path, capsys):
    art = _inspect_copy(artifact, tmp_path, lambda m: m["kernels"][0].update(kernel=None))
    mxc.load(art)  # the runtime accepts the manifest
    lines = _inspect_lines(art, capsys)
    assert any(ln.startswith("kernels ") for ln in lines)
    assert any("(none)" in ln for ln in lines)




@pytest.mark.parametrize("rel", ["weights/rank0.safetensors", "code/kernels/index.json"])
def test_inspect_does_not_block_on_a_fifo_in_the_artifact(rel, artifact, tmp_path):
    """A FIFO where a weight file (or a cuda artifact's kernel index) should be: inspect calls it MISSING, as
    ``mxc.load`` does, where it blocked forever reading the FIFO's header."""
    import os

    from tests.cli.helpers import run_mxc

    art = _inspect_copy(artifact, tmp_path)
    path = art / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    proc = run_mxc("inspect", art)  # a 120 s timeout: TimeoutExpired where it blocks
    assert proc.returncode == 0, proc.stderr
    if rel.startswith("weights/"):
        assert next(ln for ln in proc.stdout.splitlines() if rel in ln).split() == [rel, "MISSING"]


def test_inspect_of_a_cuda_manifest_with_damaged_prefill_graphs_is_one_line(artifact, tmp_path, capsys):
    """options.prefill_graph_tokens, which inspect (and a GPU load) sizes the prompt graphs by, is checked with the
    manifest's other fields (was a TypeError traceback in inspect)."""
    from tests.cli.helpers import user_error

    def edit(m):
        m["target"] = {**m["target"], "name": "cuda", "arch": "sm_90"}
        m["options"].update(target="cuda", max_batch=4, max_seq_len=256, prefill_graph_tokens="2048")

    art = _inspect_copy(artifact, tmp_path, edit)
    user_error(capsys, ["inspect", art], "field options.prefill_graph_tokens: expected a token count >= 0")
