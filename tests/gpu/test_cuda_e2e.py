"""End to end on the GPU: build --target cuda, load (precompiled cubins, CUDA graphs), compare with HF.

bf16 tolerance: logits within 3% of the logits' scale; each greedy token is
HF bf16's choice on the same sequence but for ties (``greedy_check``),
and the tokens equal mxc's own JIT path's (``rebuild_kernels=True``).
"""

from __future__ import annotations

import pytest
import torch

import mxc

CASES = [
    ("LlamaForCausalLM", {"hidden_size": 128, "intermediate_size": 256}),
    ("Qwen3ForCausalLM", {"hidden_size": 128, "intermediate_size": 256, "head_dim": 64}),
    ("Qwen2ForCausalLM", {"hidden_size": 128, "intermediate_size": 256, "tie_word_embeddings": True}),
    ("MistralForCausalLM", {"hidden_size": 128, "intermediate_size": 256, "sliding_window": 8}),
    ("LlamaForCausalLM", {"hidden_size": 128, "intermediate_size": 256, "num_key_value_heads": 1,
                          "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 32}}),
    ("LlamaForCausalLM", {"hidden_size": 128, "intermediate_size": 256, "head_dim": 80}),  # masked head lanes
    ("Qwen3ForCausalLM", {"hidden_size": 128, "intermediate_size": 256, "head_dim": 96}),
]


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("arch,overrides", CASES, ids=[c[0] + str(i) for i, c in enumerate(CASES)])
def test_cuda_artifact_matches_hf(arch, overrides, hf_checkpoint, greedy_check, tmp_path):
    ckpt, hf = hf_checkpoint(arch, **overrides)
    art = mxc.build(str(ckpt), out=tmp_path / "art", target="cuda", dtype="bfloat16", max_batch=4,
                    max_seq_len=64, progress=False, log=lambda m: None)
    assert (art / "code" / "kernels" / "index.json").is_file()
    model = mxc.load(art, device="cuda")
    hf = hf.to(device="cuda", dtype=torch.bfloat16)

    ids = torch.randint(0, 256, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids.cuda()).logits.float().cpu()
    assert _rel(model.logits(ids).cpu(), ref) < 3e-2

    ours = model.generate(ids, max_new_tokens=16)
    greedy_check(ids, ours, lambda seq: hf(seq.cuda()).logits)

    jit = mxc.load(art, device="cuda", rebuild_kernels=True)
    assert torch.equal(jit.generate(ids, max_new_tokens=16), ours)


@pytest.mark.parametrize("arch,overrides", [("LlamaForCausalLM", {}),
                                            ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                                                     "moe_intermediate_size": 64})],
                         ids=["llama", "qwen3-moe"])
