"""Every bench/ script against the current mxc, on the CPU: a benchmark that fails on the GPU machine because an
mxc internal it calls changed wastes that machine's scarce time.

- each ``bench/*.py`` imports as a module without running (its ``main`` behind ``if __name__ == "__main__"``) and
  its ``--help`` runs in a fresh process;
- ``decode_ab.recording_all`` reaches the build's ``aot.record`` (a cuda build on the CPU, stopped there): every
  variant's patches are active while its launches are recorded; ``ablate.skipping`` and ``ablate.fixed_routing``
  wrap the launcher's and the router's current signatures.

The scripts' calls into mxc: ``test_bench_calls.py``; ``bench/gpu_session.sh``'s parts: ``test_gpu_session.py``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

import pytest

import mxc
from tests import warm_python

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
LIBRARIES = {"profile_step.py", "gluon_common.py"}  # helpers the benches import, with no command line of their own


# --- import and --help --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS)
def test_imports_without_running(script):
    tree = ast.parse((BENCH / script).read_text())
    guarded = any(isinstance(n, ast.If) and ast.unparse(n.test) in ('__name__ == "__main__"', "__name__ == '__main__'")
                  for n in tree.body)
    assert guarded or script in LIBRARIES, f"bench/{script}: main() must run only under if __name__ == '__main__'"
    importlib.import_module(script.removesuffix(".py"))


@pytest.mark.parametrize("script", sorted(set(SCRIPTS) - LIBRARIES))
def test_help_runs(script):
    """``python bench/<script> --help``, in a fork of an interpreter that has imported torch (tests/warm_python.py;
    a fresh interpreter a script took 1.5 s, mostly torch's import: 35 s for all of them)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = warm_python.run([sys.executable, str(BENCH / script), "--help"], env=env, cwd=ROOT, timeout=120,
                        preload=("torch",))
    assert r.returncode == 0 and "usage:" in r.stdout, f"bench/{script} --help exited {r.returncode}:\n{r.stderr}"


LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 128,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


def test_recording_all_records_each_variant_in_the_build(tmp_path, monkeypatch):
    """decode_ab.py / ablate.py build one artifact holding every variant's kernels by wrapping ``aot.record``: a cuda
    build (on the CPU, stopped before compiling) calls the wrapper, which runs the real ``aot.record`` once under
    each variant's patches and hands the union of their launches to the compiler."""
    from decode_ab import parse_variant, recording_all

    from mxc.codegen import aot
    from mxc.runtime import decode_graphs

    real, seen = aot.record, []

    def record(*args, **kwargs):
        inspect.signature(real).bind(*args, **kwargs)
        seen.append(decode_graphs.STOP_CHECK_EVERY)
        return real(*args, **kwargs)

    class Compiled(Exception):
        pass

    def compile_specs(specs, *args, **kwargs):
        raise Compiled(specs)

    monkeypatch.setattr(aot, "record", record)
    monkeypatch.setattr(aot, "compile_specs", compile_specs)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    variants = [parse_variant(f"v{n}=mxc.runtime.decode_graphs.STOP_CHECK_EVERY={n}") for n in (5, 7)]
    with recording_all(variants), pytest.raises(Compiled) as got:
        mxc.build("llama.yaml", config=str(tmp_path / "config.json"), out=tmp_path / "art", target="cuda",
                  dtype="bfloat16", max_batch=2, max_seq_len=32, progress=False, log=lambda m: None)
    assert seen == [5, 7] and decode_graphs.STOP_CHECK_EVERY == 32
    specs = got.value.args[0]
    assert specs and all("kernel" in spec for spec in specs.values())


def test_ablate_skipping_wraps_the_launcher(monkeypatch):
    """ablate.skipping replaces ``CubinLauncher.__call__`` with one of its signature: a skipped kernel is not
    launched, another is, with the arguments ``launch.launch`` gives."""
    from ablate import skipping

    from mxc.kernels import launch
    from mxc.runtime.cuda_launch import CubinLauncher

    launched = []
    real = CubinLauncher.__call__

    def call(self, *args):
        inspect.signature(real).bind(self, *args)
        launched.append(args[0].__name__)

    monkeypatch.setattr(CubinLauncher, "__call__", call)
    launcher = object.__new__(CubinLauncher)

    def _qgemv_kernel():
        pass

    def other_kernel():
        pass

    with skipping(launcher, {"_qgemv_kernel:K=8"}), launch.using(launcher):
        launch.launch(_qgemv_kernel, (1,), [], {"K": 8})
        launch.launch(_qgemv_kernel, (1,), [], {"K": 16})
        launch.launch(other_kernel, (1,), [], {})
    assert launched == ["_qgemv_kernel", "other_kernel"]
    assert CubinLauncher.__call__ is call


def test_ablate_fixed_routing_wraps_the_router():
    """ablate.fixed_routing calls the current ``triton_route.add_rms_norm_route`` (Triton's interpreter here) and
    replaces its weights and ids, keeping its (s, h, weights, ids)."""
    import torch

    from ablate import fixed_routing

    from mxc.kernels import triton_route

    if torch.cuda.is_available():
        pytest.skip("the router runs in Triton's interpreter on CPU tensors")
    h, e, k = 16, 8, 2
    a, b = torch.randn(1, h), torch.randn(1, h)
    with fixed_routing(layers=2, experts=e, k=k, device="cpu"):
        out = triton_route.add_rms_norm_route(a, b, torch.ones(h), torch.randn(e, h), eps=1e-6, k=k)
    s, _, weights, ids = out
    assert torch.allclose(s, a + b) and weights.shape == ids.shape == (1, k)
    assert torch.all(weights == 1 / k) and len(set(ids[0].tolist())) == k


def test_decode_tp_worker_takes_what_run_ranks_passes():
    """run_ranks calls ``fn(rank, world_size, device, *args)`` (mxc.runtime.ranks._run): decode_tp.py's worker with
    the arguments its main gives run_ranks."""
    import decode_tp

    from mxc.runtime import ranks

    assert "fn(rank, world_size, device, *args)" in inspect.getsource(ranks._run)
    inspect.signature(decode_tp._worker).bind(0, 2, "cuda:0", "art", "result.json", False, False)
