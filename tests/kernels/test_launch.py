"""``mxc.kernels.launch``: routing launches through a launcher for a block, the wrappers' operand checks, and the
identity of a compiled binary (argument types named as Triton's JIT names them)."""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import mangle_type

from mxc.kernels import launch


@triton.jit
def _copy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr = 64):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


def test_using_routes_launches_for_the_block_only():
    """``using`` routes every ``launch`` through its launcher inside the block and restores the one before after it,
    nested blocks and a block left by an exception included."""
    calls = []
    outer = lambda kernel, *a: calls.append(("outer", kernel))  # noqa: E731
    inner = lambda kernel, *a: calls.append(("inner", kernel))  # noqa: E731
    before = launch._launcher
    with launch.using(outer):
        launch.launch("k1", (1,), [], {})
        with pytest.raises(RuntimeError):
            with launch.using(inner):
                launch.launch("k2", (1,), [], {})
                raise RuntimeError
        launch.launch("k3", (1,), [], {})
    assert launch._launcher is before
    assert calls == [("outer", "k1"), ("inner", "k2"), ("outer", "k3")]


def test_check_operand_wants_contiguous_tensors_of_the_shape_dtype_and_device():
    cpu = torch.device("cpu")
    t = torch.zeros(4, 6)
    launch.check_operand("bias", t, (4, 6), torch.float32, cpu)
    for bad in (None, torch.zeros(6, 4).t(), torch.zeros(4, 12)[:, ::2], t.to(torch.float16), torch.zeros(4, 5),
                torch.zeros(6, 4)):
        with pytest.raises(ValueError, match=r"bias must be contiguous \[4, 6\] torch.float32 on cpu"):
            launch.check_operand("bias", bad, (4, 6), torch.float32, cpu)


def test_spec_types_arguments_as_triton_does():
    """A launch's spec names each runtime argument's type as Triton's JIT does (tensors by dtype, ints as i32, floats
    as fp32, an absent pointer as a constexpr), a bool as a 1-bit integer, and fills in constexpr defaults."""
    x = torch.zeros(8, dtype=torch.bfloat16, device="meta")
    spec = launch.spec_of(_copy, [x, None, 8, 0.5], {}, 4, 1)
    assert spec["signature"] == {"x_ptr": mangle_type(x), "y_ptr": mangle_type(None), "n": mangle_type(8),
                                 "scale": mangle_type(0.5), "BLOCK": "constexpr"}
    assert spec["constexprs"] == {"y_ptr": None, "BLOCK": 64}
    assert launch.spec_of(_copy, [x, x, 8, 0.5], {"BLOCK": 128}, 8, 3)["constexprs"] == {"BLOCK": 128}
    for dtype in (torch.float32, torch.float16, torch.float8_e4m3fn, torch.int64, torch.int32, torch.uint8):
        t = torch.zeros(2, dtype=dtype, device="meta")
        assert launch._arg_type(t) == mangle_type(t), dtype
    assert launch._arg_type(True) in ("i1", "u1") and launch._arg_type(False) == launch._arg_type(True)


@pytest.mark.parametrize("args", [[None, None, 8], [None, None, 8, 0.5, 1]])
def test_spec_refuses_a_wrong_argument_count(args):
    with pytest.raises(TypeError, match=r"_copy takes 4 runtime arguments \(x_ptr, y_ptr, n, scale\), got"):
        launch.spec_of(_copy, args, {}, 4, 1)


def test_recorder_keeps_each_launch_s_warps_and_stages():
    """``launch(..., num_warps=, num_stages=)`` reaches the launcher as given: a recorded spec, one per binary."""
    x = torch.zeros(8, dtype=torch.float16, device="meta")
    rec = launch.Recorder()
    with launch.using(rec):
        for _ in range(2):
            launch.launch(_copy, (1,), [x, x, 8, 0.5], {}, num_warps=8, num_stages=3)
        launch.launch(_copy, (1,), [x, x, 8, 0.5], {})
    assert sorted((s["num_warps"], s["num_stages"]) for s in rec.specs.values()) == [(4, 1), (8, 3)]


