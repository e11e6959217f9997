"""Turns an HF config's rotary-embedding fields into one normalized RoPE spec.

This module owns the mapping from a parsed ``config.json`` (either the older
``rope_theta`` + ``rope_scaling`` form or the transformers-5 ``rope_parameters``
form) to a plain, JSON-serialisable dict that the rest of mxc consumes. The
defaults and precedence rules mirror transformers 5 ``modeling_rope_utils``
(``RotaryEmbeddingConfigMixin.standardize_rope_params`` and the
``_compute_*_parameters`` functions), so the spec alone determines the exact
``inv_freq`` / attention scaling HF would compute.

Spec keys: ``type``, ``theta``, ``rotary_dim``, ``max_position_embeddings`` plus
per type: linear/dynamic ``factor``; yarn ``factor``,
``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
``mscale_all_dim``, ``attention_factor``, ``truncate``; llama3 ``factor``,
``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``.
"""

import math

from mxc.errors import ConfigError

SUPPORTED_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
DEFAULT_THETA = 10000.0  # RotaryEmbeddingConfigMixin.default_theta


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(d: dict, key: str, where: str, rope_type: str | None = None, default=None):
    """Read a numeric field; ``default`` of None means required (when rope_type is given)."""
    v = d.get(key)
    field = f"{where}.{key}" if where else key
    if v is None:
        if default is None and rope_type is not None:
            raise ConfigError(f"{field} is required for rope type '{rope_type}'")
        return default
    if not _is_num(v) or not math.isfinite(v):
        raise ConfigError(f"{field} must be a number, got {v!r}")
    return v


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def normalize_rope(config: dict, head_dim: int) -> dict:
    """Return the normalized RoPE spec for a parsed ``config.json`` dict."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ConfigError(f"head_dim must be a positive integer, got {head_dim!r}")

    # transformers: `rope_parameters = rope_scaling or rope_parameters` (legacy field wins if set).
    if config.get("rope_scaling"):
        where, params = "rope_scaling", config["rope_scaling"]
    else:
        where, params = "rope_parameters", config.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where} must be an object or null, got {type(params).__name__}")
    if "rope_type" not in params and "type" not in params and any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{where} is nested per layer type ({', '.join(params)}); "
                       "per-layer RoPE is not supported")

    type_key = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(type_key, "default")
    if rope_type not in SUPPORTED_TYPES:
        raise ConfigError(f"{where}.{type_key} {rope_type!r} is not supported "
                       f"(supported: {', '.join(SUPPORTED_TYPES)})")

    # Precedence (standardize_rope_params): value inside the rope dict, then top level, then default.
    if params.get("rope_theta") is not None:
        theta = _num(params, "rope_theta", where)
    else:
        theta = _num(config, "rope_theta", "", default=DEFAULT_THETA)
    if theta <= 0:
        raise ConfigError(f"rope_theta must be positive, got {theta!r}")
    if params.get("partial_rotary_factor") is not None:
        prf = _num(params, "partial_rotary_factor", where)
    else:
        prf = _num(config, "partial_rotary_factor", "", default=1.0)
    if not 0 < prf <= 1:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {prf!r}")
    rotary_dim = head_dim if prf == 1 else int(head_dim * prf)  # exact where a float product of a huge dim is not
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"rotary dim int(head_dim {head_dim} * partial_rotary_factor {prf}) "
                       f"= {rotary_dim} must be even and >= 2")

    max_pos = config.get("max_position_embeddings")
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos <= 0:
        if max_pos is None:
            raise ConfigError("max_position_embeddings is missing or null (the longest position the RoPE tables "
                              "cover): set it to the model's context length")
        raise ConfigError(f"max_position_embeddings must be a positive integer, got {max_pos!r}")

    spec = {"type": rope_type, "theta": float(theta), "rotary_dim": rotary_dim,
            "max_position_embeddings": max_pos}
    if rope_type == "default":
        return spec

    if rope_type in ("yarn", "llama3"):
        # Phi3-style top-level original_max_position_embeddings wins; then the rope dict; then max positions.
        if config.get("original_max_position_embeddings") is not None:
            orig, owhere = config["original_max_position_embeddings"], "original_max_position_embeddings"
        else:
            orig, owhere = params.get("original_max_position_embeddings"), f"{where}.original_max_position_embeddings"
        explicit_orig = orig is not None
        orig = max_pos if orig is None else orig
        if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
            raise ConfigError(f"{owhere} must be a positive integer, got {orig!r}")

    if rope_type in ("linear", "dynamic"):
        spec["factor"] = float(_num(params, "factor", where, rope_type))
    elif rope_type == "llama3":
        spec["factor"] = float(_num(params, "factor", where, rope_type))
        low = float(_num(params, "low_freq_factor", where, rope_type))
        high = float(_num(params, "high_freq_factor", where, rope_type))
        if high == low:
            raise ConfigError(f"{where}.high_freq_factor must differ from low_freq_factor "
                           f"(both {low}) for rope type 'llama3'")
        spec.update(low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=orig)
    else:  # yarn
        factor = params.get("factor")
        if factor is None and explicit_orig:
            factor = max_pos / orig  # HF: DeepSeek-style implicit factor
        else:
            factor = _num(params, "factor", where, rope_type)
        mscale = _num(params, "mscale", where, default=None)
        mscale_all_dim = _num(params, "mscale_all_dim", where, default=None)
        attention_factor = _num(params, "attention_factor", where, default=None)
        truncate = params.get("truncate", True)  # HF: rope_parameters.get("truncate", True); null = falsy
        if truncate is not None and not isinstance(truncate, bool):
            raise ConfigError(f"{where}.truncate must be true, false or null, got {truncate!r}")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
            else:
                attention_factor = _yarn_mscale(factor)
        spec.update(
            factor=float(factor),
            original_max_position_embeddings=orig,
            beta_fast=float(_num(params, "beta_fast", where, default=None) or 32),
            beta_slow=float(_num(params, "beta_slow", where, default=None) or 1),
            mscale=None if mscale is None else float(mscale),
            mscale_all_dim=None if mscale_all_dim is None else float(mscale_all_dim),
            attention_factor=float(attention_factor),
            truncate=bool(truncate),
        )
    if spec["factor"] <= 0:
        raise ConfigError(f"{where}.factor must be positive, got {spec['factor']!r}")
    return spec
