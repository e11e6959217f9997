"""The PDL hazard check: what a kernel touches before ``griddepcontrol.wait``, from its PTX, and the build's refusal."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from mxc.codegen import pdl_check
from mxc.kernels import pdl
from mxc.kernels.pdl import prefetch_rows_l2
from tests.sm90_compile import run_compile_script

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
    assert [a.params for a in pdl_check.touched_before_wait(ptx, "k")] == [{1}, {2}]  # the slot is not w's


def test_an_address_loaded_from_memory_touches_no_argument():
    """A pointer read from memory (a table of pointers) is data: the access through it derives from no parameter."""
    ptx = _ptx("""
	ld.global.b64 	%rd8, [%rd2];
	ld.global.b32 	%r2, [%rd8];
""")
    (access,) = pdl_check.touched_before_wait(ptx, "k")
    assert access.params == {1} and access.line.startswith("ld.global.b64")


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


@triton.jit
def nowait(x_ptr, w_ptr, y_ptr, USE_PDL: tl.constexpr):
    offs = tl.arange(0, 128)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))  # never calls pdl_enter
'''

_COMPILE = """
import sys
sys.path.insert(0, sys.argv[1])
from mxc.codegen import aot
from mxc.errors import MxcError
sig = {"x_ptr": "*fp32", "w_ptr": "*fp32", "y_ptr": "*fp32", "USE_PDL": "constexpr"}
for name in ("early", "late", "nowait"):
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
    lines = run_compile_script(_COMPILE, args=[str(tmp_path)]).strip().splitlines()
    assert lines[0].startswith("early refused: kernel pdl_kernels:early loads x_ptr before griddepcontrol.wait"), lines
    assert "move it after pdl_enter" in lines[0], lines
    assert lines[1] == "late compiled", lines
    assert lines[2] == ("nowait refused: kernel pdl_kernels:nowait: built with USE_PDL but its PTX has no "
                        "griddepcontrol.wait"), lines


@pytest.mark.parametrize("exit_", ["@%p3 ret", "@!%p3 ret", "@%p3 exit", "exit"])
def test_an_exit_ahead_of_the_wait_is_reported(exit_):
    ptx = _ptx(f"""
	setp.ge.s32 	%p3, %r1, 7;
	{exit_};
""")
    (line,) = pdl_check.violations(ptx, "k", ARGS)
    assert line == f"exits the program before griddepcontrol.wait ({exit_})"
    assert pdl_check.violations(_ptx("", f"\t{exit_};"), "k", ARGS) == []


def test_a_kernel_without_a_wait_is_not_read_into_the_next_function():
    ptx = (_HEAD + "\tadd.s64 %rd5, %rd1, %rd4;\n\tld.global.b32 { %r2 }, [ %rd5 + 0 ];\n\tret;\n}\n"
           + _ptx("").replace(".entry k(", ".entry k2(").replace("k_param", "k2_param"))
    assert pdl_check.touched_before_wait(ptx, "k") == []


_ENTER_KERNELS = '''
import triton
import triton.language as tl

from mxc.kernels.pdl import pdl_enter, pdl_enter_early


@triton.jit
def enter(x_ptr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    tl.store(x_ptr, 1)


@triton.jit
def enter_early(x_ptr, USE_PDL: tl.constexpr):
    pdl_enter_early(USE_PDL)
    tl.store(x_ptr, 1)
'''

