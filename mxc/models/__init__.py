"""Model definitions (one YAML per architecture family; today ``llama.yaml``), the registry, the bundled tiny config."""

from mxc.models.registry import MODELS_DIR, Entry, architecture_of, bind_model, lookup, model_files, registry

__all__ = ["MODELS_DIR", "Entry", "architecture_of", "bind_model", "lookup", "model_files", "registry"]
