"""Input checks of ``Model.logits`` / ``Model.generate``: one-line MxcErrors naming the bad value."""

from __future__ import annotations

import pytest
import torch

import mxc
from mxc.errors import MxcError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    art = mxc.build("llama.yaml", out=tmp_path_factory.mktemp("inputs") / "art", progress=False, log=lambda m: None)
    return mxc.load(art)


@pytest.mark.parametrize("bad", [-1, 256, 10_000])
def test_token_outside_vocab(model, bad):
    assert model.vocab_size == 256
    ids = [[1, 2, bad, 3]]
    with pytest.raises(MxcError, match=rf"token id {bad} at \[0, 2\] is outside the vocabulary \(0\.\.255\)"):
        model.logits(ids)
    with pytest.raises(MxcError, match=rf"token id {bad} at \[0, 2\] is outside the vocabulary"):
        model.generate(ids, max_new_tokens=2)
    with pytest.raises(MxcError, match=rf"token id {bad} "):
        model.generate(torch.tensor(ids), max_new_tokens=2, temperature=0.7, seed=0)


@pytest.mark.parametrize("ids", [[1, 2, 3], torch.tensor([1, 2, 3]), [[]], torch.ones(1, 2, 3, dtype=torch.long),
                                 torch.ones(1, 3), torch.ones(0, 2, dtype=torch.long), [["a"]]])
def test_shape_and_dtype_refused(model, ids):
    with pytest.raises(MxcError, match=r"input_ids must be a \[batch, seq\] (integer|int64 or int32) tensor"):
        model.logits(ids)
    with pytest.raises(MxcError, match=r"input_ids must be a \[batch, seq\] (integer|int64 or int32) tensor"):
        model.generate(ids, max_new_tokens=2)


def test_edge_ids_accepted(model):
    assert model.logits([[0, 255]]).shape == (1, 2, 256)
    assert model.logits(torch.tensor([[0, 255]], dtype=torch.int32)).shape == (1, 2, 256)


