"""Launching the artifact's precompiled kernels through the CUDA driver: no Triton compile at load.

``CubinLauncher`` reads ``code/kernels/index.json``, loads every cubin with
``cuModuleLoadData`` (and executes the stored sources of the kernels rendered
from templates, so the wrappers launch exactly those) and, installed as the
``mxc.kernels.launch`` launcher, turns each wrapper's launch into a ``cuLaunchKernel`` on the current torch
stream (so launches are captured by CUDA graphs). Arguments are packed from
the parameter kinds recorded at build time; Triton's trailing scratch
pointers get NULL (the build refuses kernels that need scratch memory).
A launch whose binary is not in the artifact fails with the kernel and its
constexprs: the artifact was built for other shapes or buckets. A host tensor descriptor
argument becomes its TMA map (``tensor_maps``), shape and strides. Kernels built
with programmatic dependent launch (``--pdl``) go through ``cuLaunchKernelEx``
with the programmatic-stream-serialization attribute.
"""

from __future__ import annotations

import ctypes
import json
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from mxc.kernels import kernel_templates
from mxc.errors import MxcError
from mxc.kernels.launch import descriptor_rank, is_descriptor, spec_key, spec_of, stream_handle, with_pdl
from mxc.runtime import tensor_maps

_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float,
           "f64": ctypes.c_double, "i8": ctypes.c_int8, "i16": ctypes.c_int16}
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_PREFERRED_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
# The L1 / shared-memory split every kernel asks for, in percent of the most shared memory (-1 or None: the
# driver's choice, the default). An A/B knob (``bench/decode_ab.py --variant``), read at each launch: an SM runs
# blocks of one carveout at a time, so a kernel needing more shared memory than the SM is configured for waits
# for the blocks ahead to drain; a uniform split lets kernels overlap under PDL (``bench/moe_down_smem_lab.py``).
# 100 for every kernel costs the shipped Qwen3-30B-A3B bf16 step 1.8% on an H100 (docs/perf.md, 78th run).
CARVEOUT: int | None = None
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: a 64-byte union
    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int),
                ("_align", ctypes.c_void_p)]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, value (72 bytes)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (56 bytes)
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p,
                                                                             ctypes.POINTER(ctypes.c_void_p),
                                                                             ctypes.c_void_p]
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p]
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"CUDA driver error {code} in {what}")


def _plan(entry: dict) -> tuple[list[tuple], int]:
    """How each argument fills the kernel's parameters, from the index entry: ("ptr" | "value", its slot) or
    ("desc", its map's slot, its rank, its ``tensordesc_meta``), checked against the PTX's parameter kinds;
    and the number of parameters the arguments fill."""
    kinds, metas = entry["params"], iter(entry.get("tensordesc", []))
    plan, i = [], 0
    for arg in entry["args"]:
        rank = descriptor_rank(arg)
        if rank is None:
            kind = kinds[i] if i < len(kinds) else "value"
            plan.append((kind if kind in ("ptr", "i32") else "value", i))
            i += 1
            continue
        meta = next(metas, None)
        expected = ["tmap"] + ["i32"] * rank + ["i64"] * rank
        if meta is None or kinds[i:i + len(expected)] != expected:
            raise MxcError(f"{entry['kernel']}: its descriptor argument {arg} does not match the compiled parameters "
                           f"{kinds}; rebuild the artifact")
        why = tensor_maps.supported(meta)
        if why:
            raise MxcError(f"{entry['kernel']}: {why} is not supported by the AOT launcher")
        plan.append(("desc", i, rank, meta))
        i += len(expected)
    return plan, i


