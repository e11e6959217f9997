"""``mxc.kernels.launch``: routing launches through a launcher for a block, the wrappers' operand checks, and the
identity of a compiled binary (argument types named as Triton's JIT names them)."""

from __future__ import annotations

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