def test_float16_checkpoint_builds_in_float16_by_default(arch, overrides, hf_checkpoint, greedy_check, tmp_path):
    """A cuda build without --dtype of a checkpoint whose config.json says float16 runs in float16 (as transformers
    loads it): every kernel's float16 variant, against HF in float16."""
    ckpt, hf = hf_checkpoint(arch, dtype=torch.float16, hidden_size=128, intermediate_size=256, **overrides)
    art = mxc.build(str(ckpt), out=tmp_path / "art", target="cuda", max_batch=4, max_seq_len=64, progress=False,
                    log=lambda m: None)
    model = mxc.load(art)
    assert model.manifest["options"]["dtype"] == "float16"
    hf = hf.to(device="cuda")
    ids = torch.randint(0, 256, (3, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids.cuda()).logits.float().cpu()
    assert _rel(model.logits(ids).cpu(), ref) < 1e-2
    greedy_check(ids, model.generate(ids, max_new_tokens=16), lambda seq: hf(seq.cuda()).logits)


def test_decode_batch_buckets_and_sampling(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)
    art = mxc.build(str(ckpt), out=tmp_path / "art", target="cuda", dtype="bfloat16", max_batch=8,
                    max_seq_len=64, progress=False, log=lambda m: None)
    model = mxc.load(art, device="cuda")
    ids = torch.randint(0, 256, (5, 7), generator=torch.Generator().manual_seed(2))
    batched = model.generate(ids, max_new_tokens=10)  # bucket 8, three padding rows
    for b in range(5):
        assert torch.equal(model.generate(ids[b:b + 1], max_new_tokens=10), batched[b:b + 1])
    a = model.generate(ids, max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    b = model.generate(ids, max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert torch.equal(a, b)
    with pytest.raises(mxc.MxcError, match="max-seq-len"):
        model.generate(ids, max_new_tokens=60)
    # every bucket's graph dropped and captured again (bench/profile_step.plain_launches does this)
    # gives the same tokens; re-capturing into the freed graphs' pool tripped torch's allocator
    model._decoder.drop_graphs()
    assert torch.equal(model.generate(ids, max_new_tokens=10), batched)
    assert torch.equal(model.generate(ids[:1], max_new_tokens=10), batched[:1])


def test_greedy_graph_matches_host_loop(hf_checkpoint, tmp_path, monkeypatch):
    """The greedy graph (argmax, output column, positions, cache rows and lengths advanced on the device)
    gives the host loop's tokens: one row, a padded bucket, one new token, a generation that fills the cache,
    twice in a row and after a sampled run (both graphs of a bucket in one memory pool)."""
    from mxc.runtime import decode_graphs

    ckpt, _ = hf_checkpoint("Qwen3ForCausalLM", hidden_size=128, intermediate_size=256, head_dim=64)
    art = mxc.build(str(ckpt), out=tmp_path / "art", target="cuda", dtype="bfloat16", max_batch=8,
                    max_seq_len=64, progress=False, log=lambda m: None)
    model = mxc.load(art, device="cuda")
    ids = torch.randint(0, 256, (5, 7), generator=torch.Generator().manual_seed(8))
    cases = [(ids[:1], 12), (ids, 12), (ids[:3], 1), (ids[:2], 64 - 7)]
    assert decode_graphs.GREEDY_IN_GRAPH
    got = [model.generate(rows, max_new_tokens=n) for rows, n in cases]
    model.generate(ids, max_new_tokens=5, temperature=0.8, seed=1)
    again = model.generate(ids, max_new_tokens=12)
    assert model._decoder.buckets[8].greedy_graph is not None and model._decoder.buckets[8].graph is not None
    monkeypatch.setattr(decode_graphs, "GREEDY_IN_GRAPH", False)
    want = [model.generate(rows, max_new_tokens=n) for rows, n in cases]
    for (rows, n), a, b in zip(cases, got, want):
        assert a.shape == (rows.shape[0], n) and torch.equal(a, b), (n, a, b)
    assert torch.equal(again, want[1])


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy-graph", "sampled"])
def test_decoder_ends_once_every_row_stopped(temperature, hf_checkpoint, tmp_path, monkeypatch):
    """With stop ids the decoder ends at the first look (every ``STOP_CHECK_EVERY`` steps) after its last row
    produced one, its tokens the full run's first columns; ``stop_at_eos`` gives the host loop's padding."""
    from mxc.runtime import decode_graphs
    from mxc.runtime.model import _stop_at_eos

    monkeypatch.setattr(decode_graphs, "STOP_CHECK_EVERY", 4)
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)
    art = mxc.build(str(ckpt), out=tmp_path / "art", target="cuda", dtype="bfloat16", max_batch=4,
                    max_seq_len=64, progress=False, log=lambda m: None)
    model = mxc.load(art, device="cuda")
    ids = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(12))
    seed = 7 if temperature else None  # greedy decoding takes no seed
    full = model.generate(ids, max_new_tokens=40, temperature=temperature, seed=seed)
    eos = sorted({int(full[r, 2 + 3 * r]) for r in range(3)})  # row r has one by column 2 + 3r
    first = [min(c for c in range(40) if int(full[r, c]) in eos) for r in range(3)]
    looks = -(-(max(first) + 1) // 4) * 4  # tokens when a look first sees every row stopped
    sampling = dict(temperature=temperature, top_k=None, top_p=None)
    with torch.inference_mode():  # as model.generate calls it
        raw = model._decoder.generate(ids.cuda(), 40, sampling, torch.Generator("cuda").manual_seed(7), stop_ids=eos)
    assert raw.shape == (3, min(looks, 40)) and torch.equal(raw.cpu(), full[:, :raw.shape[1]])
    model.eos_token_ids, model.pad_token_id = eos, min(set(range(256)) - set(eos))  # a pad id of the checkpoint's
    assert torch.equal(model.generate(ids, max_new_tokens=40, temperature=temperature, seed=seed, stop_at_eos=True),
                       _stop_at_eos(full, eos, model.pad_token_id))


@pytest.mark.parametrize("arch,overrides", [("LlamaForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": 8})],
                         ids=["llama", "mistral-window8"])
def test_prompts_of_different_lengths(arch, overrides, hf_checkpoint, greedy_check, tmp_path):
    """Prompts of 13, 3, 8 and 1 tokens in one call: one prefill of them all, each row decoding from its own position
    (the greedy graph's and the sampling loop's), each row HF bf16's greedy choice on its own sequence (ties aside)."""
    ckpt, hf = hf_checkpoint(arch, hidden_size=128, intermediate_size=256, **overrides)
    art = mxc.build(str(ckpt), out=tmp_path / "art", target="cuda", dtype="bfloat16", max_batch=4,
                    max_seq_len=64, progress=False, log=lambda m: None)
    model = mxc.load(art)
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (13, 3, 8, 1)]
    got = model.generate(prompts, max_new_tokens=20)
    assert got.shape == (4, 20)
    for prompt, row, logits in zip(prompts, got, model.logits(prompts)):
        greedy_check(prompt[None], row[None], lambda seq: hf(seq.cuda()).logits)
        with torch.no_grad():
            assert _rel(logits.cpu(), hf(prompt[None].cuda()).logits[0].float().cpu()) < 3e-2
    # the sampling loop at top_k 1 picks among exactly tied logits (transformers' top-k keeps ties) where the greedy
    # graph takes the first: on an H100 this Mistral's first row tied (tokens 154 and 255), so it too is checked
    # against HF, ties aside, not against the greedy run
    sampled = model.generate(prompts, max_new_tokens=20, temperature=1.0, top_k=1, seed=0)
    assert sampled.shape == (4, 20)
    for prompt, row in zip(prompts, sampled):
        greedy_check(prompt[None], row[None], lambda seq: hf(seq.cuda()).logits)


