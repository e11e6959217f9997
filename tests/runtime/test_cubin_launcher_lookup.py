"""The runtime's cubin launcher over a real ``--target cuda`` artifact (built here for sm_90 on the CPU),
with a stand-in for the CUDA driver: run through every scenario the build recorded, the generated
program's launches each find their binary and every binary is launched, even after the kernel
templates changed (the artifact's stored kernel sources run, not a fresh rendering)."""

from __future__ import annotations

import contextlib
import json
import sys
import types

import torch

from mxc.codegen import aot
from mxc.kernels import kernel_templates
from mxc.ir.serialize import load_graph
from mxc.kernels import launch
from mxc.runtime import cuda_launch
from mxc.runtime_buckets import PREFILL_GRAPH_TOKENS
from tests import warm_python
from tests.sm90_compile import compile_env


class _Driver:
    def __init__(self):
        self.names, self.launched = {}, []

    def cuModuleLoadData(self, module, data):
        return 0

    def cuModuleGetFunction(self, func, module, name):
        func._obj.value = len(self.names) + 1  # a distinct handle per binary
        self.names[func._obj.value] = name.decode()
        return 0

    def cuFuncSetAttribute(self, *_):
        return 0

    def cuTensorMapEncodeTiled(self, *_):  # the prefill attention's TMA descriptors
        return 0

    def cuLaunchKernel(self, func, *rest):
        self.launched.append(("plain", func.value))
        return 0

    def cuLaunchKernelEx(self, config, func, params, extra):
        self.launched.append(("pdl", func.value))
        return 0


def test_every_launch_finds_its_binary(tmp_path, monkeypatch):
    art = tmp_path / "art"
    env = compile_env()
    proc = warm_python.run([sys.executable, "-m", "mxc", "build", "llama.yaml", "--target", "cuda", "--out", str(art),
                            "--max-batch", "2", "--max-seq-len", "64", "--jobs", "1"], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    options = json.loads((art / "manifest.json").read_text())["options"]

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    driver = _Driver()
    launcher = cuda_launch.CubinLauncher(art / "code" / "kernels", pdl=options.get("pdl", False), driver=driver)

    class Through:  # in place of the build's recorder: every launch goes to the runtime's launcher
        specs: dict = {}

        def __init__(self, pdl=False):
            pass

        def __call__(self, *args):
            launcher(*args)

    monkeypatch.setattr(launch, "Recorder", Through)
    monkeypatch.setattr(kernel_templates, "unpinned", contextlib.nullcontext)  # the runtime's view: pins in force
    render = kernel_templates.render  # and the templates edited since the build: a fresh rendering would miss
    monkeypatch.setattr(kernel_templates, "render", lambda *a, **k: render(*a, **k) + "# edited after the build\n")
    program = types.ModuleType("forward")
    exec(compile((art / "code" / "forward.py").read_text(), "forward.py", "exec"), program.__dict__)
    assert options["prefill_graph_tokens"] == PREFILL_GRAPH_TOKENS  # the cuda default: the prompt buckets' forwards run too
    aot.record(program, load_graph((art / "graph.yaml").read_text()), options["max_batch"], options["max_seq_len"],
               pdl=options.get("pdl", False), prefill_graph_tokens=options["prefill_graph_tokens"])
    assert {f for _, f in driver.launched} == set(driver.names) and len(driver.names) == len(launcher.binaries) > 10
    assert {how for how, _ in driver.launched} == ({"pdl"} if options.get("pdl") else {"plain"})
    index = json.loads((art / "code" / "kernels" / "index.json").read_text())
    for entry in (e for e in index.values() if "source" in e):  # what ran is the artifact's stored source
        module = entry["kernel"].split(":")[0]
        assert kernel_templates.source(module) == (art / "code" / "kernels" / entry["source"]).read_text()
