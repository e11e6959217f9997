"""RoPE spec + torch reference vs Hugging Face transformers 5 (the oracle)."""

import copy
import json
import math

import pytest
import torch

from mxc.errors import MxcError
from mxc.kernels.rope import apply_rope, cos_sin, inv_freq
from mxc.models.rope_config import normalize_rope

from transformers import GPTNeoXConfig, LlamaConfig  # the oracle; mxc itself never imports transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox import modeling_gpt_neox as neox
from transformers.models.llama import modeling_llama as llama

HEAD_DIM = 32
BASE = {"hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 16}

# name -> (top-level config fields, rope fields without type/theta, theta, type)
M64, M16K = {"max_position_embeddings": 64}, {"max_position_embeddings": 16384}
YARN = {"factor": 4.0, "original_max_position_embeddings": 4096}
CASES = {
    "default": (M64, {}, 10000.0, "default"),
    "linear": (M64, {"factor": 2.0}, 10000.0, "linear"),
    "dynamic": (M64, {"factor": 3.0}, 10000.0, "dynamic"),
    "yarn": (M16K, YARN, 10000.0, "yarn"),
    "yarn_explicit": (M16K, {**YARN, "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0}, 1e4, "yarn"),
    "yarn_mscale": (M16K, {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707}, 1e4, "yarn"),
    "yarn_no_truncate": (M16K, {**YARN, "truncate": False}, 1000000.0, "yarn"),
    "yarn_implicit_orig": ({"max_position_embeddings": 4096}, {"factor": 4.0}, 10000.0, "yarn"),
    "yarn_toplevel_orig": ({**M16K, "original_max_position_embeddings": 2048}, YARN, 10000.0, "yarn"),
    "llama3": ({"max_position_embeddings": 131072}, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}, 500000.0, "llama3"),
    "linear_partial": ({**M64, "partial_rotary_factor": 0.5}, {"factor": 2.0}, 10000.0, "linear"),
    # the rope dict's partial_rotary_factor wins over the top-level one, as its theta does
    "linear_partial_inner": ({**M64, "partial_rotary_factor": 0.5}, {"factor": 2.0, "partial_rotary_factor": 0.25},
                             10000.0, "linear"),
    # DeepSeek-style: a null factor is max_position_embeddings / original_max_position_embeddings
    "yarn_implicit_factor": (M16K, {"factor": None, "original_max_position_embeddings": 4096}, 10000.0, "yarn"),
    "yarn_truncate_null": (M16K, {**YARN, "truncate": None}, 1000000.0, "yarn"),  # null is falsy: no truncation
    # attention_factor from mscale and mscale_all_dim only when both are set
    "yarn_mscale_only": (M16K, {**YARN, "factor": 40.0, "mscale": 1.0}, 1e4, "yarn"),
    "yarn_mscale_all_dim_only": (M16K, {**YARN, "factor": 40.0, "mscale_all_dim": 1.0}, 1e4, "yarn"),
    # yarn's ramp at its edges: its high end clamped to the last dim, and a ramp of zero width (low == high)
    "yarn_ramp_clamped": (M16K, {"factor": 4.0, "original_max_position_embeddings": 1024}, 10.0, "yarn"),
    "yarn_ramp_empty": (M16K, {"factor": 4.0, "original_max_position_embeddings": 4}, 10000.0, "yarn"),
    # a zero-width ramp between dims (beta_fast == beta_slow, no truncation: low == high == 5.81): HF's 0.001
    # widening makes it a step between dims 5 and 6
    "yarn_ramp_point": (M16K, {**YARN, "beta_fast": 23.0, "beta_slow": 23.0, "truncate": False}, 10000.0, "yarn"),
}
STYLES = ("legacy_type", "legacy_rope_type", "v5")


def config_json(case: str, style: str) -> dict:
    top, fields, theta, kind = CASES[case]
    d = {**BASE, **copy.deepcopy(top)}
    if style == "v5":
        d["rope_parameters"] = {"rope_type": kind, "rope_theta": theta, **copy.deepcopy(fields)}
    else:
        d["rope_theta"] = theta
        key = "type" if style == "legacy_type" else "rope_type"
        d["rope_scaling"] = None if kind == "default" else {key: kind, **copy.deepcopy(fields)}
    return d


def hf_rotary(d: dict):
    cfg = LlamaConfig(**copy.deepcopy(d))
    return cfg, llama.LlamaRotaryEmbedding(cfg)


def hf_cos_sin(rot, positions, dtype=torch.float32):
    return rot(torch.zeros(1, dtype=dtype), positions[None])


def positions_for(case: str, last: int | None) -> torch.Tensor:
    max_pos = CASES[case][0]["max_position_embeddings"]
    return torch.tensor([0, 1, 2, 7, 31, max_pos // 2, max_pos - 1 if last is None else last])


def same(pairs, atol=1e-6):  # fp32 tolerance from the brief; in practice the match is bitwise
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_inv_freq_matches_hf(case, style):
    d = config_json(case, style)
    spec, (cfg, rot) = normalize_rope(d, HEAD_DIM), hf_rotary(d)
    assert json.loads(json.dumps(spec)) == spec
    ours, scaling = inv_freq(spec)
    assert ours.dtype == torch.float32 and ours.shape == (spec["rotary_dim"] // 2,)
    ref, ref_scaling = ((rot.inv_freq, rot.attention_scaling) if spec["type"] == "default"  # HF: inside the class
                        else ROPE_INIT_FUNCTIONS[spec["type"]](cfg, torch.device("cpu")))
    assert torch.equal(ours, ref) and scaling == pytest.approx(ref_scaling, rel=1e-12)


# dynamic: max position below/at/above the original max (64) -> HF's stateful update on a fresh model
COS_SIN_CASES = [(c, s, None) for c in sorted(CASES) for s in STYLES] + [
    ("dynamic", s, last) for s in STYLES for last in (50, 63, 64, 100, 300)]


@pytest.mark.parametrize("case, style, last", COS_SIN_CASES)
def test_cos_sin_matches_hf(case, style, last):
    d = config_json(case, style)
    spec, (_, rot) = normalize_rope(d, HEAD_DIM), hf_rotary(d)
    pos = positions_for(case, last)
    cos, sin = cos_sin(spec, pos, torch.float32)
    ref_cos, ref_sin = hf_cos_sin(rot, pos)
    assert cos.shape == (len(pos), spec["rotary_dim"])
    same([(cos, ref_cos[0]), (sin, ref_sin[0])])
    (cos16, sin16), ref16 = cos_sin(spec, pos, torch.bfloat16), hf_cos_sin(hf_rotary(d)[1], pos, torch.bfloat16)
    assert cos16.dtype == torch.bfloat16 and torch.equal(cos16, ref16[0][0]) and torch.equal(sin16, ref16[1][0])


@pytest.mark.parametrize("seq_len", [None, 1, 40, 64, 65, 100, 1000])
def test_dynamic_inv_freq_by_seq_len(seq_len):
    d = config_json("dynamic", "v5")
    spec, (cfg, _) = normalize_rope(d, HEAD_DIM), hf_rotary(d)
    ours, scaling = inv_freq(spec, seq_len=seq_len)
    ref, ref_scaling = ROPE_INIT_FUNCTIONS["dynamic"](cfg, torch.device("cpu"), seq_len=seq_len)
    assert torch.equal(ours, ref) and scaling == ref_scaling == 1.0
    default, _ = inv_freq({**spec, "type": "default"})
    assert torch.equal(ours, default) == (seq_len is None or seq_len <= 64)


def test_llama3_band_edges_match_hf():
    """llama3 with a wavelength exactly at each band edge (low/high_freq_factor = original max / a default
    wavelength): the strict comparisons at the edges pick scaled, smoothed or unscaled as HF does."""
    d = config_json("llama3", "v5")
    params = d["rope_parameters"]
    orig = params["original_max_position_embeddings"]
    default = {**BASE, "max_position_embeddings": d["max_position_embeddings"], "rope_theta": params["rope_theta"]}
    wavelen = 2 * math.pi / hf_rotary(default)[1].inv_freq  # float32, as both compute it
    params.update(low_freq_factor=orig / float(wavelen[10]), high_freq_factor=orig / float(wavelen[5]))
    for edge, i in ((orig / params["low_freq_factor"], 10), (orig / params["high_freq_factor"], 5)):
        assert (wavelen == edge).nonzero().flatten().tolist() == [i]  # the edges fall on wavelengths exactly
    spec, (cfg, _) = normalize_rope(d, HEAD_DIM), hf_rotary(d)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    assert torch.equal(inv_freq(spec)[0], ref)


def test_inv_freq_rejects_unknown_type():
    with pytest.raises(ValueError, match="'longrope'"):
        inv_freq({"type": "longrope", "theta": 10000.0, "rotary_dim": HEAD_DIM})


def test_dynamic_cos_sin_of_no_positions():
    """An empty batch has no longest position: dynamic gives empty tables (no max over nothing)."""
    spec = normalize_rope(config_json("dynamic", "v5"), HEAD_DIM)
    cos, sin = cos_sin(spec, torch.zeros(0, dtype=torch.int64), torch.bfloat16)
    assert cos.shape == sin.shape == (0, HEAD_DIM) and cos.dtype == sin.dtype == torch.bfloat16


def test_partial_rotary_default_matches_gpt_neox():
    d = {**BASE, "max_position_embeddings": 64,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}
    spec = normalize_rope(d, HEAD_DIM)
    assert spec["rotary_dim"] == 8
    rot = neox.GPTNeoXRotaryEmbedding(GPTNeoXConfig(**copy.deepcopy(d)))
    pos = torch.tensor([0, 5, 9, 63])
    cos, sin = cos_sin(spec, pos, torch.float32)
    ref_cos, ref_sin = hf_cos_sin(rot, pos)
    same([(cos, ref_cos[0]), (sin, ref_sin[0])])
    x = torch.randn(len(pos), 3, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    q = x.permute(1, 0, 2)[None]
    ref_q, _ = neox.apply_rotary_pos_emb(q, q, ref_cos, ref_sin, unsqueeze_dim=1)
    out = apply_rope(x, cos, sin)
    same([(out, ref_q[0].permute(1, 0, 2))])
    assert torch.equal(out[..., 8:], x[..., 8:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_matches_llama(dtype):
    d = config_json("llama3", "v5")
    spec = normalize_rope(d, HEAD_DIM)
    pos = torch.tensor([0, 1, 9, 500, 4000])
    cos, sin = cos_sin(spec, pos, dtype)
    x = torch.randn(len(pos), 4, HEAD_DIM, generator=torch.Generator().manual_seed(0)).to(dtype)
    q = x.permute(1, 0, 2)[None]  # HF layout [batch, heads, seq, dim]
    ref_q, _ = llama.apply_rotary_pos_emb(q, q, cos[None], sin[None], unsqueeze_dim=1)
    out = apply_rope(x, cos, sin)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out, ref_q[0].permute(1, 0, 2))


def test_normalize_specs():
    assert normalize_rope(config_json("default", "legacy_type"), 64) == {
        "type": "default", "theta": 10000.0, "rotary_dim": 64, "max_position_embeddings": 64}
    assert normalize_rope({"max_position_embeddings": 8}, 16)["theta"] == 10000.0
    yarn = normalize_rope(config_json("yarn", "v5"), 128)
    assert yarn == {"type": "yarn", "theta": 10000.0, "rotary_dim": 128, "max_position_embeddings": 16384,
                    "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                    "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None,
                    "attention_factor": 0.1 * math.log(4.0) + 1.0, "truncate": True}
    assert normalize_rope(config_json("yarn_implicit_orig", "v5"), 8)["original_max_position_embeddings"] == 4096
    assert normalize_rope(config_json("yarn_toplevel_orig", "v5"), 8)["original_max_position_embeddings"] == 2048
    assert normalize_rope(config_json("llama3", "legacy_type"), 128) == {
        "type": "llama3", "theta": 500000.0, "rotary_dim": 128, "max_position_embeddings": 131072,
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for case in CASES:  # all styles give the same spec
        specs = [normalize_rope(config_json(case, s), HEAD_DIM) for s in STYLES]
        assert specs[0] == specs[1] == specs[2], case
    assert normalize_rope(config_json("linear_partial", "v5"), 64)["rotary_dim"] == 32
    mscale = normalize_rope(config_json("yarn_mscale", "v5"), 8)
    assert (mscale["mscale"], mscale["mscale_all_dim"]) == (1.0, 0.707)  # carried as the config gives them
    both = {"max_position_embeddings": 8, "rope_theta": 5.0, "rope_scaling": {"type": "linear", "factor": 2},
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 7.0, "factor": 3.0}}
    assert normalize_rope(both, 8) == {"type": "linear", "theta": 5.0, "rotary_dim": 8,
                                       "max_position_embeddings": 8, "factor": 2.0}
    both["rope_scaling"]["rope_theta"] = 9.0  # the rope dict's theta wins over the top-level one
    assert normalize_rope(both, 8)["theta"] == 9.0


def test_rope_type_wins_over_type():
    """With both keys, transformers keeps ``rope_type`` (standardize_rope_params only defaults it from ``type``)."""
    d = {**BASE, **M64, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "rope_type": "dynamic", "factor": 2.0}}
    assert normalize_rope(d, HEAD_DIM)["type"] == hf_rotary(d)[0].rope_parameters["rope_type"] == "dynamic"


@pytest.mark.parametrize("config, message", [
    ({"rope_scaling": {"type": "linear"}}, "config.json: rope_scaling.factor is required for rope type 'linear'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
     "config.json: rope_parameters.factor is required for rope type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     "config.json: rope_scaling.low_freq_factor is required for rope type 'llama3'"),
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 8.5, "factor": 2}},
     "config.json: rope_scaling.original_max_position_embeddings must be a positive integer, got 8.5"),
    ({"rope_scaling": {"type": "yarn"}}, "config.json: rope_scaling.factor is required for rope type 'yarn'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "config.json: rope_scaling.type 'longrope' is not supported (supported: default, linear, dynamic, yarn, llama3)"),
    ({"rope_parameters": {"rope_type": "foo"}}, "config.json: rope_parameters.rope_type 'foo' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": "2"}}, "config.json: rope_scaling.factor must be a number, got '2'"),
    ({"rope_scaling": "linear"}, "config.json: rope_scaling must be an object or null, got str"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {}}},
     "config.json: rope_parameters is nested per layer type"),
    ({"rope_theta": "big"}, "config.json: rope_theta must be a number, got 'big'"),
    ({"partial_rotary_factor": 0.3}, "config.json: rotary dim int(head_dim 32 * partial_rotary_factor 0.3) = 9"),
    ({"max_position_embeddings": None}, "config.json: max_position_embeddings is missing or null"),
    ({"max_position_embeddings": 0}, "config.json: max_position_embeddings must be a positive integer, got 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "truncate": "no"}},
     "config.json: rope_scaling.truncate must be true, false or null, got 'no'"),
    ({"rope_scaling": {"type": "linear", "factor": True}}, "config.json: rope_scaling.factor must be a number, got True"),
    ({"rope_scaling": {"type": "linear", "factor": math.nan}}, "config.json: rope_scaling.factor must be a number, got nan"),
    ({"rope_scaling": {"type": "linear", "factor": 0}}, "config.json: rope_scaling.factor must be positive, got 0.0"),
    ({"rope_theta": 0}, "config.json: rope_theta must be positive, got 0"),
    ({"max_position_embeddings": True}, "config.json: max_position_embeddings must be a positive integer, got True"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}},
     "config.json: rope_scaling.original_max_position_embeddings must be a positive integer, got 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": True}},
     "config.json: rope_scaling.original_max_position_embeddings must be a positive integer, got True"),
    ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "config.json: rope_scaling.factor is required for rope type 'llama3'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
     "config.json: rope_scaling.high_freq_factor is required for rope type 'llama3'"),
    # HF's llama3 smoothing divides by high_freq_factor - low_freq_factor
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0}},
     "config.json: rope_scaling.high_freq_factor must differ from low_freq_factor (both 2.0)"),
])
def test_normalize_errors(config, message):
    with pytest.raises(MxcError) as err:
        normalize_rope({"max_position_embeddings": 64, **config}, HEAD_DIM)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_missing_max_position_embeddings_is_named():
    with pytest.raises(MxcError) as err:
        normalize_rope({}, HEAD_DIM)
    assert str(err.value).startswith("config.json: max_position_embeddings is missing or null")