@pytest.mark.parametrize("kw, pattern", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"), (dict(temperature=float("nan")), "temperature"),
    # infinite: every logit divided to 0, a uniform draw that ignores top_k and top_p
    (dict(temperature=float("inf"), top_k=1), "temperature must be a finite number >= 0, got inf"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k must be an integer >= 1"), (dict(top_k=2.5), "top_k"),
    (dict(seed=10**23, temperature=1.0), r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
])
def test_bad_generation_settings(model, kw, pattern):
    args = {"max_new_tokens": 2, **kw}
    with pytest.raises(MxcError, match=pattern):
        model.generate([[1, 2]], **args)


def test_cuda_decoder_capacity_counts_the_new_tokens(model, monkeypatch):
    """On a GPU the KV cache holds --max-batch x --max-seq-len rows: a generation needs prompt + new tokens of them,
    and is refused before any work when they do not fit (the kernels would write past the cache)."""
    import types

    made = []

    def generate(ids, n, *args, lens, **kwargs):
        made.append((tuple(ids.shape), lens, n))
        return torch.zeros(len(lens), n, dtype=torch.int64)

    monkeypatch.setattr(model, "_decoder", types.SimpleNamespace(max_batch=2, max_len=16, generate=generate))
    assert model.generate([[1] * 10] * 2, max_new_tokens=6).shape == (2, 6)  # 16 rows: a full slot
    for ids, n in [([[1] * 10], 7), ([[1] * 16], 1), ([[1] * 4] * 3, 2), ([[1] * 3, [1] * 10], 7)]:
        with pytest.raises(MxcError, match=r"exceeds what the artifact was built for \(--max-batch 2, --max-seq-len "
                                           r"16\)"):
            model.generate(ids, max_new_tokens=n)
    with pytest.raises(MxcError, match=r"batch 1 x 17 tokens exceeds"):
        model.logits([[1] * 17])
    with pytest.raises(MxcError) as e:
        model.generate([[1] * 4] * 3, max_new_tokens=2)
    assert str(e.value) == ("batch 3 x 6 tokens (4 prompt + 2 new) exceeds what the artifact was built for "
                            "(--max-batch 2, --max-seq-len 16); run at most 2 sequences a call, or rebuild with "
                            "--max-batch 3")
    assert model.generate([[1] * 3, [1] * 10], max_new_tokens=6).shape == (2, 6)  # the longest fills its slot
    assert made == [((20,), [10, 10], 6), ((13,), [3, 10], 6)]


def test_cpu_generation_is_held_to_the_max_seq_len_built_for(model, monkeypatch):
    """On the CPU too, prompt + new tokens beyond the artifact's --max-seq-len (512 for the bundled tiny model) are
    refused in one line naming both counts and the limit, before the KV cache is allocated (a billion new tokens
    would ask the allocator for gigabytes); the limit itself is accepted."""
    assert model._decoder is None and model.manifest["options"]["max_seq_len"] == 512
    allocated = []
    monkeypatch.setattr(model, "new_cache", lambda b, n: allocated.append(n))
    for n, left in [(2000, 510), (10**9, 510)]:
        with pytest.raises(MxcError) as e:
            model.generate([[1, 2]], max_new_tokens=n)
        assert str(e.value) == (f"batch 1 x {n + 2} tokens (2 prompt + {n} new) exceeds what the artifact was built "
                                f"for (--max-seq-len 512); ask for at most {left} new tokens, or rebuild with "
                                f"--max-seq-len {n + 2}")
    with pytest.raises(MxcError, match=r"batch 1 x 513 tokens \(512 prompt \+ 1 new\) exceeds .*; give at most 511 "
                                       r"prompt tokens, or rebuild with --max-seq-len 513"):
        model.generate([[1] * 512], max_new_tokens=1)
    with pytest.raises(MxcError, match=r"batch 1 x 513 tokens exceeds what the artifact was built for "
                                       r"\(--max-seq-len 512\); give at most 512 prompt tokens"):
        model.logits([[1] * 513])
    assert allocated == []
    monkeypatch.undo()
    assert model.generate([[1] * 510], max_new_tokens=2).shape == (1, 2)  # 512: the limit itself


def test_capacity_advice_is_only_what_can_be_done():
    """No rebuild to a length no KV cache can have (2**70 new tokens), and no 'at most 0 prompt tokens' for an
    artifact built (before that was refused) with --max-seq-len 1."""
    from mxc.runtime.model import check_capacity

    with pytest.raises(MxcError) as e:
        check_capacity(1, 2, 2**70, 512)
    assert str(e.value).endswith("; ask for at most 510 new tokens")
    with pytest.raises(MxcError) as e:
        check_capacity(1, 1, 1, 1)
    assert str(e.value).endswith("(--max-seq-len 1); rebuild with --max-seq-len 2 or more")


def test_a_cpu_kv_cache_past_the_host_s_memory_is_refused(model, monkeypatch):
    """The CPU path allocates its cache per call: one past the memory available is refused in one line, before
    zeroing it would have the process killed (an artifact built with a huge --max-seq-len lets such a call in)."""
    import mxc.runtime.model as runtime_model

    kv = model._kv
    need = 2 * kv["layers"] * (20 * kv["kv_heads"] * kv["head_dim"]) * model.dtype.itemsize  # 2 prompt + 18 new
    monkeypatch.setattr(runtime_model, "host_memory_available", lambda: need - 1)
    with pytest.raises(MxcError, match=r"^the KV cache of 1 x 20 tokens takes .+, more than the .+ of memory "
                                       r"available; give a shorter prompt or fewer new tokens$"):
        model.generate([[1, 2]], max_new_tokens=18)
    monkeypatch.setattr(runtime_model, "host_memory_available", lambda: need)
    assert model.generate([[1, 2]], max_new_tokens=18).shape == (1, 18)
    assert runtime_model.host_memory_available.__module__  # the patched one ran: the real one reads /proc/meminfo
    monkeypatch.undo()
    available = runtime_model.host_memory_available()
    assert available is None or available > 0


def test_seed_zero_is_a_seed(model):
    """``seed=0`` seeds the draw like any other seed: the global RNG's state does not matter."""
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        runs.append(model.generate([[1, 2, 3]], max_new_tokens=8, temperature=1.0, seed=0))
    assert torch.equal(*runs)


def test_cuda_decoder_stops_at_eos_only_when_asked(model, monkeypatch):
    """The GPU decoder is told the eos ids only under ``stop_at_eos``, and its tokens then go through the same rule as
    the host loop's (``generate``'s docstring): after a row's first eos, eos[0]; trimmed once every row stopped."""
    import types

    asked = []

    def generate(ids, n, sampling, gen, agree, stop_ids=(), lens=None):
        asked.append(tuple(stop_ids))
        return torch.tensor([[4, 6, 9], [8, 9, 7]])  # row 0 stops at its 2nd token, row 1 at its 2nd

    monkeypatch.setattr(model, "_decoder", types.SimpleNamespace(max_batch=2, max_len=16, generate=generate))
    monkeypatch.setattr(model, "eos_token_ids", [6, 9])
    assert model.generate([[1, 2]] * 2, max_new_tokens=3).tolist() == [[4, 6, 9], [8, 9, 7]]
    assert model.generate([[1, 2]] * 2, max_new_tokens=3, stop_at_eos=True).tolist() == [[4, 6], [8, 9]]
    assert asked == [(), (6, 9)]


def test_stop_at_eos_without_eos_ids_runs_to_the_end(model, monkeypatch):
    """A model without eos ids never stops early, whatever the tokens (here every sampled token is 0)."""
    from mxc.runtime import model as model_mod

    monkeypatch.setattr(model, "eos_token_ids", [])
    monkeypatch.setattr(model_mod, "sample", lambda logits, *a: torch.zeros(logits.shape[0], dtype=torch.int64))
    assert model.generate([[1, 2]] * 2, max_new_tokens=4, stop_at_eos=True).tolist() == [[0] * 4] * 2


@pytest.mark.parametrize("ids, pattern", [(None, r"input_ids must be a \[batch, seq\] integer tensor"),
                                          (torch.ones(1, 2, dtype=torch.long, device="meta"), r"meta device"),
                                          (torch.ones(1, 2, dtype=torch.bool), r"integer tensor .* torch.bool"),
                                          (torch.ones(1, 2), r"integer tensor .* torch.float32")])
def test_ids_no_tensor_can_be_made_of_are_named(model, ids, pattern):
    """None (torch raised a RuntimeError), ids on the meta device (.item() failed), and bool or float tensors."""
    with pytest.raises(MxcError, match=pattern):
        model.logits(ids)


@pytest.mark.parametrize("kw", [dict(top_k=5), dict(top_p=0.9), dict(seed=0), dict(top_k=5, temperature=0.0)])
def test_sampling_arguments_need_a_temperature(model, kw):
    """Greedy decoding would ignore them (as the CLI already said)."""
    name = next(k for k in kw if k != "temperature")
    with pytest.raises(MxcError, match=rf"^{name} needs temperature > 0 \(greedy decoding does not sample\)$"):
        model.generate([[1, 2]], max_new_tokens=2, **kw)


def test_a_tiny_temperature_samples_the_top_token(model):
    """logits / 1e-39 overflowed to inf and multinomial failed; from the row's top down it is greedy."""
    from fractions import Fraction

    greedy = model.generate([[1, 2, 3]], max_new_tokens=3)
    assert torch.equal(model.generate([[1, 2, 3]], max_new_tokens=3, temperature=1e-39, seed=0), greedy)
    assert model.generate([[1, 2, 3]], max_new_tokens=3, temperature=Fraction(7, 10), seed=0).shape == (1, 3)


def test_eos_token_ids_are_the_models_own_copy(model):
    model.eos_token_ids.append(99)
    assert 99 not in model.manifest["runtime"]["eos_token_id"]
    model.eos_token_ids.pop()


def test_calls_from_threads_take_turns(model):
    """One forward at a time in the process (the launcher is process-wide; a GPU model's cache and graphs are its
    own): two threads calling one model never overlap inside the forward, and each gets its own answer."""
    import threading
    import time

    inside, overlaps, forward = [0], [], model._forward

    def tracked(*args):
        inside[0] += 1
        overlaps.append(inside[0])
        time.sleep(0.01)
        try:
            return forward(*args)
        finally:
            inside[0] -= 1

    want = {n: model.logits([[n, n + 1]]) for n in range(4)}
    model._forward = tracked
    try:
        got = {}
        threads = [threading.Thread(target=lambda n=n: got.__setitem__(n, model.logits([[n, n + 1]]))) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        model._forward = forward
    assert max(overlaps) == 1 and all(torch.equal(got[n], want[n]) for n in range(4))


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.uint32, torch.uint64])
def test_ids_of_any_integer_dtype_are_accepted(model, dtype):
    """Token ids of any integer dtype are the same ids as int64's (checked against the vocabulary first)."""
    ids = [[1, 100, 127]]
    want = model.logits(ids)
    assert torch.equal(model.logits(torch.tensor(ids).to(dtype)), want)
    assert torch.equal(model.generate(torch.tensor(ids).to(dtype), max_new_tokens=2), model.generate(ids, 2))


