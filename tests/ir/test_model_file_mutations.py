"""Every line of llama.yaml broken in a few ways a hand edit breaks it (dropped, its value made a mapping, a list, a
number or a string): binding either succeeds or fails with a one-line MxcError, never another exception.

Random mutations of this kind found four ways a model file ended in a Python traceback (a shard given as a number,
an expression given as a YAML mapping, a resolver named by a list, a resolver reading a param the file no longer
declares); this sweep runs every line through the same edits, for a dense and an MoE architecture.
"""

from __future__ import annotations

import re

import pytest

from mxc.errors import MxcError
from mxc.models.registry import MODELS_DIR, bind_model, lookup

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, head_dim=16,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
VALUES = ("{}", "[1]", "0", "'x y'")
_VALUE = re.compile(r":\s*([^,{}\[\]#\s][^,{}\[\]#]*)")  # the first plain scalar after a key


def _mutants(lines: list[str]):
    for i, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        yield f"drop line {i + 1}", lines[:i] + lines[i + 1:]
        m = _VALUE.search(line)
        if m:
            for v in VALUES:
                yield f"line {i + 1} value -> {v}", lines[:i] + [line[:m.start(1)] + v + line[m.end(1):]] + lines[i + 1:]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_every_line_broken_binds_or_fails_in_one_line(arch, tmp_path):
    lines = (MODELS_DIR / "llama.yaml").read_text().splitlines()
    path, entry, failures = tmp_path / "bad.yaml", lookup(arch), []
    count = 0
    for what, mutant in _mutants(lines):
        count += 1
        path.write_text("\n".join(mutant) + "\n")
        try:
            bind_model(path, {**TINY, "architectures": [arch]}, "float32", entry)
        except MxcError as e:
            if "\n" in str(e):
                failures.append(f"{what}: a multi-line error: {e}")
        except Exception as e:  # noqa: BLE001 - what the test looks for
            failures.append(f"{what}: {type(e).__name__}: {e}")
    assert count > 300
    assert not failures, "\n".join(failures[:10])
