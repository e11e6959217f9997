"""Sampling: seeded reproducibility, degenerate settings equal greedy, and parity with HF's warpers."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import mxc
from mxc.errors import MxcError
from mxc.runtime.sampling import sample

PROMPT = [[3, 14, 15, 92, 65]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    art = mxc.build("llama.yaml", out=tmp_path_factory.mktemp("sampling") / "art", progress=False,
                    log=lambda m: None)
    return mxc.load(art)


def test_seeded_sampling_is_reproducible(model):
    a = model.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=1)
    b = model.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=1)
    c = model.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=2)
    assert a.shape == (1, 16)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, model.generate(PROMPT, max_new_tokens=16))  # near-uniform logits: not greedy
    d = model.generate(PROMPT, max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    assert torch.equal(d, model.generate(PROMPT, max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=7))


def test_top_k_1_and_tiny_top_p_equal_greedy(model):
    greedy = model.generate(PROMPT, max_new_tokens=16)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=16, temperature=1.0, top_k=1, seed=3), greedy)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=16, temperature=1.0, top_p=1e-6, seed=3), greedy)


def _hf_warp(logits, temperature, top_k, top_p):
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores


def _sample_probs(monkeypatch, logits, temperature, top_k, top_p):
    """(the probabilities ``sample`` draws from, the tokens it draws): ``torch.multinomial`` spied on."""
    seen = []
    real = torch.multinomial

    def spy(probs, *args, **kwargs):
        seen.append(probs.clone())
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", spy)
    tokens = sample(logits.clone(), temperature, top_k, top_p, torch.Generator().manual_seed(0))
    monkeypatch.undo()
    (probs,) = seen
    return probs, tokens


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, None, None), (0.7, 10, None), (1.3, None, 0.9), (0.5, 50, 0.8), (1.0, 3, 0.99), (2.0, 1, None),
    (1.0, None, 0.3), (0.9, 255, 0.5), (1.0, 300, None), (1.0, None, 1.0),
    (1.0, None, 1e-9),  # 1 - top_p rounds to 1.0 in float32: only the kept top token is left
])
def test_sample_keeps_the_same_tokens_as_hf_warpers(monkeypatch, temperature, top_k, top_p):
    logits = torch.randn(6, 256, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :4] = logits[0].max() + 1  # ties at the top
    probs, tokens = _sample_probs(monkeypatch, logits, temperature, top_k, top_p)
    ref = _hf_warp(logits, temperature, top_k, top_p)
    keep = torch.isfinite(ref)
    assert torch.equal(probs > 0, keep)
    torch.testing.assert_close(probs, ref.softmax(-1))
    assert keep.gather(1, tokens[:, None]).all()


def test_top_p_removes_tokens_whose_tail_mass_equals_one_minus_top_p(monkeypatch):
    """Equal logits give exact probabilities (k/8 a tail): HF removes a token whose cumulative tail mass is
    exactly 1 - top_p (``<=``), so top_p = 0.5 keeps 4 of 8; random logits never meet that boundary."""
    logits = torch.zeros(2, 8)
    probs, _ = _sample_probs(monkeypatch, logits, 1.0, None, 0.5)
    keep = torch.isfinite(_hf_warp(logits, 1.0, None, 0.5))
    assert torch.equal((probs > 0).sum(-1), keep.sum(-1))
    torch.testing.assert_close(probs[probs > 0], torch.full((int((probs > 0).sum()),), 1 / keep.sum(-1)[0].item()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_sampled_in_float32_as_hf_does(monkeypatch, dtype):
    """The GPU's logits arrive in the model dtype; HF casts the next-token logits to float32 before its warpers."""
    logits = (torch.randn(6, 4096, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    probs, _ = _sample_probs(monkeypatch, logits, 0.7, 50, 0.9)
    ref = _hf_warp(logits.float(), 0.7, 50, 0.9)
    assert torch.equal(probs > 0, torch.isfinite(ref))
    torch.testing.assert_close(probs, ref.softmax(-1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_logits_that_are_not_finite_are_one_line(bad):
    """An fp16 model whose activations overflow gives NaN or infinite logits: sampling said torch's "probability
    tensor contains either inf, nan or element < 0" in a traceback. A row of -inf alone is no sampling error."""
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = bad
    if bad == float("-inf"):
        assert sample(logits, 0.7).shape == (2,)
        return
    with pytest.raises(MxcError, match=r"^the model's logits hold NaN or infinite values .* rebuild with a wider "
                                       r"--dtype \(bfloat16 or float32\)$"):
        sample(logits, 0.7, top_k=5, top_p=0.9)


def test_top_p_1_is_no_filter(model):
    TopPLogitsWarper(1.0)  # HF takes it too
    assert torch.equal(model.generate(PROMPT, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=5),
                       model.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=5))


@pytest.mark.parametrize("seed", [2**64 - 1, 2**64, -2**63, -2**63 - 1])
def test_seeds_are_taken_exactly_where_torch_takes_them(seed):
    from mxc.errors import MxcError
    from mxc.runtime.sampling import check_generate_args

    try:
        torch.Generator().manual_seed(seed)
    except (RuntimeError, ValueError):
        with pytest.raises(MxcError, match="seed"):
            check_generate_args(1, 1.0, seed=seed)
    else:
        check_generate_args(1, 1.0, seed=seed)


@pytest.mark.parametrize("temperature", [1e-39, 1e-46, 5e-324])
@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.5}])
def test_a_temperature_past_float32_s_range_samples_the_top_token(temperature, filters):
    """A positive temperature that is 0 in float32 (1e-46) divided the top logit 0 / 0 (NaN: multinomial raised);
    any temperature that small leaves only the top token, as greedy does."""
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    got = sample(logits, temperature, generator=torch.Generator().manual_seed(1), **filters)
    assert torch.equal(got, logits.argmax(dim=-1))