_ENTER_PTX = """
import sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import enter_kernels
for name in ("enter", "enter_early"):
    for pdl in (False, True):
        src = ASTSource(getattr(enter_kernels, name), signature={"x_ptr": "*i32", "USE_PDL": "constexpr"},
                        constexprs={"USE_PDL": pdl})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        print(name, pdl, *[w for line in ptx.splitlines() for w in ("wait", "launch_dependents")
                            if "griddepcontrol." + w in line])
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check is for machines without a GPU")
def test_pdl_enter_waits_then_lets_the_next_kernel_launch(tmp_path):
    """``pdl_enter``: ``griddepcontrol.wait`` then ``launch_dependents``; ``pdl_enter_early`` the other way round;
    without USE_PDL neither (a kernel launched the ordinary way, which also compiles below sm_90)."""
    (tmp_path / "enter_kernels.py").write_text(_ENTER_KERNELS)
    lines = run_compile_script(_ENTER_PTX, args=[str(tmp_path)]).strip().splitlines()
    assert lines == ["enter False", "enter True wait launch_dependents",
                     "enter_early False", "enter_early True launch_dependents wait"], lines


@triton.jit
def _prefetch_rows_kernel(w_ptr, rows_ptr, k_start, K: tl.constexpr, R: tl.constexpr, BYTES: tl.constexpr):
    prefetch_rows_l2(w_ptr, tl.load(rows_ptr + tl.arange(0, R)), k_start, K, BYTES)


@triton.jit
def _count_prefetch(ptrs):
    tl.atomic_add(ptrs, 1)  # stands in for the L2 hint: counts each address asked for


@pytest.mark.interpreter
@pytest.mark.parametrize("k,k_start,nbytes,cols", [
    (256, 0, 256, {0: 1, 32: 1}),  # int32: 32 columns a 128-byte line; two lines from column 0
    (256, 64, 512, {64: 1, 96: 1, 128: 1, 160: 1}),  # four lines from column k_start
    (65, 0, 512, {0: 1, 32: 1, 64: 2}),  # a 260-byte row: the fourth line would start past it, stays in the row
    (96, 64, 256, {64: 1, 95: 1}),  # a split-K program's slice near the row's end: its second line too stays in the row
])
def test_prefetch_rows_l2_asks_for_one_address_a_line_of_the_given_rows(monkeypatch, k, k_start, nbytes, cols):
    """``prefetch_rows_l2``: the first ``BYTES`` bytes from column ``k_start`` of each row in ``rows``, one address a
    128-byte line, never past the row (here each address asked for is counted in the weight matrix itself)."""
    monkeypatch.setattr(pdl, "prefetch_l2", _count_prefetch)
    w = torch.zeros(32, k, dtype=torch.int32)  # rows to spare: an address off the asked rows is counted, not a crash
    rows = torch.tensor([3, 1], dtype=torch.int32)
    _prefetch_rows_kernel[(1,)](w, rows, k_start, K=k, R=2, BYTES=nbytes)
    want = torch.zeros_like(w)
    for r in rows.tolist():
        for c, n in cols.items():
            want[r, c] = n
    assert torch.equal(w, want)


def test_prefetch_bytes_rule():
    """``prefetch_bytes``: 0 for none, else the bytes asked capped at the row (a power of two), at least 128."""
    from mxc.kernels.pdl import prefetch_bytes

    assert prefetch_bytes(0, 4096) == 0 and prefetch_bytes(-5, 4096) == 0
    assert prefetch_bytes(64, 4096) == 128 and prefetch_bytes(2048, 8192) == 2048
    assert prefetch_bytes(8192, 1000) == 1024 and prefetch_bytes(4096, 100) == 128


@pytest.mark.parametrize("inst,kind", [
    ("ld.global.b32 \t%r5, [%rd5]", "load"),
    ("ld.b32 \t%r5, [%rd5]", "load"),  # generic addressing may be global
    ("ldu.global.b32 \t%r5, [%rd5]", "load"),
    ("@!%p1 ld.global.nc.b32 \t%r5, [%rd5]", "load"),  # a negated guard is still a guard
    ("cp.async.ca.shared.global [%r6], [%rd5], 4", "load"),
    ("st.global.b32 \t[%rd5], %r1", "store"),
    ("atom.global.add.u32 \t%r5, [%rd5], 1", "atomic"),
    ("red.global.add.u32 \t[%rd5], 1", "atomic"),
])
def test_each_global_memory_instruction_is_reported(inst, kind):
    ptx = _ptx("\tadd.s64 \t%rd5, %rd2, %rd4;\n\t" + inst + ";")
    assert [(a.kind, a.params, a.line) for a in pdl_check.touched_before_wait(ptx, "k")] == [(kind, {1}, inst)]


@pytest.mark.parametrize("inst", [
    "ld.shared.b32 \t%r12, [%r11]",
    "st.shared.b32 \t[%r11], %r1",
    "atom.shared.add.u32 \t%r12, [%r11], 1",
    "ld.local.b32 \t%r12, [%r11]",
    "ld.const.b32 \t%r12, [%r11]",
    "prefetch.global.L2 \t[%rd5]",
    "cp.async.bulk.prefetch.L2.global [%rd5], 256",
])
def test_memory_of_the_program_itself_and_l2_hints_are_not_reported(inst):
    """Shared, local and constant memory are no kernel's output (here at an offset from the scalar argument n);
    an L2 prefetch reads nothing into the program."""
    ptx = _ptx(f"""
	ld.param.u32 	%r10, [k_param_3];
	add.s32 	%r11, %r10, %r1;
	add.s64 	%rd5, %rd2, %rd4;
	{inst};