class _Binary:
    def __init__(self, lib, data: bytes, entry: dict, maps: tensor_maps.TensorMaps | None = None):
        self.lib, self.entry = lib, entry
        self.module, self.func = ctypes.c_void_p(), ctypes.c_void_p()
        self._data = data  # keep the image alive while the module is loaded
        _check(lib.cuModuleLoadData(ctypes.byref(self.module), data), f"loading {entry['kernel']}")
        _check(lib.cuModuleGetFunction(ctypes.byref(self.func), self.module, entry["entry"].encode()),
               f"finding {entry['entry']}")
        if entry["shared"] > 48 * 1024:
            _check(lib.cuFuncSetAttribute(self.func, _MAX_DYNAMIC_SHARED, entry["shared"]), "shared memory")
        self.threads = 32 * entry["num_warps"]
        self.kinds = entry["params"]
        self.n_args = len(entry["args"])
        self._plan, used = _plan(entry)
        if any(kind != "ptr" for kind in self.kinds[used:]):
            raise MxcError(f"{entry['kernel']}: parameters past its {self.n_args} arguments are not all Triton's "
                           f"scratch pointers ({self.kinds}); rebuild the artifact")
        if maps is None and "tensordesc" in entry:  # a binary loaded alone (the launcher shares one)
            maps = tensor_maps.TensorMaps(lib)
        self._maps = maps
        self.pdl = bool(entry.get("pdl"))
        self._local = threading.local()
        self._carveout = -1  # the driver's default until ``CARVEOUT`` says otherwise

    def _slots(self):
        """This thread's ctypes value for each parameter, the array of their addresses the driver reads, and
        the PDL launch's config (its programmatic-serialization attribute set once): filled in place at each
        launch (the driver copies what it reads when the launch is made, captured launches included).
        Triton's scratch pointers are never written: NULL."""
        slots = getattr(self._local, "slots", None)
        if slots is None:  # a TMA map's slot is a pointer set at each launch to the kept map (``tensor_maps``)
            values = [_CTYPES[kind]() if kind != "tmap" else None for kind in self.kinds]
            attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
            attr.value.programmaticStreamSerializationAllowed = 1
            config = _LaunchConfig(1, 1, 1, self.threads, 1, 1, self.entry["shared"], None, ctypes.pointer(attr), 1)
            params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) if v is not None else 0 for v in values])
            slots = self._local.slots = (values, params, config, attr, ctypes.byref(config))
        return slots

    def launch(self, grid, args, pdl: bool = True) -> None:
        carveout = -1 if CARVEOUT is None else CARVEOUT
        if carveout != self._carveout:
            _check(self.lib.cuFuncSetAttribute(self.func, _PREFERRED_CARVEOUT, carveout), "the carveout")
            self._carveout = carveout
        values, params, config, _attr, config_ref = self._slots()
        for step, arg in zip(self._plan, args):  # args: no None (absent = constexpr)
            kind, i = step[0], step[1]
            if kind == "ptr":
                ptr = arg.data_ptr()
                if ptr % 16:
                    raise MxcError(f"{self.entry['kernel']}: a tensor argument is not 16-byte aligned "
                                   f"(a view with an offset?); the kernel was compiled assuming alignment")
                values[i].value = ptr
            elif kind == "i32":  # ctypes would keep the low 32 bits of a larger int without a word
                if not -0x80000000 <= arg <= 0x7FFFFFFF:
                    raise MxcError(f"{self.entry['kernel']}: argument {arg} does not fit the 32-bit integer the "
                                   f"kernel was compiled for (a size past 2**31 elements); use a smaller "
                                   f"--max-batch or --max-seq-len")
                values[i].value = arg
            elif kind == "value":
                values[i].value = arg
            else:  # a tensor descriptor: its map, then its shape and strides
                params[i] = self._maps.address(arg, step[3])
                for j, n in enumerate((*arg.shape, *arg.strides)):
                    values[i + 1 + j].value = n
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        stream = stream_handle()
        if pdl and self.pdl:  # may start before the previous kernel ends; it waits on it first
            config.gridDimX, config.gridDimY, config.gridDimZ, config.hStream = gx, gy, gz, stream
            _check(self.lib.cuLaunchKernelEx(config_ref, self.func, params, None), f"launching {self.entry['kernel']}")
            return
        _check(self.lib.cuLaunchKernel(self.func, gx, gy, gz, self.threads, 1, 1, self.entry["shared"],
                                       stream, params, None), f"launching {self.entry['kernel']}")


class CubinLauncher:
    """A ``mxc.kernels.launch`` launcher over an artifact's precompiled kernels."""

    def __init__(self, kernels_dir: Path, pdl: bool = False, driver=None):
        """``driver``: the CUDA driver library (default: libcuda, after making torch's context current)."""
        self.pdl = pdl  # the artifact was built with programmatic dependent launch (``mxc.kernels.pdl``)
        if driver is None:
            torch.cuda.init()
            torch.empty(1, device="cuda")  # make the primary context current on this thread
            driver = _driver()
        self.lib = driver
        index = json.loads((kernels_dir / "index.json").read_text())
        for e in index.values():  # the kernels rendered at build time run as stored, not re-rendered
            if "source" in e:
                kernel_templates.pin(e["template"], e["template_params"], e["kernel"].partition(":")[0],
                                     (kernels_dir / e["source"]).read_text())
        self.maps = tensor_maps.TensorMaps(self.lib)
        self.binaries = {key: _Binary(self.lib, (kernels_dir / e["file"]).read_bytes(), e, self.maps)
                         for key, e in index.items()}
        self._fast: dict[tuple, _Binary] = {}
        self.pdl_launch = True  # PDL cubins get the launch attribute; ``plain()`` turns it off

    @contextmanager
    def plain(self):
        """Launch the PDL cubins without the PDL attribute (each kernel starts after the one ahead
        ends; their ``griddepcontrol.wait`` returns at once) inside this block."""
        before, self.pdl_launch = self.pdl_launch, False
        try:
            yield
        finally:
            self.pdl_launch = before

    def __call__(self, kernel, grid, args, constexprs, num_warps, num_stages):
        present = [a for a in args if a is not None]  # absent optionals are specialised away
        # what picks the binary, as the call gives it (a wrapper builds its constexprs in one order; another
        # order is only another entry for the same binary); USE_PDL follows from the kernel and self.pdl
        fast_key = (id(kernel), tuple([a.dtype if isinstance(a, torch.Tensor) else
                                       (a.base.dtype, *a.block_shape) if is_descriptor(a) else type(a) for a in args]),
                    tuple(constexprs.items()), num_warps, num_stages)
        binary = self._fast.get(fast_key)
        if binary is None:
            constexprs = with_pdl(kernel, constexprs, self.pdl)
            spec = spec_of(kernel, args, constexprs, num_warps, num_stages)
            binary = self.binaries.get(spec_key(spec))
            if binary is None:
                origin = kernel_templates.origin(spec["kernel"].partition(":")[0])
                rendered = f" rendered from template {origin[0]} with {origin[1]}" if origin else ""
                raise MxcError(f"kernel {spec['kernel']}{rendered} with constexprs {spec['constexprs']} is not in "
                               f"the artifact (built for other shapes or batch sizes); rebuild it, or load with "
                               f"rebuild_kernels=True")
            if len(present) != binary.n_args:
                raise MxcError(f"kernel {spec['kernel']} takes {binary.n_args} arguments in the artifact, "
                               f"the launch gives {len(present)}; rebuild it")
            self._fast[fast_key] = binary
        binary.launch(grid, present, self.pdl_launch)
