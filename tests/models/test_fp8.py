"""--quant fp8 on tiny random HF checkpoints: logits close to the unquantized bf16 model, per granularity.

The CPU target dequantizes weights and quantizes activations per token, as the
GPU kernels do (W8A8). Measured on these models: L2 error 3-6% of the logits'
L2 norm, max error 4-8% of the largest logit (each e4m3 rounding is up to
6%, and random weights have no dominant directions to average the noise
out). The bounds below sit just above that; the issue's 5%-of-scale target is
met on L2 for Llama and Qwen2, not for Qwen3 (docs/perf.md). Greedy agreement
with bf16 is printed; tiny random models have near-flat logits, so it is
reported rather than asserted. ``test_fp8_logits_are_the_schemes_own`` shows the
error is the scheme's: in float32, transformers computing W8A8 e4m3 itself gives
mxc's fp8 logits to 1e-7, 5.4-5.7% off the unquantized ones for Qwen3.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import mxc

IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(4))


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _l2(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("arch,overrides", [("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {}),
                                            ("Qwen3ForCausalLM", {"head_dim": 32})])
@pytest.mark.parametrize("granularity", ["channel", "tensor", "block128"])
def test_fp8_logits_close_to_unquantized(arch, overrides, granularity, hf_checkpoint, tmp_path, record_property):
    ckpt, hf = hf_checkpoint(arch, **overrides)
    ref = mxc.load(mxc.build(str(ckpt), out=tmp_path / "ref", dtype="bfloat16", progress=False, log=lambda m: None))
    art = mxc.build(str(ckpt), out=tmp_path / "fp8", dtype="bfloat16", quant="fp8", quant_granularity=granularity,
                    progress=False, log=lambda m: None)
    model = mxc.load(art)
    got, want = model.logits(IDS), ref.logits(IDS)
    assert _l2(got, want) < 0.065 and _rel(got, want) < 0.09, (_l2(got, want), _rel(got, want))
    agree = (model.generate(IDS, max_new_tokens=16) == ref.generate(IDS, max_new_tokens=16)).float().mean()
    record_property("report", f"fp8 {granularity:8s} {arch:18s} logits L2 err {_l2(got, want):.1%}, max err "
                              f"{_rel(got, want):.1%}, greedy agreement with bf16: {agree:.0%}")
    with safe_open(art / "weights" / "rank0.safetensors", "pt") as f:
        assert f.get_tensor("layers.0.wqkv").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.0.wqkv_scale").dtype == torch.float32
        assert f.get_tensor("lm_head" if "lm_head" in f.keys() else "embed").dtype == torch.bfloat16


def _w8a8(model, granularity):
    """Make a transformers model compute #5's scheme, written here apart from mxc: each decoder linear's weight
    rounded to e4m3 at amax / 448 scales (per output row, per tensor, or per 128x128 tile of the weight mxc merges
    the parts into: ``block128`` tiles the merged qkv and gate/up, ``channel`` and ``tensor`` keep each part's own
    scales), and each token of its input rounded to e4m3 at its own amax / 448. Fused experts (transformers'
    [E, rows, K] stacks) have each expert's rows rounded at their own scales, whatever the granularity, and their
    inputs left as they are; the routers stay unrounded."""
    fmax = torch.finfo(torch.float8_e4m3fn).max

    def rounded(t, amax):
        scale = (amax / fmax).clamp(min=1e-12)
        return (t / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).float() * scale

    def weights(parts):
        if granularity == "channel":
            return [rounded(w, w.abs().amax(dim=1, keepdim=True)) for w in parts]
        if granularity == "tensor":
            return [rounded(w, w.abs().amax()) for w in parts]
        w = torch.cat(parts)
        n, k = w.shape
        tiles = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128)).unflatten(1, (-1, 128)).unflatten(0, (-1, 128))
        return rounded(tiles, tiles.abs().amax(dim=(1, 3), keepdim=True)).flatten(2).flatten(0, 1)[:n, :k].split(
            [p.shape[0] for p in parts])

    def tokens_rounded(_, args):
        return (rounded(args[0], args[0].abs().amax(dim=-1, keepdim=True)),)

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups = [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj]]
        if hasattr(mlp, "experts"):
            for stack in (mlp.experts.gate_up_proj.data, mlp.experts.down_proj.data):
                stack.copy_(rounded(stack.float(), stack.float().abs().amax(dim=2, keepdim=True)))
        else:
            groups += [[mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]
        for linears in groups:
            for linear, w in zip(linears, weights([lin.weight.detach().float() for lin in linears])):
                linear.weight.data.copy_(w)
                linear.register_forward_pre_hook(tokens_rounded)
    return model


QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True)
MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=40)


@pytest.mark.parametrize("arch,overrides", [("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {}),
                                            ("Qwen3ForCausalLM", {"head_dim": 32}),
                                            ("Qwen3MoeForCausalLM", QWEN3_MOE), ("MixtralForCausalLM", MIXTRAL)])
@pytest.mark.parametrize("granularity", ["channel", "tensor", "block128"])
def test_fp8_logits_are_the_schemes_own(arch, overrides, granularity, hf_checkpoint, tmp_path, record_property):
    """In float32, where no other rounding differs, the fp8 artifact's logits are those of transformers computing
    the W8A8 scheme itself (``_w8a8``): what the fp8 logits lose against the unquantized model is the scheme's
    rounding, not mxc's (the reported figure, at these models' float32; bfloat16's is in the test above)."""
    ckpt, hf = hf_checkpoint(arch, **overrides)
    art = mxc.build(str(ckpt), out=tmp_path / "fp8", dtype="float32", quant="fp8", quant_granularity=granularity,
                    progress=False, log=lambda m: None)
    got = mxc.load(art).logits(IDS)
    with torch.no_grad():
        plain = hf(IDS).logits
        want = _w8a8(hf, granularity)(IDS).logits
    assert _l2(got, want) < 1e-4 and _rel(got, want) < 1e-4, (_l2(got, want), _rel(got, want))
    assert _l2(want, plain) > 0.02  # the scheme's rounding is there to match
    record_property("report", f"fp8 {granularity:8s} {arch:18s} float32: the W8A8 scheme in transformers puts the "
                              f"logits {_l2(want, plain):.1%} (L2) off; mxc {_l2(got, want):.0e} off the scheme")


