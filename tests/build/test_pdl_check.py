"""The PDL hazard check: what a kernel touches before ``griddepcontrol.wait``, from its PTX, and the build's refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxc.codegen import pdl_check

_HEAD = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u64 .ptr .global .align 1 k_param_1,
	.param .u64 .ptr .global .align 1 k_param_2,
	.param .u32 k_param_3
)
{
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b64 	%rd2, [k_param_1];
	ld.param.b64 	%rd3, [k_param_2];
	mov.u32 	%r1, %tid.x;
	mul.wide.u32 	%rd4, %r1, 4;
"""
ARGS = ["x_ptr", "w_ptr", "y_ptr", "n"]


def _ptx(before: str, after: str = "") -> str:
    return _HEAD + before + "\n\tgriddepcontrol.wait ;\n" + after + "\n\tret;\n}\n"


def test_a_load_through_pointer_arithmetic_is_found():
    ptx = _ptx("""
	add.s64 	%rd5, %rd1, %rd4;   // x + 4 * tid
	mad.wide.s32 	%rd6, %r1, 2, %rd5;
	@%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd6 + 0 ];
""")
    (access,) = pdl_check.touched_before_wait(ptx, "k")
    assert access.kind == "load" and access.params == {0}
    assert pdl_check.violations(ptx, "k", ARGS) == [f"loads x_ptr before griddepcontrol.wait ({access.line})"]
    assert pdl_check.violations(ptx, "k", ARGS, frozenset({"x_ptr"})) == []


def test_accesses_after_the_wait_and_prefetches_are_not_reported():
    ptx = _ptx("""
	add.s64 	%rd5, %rd2, %rd4;
	prefetch.global.L2 	[%rd5];
	ld.shared.b32 	%r9, [%r1];
""", """
	add.s64 	%rd7, %rd1, %rd4;
	ld.global.b32 { %r2 }, [ %rd7 + 0 ];
""")
    assert pdl_check.touched_before_wait(ptx, "k") == []


def test_a_loaded_index_does_not_carry_its_pointer():
    """slot = slots[b] read early (declared), then k_cache + slot * stride: the access touches k_cache."""
    ptx = _ptx("""
	ld.global.b32 { %r2 }, [ %rd2 + 0 ];
	mul.wide.s32 	%rd8, %r2, 256;
	add.s64 	%rd9, %rd3, %rd8;
	ld.global.b32 { %r3 }, [ %rd9 + 0 ];
""")
    found = pdl_check.violations(ptx, "k", ARGS, frozenset({"w_ptr"}))
    assert len(found) == 1 and found[0].startswith("loads y_ptr")


def test_stores_atomics_and_async_copies_are_reported_even_when_declared():
    ptx = _ptx("""
	add.s64 	%rd5, %rd3, %rd4;
	st.global.b32 	[%rd5], %r1;
	atom.global.gpu.acq_rel.add.u32 	%r7, [%rd5], 1;
	add.s64 	%rd6, %rd1, %rd4;
	cp.async.cg.shared.global [ %r8 + 0 ], [ %rd6 + 0 ], 0x10, %r9;
""")
    found = pdl_check.violations(ptx, "k", ARGS, frozenset({"x_ptr", "y_ptr"}))
    assert [line.split(" (")[0] for line in found] == [
        "atomics y_ptr before griddepcontrol.wait", "stores y_ptr before griddepcontrol.wait"]


def test_a_pointer_carried_around_a_loop_is_followed():
    """The fixed point: %rd11 gets w's pointer only from the back edge (a later mov)."""
    ptx = _ptx("""
	mov.u64 	%rd10, 0;
$L_loop:
	add.s64 	%rd11, %rd10, %rd4;
	ld.global.b32 { %r5 }, [ %rd11 + 0 ];
	mov.u64 	%rd10, %rd2;
	@%p2 bra 	$L_loop;
""")
    (access,) = pdl_check.touched_before_wait(ptx, "k")
    assert access.params == {1}