def test_ids_past_the_vocabulary_are_named_by_their_value_in_any_integer_dtype(model):
    """uint8 200 was compared with 256 as a uint8 (wrapping), uint16 to uint64 could not be compared at all; a
    uint64 id past int64's range is named as it is, not as the negative int64 it reads as."""
    import numpy as np

    with pytest.raises(MxcError, match=r"token id 300 at \[0, 1\] is outside the vocabulary \(0\.\.255\)"):
        model.logits(torch.tensor([[1, 300]], dtype=torch.int16))
    with pytest.raises(MxcError, match=r"token id 300 at \[0, 1\] is outside the vocabulary"):
        model.logits(torch.tensor([[1, 300]]).to(torch.uint32))
    with pytest.raises(MxcError, match=rf"token id {2**64 - 1} at \[0, 0\] is outside the vocabulary"):
        model.logits(torch.from_numpy(np.array([[2**64 - 1, 1]], dtype=np.uint64)))


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested", "jagged"])
def test_ids_of_other_layouts_are_refused(model, layout):
    """A sparse tensor failed in a NotImplementedError, a nested one in a RuntimeError."""
    import warnings

    with warnings.catch_warnings():  # CSR's beta and the strided nested layout's prototype warnings
        warnings.simplefilter("ignore")
        if layout.startswith("sparse"):
            ids = getattr(torch.tensor([[1, 2]]), f"to_{layout.replace('_coo', '')}")()
        else:
            kw = dict(layout=torch.jagged) if layout == "jagged" else {}
            ids = torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])], **kw)
            layout = "nested"
    pattern = (rf"^input_ids must be a \[batch, seq\] integer tensor of the default \(strided\) layout, got a {layout} "
               r"tensor; give a plain tensor or a list of lists")
    if layout == "nested":  # a nested tensor: prompts of different lengths
        assert torch.equal(model.generate(ids, max_new_tokens=2), model.generate([[1, 2], [3]], max_new_tokens=2))
        assert all(torch.equal(a, b) for a, b in zip(model.logits(ids), model.logits([[1, 2], [3]])))
        return
    with pytest.raises(MxcError, match=pattern):
        model.logits(ids)
    with pytest.raises(MxcError, match=pattern):
        model.generate(ids, max_new_tokens=2)


