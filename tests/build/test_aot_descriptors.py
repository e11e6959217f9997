"""A kernel with TMA tensor-descriptor arguments compiled ahead of time (sm_90, on the CPU): the prefill
attention's q, K and V descriptors become a 128-byte map parameter each, followed by the tensor's shape and
strides; the index entry keeps Triton's descriptor metadata, from which the runtime encodes the maps, and
the PDL check names the expanded parameters."""

from __future__ import annotations

import json

import pytest

from mxc.codegen import aot
from mxc.kernels import launch
from tests.sm90_compile import run_compile_script


def test_param_names_expand_descriptors():
    sig = {"x_ptr": "*bf16", "d": "tensordesc<bf16[64, 128]>", "n": "i32", "B": "constexpr"}
    assert aot.param_names(sig) == ["x_ptr", "d", "d.shape", "d.shape", "d.strides", "d.strides", "n"]
    assert launch.descriptor_rank("tensordesc<fp16[16, 32, 8]>") == 3 and launch.descriptor_rank("*fp16") is None


_PTX_PARAMS = """
.visible .entry k_split(
	.param .u64 k_split_param_0
)
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .align 64 .b8 k_param_1[128],
	.param .u64 k_param_2,
	.param .s32 k_param_3,
	.param .f32 k_param_4,
	.param .f64 k_param_5,
	.param .b8 k_param_6,
	.param .u16 k_param_7,
	.param .b32 k_param_8
)
{
	ret;
}
"""


def test_ptx_params_reads_each_kind_from_the_entry_declaration():
    """The kinds of ``k``'s parameters in order (a 128-byte, 64-aligned ``.b8`` array is a TMA map, a lone ``.b8``
    a byte); ``k_split`` ahead of it is another entry; a missing entry or an unknown type is an error."""
    assert aot.ptx_params(_PTX_PARAMS, "k") == ["ptr", "tmap", "i64", "i32", "f32", "f64", "i8", "i16", "i32"]
    assert aot.ptx_params(_PTX_PARAMS, "k_split") == ["i64"]
    with pytest.raises(RuntimeError, match="entry k2 not found"):
        aot.ptx_params(_PTX_PARAMS, "k2")
    with pytest.raises(RuntimeError, match=r"unrecognised PTX parameter '\.param \.f16 k_param_0' in k"):
        aot.ptx_params(".visible .entry k(\n\t.param .f16 k_param_0\n)", "k")


@pytest.mark.interpreter
def test_kernels_are_not_compiled_ahead_of_time_under_the_interpreter():
    from mxc.errors import MxcError

    with pytest.raises(MxcError, match="cannot compile kernels ahead of time under TRITON_INTERPRET=1"):
        aot._jit_function("mxc.kernels.pdl:pdl_enter")


_COMPILE = """
import json, sys, torch
from mxc.codegen import aot
from mxc.kernels import kernel_templates, launch
from mxc.kernels import triton_attention as ta
q = torch.empty(300, 8, 128, dtype=torch.bfloat16, device="meta")
cache = torch.empty(4, 512, 2, 128, dtype=torch.bfloat16, device="meta")
i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="meta")
recorder = launch.Recorder(pdl=sys.argv[1] == "pdl")
with launch.using(recorder), kernel_templates.unpinned():
    ta.prefill_attention(q, cache, cache, i32([1, 0]), i32([100, 200]), i32([0, 100, 300]), 300, 0.1, None)
((key, spec),) = recorder.specs.items()
_, _, entry = aot._compile_one(key, spec, 90, kernel_templates.source(spec["kernel"].partition(":")[0]))
print(json.dumps(entry))
"""


@pytest.mark.parametrize("pdl", [False, True])
def test_prefill_attention_compiles_with_tma_maps(pdl):
    out = run_compile_script(_COMPILE, args=["pdl" if pdl else "plain"])  # compiles for sm_90 with ptxas
    entry = json.loads(out.strip().splitlines()[-1])
    tmap = ["tmap", "i32", "i32", "i64", "i64"]
    # q, k_cache, v_cache, slots, kv_lens, q_start, out pointers, the scale, then the three descriptors
    assert entry["params"][:8] == ["ptr"] * 7 + ["f32"]
    assert entry["params"][8:23] == tmap * 3 and set(entry["params"][23:]) <= {"ptr"}
    assert entry["args"][8:] == ["tensordesc<bf16[64, 128]>"] * 3
    assert len(entry["tensordesc"]) == 3 and entry["pdl"] == pdl
    assert entry["shared"] > 0  # TMA copies land in shared memory: the launcher must reserve it
    for meta in entry["tensordesc"]:  # a bf16 [64, 128] block moves as [64, 64] boxes under the 128-byte swizzle
        assert meta["elem_size"] == 2 and meta["block_size"][0] == 64 and meta["block_size"][1] * 2 <= 128


_DEVICE_DESCRIPTOR = """
import triton
import triton.language as tl


@triton.jit
def device_desc(x_ptr, y_ptr, n):
    desc = tl.make_tensor_descriptor(x_ptr, shape=[n, 64], strides=[64, 1], block_shape=[16, 64])
    tl.store(y_ptr + tl.arange(0, 16)[:, None] * 64 + tl.arange(0, 64)[None, :], desc.load([0, 0]))
"""