def test_buckets_past_pdl_max_run_plain(hf_checkpoint, tmp_path):
    """Buckets above ``PDL_MAX_BUCKET`` rows are captured without the PDL attribute: the same tokens
    as one row at a time (bucket 1, with PDL) for 12 rows in bucket 16."""
    from mxc.runtime.decode_graphs import PDL_MAX_BUCKET

    ckpt, _ = hf_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)
    art = mxc.build(str(ckpt), out=tmp_path / "art", target="cuda", dtype="bfloat16", max_batch=16,
                    max_seq_len=64, progress=False, log=lambda m: None)
    model = mxc.load(art)  # no device: a cuda artifact's default is the current GPU
    assert model.device.type == "cuda" and model._launcher.pdl and PDL_MAX_BUCKET < 12
    ids = torch.randint(0, 256, (12, 5), generator=torch.Generator().manual_seed(6))
    batched = model.generate(ids, max_new_tokens=8)
    for b in (0, 5, 11):
        assert torch.equal(model.generate(ids[b:b + 1], max_new_tokens=8), batched[b:b + 1])


def test_pdl_artifact_matches(hf_checkpoint, tmp_path):
    """--pdl changes when kernels start, not what they compute: logits and tokens equal the plain build's,
    eagerly (prefill) and from the decode graphs, at batch 1 and in a padded bucket."""
    ckpt, _ = hf_checkpoint("Qwen2ForCausalLM", hidden_size=128, intermediate_size=256)
    kw = dict(target="cuda", dtype="bfloat16", max_batch=4, max_seq_len=64, progress=False, log=lambda m: None)
    plain = mxc.load(mxc.build(str(ckpt), out=tmp_path / "plain", **kw), device="cuda")
    pdl = mxc.load(mxc.build(str(ckpt), out=tmp_path / "pdl", pdl=True, **kw), device="cuda")
    ids = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(pdl.logits(ids), plain.logits(ids))
    for rows in (ids[:1], ids):
        assert torch.equal(pdl.generate(rows, max_new_tokens=16), plain.generate(rows, max_new_tokens=16))