""")
    assert pdl_check.touched_before_wait(ptx, "k") == []


def test_a_pointer_split_into_halves_is_followed():
    """A vector destination (``mov.b64 {lo, hi}``) takes the pointer into every element."""
    ptx = _ptx("""
	mov.b64 	{%r3, %r4}, %rd1;
	mov.b64 	%rd7, {%r9, %r4};
	ld.global.b32 	%r5, [%rd7];
""")
    assert [a.params for a in pdl_check.touched_before_wait(ptx, "k")] == [{0}]


def test_a_register_holding_two_pointers_in_turn_is_reported_for_both():
    """Double buffering: the loop swaps which pointer %rd10 holds; the analysis is flow-insensitive, so both."""
    ptx = _ptx("""
	mov.u64 	%rd10, %rd1;
	mov.u64 	%rd11, %rd2;
$L_loop:
	ld.global.b32 	%r5, [%rd10];
	mov.u64 	%rd12, %rd10;
	mov.u64 	%rd10, %rd11;
	mov.u64 	%rd11, %rd12;
	@%p2 bra 	$L_loop;
""")
    assert [a.params for a in pdl_check.touched_before_wait(ptx, "k")] == [{0, 1}]


def test_an_address_from_two_pointers_is_checked_for_each():
    """``tl.where(c, x_ptr, w_ptr)``: declaring x does not cover w."""
    ptx = _ptx("""
	selp.b64 	%rd5, %rd1, %rd2, %p1;
	ld.global.b32 	%r5, [%rd5];
""")
    assert [line.split(" (")[0] for line in pdl_check.violations(ptx, "k", ARGS, frozenset({"x_ptr"}))] == [
        "loads w_ptr before griddepcontrol.wait"]


def test_parameters_past_the_named_arguments_are_named_by_index():
    """``arg_names`` lists the kernel's own arguments; a parameter the compiler appends is named ``param_<i>``."""
    ptx = _ptx("\tadd.s64 \t%rd5, %rd2, %rd4;\n\tld.global.b32 \t%r5, [%rd5];")
    assert [line.split(" (")[0] for line in pdl_check.violations(ptx, "k", ARGS[:1])] == [
        "loads param_1 before griddepcontrol.wait"]


def test_the_entry_is_found_by_its_whole_name():
    """``k`` is not ``k_split`` printed ahead of it; an entry missing from the PTX is an error."""
    split = _ptx("\tadd.s64 \t%rd5, %rd2, %rd4;\n\tld.global.b32 \t%r5, [%rd5];")
    ptx = split.replace(".entry k(", ".entry k_split(").replace("k_param", "k_split_param") + _ptx("")
    assert pdl_check.touched_before_wait(ptx, "k") == []
    assert len(pdl_check.touched_before_wait(ptx, "k_split")) == 1
    with pytest.raises(ValueError, match="entry k2 not found"):
        pdl_check.touched_before_wait(ptx, "k2")