def test_a_kernel_without_a_wait_touches_nothing_before_it():
    ptx = _HEAD + "\tadd.s64 %rd5, %rd1, %rd4;\n\tld.global.b32 { %r2 }, [ %rd5 + 0 ];\n\tret;\n}\n"
    assert pdl_check.touched_before_wait(ptx, "k") == []


def test_reads_before_wait_names_real_arguments():
    import triton

    from mxc.kernels.pdl import reads_before_wait

    @triton.jit
    def kern(a_ptr, b_ptr):
        pass

    assert reads_before_wait("b_ptr")(kern).reads_before_wait == {"b_ptr"}
    with pytest.raises(ValueError, match="no argument w_ptr"):
        reads_before_wait("w_ptr")(kern)


_KERNELS = '''
import triton
import triton.language as tl

from mxc.kernels.pdl import pdl_enter, reads_before_wait


@reads_before_wait("w_ptr")
@triton.jit
def early(x_ptr, w_ptr, y_ptr, USE_PDL: tl.constexpr):
    offs = tl.arange(0, 128)
    w = tl.load(w_ptr + offs)
    x = tl.load(x_ptr + offs)  # written by the kernel ahead: a race under PDL
    pdl_enter(USE_PDL)
    tl.store(y_ptr + offs, x * w)


@reads_before_wait("w_ptr")
@triton.jit
def late(x_ptr, w_ptr, y_ptr, USE_PDL: tl.constexpr):
    offs = tl.arange(0, 128)
    w = tl.load(w_ptr + offs)  # weights: declared, read early
    pdl_enter(USE_PDL)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, x * w)
'''

_COMPILE = """
import sys
sys.path.insert(0, sys.argv[1])
from mxc.codegen import aot
from mxc.errors import MxcError
sig = {"x_ptr": "*fp32", "w_ptr": "*fp32", "y_ptr": "*fp32", "USE_PDL": "constexpr"}
for name in ("early", "late"):
    spec = {"kernel": "pdl_kernels:" + name, "signature": sig, "constexprs": {"USE_PDL": True}, "num_warps": 4,
            "num_stages": 1}
    try:
        aot._compile_one(name, spec, 90, None)
        print(name, "compiled")
    except MxcError as e:
        print(name, "refused:", e)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_the_build_refuses_a_kernel_that_reads_its_input_before_the_wait(tmp_path):
    (tmp_path / "pdl_kernels.py").write_text(_KERNELS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path)], cwd=Path(__file__).resolve().parents[2],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("early refused: kernel pdl_kernels:early loads x_ptr before griddepcontrol.wait"), lines
    assert "move it after pdl_enter" in lines[0], lines
    assert lines[1] == "late compiled", lines


def test_an_exit_ahead_of_the_wait_is_reported():
    ptx = _ptx("""
	setp.ge.s32 	%p3, %r1, 7;
	@%p3 ret;
""")
    (line,) = pdl_check.violations(ptx, "k", ARGS)
    assert line == "exits the program before griddepcontrol.wait (@%p3 ret)"
    assert pdl_check.violations(_ptx("", "\t@%p3 ret;"), "k", ARGS) == []


def test_a_kernel_without_a_wait_is_not_read_into_the_next_function():
    ptx = (_HEAD + "\tadd.s64 %rd5, %rd1, %rd4;\n\tld.global.b32 { %r2 }, [ %rd5 + 0 ];\n\tret;\n}\n"
           + _ptx("").replace(".entry k(", ".entry k2(").replace("k_param", "k2_param"))
    assert pdl_check.touched_before_wait(ptx, "k") == []


def test_prefetch_bytes_rule():
    """``prefetch_bytes``: 0 for none, else the bytes asked capped at the row (a power of two), at least 128."""
    from mxc.kernels.pdl import prefetch_bytes

    assert prefetch_bytes(0, 4096) == 0 and prefetch_bytes(-5, 4096) == 0
    assert prefetch_bytes(64, 4096) == 128 and prefetch_bytes(2048, 8192) == 2048
    assert prefetch_bytes(8192, 1000) == 1024 and prefetch_bytes(4096, 100) == 128
