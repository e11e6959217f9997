"""Generation: batching, stopping at EOS, and KV-cache consistency with full-sequence logits."""

from __future__ import annotations

import json

import pytest
import torch

import mxc


def _build(source, out):
    return mxc.build(str(source), out=out, progress=False, log=lambda m: None)


def test_batch_equals_separate_prompts(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    model = mxc.load(_build(ckpt, tmp_path / "art"))
    prompts = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    both = model.generate(prompts, max_new_tokens=12)
    assert both.shape == (2, 12)
    for row in range(2):
        assert torch.equal(model.generate(prompts[row:row + 1], max_new_tokens=12), both[row:row + 1])


def _expected_with_eos(greedy: list[list[int]], eos: list[int], max_new: int) -> list[list[int]]:
    """What stop_at_eos must give, derived from a run without it: stop at the first eos, pad with eos[0]."""
    stops = [next((i for i, t in enumerate(row) if t in eos), None) for row in greedy]
    length = max_new if None in stops else max(stops) + 1
    return [row[:length] if stop is None else row[:stop + 1] + [eos[0]] * (length - stop - 1)
            for row, stop in zip(greedy, stops)]


def _set_eos(ckpt, eos):
    config = json.loads((ckpt / "config.json").read_text())
    config["eos_token_id"] = eos
    (ckpt / "config.json").write_text(json.dumps(config))


def test_stop_at_eos(hf_checkpoint, tmp_path):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    prompts = torch.tensor([[10, 20, 30, 40], [200, 150, 100, 50]])
    plain = mxc.load(_build(ckpt, tmp_path / "plain"))
    assert plain.eos_token_ids == []
    greedy = plain.generate(prompts, max_new_tokens=10).tolist()
    eos = greedy[0][2]  # the token row 0 produces at step 3

    _set_eos(ckpt, eos)
    model = mxc.load(_build(ckpt, tmp_path / "eos"))
    assert model.eos_token_ids == [eos]
    # eos is ignored unless stop_at_eos is asked for
    assert model.generate(prompts, max_new_tokens=10).tolist() == greedy

    single = model.generate(prompts[:1], max_new_tokens=10, stop_at_eos=True)[0].tolist()
    first = greedy[0].index(eos)
    assert first <= 2 and single == greedy[0][:first + 1] and single[-1] == eos

    batch = model.generate(prompts, max_new_tokens=10, stop_at_eos=True).tolist()
    assert batch == _expected_with_eos(greedy, [eos], 10)


def test_stop_at_eos_pads_finished_rows(hf_checkpoint, tmp_path):
    """Row 1 stops at once (its first token is an eos id) and is padded while row 0 runs on."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    prompts = torch.tensor([[10, 20, 30, 40], [200, 150, 100, 50]])
    greedy = mxc.load(_build(ckpt, tmp_path / "plain")).generate(prompts, max_new_tokens=10).tolist()
    eos = [t for t in range(256) if t not in greedy[0]][:1] + [greedy[1][0]]  # eos[0] never produced by row 0
    _set_eos(ckpt, eos)
    model = mxc.load(_build(ckpt, tmp_path / "eos"))
    assert model.eos_token_ids == eos
    out = model.generate(prompts, max_new_tokens=10, stop_at_eos=True).tolist()
    assert out == _expected_with_eos(greedy, eos, 10)
    assert len(out[0]) == 10 and out[1] == [eos[1]] + [eos[0]] * 9


def test_stop_at_eos_of_full_runs_matches_the_host_loop():
    """``_stop_at_eos`` (what the GPU decoder's tokens go through) gives the host loop's result, from full-length
    runs and from runs cut short after every row stopped: padding with eos[0] after a row's first eos of any id."""
    from mxc.runtime.model import _stop_at_eos

    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        b, n = 1 + trial % 4, 1 + trial % 13
        out = torch.randint(0, 12, (b, n), generator=gen)
        eos = [[], [5], [7, 2], [11, 3, 5]][trial % 4]
        want = _expected_with_eos(out.tolist(), eos, n) if eos else out.tolist()
        assert _stop_at_eos(out, eos, None).tolist() == want, (out, eos)
        if eos and len(want[0]) < n:  # every row stopped: the same from any run at least that long
            length = len(want[0]) + trial % (n - len(want[0]))
            assert _stop_at_eos(out[:, :length], eos, None).tolist() == want


@pytest.mark.parametrize("config_pad, gen_config, pad", [
    (7, None, 7),  # no generation_config.json: config.json's pad_token_id
    (7, {"pad_token_id": 9}, 9),  # generation_config.json's
    (7, {}, None),  # generation_config.json names none: config.json's is not read; the first eos id pads
    (-1, None, None),  # not a token id: the first eos id pads
])
def test_stopped_rows_are_padded_as_transformers_generate_pads(config_pad, gen_config, pad, hf_checkpoint, tmp_path):
    import transformers

    ckpt, hf = hf_checkpoint("LlamaForCausalLM")
    prompts = torch.tensor([[10, 20, 30, 40], [200, 150, 100, 50]])
    greedy = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=10, min_new_tokens=10,
                         do_sample=False, eos_token_id=None, pad_token_id=0)[:, 4:].tolist()
    eos = greedy[0][2]
    assert eos not in greedy[0][:2] and eos not in greedy[1][-3:]  # row 0 stops early; row 1 later or never
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "eos_token_id": eos, "pad_token_id": config_pad}))
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    if gen_config is not None:
        (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, **gen_config}))
    model = mxc.load(_build(ckpt, tmp_path / "art"))
    assert model.pad_token_id == pad
    out = model.generate(prompts, max_new_tokens=10, stop_at_eos=True)
    assert out.shape[1] > 3 and out[0, 3:].tolist() == [eos if pad is None else pad] * (out.shape[1] - 3)
    if config_pad >= 0:  # transformers pads with -1 where config.json says so; mxc with the eos id
        ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt).generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=10, do_sample=False)[:, 4:]
        assert torch.equal(out, ref)


