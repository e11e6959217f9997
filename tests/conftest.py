"""Shared fixtures: tiny random Hugging Face checkpoints made in the test, no downloads."""

from __future__ import annotations

import os
import shlex

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Without a GPU, Triton kernels run in Triton's interpreter. This must be set
# before any module defining a kernel is imported (the decorator reads it).
def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # bf16/fp8 conversions and dots as the GPU does them
    from tests.triton_interpreter import patch_interpreter

    patch_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread pool a core: pytest-xdist's workers (-n auto: one a core) each left at the core count
# oversubscribe the CPUs, 9-13% slower on the 2-core CI machine (2026-12-06)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(4, torch.get_num_threads(), len(os.sched_getaffinity(0)) // _WORKERS)))

# Figures a test reports (``record_property("report", line)``, e.g. fp8's greedy-token agreement), printed
# after the run: report properties travel from pytest-xdist's workers, whose own output is not shown.
_REPORTS: list[str] = []


def _dist_given(config) -> bool:
    """Whether the command line or PYTEST_ADDOPTS names pytest-xdist's mode (--dist, --dist=MODE, -d)."""
    args = [*config.invocation_params.args, *shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))]
    return bool(getattr(config.option, "distload", False)) or any(a == "--dist" or a.startswith("--dist=")
                                                                    for a in args)


def pytest_configure(config):
    # -n with pytest-xdist's default 'load': 'loadgroup' instead, so the tests marked xdist_group("cutlass") (those
    # compiling the CUTLASS fp8 library, 150 s of nvcc on the 2-core CI machine when the cache is cold) run on one
    # worker, the first compiling it and the rest finding it cached, while the other workers go on; under 'load' two
    # workers compiled it at once in one CI run out of two (2026-12-06). A --dist or -d the user gives is kept.
    if getattr(config.option, "dist", "no") == "load" and not _dist_given(config):
        config.option.dist = "loadgroup"
    config.addinivalue_line("markers", "interpreter: runs Triton kernels in Triton's interpreter on CPU tensors "
                            "(simulated ranks, a whole program on the CPU); skipped where CUDA is available")


def pytest_collection_modifyitems(config, items):
    """Where CUDA is available the interpreter is off, so the ``interpreter`` tests skip (tests/gpu runs the same
    kernels and programs on the GPU); every other test runs on either machine."""
    if not _has_cuda():
        return
    skip = pytest.mark.skip(reason="runs Triton's interpreter on CPU tensors, which is off where CUDA is available")
    for item in items:
        if item.get_closest_marker("interpreter"):
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    if report.when == "call":
        _REPORTS.extend(value for key, value in report.user_properties if key == "report")


def pytest_terminal_summary(terminalreporter):
    if _REPORTS:
        terminalreporter.section("reported figures")
        for line in sorted(_REPORTS):
            terminalreporter.write_line(line)

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, eos_token_id=None,
            bos_token_id=None, pad_token_id=None)

CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
    "MixtralForCausalLM": "MixtralConfig", "Qwen2MoeForCausalLM": "Qwen2MoeConfig",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "OlmoeForCausalLM": "OlmoeConfig",
    "Phi3ForCausalLM": "Phi3Config",  # no bundled definition: tests/models/test_fused_checkpoint_weights.py writes one
}


def make_hf_model(arch: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny random HF model of ``arch`` (non-trivial norm weights and biases)."""
    import transformers

    config = getattr(transformers, CONFIG_CLASSES[arch])(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(dtype).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb so they are tested
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: save a tiny random HF model; returns (directory, model)."""

    def make(arch="LlamaForCausalLM", name="ckpt", seed=0, **overrides):
        model = make_hf_model(arch, seed=seed, **overrides)
        path = tmp_path / name
        model.save_pretrained(path, safe_serialization=True)
        return path, model

    return make