def test_logits_of_prompts_of_different_lengths_are_a_list_of_each_prompt_s(model):
    """One forward of every prompt, no padding: each prompt's [seq, vocab] logits, as the prompt alone gives them."""
    prompts = [[5, 6, 7, 8], [9], [10, 11]]
    got = model.logits(prompts)
    assert isinstance(got, list) and [g.shape for g in got] == [(4, 256), (1, 256), (2, 256)]
    for g, prompt in zip(got, prompts):
        want = model.logits([prompt])[0]
        assert g.dtype == torch.float32 and float((g - want).abs().max() / want.abs().max()) < 1e-5


@pytest.mark.parametrize("ids, pattern", [
    ([[1, 2], []], r"input_ids\[1\] must be a 1-D integer tensor or list of at least one token id, got \[0\]"),
    ([[1, 2], [3.5]], r"input_ids\[1\] must be .* got \[1\] torch.float32"),
    ([[1, 2], [[3]]], r"input_ids\[1\] must be .* got \[1, 1\] torch.int64"),
    ([[1], ["a", "b"]], r"input_ids\[1\] must be a list or 1-D tensor of integer token ids; "),
    ([[1, 2], torch.ones(3, dtype=torch.long, device="meta")], r"input_ids\[1\] are on the meta device"),
    ([[1, 2, 3], [4, 300]], r"token id 300 at \[1, 1\] is outside the vocabulary \(0\.\.255\)"),
    ((torch.tensor([7]), [1, 2, 3], [4, 5, -2]), r"token id -2 at \[2, 2\] is outside the vocabulary"),
    # named by its own value, as a [batch, seq] batch's (it was cast to int64 first: the negative it reads as)
    ([[1], torch.tensor([3, 2**64 - 1], dtype=torch.uint64)], rf"token id {2**64 - 1} at \[1, 1\] is outside"),
])
def test_prompts_of_different_lengths_are_checked_one_by_one(model, ids, pattern):
    with pytest.raises(MxcError, match=f"^{pattern}"):
        model.generate(ids, max_new_tokens=2)
    with pytest.raises(MxcError, match=f"^{pattern}"):
        model.logits(ids)