def test_kv_cache_matches_full_logits_qwen3(hf_checkpoint, tmp_path):
    ckpt, hf = hf_checkpoint("Qwen3ForCausalLM", head_dim=32)
    model = mxc.load(_build(ckpt, tmp_path / "art"))
    prompts = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(9))
    gen = model.generate(prompts, max_new_tokens=12)
    full = torch.cat([prompts, gen[:, :-1]], dim=1)
    logits = model.logits(full)
    assert torch.equal(logits[:, prompts.shape[1] - 1:].argmax(-1), gen)
    with torch.no_grad():
        ref = hf(full).logits
    assert float((logits - ref).abs().max() / ref.abs().max()) <= 1e-4


def test_eos_of_every_row_is_ignored_without_stop_at_eos(hf_checkpoint, tmp_path):
    ckpt, hf = hf_checkpoint("LlamaForCausalLM")
    prompt = torch.tensor([[10, 20, 30, 40]])
    # reference: transformers' greedy continuation, eos disabled
    ref = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                      min_new_tokens=8)[:, 4:]
    config = json.loads((ckpt / "config.json").read_text())
    config["eos_token_id"] = int(ref[0, 0])  # the first token generated is an eos id
    (ckpt / "config.json").write_text(json.dumps(config))
    model = mxc.load(mxc.build(str(ckpt), out=tmp_path / "art", progress=False, log=lambda m: None))
    out = model.generate(prompt, max_new_tokens=8)
    assert out.shape == (1, 8)
    assert torch.equal(out, ref)


def test_stop_at_eos_stops_where_transformers_generate_does(hf_checkpoint, tmp_path):
    """transformers' generate reads generation_config.json's eos_token_id alone: an id only config.json names does
    not stop it, and generation_config.json's first id pads the rows that stopped (its union with config.json's,
    config.json's first, stopped earlier and padded with another id)."""
    import transformers

    ckpt, hf = hf_checkpoint("LlamaForCausalLM")
    prompts = torch.tensor([[10, 20, 30, 40], [200, 150, 100, 50]])
    greedy = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=10, min_new_tokens=10,
                         do_sample=False, eos_token_id=None, pad_token_id=0)[:, 4:].tolist()
    only_config, stop = greedy[0][1], greedy[0][5]  # row 0's 2nd and 6th tokens
    assert stop not in greedy[0][:5] and only_config not in greedy[0][:1]
    _set_eos(ckpt, only_config)
    unused = next(t for t in range(256) if t not in greedy[0] + greedy[1])
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused, stop]}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt).generate(
        prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=10, do_sample=False)[:, 4:]
    model = mxc.load(_build(ckpt, tmp_path / "art"))
    assert model.eos_token_ids == [unused, stop]
    assert torch.equal(model.generate(prompts, max_new_tokens=10, stop_at_eos=True), ref)


@pytest.mark.parametrize("arch,overrides", [
    ("LlamaForCausalLM", {}),
    ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40)),
    ("MistralForCausalLM", dict(sliding_window=4)),  # the window counted from each row's own positions
], ids=["llama", "qwen3-moe", "mistral-window4"])
def test_prompts_of_different_lengths_match_transformers_generate_of_each(arch, overrides, hf_checkpoint, tmp_path):
    """A list of prompts of different lengths: one prefill of them all, then each row decodes from its own position,
    with no padding. Each row's tokens are transformers' generate of that prompt alone, on the sampling path (top_k
    1) too, and stop_at_eos pads each row after its own first eos; ``logits`` gives each prompt's, as HF's of it."""
    ckpt, hf = hf_checkpoint(arch, **overrides)
    model = mxc.load(_build(ckpt, tmp_path / "art"))
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 2, 5, 1)]
    got = model.generate(prompts, max_new_tokens=12)
    assert got.shape == (4, 12)
    for row, logits, prompt in zip(got, model.logits(prompts), prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
            ref_logits = hf(torch.tensor([prompt])).logits[0]
        assert torch.equal(row, ref[0, len(prompt):]), prompt
        assert float((logits - ref_logits).abs().max() / ref_logits.abs().max()) <= 1e-4, prompt
    assert torch.equal(model.generate(prompts, max_new_tokens=12, temperature=1.0, top_k=1, seed=0), got)
    assert torch.equal(model.generate(tuple(torch.tensor(p) for p in prompts), max_new_tokens=12), got)

    eos = int(got[1, 3])
    model.eos_token_ids = [eos]
    out = model.generate(prompts, max_new_tokens=12, stop_at_eos=True).tolist()
    assert out == _expected_with_eos(got.tolist(), [eos], 12)
