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
    lines = _inspect_lines(art, capsys)
    assert ("cuda         KV cache 4 x 256 tokens (decode graphs per batch bucket), prefill graphs up to 64 tokens, "
            "PDL on" in lines)
    # what the GPU decoder allocates (keys and values, every layer, 4 slots + the scratch slot of 256 rows) beside
    # the rank's weights
    from mxc.errors import size_text

    kv = json.loads((art / "manifest.json").read_text())["runtime"]["kv_cache"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[json.loads((art / "manifest.json").read_text())["runtime"]
                                                            ["dtype"]]
    cache = 2 * kv["layers"] * (4 + 1) * 256 * kv["kv_heads"] * kv["head_dim"] * itemsize
    weights = (art / "weights" / "rank0.safetensors").stat().st_size
    assert (f"gpu memory   {size_text(weights)} of weights + {size_text(cache)} of KV cache a GPU (--max-batch 4 + 1 "
            f"scratch slot x --max-seq-len 256 tokens), before activations") in lines



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
    shows its scales' granularity, whether the LM head is quantized, and that --quant fp8 gives the experts channel
    scales whatever the granularity (quantize's _expert_rule: block128 here)."""
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
    assert "quant fp8 (block128 scales, LM head too; channel scales for the experts), max-seq-len 512" in build, build


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


def test_inspect_shows_the_experts_scales_of_a_real_build(hf_checkpoint, tmp_path, capsys):
    """--quant fp8 --quant-granularity block128 of a mixture: attention weights get block scales, the experts one scale
    a row (the weight file says so); inspect said "block128 scales" for the whole model."""
    from safetensors import safe_open

    ckpt, _ = hf_checkpoint("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    art = mxc.build(str(ckpt), out=tmp_path / "a", quant="fp8", quant_granularity="block128", progress=False,
                    log=lambda m: None)
    with safe_open(art / "weights" / "rank0.safetensors", framework="pt") as f:
        assert f.get_slice("layers.0.wo_scale").get_shape() == [1, 1]  # one 128x128 block
        assert f.get_slice("layers.0.we_down_scale").get_shape() == [4, 64]  # [experts, rows]
    build = next(ln for ln in _inspect_lines(art, capsys) if ln.startswith("build"))
    assert "quant fp8 (block128 scales; channel scales for the experts)" in build, build


@pytest.mark.parametrize("rope, shown", [
    ({"type": "linear", "theta": 10000.0, "rotary_dim": 16, "max_position_embeddings": 512, "factor": 2.0},
     "linear (theta 10000.0, factor 2.0)"),
    ({"type": "llama3", "theta": 500000.0, "rotary_dim": 16, "max_position_embeddings": 512, "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
     "llama3 (theta 500000.0, factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0, "
     "original_max_position_embeddings 64)"),
    ({"type": "yarn", "theta": 10000.0, "rotary_dim": 8, "max_position_embeddings": 512, "factor": 4.0,
      "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None,
      "mscale_all_dim": None, "attention_factor": 1.25, "truncate": True},
     "yarn (theta 10000.0, rotary_dim 8 of head_dim 16, factor 4.0, original_max_position_embeddings 32, "
     "beta_fast 32.0, beta_slow 1.0, attention_factor 1.25, truncate True)"),
], ids=["linear", "llama3", "yarn-partial"])
def test_inspect_shows_the_rope_scaling_parameters(rope, shown, artifact, tmp_path, capsys):
    """The rope line shows the scaling the spec holds (a linear factor 2 and 8 were the same line: type and theta
    only), and a rotary_dim short of head_dim; None parameters are left out."""
    art = _inspect_copy(artifact, tmp_path, lambda m: m["config"].update(rope=rope))
    assert f"rope         {shown}" in _inspect_lines(art, capsys)


def test_inspect_shows_the_sliding_window(hf_checkpoint, tmp_path, capsys):
    """A Mistral's sliding_window windows its attention (config attention_window): the shape line says so."""
    ckpt, _ = hf_checkpoint("MistralForCausalLM", sliding_window=16)
    art = mxc.build(str(ckpt), out=tmp_path / "a", progress=False, log=lambda m: None)
    assert json.loads((art / "manifest.json").read_text())["config"]["attention_window"] == 16
    shape = next(ln for ln in _inspect_lines(art, capsys) if ln.startswith("shape"))
    assert "head_dim 16, sliding window 16 tokens, mlp 96" in shape, shape


def test_inspect_shows_disabled_passes(tmp_path, capsys):
    """A build with --disable-pass is not the default build of the same line: the build line names them, as flags."""
    art = mxc.build("llama.yaml", out=tmp_path / "a", disable_passes=["merge_qkv", "fuse_add_rms_norm"],
                    progress=False, log=lambda m: None)
    build = next(ln for ln in _inspect_lines(art, capsys) if ln.startswith("build"))
    assert build.endswith(", --disable-pass fuse_add_rms_norm, --disable-pass merge_qkv"), build


def test_inspect_shows_a_cuda_artifacts_all_reduce_and_mlp_pair(artifact, tmp_path, capsys):
    """--tp-allreduce (cuda, tp > 1) and --mlp-pair change what runs: the cuda line names them."""
    def edit(m):
        m["target"] = {**m["target"], "name": "cuda", "arch": "sm_90"}
        m["options"].update(target="cuda", max_batch=4, max_seq_len=256, prefill_graph_tokens=0, pdl=True,
                            tp_allreduce="push", mlp_pair=True)

    line = next(ln for ln in _inspect_lines(_inspect_copy(artifact, tmp_path, edit), capsys) if ln.startswith("cuda"))
    assert line.endswith("PDL on, --mlp-pair"), line  # tp 1: no all-reduce
    shutil.rmtree(tmp_path / "copy")

    def tp2(m):
        edit(m)
        m.update(tp=2, files={**m["files"], "weights/rank1.safetensors": m["files"]["weights/rank0.safetensors"]})
    art = _inspect_copy(artifact, tmp_path, tp2)
    shutil.copyfile(art / "weights" / "rank0.safetensors", art / "weights" / "rank1.safetensors")
    line = next(ln for ln in _inspect_lines(art, capsys) if ln.startswith("cuda"))
    assert line.endswith("PDL on, all-reduce push, --mlp-pair"), line


def test_inspect_counts_kernels_per_layer_and_outside_them(artifact, capsys):
    """Each kernel with its IR nodes, those of a layer apart from those outside the layers: "torch_ref.linear x5" read
    as five linears in a model that runs 4 a layer and the LM head; one a line, a bucketed choice whole."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    layers = manifest["runtime"]["layers"]["count"]
    lines = _inspect_lines(artifact, capsys)
    at = next(i for i, ln in enumerate(lines) if ln.startswith("kernels"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("files"))
    assert lines[at] == f"kernels      in each of the {layers} layers"
    outside = lines.index("             outside the layers")
    per_layer, top = lines[at + 1:outside], lines[outside + 1:end]
    assert "  4 x torch_ref.linear" in per_layer and "  1 x torch_ref.linear" in top
    count = {where: sum(int(ln.split(" x ")[0]) for ln in group) for where, group in (("layers", per_layer),
                                                                                         ("top", top))}
    assert count == {w: sum(r["in"] == w for r in manifest["kernels"]) for w in ("layers", "top")}


def test_inspect_keeps_the_sizes_in_one_column(artifact, tmp_path, capsys):
    """A file name longer than the 32 columns (a cuda artifact's code/kernels/src/<template>_<hash>.py) pushed its
    size out of the column: every size starts at one column."""
    def edit(m):
        m["files"]["code/kernels/src/prefill_attention_5890bc68f6ae0218.py"] = "0" * 64

    art = _inspect_copy(artifact, tmp_path, edit)
    (art / "code" / "kernels" / "src").mkdir(parents=True)
    (art / "code" / "kernels" / "src" / "prefill_attention_5890bc68f6ae0218.py").write_text("x = 1\n")
    (art / "code" / "a_file_the_manifest_does_not_list_at_all.txt").write_text("mine")
    lines = _inspect_lines(art, capsys)
    files = lines[lines.index("files") + 1:]
    assert len(files) == 5
    columns = {len(ln) - len(ln[2:].split(" ", 1)[1].lstrip()) for ln in files}
    assert len(columns) == 1, files


def test_inspect_says_an_fp8_checkpoint_was_imported(artifact, tmp_path, capsys):
    """An fp8 checkpoint's scales are imported, not made by --quant fp8 (no flag to repeat), and the linear weights it
    left unquantized stay in the model dtype: the build line says both."""
    def edit(m):
        m["config"].update(moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        m["options"].update(quant="fp8", quant_granularity="block128", quant_scale_suffix="weight_scale_inv",
                            quant_unquantized=[f"model.layers.{{i}}.mlp.shared_expert.{n}.weight"
                                               for n in ("down_proj", "gate_proj", "up_proj")])

    build = next(ln for ln in _inspect_lines(_inspect_copy(artifact, tmp_path, edit), capsys)
                 if ln.startswith("build"))
    assert ("quant fp8 (block128 scales, from the checkpoint; 3 of the layers' linear weights left in float32 by it)"
            in build), build  # the checkpoint's experts keep its scales: no channel note


def test_inspect_says_what_text_generate_takes(hf_checkpoint, tmp_path, capsys):
    """The tokenizer line: no tokenizer (--ids only, and why), tokenizer.json without a chat template, the chat
    templates by name (the one --chat uses, or that it needs --chat-template), and a template the artifact lost,
    named as damaged rather than a traceback."""
    from tests.cli.test_cli_chat import LLAMA3, TOOL_USE, _checkpoint

    def line(art):
        assert main(["inspect", str(art)]) == 0
        return next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tokenizer "))

    art = mxc.build("llama.yaml", out=tmp_path / "random", progress=False, log=lambda m: None)
    assert "none: generate takes --ids only (--prompt needs a tokenizer" in line(art)
    ckpt = _checkpoint(hf_checkpoint, {})
    assert line(mxc.build(str(ckpt), out=tmp_path / "plain", progress=False, log=lambda m: None)).endswith(
        "tokenizer.json (--prompt); no chat template (--chat cannot run)")
    ckpt = _checkpoint(hf_checkpoint, {}, jinja=LLAMA3, named={"tool_use": TOOL_USE})
    art = mxc.build(str(ckpt), out=tmp_path / "named", progress=False, log=lambda m: None)
    assert line(art).endswith("chat templates 'default', 'tool_use' (--chat; --chat-template NAME picks another)")
    (ckpt / "chat_template.jinja").unlink()
    art = mxc.build(str(ckpt), out=tmp_path / "no-default", progress=False, log=lambda m: None)
    assert line(art).endswith("""chat templates 'tool_use' (--chat needs --chat-template NAME: none is "default")""")
    (art / "tokenizer" / "additional_chat_templates" / "tool_use.jinja").unlink()
    damaged = line(art)
    assert "chat templates UNREADABLE (" in damaged and "is missing; the artifact is incomplete" in damaged