def test_fp8_experts(hf_checkpoint, tmp_path):
    """--quant fp8 also stores the expert stacks in fp8 with per-expert row scales."""
    ckpt, _ = hf_checkpoint("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                            norm_topk_prob=True)
    ref = mxc.load(mxc.build(str(ckpt), out=tmp_path / "ref", dtype="bfloat16", progress=False, log=lambda m: None))
    art = mxc.build(str(ckpt), out=tmp_path / "fp8", dtype="bfloat16", quant="fp8", progress=False, log=lambda m: None)
    got, want = mxc.load(art).logits(IDS), ref.logits(IDS)
    assert _l2(got, want) < 0.065 and _rel(got, want) < 0.09, (_l2(got, want), _rel(got, want))
    from safetensors.torch import load_file

    from mxc.loaders.quantize import quantize_fp8

    hf = load_file(ckpt / "model.safetensors")
    expert = "model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"
    with safe_open(art / "weights" / "rank0.safetensors", "pt") as f:
        for i in (0, 1):  # each expert's rows quantized on their own, stored at its index, bit for bit
            gate_up = torch.stack([torch.cat([hf[expert.format(i=i, e=e, p=p)] for p in ("gate", "up")])
                                   for e in range(8)])
            down = torch.stack([hf[expert.format(i=i, e=e, p="down")] for e in range(8)])
            for name, w in (("we_gate_up", gate_up), ("we_down", down)):
                q, scale = quantize_fp8(w, "channel")
                stored = f.get_tensor(f"layers.{i}.{name}")
                assert stored.dtype == torch.float8_e4m3fn and tuple(stored.shape) == tuple(w.shape)
                assert torch.equal(stored.view(torch.uint8), q.view(torch.uint8)), name
                assert torch.equal(f.get_tensor(f"layers.{i}.{name}_scale"), scale), name


def test_fp8_fused_moe_reference_is_the_dequantized_moe():
    """The CPU path's fp8 experts (``torch_ref.fused_moe`` with scales) compute the bf16 MoE of the dequantized
    stacks: each expert's rows times their own scale."""
    from mxc.kernels import moe_ref, torch_ref
    from mxc.loaders.quantize import quantize_fp8

    g = torch.Generator().manual_seed(7)
    E, K, N, T, k = 6, 32, 24, 5, 2
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    wgu = torch.randn(E, 2 * N, K, generator=g) * torch.rand(E, 2 * N, 1, generator=g) * 3  # uneven rows
    wd = torch.randn(E, K, N, generator=g) * torch.rand(E, K, 1, generator=g) * 3
    (qgu, sgu), (qd, sd) = quantize_fp8(wgu, "channel"), quantize_fp8(wd, "channel")
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g).to(torch.bfloat16)
    got = torch_ref.fused_moe(x, weights, ids, qgu, qd, sgu, sd)
    dq = lambda q, s: (q.float() * s[..., None]).to(torch.bfloat16)  # noqa: E731
    want = moe_ref.fused_moe(x, weights, ids, dq(qgu, sgu), dq(qd, sd))
    assert torch.equal(got, want)


