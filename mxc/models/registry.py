"""The model registry: HF ``architectures`` strings -> model definition files.

``registry.yaml`` maps each architecture to a model file in this folder, the
params it sets (``set``, values are literals or expressions over config.json
fields), the config conditions it cannot serve (``refuse_if``, expressions) and the values of fields a
config.json leaves out where the transformers config class's default differs from the model file's
(``defaults``), and the config fields listing layers by index (``layer_lists``). ``bind_model``
binds a definition to a config, with the resolvers model files may name
(``RESOLVERS``: ``rope``, ``llama_rope``). An unknown architecture fails naming it and listing the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mxc.errors import ConfigError, MxcError
from mxc.ir import Graph, bind
from mxc.ir.expr import ExprError, evaluate, names_read
from mxc.models.rope_config import normalize_rope

MODELS_DIR = Path(__file__).parent


@dataclass(frozen=True)
class Entry:
    architecture: str
    model: str
    set: dict = field(default_factory=dict)
    refuse_if: list = field(default_factory=list)
    defaults: dict = field(default_factory=dict)
    tested: bool = True
    field_aliases: dict = field(default_factory=dict)
    layer_lists: list = field(default_factory=list)

    @property
    def path(self) -> Path:
        return MODELS_DIR / self.model


ENTRY_KEYS = ("model", "set", "refuse_if", "defaults", "tested", "field_aliases", "layer_lists")


def registry() -> dict[str, Entry]:
    path = MODELS_DIR / "registry.yaml"
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise MxcError(f"{path}: expected a mapping architecture -> {{model: file.yaml, ...}}")
    return {arch: _entry(path, arch, spec) for arch, spec in data.items()}


def _entry(path: Path, arch: str, spec) -> Entry:
    """One registry line, checked: a typo there (a contributor's new line) names the architecture and the key."""
    where = f"{path.name}: {arch}"
    if not isinstance(spec, dict) or "model" not in spec or set(spec) - set(ENTRY_KEYS):
        raise MxcError(f"{where}: expected a mapping with model and keys among {', '.join(ENTRY_KEYS)}, got {spec!r}")
    kinds = (("set", dict), ("refuse_if", list), ("defaults", dict), ("tested", bool), ("field_aliases", dict),
             ("layer_lists", list))
    for key, kind in kinds:
        if key in spec and not isinstance(spec[key], kind):
            raise MxcError(f"{where}: {key}: expected a {'mapping' if kind is dict else kind.__name__}, "
                           f"got {spec[key]!r}")
    if not (MODELS_DIR / str(spec["model"])).is_file():
        raise MxcError(f"{where}: model: no model file {spec['model']!r} in {MODELS_DIR}")
    return Entry(arch, **spec)


def model_files() -> list[str]:
    return sorted(p.name for p in MODELS_DIR.glob("*.yaml") if p.name != "registry.yaml")


def lookup(architecture: str, config_path: str = "config.json") -> Entry:
    reg = registry()
    if architecture not in reg:
        raise MxcError(f"{config_path}: architecture {architecture!r} is not supported; "
                       f"supported: {', '.join(sorted(reg))}")
    return reg[architecture]


def architecture_of(config: dict, config_path: str = "config.json") -> str:
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or len(archs) != 1:
        raise MxcError(f"{config_path}: field 'architectures' must list exactly one architecture, got {archs!r}")
    return archs[0]


class _ConfigEnv(dict):
    """config.json fields for refuse_if expressions; an absent field reads as None."""

    def __contains__(self, key):
        return True

    def __missing__(self, key):
        return None


def _resolve_rope(config: dict, params: dict) -> dict:
    return normalize_rope(config, params["head_dim"])


def _resolve_llama_rope(config: dict, params: dict) -> dict:
    """RoPE as transformers' Llama-family models compute it. They rotate the whole head: with the default type
    ``partial_rotary_factor`` is ignored, and with a scaled type their rope functions make tables of the rotary
    dims only, which the models then fail to apply (a size mismatch, transformers 5.25). A factor below 1 has no
    reference to match, so it is refused rather than built one way or the other."""
    spec = normalize_rope(config, params["head_dim"])
    if spec["rotary_dim"] != params["head_dim"]:
        what = ("ignore it there and rotate all {} dims" if spec["type"] == "default" else
                "cannot run it (their {} dims are rotated by tables of the rotary dims only)")
        raise ConfigError(f"partial_rotary_factor < 1 with the {spec['type']} RoPE type: transformers' Llama-family "
                          f"models {what.format(params['head_dim'])}; mxc refuses to guess (remove the field, or set "
                          "it to 1.0)")
    return spec


RESOLVERS = {"rope": _resolve_rope, "llama_rope": _resolve_llama_rope}


def _copied_field(expr, config: dict, value) -> str | None:
    """The config field a ``set`` expression copies: the one field it reads that the config gives a value, when
    the expression's value is that field's (``num_local_experts``, or ``num_experts if num_experts is not None
    else num_local_experts`` on a config with only the second)."""
    if not isinstance(expr, str):
        return None
    if expr.isidentifier() and expr in config:  # the field itself, null included
        return expr
    present = [n for n in names_read(expr) if config.get(n) is not None]
    if len(present) == 1 and config[present[0]] == value and type(config[present[0]]) is type(value):
        return present[0]
    return None


def _unaliased(config: dict, entry: Entry, config_path: str) -> dict:
    """config.json with each alias a transformers config class reads as another field (its ``attribute_map``:
    Mixtral's ``num_experts`` is its ``num_local_experts``) under that field's name; both given, and different, is
    refused, naming the two."""
    config = dict(config)
    for alias, name in entry.field_aliases.items():
        if alias not in config:
            continue
        if name in config and config[name] != config[alias]:
            raise MxcError(f"{config_path}: {alias} ({config[alias]!r}) and {name} ({config[name]!r}) are one field "
                           f"for {entry.architecture} (transformers reads {alias} as {name}); keep one of them")
        config[name] = config[alias]
    return config


def _layer_index(value, num_layers: int) -> int | None:
    """The layer 0..num_layers-1 that ``value`` equals (``1``, ``1.0`` and ``true`` are layer 1, as ``==`` has
    it), else None: an index past the last layer, a negative one or a string equals none."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return int(value) if isinstance(value, int) and 0 <= value < num_layers else None


def _layers_named(config: dict, entry: Entry) -> dict:
    """config.json with each of the entry's ``layer_lists`` fields as the layers it picks. transformers picks
    layer ``i`` where ``i in <field>`` (Qwen2-MoE's and Qwen3-MoE's mlp_only_layers), so an index outside
    0..num_hidden_layers-1 picks none: such a list is the empty one, not refused for naming a layer that is not
    there. A value that is no list, or a config without an integer num_hidden_layers, is left as it is."""
    layers = config.get("num_hidden_layers")
    if not entry.layer_lists or not isinstance(layers, int) or isinstance(layers, bool):
        return config
    config = dict(config)
    for name in entry.layer_lists:
        if isinstance(config.get(name), list):
            picked = (_layer_index(v, layers) for v in config[name])
            config[name] = sorted({i for i in picked if i is not None})
    return config


def bind_model(model_file: Path, config: dict, dtype: str, entry: Entry | None,
               config_path: str = "config.json") -> Graph:
    """Bind ``model_file`` to ``config`` with the registry entry's settings."""
    overrides, read_as = {}, {}
    if entry is not None:
        config = _unaliased(config, entry, config_path)
        config = _layers_named({**entry.defaults, **config}, entry)  # a field in config.json, null included, wins
        env = _ConfigEnv(config)
        for cond in entry.refuse_if:
            try:
                hit = evaluate(cond, env)
            except (ExprError, TypeError, ArithmeticError) as e:  # TypeError: a field of another type (None > 1)
                raise MxcError(f"{config_path}: cannot check {cond!r} for {entry.architecture}: {e}") from None
            if hit:
                raise MxcError(f"{config_path}: `{cond}` is true, which is not supported for {entry.architecture} "
                               f"(registry.yaml refuse_if)")
        for key, value in entry.set.items():
            try:
                overrides[key] = evaluate(value, env) if isinstance(value, str) else value
            except (ExprError, TypeError, ArithmeticError) as e:
                raise MxcError(f"{config_path}: {entry.architecture} sets {key} = {value}, which cannot be computed "
                               f"from it: {e}") from None
            field = _copied_field(value, config, overrides[key])
            if field is not None:
                read_as[key] = field  # a config field copied: errors about the value name it
    return bind(model_file, config, dtype=dtype, overrides=overrides, resolvers=RESOLVERS, config_path=config_path,
                read_as=read_as)