_COMPILE_DEVICE_DESCRIPTOR = """
import sys
sys.path.insert(0, sys.argv[1])
from mxc.codegen import aot
from mxc.errors import MxcError
spec = {"kernel": "desc_kernels:device_desc", "signature": {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32"},
        "constexprs": {}, "num_warps": 4, "num_stages": 1}
try:
    aot._compile_one("k", spec, 90, None)
    print("compiled")
except MxcError as e:
    print(e)
"""


def test_a_descriptor_made_on_the_device_is_refused(tmp_path):
    """A descriptor built inside the kernel (``tl.make_tensor_descriptor``) needs Triton's global scratch memory for
    its map, which the AOT launcher does not pass: the build refuses it instead of launching it without."""
    (tmp_path / "desc_kernels.py").write_text(_DEVICE_DESCRIPTOR)
    out = run_compile_script(_COMPILE_DEVICE_DESCRIPTOR, args=[str(tmp_path)])
    assert out.strip().splitlines()[-1] == ("kernel desc_kernels:device_desc needs Triton scratch memory, "
                                            "which the AOT launcher does not provide")


class _Compiled:
    def __init__(self, ptx, **md):
        from types import SimpleNamespace

        self.asm = {"ptx": ptx, "cubin": b"\x7fELF"}
        self.metadata = SimpleNamespace(**{"name": "k", "shared": 0, "num_warps": 4, **md})


_K_PTX = ".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1,\n" \
         "\t.param .align 64 .b8 k_param_2[128],\n\t.param .u32 k_param_3,\n\t.param .u64 k_param_4\n)\n{\n" \
         "\tgriddepcontrol.wait;\n\tret;\n}\n"


def _compile_with(monkeypatch, spec, **md):
    """``aot._compile_one`` with Triton's compiler stood in for (what it is asked, what it returns): the host-side
    rules around it, in this process."""
    import triton
    import triton.compiler
    from types import SimpleNamespace

    seen = {}
    names = [n for n in spec["signature"]]
    monkeypatch.setattr(aot, "_jit_function", lambda kernel, source=None: SimpleNamespace(arg_names=names))
    monkeypatch.setattr(triton.compiler, "ASTSource", lambda fn, signature, constexprs, attrs: seen.update(attrs=attrs))
    monkeypatch.setattr(triton, "compile", lambda src, target, options: _Compiled(md.pop("ptx", _K_PTX), **md))
    return aot._compile_one("key", spec, 90, None), seen


_SPEC = {"kernel": "m:k", "signature": {"x_ptr": "*bf16", "n": "i32", "d": "tensordesc<bf16[64, 128]>",
                                        "B": "constexpr"},
         "constexprs": {"B": 4}, "num_warps": 4, "num_stages": 1}


def test_only_pointers_are_compiled_as_aligned(monkeypatch):
    """Pointer arguments are compiled 16-byte aligned (the runtime checks it); integers, descriptors and
    constexprs are not assumed divisible."""
    (_, _, entry), seen = _compile_with(monkeypatch, _SPEC, tensordesc_meta=[{"elem_size": 2}])
    assert seen["attrs"] == {(0,): [["tt.divisibility", 16]]}
    assert entry["args"] == ["*bf16", "i32", "tensordesc<bf16[64, 128]>"] and entry["tensordesc"] == [{"elem_size": 2}]


@pytest.mark.parametrize("scratch", ["global_scratch_size", "profile_scratch_size"])
def test_scratch_memory_of_either_kind_is_refused(monkeypatch, scratch):
    from mxc.errors import MxcError

    with pytest.raises(MxcError, match="needs Triton scratch memory"):
        _compile_with(monkeypatch, _SPEC, tensordesc_meta=[{}], **{scratch: 64})


@pytest.mark.parametrize("maps", [0, 2])
def test_descriptors_not_all_lowered_to_tma_are_refused(monkeypatch, maps):
    from mxc.errors import MxcError

    with pytest.raises(MxcError, match=f"Triton gave {maps} maps for 1 descriptors"):
        _compile_with(monkeypatch, _SPEC, tensordesc_meta=[{}] * maps)


def test_a_pdl_refusal_counts_the_other_violations(monkeypatch):
    """Each violation past the first is counted in the one refusal."""
    from mxc.codegen import pdl_check
    from mxc.errors import MxcError

    spec = {**_SPEC, "constexprs": {"B": 4, "USE_PDL": True}}
    monkeypatch.setattr(pdl_check, "violations", lambda ptx, name, params, declared: ["loads x_ptr", "loads n", "x"])
    with pytest.raises(MxcError, match="kernel m:k loads x_ptr: under PDL") as e:
        _compile_with(monkeypatch, spec, tensordesc_meta=[{}])
    assert str(e.value).endswith("; and 2 more")
    monkeypatch.setattr(pdl_check, "violations", lambda ptx, name, params, declared: ["loads x_ptr"])
    with pytest.raises(MxcError) as e:
        _compile_with(monkeypatch, spec, tensordesc_meta=[{}])
    assert "more" not in str(e.value)