def test_quant_specs_in_ir_and_manifest(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    art = mxc.build(str(ckpt), out=tmp_path / "a", quant="fp8", quant_lm_head=True, progress=False,
                    log=lambda m: None)
    graph = (art / "graph.yaml").read_text()
    assert "quant: {scheme: fp8_e4m3, granularity: channel}" in graph and "scale_of: wqkv" in graph
    assert "logits = rms_norm_qlinear(" in graph  # --quant-lm-head (the final norm joined it)
    assert "qkv = rms_norm_qlinear(x, ln1, wqkv, wqkv_scale" in graph and "= rms_norm(" not in graph
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["options"]["quant"] == "fp8"
    assert all(r["kernel"] == f"torch_ref.{r['op']}" for r in manifest["kernels"]
               if r["op"] in ("qlinear", "rms_norm_qlinear"))


def test_tied_lm_head_is_not_quantized(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("Qwen2ForCausalLM", tie_word_embeddings=True)
    with pytest.raises(mxc.MxcError, match="tied to the embedding table"):
        mxc.build(str(ckpt), out=tmp_path / "a", quant="fp8", quant_lm_head=True, progress=False, log=lambda m: None)


def test_tensor_scales_of_merged_weights_are_one_a_part(hf_checkpoint, tmp_path):
    """--quant-granularity tensor over the merged qkv: q, k and v each keep their own tensor scale (amax / 448 of
    the checkpoint's tensor), repeated over its rows, as three separate linears would have."""
    from safetensors.torch import load_file

    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    art = mxc.build(str(ckpt), out=tmp_path / "a", quant="fp8", quant_granularity="tensor", progress=False,
                    log=lambda m: None)
    hf = load_file(ckpt / "model.safetensors")
    stored = load_file(art / "weights" / "rank0.safetensors")
    parts = [hf[f"model.layers.0.self_attn.{n}_proj.weight"].float() for n in "qkv"]
    want = torch.cat([(t.abs().amax() / torch.finfo(torch.float8_e4m3fn).max).expand(t.shape[0]) for t in parts])
    assert len(set(want.tolist())) == 3  # the parts' scales differ, so one scale for all would fail
    torch.testing.assert_close(stored["layers.0.wqkv_scale"], want, rtol=0, atol=0)
