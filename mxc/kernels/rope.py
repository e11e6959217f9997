"""Torch reference for rotary position embeddings (RoPE).

Takes the normalized spec from ``mxc.models.rope_config.normalize_rope`` and
reproduces Hugging Face transformers 5 numerics op for op: ``inv_freq`` as the
``ROPE_INIT_FUNCTIONS`` compute it, ``cos``/``sin`` as ``LlamaRotaryEmbedding``
forward does (float32, ``cat(freqs, freqs)`` layout, times attention scaling,
then cast), and the rotate-half application of ``apply_rotary_pos_emb``
(partial rotary: only the first ``rotary_dim`` features are rotated).
Does not import transformers.
"""

import math

import torch


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim


def _default(spec: dict) -> torch.Tensor:
    return 1.0 / (spec["theta"] ** _exponents(spec["rotary_dim"]))


def _dynamic(spec: dict, seq_len) -> torch.Tensor:
    # Same expression as HF _compute_dynamic_ntk_parameters; seq_len may be an int or a 0-dim int tensor.
    base, dim, factor = spec["theta"], spec["rotary_dim"], spec["factor"]
    max_pos = spec["max_position_embeddings"]
    if seq_len is None:
        seq_len = max_pos
    elif isinstance(seq_len, torch.Tensor):
        seq_len = torch.maximum(seq_len, torch.tensor(max_pos, dtype=seq_len.dtype))
    else:
        seq_len = max(seq_len, max_pos)
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim))


def _yarn(spec: dict) -> torch.Tensor:
    base, dim, factor = spec["theta"], spec["rotary_dim"], spec["factor"]
    orig = spec["original_max_position_embeddings"]

    def correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec["beta_fast"]), correction_dim(spec["beta_slow"])
    if spec["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent singularity, as HF does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return (inv_freq_interpolation * (1 - extrapolation_factor)
            + inv_freq_extrapolation * extrapolation_factor)


def _llama3(spec: dict) -> torch.Tensor:
    inv = _default(spec)
    factor, low_ff, high_ff = spec["factor"], spec["low_freq_factor"], spec["high_freq_factor"]
    old_context_len = spec["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_ff
    high_freq_wavelen = old_context_len / high_ff
    wavelen = 2 * math.pi / inv
    inv_llama = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_context_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_llama)


def inv_freq(spec: dict, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Return (inv_freq float32 [rotary_dim // 2], attention_scaling) for ``spec``.

    ``seq_len`` only matters for ``dynamic`` (current length = max position + 1);
    at or below ``max_position_embeddings`` it gives the default frequencies.
    """
    kind = spec["type"]
    if kind == "default":
        return _default(spec), 1.0
    if kind == "linear":
        inv = _default(spec)
        inv /= spec["factor"]
        return inv, 1.0
    if kind == "dynamic":
        return _dynamic(spec, seq_len), 1.0
    if kind == "yarn":
        return _yarn(spec), spec["attention_factor"]
    if kind == "llama3":
        return _llama3(spec), 1.0
    raise ValueError(f"unknown rope type {kind!r}")  # specs come from normalize_rope


def cos_sin(spec: dict, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (cos, sin), each [T, rotary_dim] in ``dtype``, for integer ``positions`` [T]."""
    if spec["type"] == "dynamic" and positions.numel():
        seq_len = positions.max() + 1
        # HF recomputes only on growth past max_position_embeddings (with a tensor seq_len);
        # otherwise it keeps the frequencies from init (seq_len=None).
        inv, scaling = inv_freq(spec, seq_len if int(seq_len) > spec["max_position_embeddings"] else None)
    else:
        inv, scaling = inv_freq(spec)
    inv = inv.to(device=positions.device)
    freqs = positions[..., None].float() * inv.to(dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * scaling
    sin = emb.sin() * scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] with ``cos``/``sin`` [T, rotary_dim] (rotate-half convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat(((x_rot * cos) + (_rotate_half(x_rot) * sin), x_pass), dim=-1)