def test_prompts_as_tensors_of_one_length_are_the_same_prompts_as_lists(model):
    """A list of 1-D tensors (or arrays) of one length, or a list of one tensor, are prompts as the same ids in lists
    are: they went to torch.as_tensor as one [batch, seq] batch, which makes no tensor of a list of tensors."""
    import numpy as np

    rows = [[1, 2, 3], [4, 5, 6]]
    want = model.generate(rows, max_new_tokens=3)
    assert torch.equal(model.generate([torch.tensor(r, dtype=torch.int32) for r in rows], max_new_tokens=3), want)
    assert torch.equal(model.generate((torch.tensor(rows[0]), rows[1]), max_new_tokens=3), want)
    assert torch.equal(model.generate([np.array(r, dtype=np.uint8) for r in rows], max_new_tokens=3), want)
    assert torch.equal(model.generate([torch.tensor(rows[1])], max_new_tokens=3), want[1:])


def test_numpy_numbers_and_fractions_sample_as_python_numbers(model):
    """Arguments that pass the checks as their values do (numpy integers and floats, a Fraction) sample as those
    values: a numpy seed failed in torch.Generator.manual_seed, a Fraction top_p against a tensor."""
    from fractions import Fraction

    import numpy as np

    want = model.generate([[1, 2, 3]], max_new_tokens=5, temperature=0.75, top_k=50, top_p=0.5, seed=7)
    for kw in [dict(seed=np.int64(7)), dict(seed=np.uint64(7)), dict(top_p=Fraction(1, 2)), dict(top_p=np.float32(0.5)),
               dict(temperature=Fraction(3, 4)), dict(temperature=np.float64(0.75)), dict(top_k=np.int32(50)),
               dict(max_new_tokens=np.int64(5))]:
        args = {**dict(max_new_tokens=5, temperature=0.75, top_k=50, top_p=0.5, seed=7), **kw}
        assert torch.equal(model.generate([[1, 2, 3]], **args), want), kw
    assert torch.equal(model.generate([[1, 2, 3]], max_new_tokens=np.int8(5)), model.generate([[1, 2, 3]], 5))


def test_normalised_generation_settings():
    """check_generate_args returns Python's own numbers; a Fraction past float's range is not finite."""
    from fractions import Fraction

    import numpy as np

    from mxc.runtime.sampling import check_generate_args

    got = check_generate_args(np.int64(3), Fraction(1, 2), np.int32(4), np.float32(0.25), np.uint64(2**64 - 1))
    assert got == (3, 0.5, 4, 0.25, 2**64 - 1) and [type(v) for v in got] == [int, float, int, float, int]
    assert check_generate_args(1) == (1, 0.0, None, None, None)
    with pytest.raises(MxcError, match=r"temperature must be a finite number >= 0, got Fraction"):
        check_generate_args(1, Fraction(10**400))


def test_a_cpu_logits_call_past_the_host_s_memory_is_refused(model, monkeypatch):
    """Every row's [vocab] logits (in the model's dtype, then as float32) come on top of the KV cache: a call whose
    logits alone pass the memory available is refused in one line, as the cache is."""
    import mxc.runtime.model as runtime_model

    b, s = 2, 10
    cache = model._cache_bytes(b, s)
    logits = b * s * model.vocab_size * (model.dtype.itemsize + 4)
    monkeypatch.setattr(runtime_model, "host_memory_available", lambda: cache + logits - 1)
    with pytest.raises(MxcError, match=rf"^a logits call of {b} x {s} tokens needs at least .+, more than the .+ of "
                                       r"memory available; give fewer or shorter prompts a call$"):
        model.logits([[1] * s] * b)
    assert model.generate([[1] * s] * b, max_new_tokens=1).shape == (b, 1)  # its cache and last rows fit
    monkeypatch.setattr(runtime_model, "host_memory_available", lambda: cache + logits)
    assert model.logits([[1] * s] * b).shape == (b, s, model.vocab_size)