@pytest.mark.parametrize("arch,overrides,quant", [
    ("LlamaForCausalLM", {"hidden_size": 128, "intermediate_size": 256}, None),
    ("LlamaForCausalLM", {"hidden_size": 128, "intermediate_size": 256}, "fp8"),
    ("Qwen3MoeForCausalLM", {"hidden_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 64, "norm_topk_prob": True}, None),
], ids=["llama", "llama-fp8", "qwen3-moe"])
def test_prefill_graphs_match_eager(arch, overrides, quant, hf_checkpoint, tmp_path):
    """A one-prompt prefill of up to ``--prefill-graphs`` tokens replays its length bucket's CUDA graph, the
    prompt padded by a second sequence in the scratch slot: the same logits and slot-0 cache rows as the eager
    prefill, for prompts at both ends of three buckets, several prompts per bucket (the inputs refilled in
    place), and the same generated tokens as a build without the graphs."""
    ckpt, _ = hf_checkpoint(arch, **overrides)
    kw = dict(target="cuda", dtype="bfloat16", quant=quant, max_batch=2, max_seq_len=64, progress=False,
              log=lambda m: None)
    model = mxc.load(mxc.build(str(ckpt), out=tmp_path / "art", **kw), device="cuda")
    dec = model._decoder
    assert sorted(dec.prefill_graphs) == [16, 32, 64]
    g = torch.Generator().manual_seed(5)
    tol = 5e-2 if quant else 1e-2  # fp8: another kernel's last bf16 bit can move an activation by one e4m3 step
    for s in (9, 16, 12, 17, 32, 33, 64, 1):
        ids = torch.randint(0, 256, (1, s), generator=g).cuda()
        want = dec.prefill(ids, graphs=False).float()
        rows = [(k[0, :s].clone(), v[0, :s].clone()) for k, v in zip(dec.k_cache, dec.v_cache)]
        for cache in (*dec.k_cache, *dec.v_cache):
            cache[0].zero_()
        got = dec.prefill(ids).float()
        assert _rel(got, want) < tol, (s, _rel(got, want))
        for (k, v), k_new, v_new in zip(rows, dec.k_cache, dec.v_cache):
            assert _rel(k_new[0, :s], k) < tol and _rel(v_new[0, :s], v) < tol, s
            assert not k_new[0, s:].any() and not v_new[0, s:].any(), s  # the padding wrote no prompt rows
    assert all(bucket.graph is not None for bucket in dec.prefill_graphs.values())

    eager = mxc.load(mxc.build(str(ckpt), out=tmp_path / "eager", prefill_graphs=0, **kw), device="cuda")
    assert not eager._decoder.prefill_graphs
    for s in (13, 16, 40):  # eager and graph in one power-of-two bucket: the same kernels, the same tokens
        ids = torch.randint(0, 256, (1, s), generator=g)
        assert torch.equal(model.generate(ids, max_new_tokens=8), eager.generate(ids, max_new_tokens=8)), s


def test_prefill_graphs_step_past_512_tokens(hf_checkpoint, tmp_path):
    """Past 512 tokens the prompt buckets step by 256: a prompt of 600 tokens replays the 768 bucket's graph
    (168 padding tokens in the scratch slot) and one of 1024 the 1024 bucket's, with the eager prefill's logits."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256, max_position_embeddings=2048)
    model = mxc.load(mxc.build(str(ckpt), out=tmp_path / "art", target="cuda", dtype="bfloat16", max_batch=1,
                               max_seq_len=1100, prefill_graphs=1024, progress=False, log=lambda m: None),
                     device="cuda")
    dec = model._decoder
    assert sorted(dec.prefill_graphs)[-3:] == [512, 768, 1024]
    g = torch.Generator().manual_seed(7)
    for s in (600, 1024):
        ids = torch.randint(0, 256, (1, s), generator=g).cuda()
        want = dec.prefill(ids, graphs=False).float()
        got = dec.prefill(ids).float()
        assert _rel(got, want) < 1e-2, (s, _rel(got, want))
    assert dec.prefill_graphs[768].graph is not None and dec.prefill_graphs[1024].graph is not None


def test_a_kv_cache_larger_than_the_gpu_is_refused_at_load(tmp_path):
    """--max-batch x --max-seq-len sized past the GPU's memory (under the 2**31 KV rows a build takes):
    ``mxc.load`` says so in one line (no OOM trace)."""
    art = mxc.build("llama.yaml", out=tmp_path / "a", target="cuda", max_batch=2000, max_seq_len=1_000_000,
                    progress=False, log=lambda m: None)
    with pytest.raises(mxc.MxcError, match=r"the KV cache of --max-batch 2000 x --max-seq-len 1000000 takes "
                                           r"[0-9.]+ GiB, more than the [0-9.]+ GiB free"):
        mxc.load(art, device="cuda")