@triton.jit
def _two_consts(x_ptr, n, A: tl.constexpr, B: tl.constexpr):
    pass


class _Kernel:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` is recorded, not run."""

    def __init__(self, arg_names):
        self.arg_names, self.calls = arg_names, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_jit_launchers_pass_warps_stages_and_pdl_to_the_kernel():
    """``jit_launch`` is ``kernel[grid](*args, **constexprs, num_warps=, num_stages=)``; ``jit_launch_pdl`` adds
    ``launch_pdl=True`` and ``USE_PDL=True`` where the kernel takes it (and only there)."""
    k = _Kernel(["x", "n", "BLOCK"])
    launch.jit_launch(k, (3,), [1, 2], {"BLOCK": 16}, 8, 3)
    assert k.calls == [((3,), (1, 2), {"BLOCK": 16, "num_warps": 8, "num_stages": 3})]
    launch.jit_launch_pdl(k, (3,), [1, 2], {"BLOCK": 16}, 2, 5)
    assert k.calls[1] == ((3,), (1, 2), {"BLOCK": 16, "num_warps": 2, "num_stages": 5, "launch_pdl": True})
    pdl = _Kernel(["x", "n", "BLOCK", "USE_PDL"])
    launch.jit_launch_pdl(pdl, (1, 2), [1], {"BLOCK": 16}, 4, 1)
    assert pdl.calls == [((1, 2), (1,), {"BLOCK": 16, "USE_PDL": True, "num_warps": 4, "num_stages": 1,
                                         "launch_pdl": True})]


def test_launch_hands_the_launcher_a_tuple_grid_and_a_list_of_arguments():
    """``launch`` normalises what wrappers pass (a grid list, an argument tuple): every launcher gets the grid as a
    tuple, the arguments as a list, the constexprs as a dict, and the default 4 warps and 1 stage."""
    got = []
    with launch.using(lambda *a: got.append(a)):
        launch.launch("k", [4, 2], (1, 2), {"BLOCK": 8})
    assert got == [("k", (4, 2), [1, 2], {"BLOCK": 8}, 4, 1)]
    assert [type(v) for v in got[0][1:4]] == [tuple, list, dict]


def test_stream_handle_asks_the_device_given_else_the_current_one(monkeypatch):
    """``stream_handle``: the raw current stream of ``device``'s index, of the current device when no device (or one
    without an index) is given; through ``torch.cuda.current_stream`` where torch lacks the raw accessor."""
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda index: 1000 + index)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 3, raising=False)
    assert launch.stream_handle() == 1003
    assert launch.stream_handle(torch.device("cuda", 1)) == 1001
    assert launch.stream_handle(torch.device("cuda")) == 1003

    class _Stream:
        def __init__(self, device=None):
            self.cuda_stream = 7 if device is None else 100 + device.index

    monkeypatch.setattr(launch, "_RAW_STREAM", None)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    assert launch.stream_handle() == 7 and launch.stream_handle(torch.device("cuda", 2)) == 102


def test_check_operand_wants_the_device():
    launch.check_operand("out", torch.zeros(2, 3, device="meta"), (2, 3), torch.float32, torch.device("meta"))
    with pytest.raises(ValueError, match=r"out must be contiguous \[2, 3\] torch.float32 on cpu"):
        launch.check_operand("out", torch.zeros(2, 3, device="meta"), (2, 3), torch.float32, torch.device("cpu"))


def test_every_tensor_dtype_is_typed_as_triton_does():
    """Each dtype of ``TRITON_DTYPES`` gives Triton's pointer type (a bool tensor: a 1-bit integer, which Triton
    names ``i1`` or ``u1`` by version)."""
    for name in launch.TRITON_DTYPES:
        t = torch.zeros(2, dtype=getattr(torch, name.removeprefix("torch.")), device="meta")
        want = mangle_type(t)
        got = launch._arg_type(t)
        assert got == want or (t.dtype == torch.bool and {got, want} <= {"*i1", "*u1"}), (name, got, want)


def test_spec_refuses_an_argument_kernels_cannot_take():
    with pytest.raises(TypeError, match="unsupported kernel argument 'eight'"):
        launch.spec_of(_copy, [None, None, "eight", 0.5], {}, 4, 1)


def test_kernel_id_names_the_kernel_s_module_and_function():
    """The id a binary is stored under names the kernel's module and function, so the runtime can import it."""
    module, name = launch.kernel_id(_copy).split(":")
    assert getattr(importlib.import_module(module), name) is _copy
    assert launch.spec_of(_copy, [None, None, 8, 0.5], {}, 4, 1)["kernel"] == launch.kernel_id(_copy)


def test_one_binary_whatever_the_order_of_its_constexprs():
    """Launches that differ only in the order their constexprs were given need one binary: one recorded spec."""
    x = torch.zeros(8, dtype=torch.float16, device="meta")
    rec = launch.Recorder()
    with launch.using(rec):
        launch.launch(_two_consts, (1,), [x, 8], {"A": 1, "B": 2})
        launch.launch(_two_consts, (1,), [x, 8], {"B": 2, "A": 1})
    assert len(rec.specs) == 1


@triton.jit
def _pdl_copy(x_ptr, n, BLOCK: tl.constexpr = 16, USE_PDL: tl.constexpr = False):
    pass


def test_recorder_records_the_pdl_variant_only_when_asked():
    """A plain recorder keeps a PDL-capable kernel's launch as given; one for a ``pdl`` artifact sets ``USE_PDL``
    (even over a caller's False: every kernel of such an artifact is launched for PDL, so each must wait), and
    leaves a kernel without ``USE_PDL`` alone."""
    x = torch.zeros(8, dtype=torch.float16, device="meta")
    for pdl in (False, True):
        rec = launch.Recorder(pdl=pdl) if pdl else launch.Recorder()
        with launch.using(rec):
            launch.launch(_pdl_copy, (1,), [x, 8], {})
            launch.launch(_pdl_copy, (1,), [x, 8], {"USE_PDL": False})
            launch.launch(_copy, (1,), [x, x, 8, 0.5], {})
        uses = sorted(str(s["constexprs"].get("USE_PDL")) for s in rec.specs.values())
        assert uses == (["None", "True"] if pdl else ["False", "None"]), (pdl, uses)


def test_descriptor_arguments_are_typed_as_triton_does():
    """A host tensor descriptor's type is Triton's ``tensordesc<dtype[block]>``; its rank is its block's."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    for dtype, block in [(torch.bfloat16, [16, 32]), (torch.float8_e4m3fn, [8, 16, 32])]:
        t = torch.zeros([2 * b for b in block], dtype=dtype)
        desc = TensorDescriptor.from_tensor(t, block)
        assert launch.is_descriptor(desc) and not launch.is_descriptor(t)
        assert launch._arg_type(desc) == mangle_type(desc)
        assert launch.descriptor_rank(launch._arg_type(desc)) == len(block)


@triton.jit
def _scaled(x_ptr, n, scale=1.0, BLOCK: tl.constexpr = 64):
    pass


def test_a_runtime_argument_s_default_is_no_constexpr():
    """Only constexpr parameters' defaults are filled in: a runtime parameter with a default stays a runtime
    argument, typed by its value."""
    x = torch.zeros(8, dtype=torch.float16, device="meta")
    spec = launch.spec_of(_scaled, [x, 8, 0.5], {}, 4, 1)
    assert spec["constexprs"] == {"BLOCK": 64}
    assert spec["signature"] == {"x_ptr": mangle_type(x), "n": mangle_type(8), "scale": mangle_type(0.5),
                                 "BLOCK": "constexpr"}
