"""The CUTLASS fp8 GEMM generator on the CPU: source from cutlass_cppgen, nvcc into a .so, its C entry points.

The generator's tests skip where it (package nvidia-cutlass) or nvcc is missing, even where ``$MXC_CUTLASS_LIBRARY``
names a prebuilt library; the host code's tests, on a fake library, run everywhere. The compile test builds the library
a build ships (``build_library``: nvcc on ``BUILD_CONFIG``, about 90 s on a 2-core machine, cached by the source's
hash, so the fp8 cuda build tests and this one compile it once); the GPU run is tests/gpu/test_cutlass_fp8_gpu.py.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import time

import pytest

from mxc.kernels import cutlass_fp8

_WHY_NOT = cutlass_fp8.generator_available()
needs_generator = pytest.mark.skipif(_WHY_NOT is not None, reason=f"CUTLASS fp8 generator unusable here: {_WHY_NOT}")

ENTRIES = ("mxc_cutlass_fp8_gemm", "mxc_cutlass_fp8_workspace", "mxc_cutlass_fp8_can_implement",
           "mxc_cutlass_fp8_name", "mxc_cutlass_fp8_gemm_residual", "mxc_cutlass_fp8_residual_workspace")
PAIR_ENTRIES = ("mxc_cutlass_fp8_gemm_silu_pair", "mxc_cutlass_fp8_silu_pair_workspace",
                "mxc_cutlass_fp8_silu_pair_block")


@pytest.fixture(scope="module")
def source():
    return cutlass_fp8.generate()


@needs_generator
def test_generate_emits_kernel_and_entry_points(source):
    assert 'extern "C"' in source
    for entry in ENTRIES:
        assert f" {entry}(" in source
    # e4m3 x e4m3 (A row-major, B column-major = wq [N, K] row-major), fp32 accumulation, bf16 out, no C
    assert "cutlass::float_e4m3_t, cutlass::layout::RowMajor, 16" in source
    assert "cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, 16" in source
    plain, residual = source.split("namespace mxc_cutlass_fp8_plain {")[1].split("namespace mxc_cutlass_fp8_residual {")
    assert "using ElementD = cutlass::bfloat16_t;" in plain and "using ElementC = void;" in plain
    # the traced epilogue: scale_a per row (column broadcast), scale_b per column (row broadcast), bf16 last
    assert "Sm90ColBroadcast" in plain and "Sm90RowBroadcast" in plain
    assert "cutlass::multiplies, cutlass::bfloat16_t, float" in plain
    # the residual kernel: the same product, + C (bf16, the source operand) ...
    assert "using ElementC = cutlass::bfloat16_t;" in residual and "Sm90SrcFetch<cutlass::bfloat16_t>" in residual
    # ... the scaled product rounded to bf16 first (the unfused order), then + C in fp32, rounded to bf16
    assert "cutlass::multiplies, cutlass::bfloat16_t, float" in residual
    assert "cutlass::plus, cutlass::bfloat16_t, float" in residual
    assert "using EVTCompute2" in residual and "using EVTCompute2" not in plain
    assert "cutlass::gemm::KernelTmaWarpSpecializedCooperative\n" in source  # promoted fp32 accumulation
    assert "cute::Shape<cute::_128, cute::_128, cute::_128>" in source


@needs_generator
def test_small_m_kernels_and_the_dispatch(monkeypatch):
    """The shipped library's second configuration: two more kernels, and every entry point picks by M."""
    source = cutlass_fp8.generate(**cutlass_fp8.BUILD_CONFIG)
    small = cutlass_fp8.BUILD_CONFIG["small_m"]
    assert "#define MXC_SMALL_M_MAX 256" in source and small["max_m"] == 256
    for kind in ("plain", "residual"):
        assert f"namespace mxc_cutlass_fp8_{kind} {{" in source and f"namespace mxc_cutlass_fp8_small_{kind} {{" in source
    # the small-M pair's CTA tile (2 each), and its SiLU-pair kernel's
    assert source.count("cute::Shape<cute::_64, cute::_128, cute::_128>") == 5
    assert source.count("KernelTmaWarpSpecializedPingpongFP8FastAccum") == 6
    assert source.count("MXC_BY_M(M, ") == 8  # the macro, then every entry point but name() and the pair's block
    for entry in PAIR_ENTRIES:
        assert f" {entry}(" in source
    assert "namespace mxc_cutlass_fp8_silu_pair {" in source and "namespace mxc_cutlass_fp8_small_silu_pair {" in source
    assert "struct SiluPairEpilogue" in source and "#pragma once" not in source  # the header, embedded
    assert f"int mxc_cutlass_fp8_silu_pair_block() {{ return {cutlass_fp8.PAIR_BLOCK}; }}" in source
    # the library's name: the main plain kernel's, then the small-M plain kernel's (not a residual one's)
    name = source.split('mxc_cutlass_fp8_name() { return "')[1].split('"')[0]
    main, small_name = name.split("; M <= 256: ")
    assert "_void_bf16" in main and "_void_bf16" in small_name and "64x128x128_1x1x1" in small_name
    single = cutlass_fp8.generate()
    assert "#define MXC_SMALL_M_MAX 0" in single and "namespace mxc_cutlass_fp8_small_plain = mxc_cutlass_fp8_plain;" in single
    monkeypatch.delenv(cutlass_fp8.PREBUILT_ENV, raising=False)
    assert cutlass_fp8.library_config()["small_m"] == {**small, "tile": [64, 128, 128], "cluster": [1, 1, 1]}


@needs_generator
def test_generate_options():
    fast = cutlass_fp8.generate(tile=(128, 256, 128), cluster=(2, 1, 1), schedule="cooperative", fast_accum=True)
    assert "KernelTmaWarpSpecializedCooperativeFP8FastAccum" in fast
    assert "cute::Shape<cute::_2,cute::_1,cute::_1>" in fast
    # every tile the kernel declares is the CTA's: the collectives' and the EVT broadcasts' (see _fix_evt_tile)
    assert fast.count("cute::Shape<cute::_128, cute::_256, cute::_128>") == 4  # two kernels
    assert fast.count("EpilogueDescriptor<\n  cute::Shape<_128, _256, _128>") == 2
    assert "_256, _256" not in fast and "cute::_256, cute::_256" not in fast
    assert "silu_pair" not in fast  # SiLU-pair kernels for pingpong configurations only
    with pytest.raises(ValueError, match="schedule"):
        cutlass_fp8.generate(schedule="stream-k")
    with pytest.raises(ValueError, match="scheduler"):
        cutlass_fp8.generate(scheduler="round-robin")


@needs_generator
def test_compile_failure_reports_nvcc_output(tmp_path):
    with pytest.raises(RuntimeError, match="nvcc failed.*\n.*mxc_compile_probe"):
        cutlass_fp8.compile_so('#error "mxc_compile_probe"\n', tmp_path / "bad.so")
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


@needs_generator
@pytest.mark.xdist_group("cutlass")  # one pytest-xdist worker compiles the library (tests/conftest.py)
def test_compile_so_exports_entry_points(tmp_path, monkeypatch):
    monkeypatch.delenv(cutlass_fp8.PREBUILT_ENV, raising=False)
    start = time.perf_counter()
    so = cutlass_fp8.build_library(tmp_path / "cutlass_fp8.so", log=lambda m: None)
    seconds = time.perf_counter() - start
    print(f"nvcc: {seconds:.1f} s, {so.stat().st_size / 2**20:.2f} MiB")
    assert so.is_file() and [p.name for p in tmp_path.iterdir()] == ["cutlass_fp8.so"]
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True,
                                 check=True).stdout
        for entry in ENTRIES + PAIR_ENTRIES:
            assert f" T {entry}\n" in symbols
    # cudart is linked statically and loads the driver lazily: the library opens without a GPU
    lib = ctypes.CDLL(str(so))
    for entry in ENTRIES:
        assert hasattr(lib, entry)
    gemm = cutlass_fp8.load(so)
    assert gemm.name.startswith("cutlass3x_sm90_tensorop") and "e4m3_e4m3_f32_void_bf16" in gemm.name
    assert "; M <= 256: " in gemm.name and "64x128x128_1x1x1" in gemm.name.split("; ")[1]
    assert gemm.can_implement(2048, 6144, 4096) and gemm.can_implement(1, 4096, 14336)
    assert gemm.can_implement(256, 6144, 4096) and gemm.workspace_bytes(100, 4096, 4096, residual=True) >= 0
    assert not gemm.can_implement(16, 4096, 4100)  # K must be a multiple of 16 (16-byte TMA rows)
    assert gemm.workspace_bytes(2048, 6144, 4096) >= 0 and gemm.workspace_bytes(2048, 6144, 4096, residual=True) >= 0
    assert gemm.has_residual
    assert gemm.has_silu_pair and gemm.pair_block == cutlass_fp8.PAIR_BLOCK == 64
    assert gemm.workspace_bytes(2048, 28672, 4096, kind="silu_pair") >= 0
    with pytest.raises(RuntimeError, match="SiLU-pair GEMM .*status 1"):  # N not whole 128-column tiles
        gemm.silu_pair(0, 0, 0, 0, 0, 0, 16, 4096 + 64, 4096)
    with pytest.raises(RuntimeError, match="status 1"):  # rejected before anything touches the GPU
        gemm(0, 0, 0, 0, 0, 16, 4096, 4100)
    with pytest.raises(RuntimeError, match="status 1"):
        gemm(0, 0, 0, 0, 0, 16, 4096, 4100, residual=1)


def test_lab_library_hook_picks_a_library_per_k(monkeypatch):
    """The bench hook (``LAB_LIBRARY``): a path serves every K, a dict its Ks with key 0 for the rest; unset, the
    artifact's library (``use``) is the one called."""
    opened = []
    monkeypatch.setattr(cutlass_fp8, "_lab_library", lambda path: opened.append(path) or path)
    monkeypatch.setattr(cutlass_fp8, "_ACTIVE", ["artifact"])
    assert cutlass_fp8.active(4096) == "artifact" and opened == []
    monkeypatch.setattr(cutlass_fp8, "LAB_LIBRARY", "a.so")
    assert cutlass_fp8.active(4096) == "a.so" and cutlass_fp8.active(14336) == "a.so"
    monkeypatch.setattr(cutlass_fp8, "LAB_LIBRARY", {0: "base.so", 14336: "down.so"})
    assert [cutlass_fp8.active(k) for k in (4096, 14336, 0)] == ["base.so", "down.so", "base.so"]


class _FakeLib:
    """Stands in for the ctypes library: counts the workspace queries, gives each kind its own size."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        sizes = {"mxc_cutlass_fp8_workspace": 1, "mxc_cutlass_fp8_residual_workspace": 2,
                 "mxc_cutlass_fp8_silu_pair_workspace": 3}

        def fn(*args):
            self.calls.append(name)
            return sizes.get(name, 0) * 1000 + args[0] if name in sizes else 0
        return fn


def _fake_gemm(has_residual=True, has_silu_pair=True):
    gemm = object.__new__(cutlass_fp8.CutlassFp8Gemm)
    gemm.path, gemm._lib, gemm._workspace = "fake.so", _FakeLib(), {}
    gemm.has_residual, gemm.has_silu_pair = has_residual, has_silu_pair
    return gemm


def test_workspace_is_asked_once_per_shape_and_kind():
    gemm = _fake_gemm()
    assert [gemm.workspace_bytes(7, 8, 16, kind=k) for k in ("plain", "residual", "silu_pair")] == [1007, 2007, 3007]
    assert gemm.workspace_bytes(7, 8, 16, residual=True) == 2007 and gemm.workspace_bytes(7, 8, 16) == 1007
    assert len(gemm._lib.calls) == 3  # cached
    for m in range(5000):  # one entry a shape, bounded
        gemm.workspace_bytes(m, 8, 16)
    assert len(gemm._workspace) <= 4096


def test_missing_kernels_and_bad_status_raise():
    gemm = _fake_gemm(has_residual=False, has_silu_pair=False)
    with pytest.raises(RuntimeError, match="no residual kernel"):
        gemm(0, 0, 0, 0, 0, 16, 32, 64, residual=1)
    with pytest.raises(RuntimeError, match="no SiLU-pair kernels"):
        gemm.silu_pair(0, 0, 0, 0, 0, 0, 16, 128, 64)
    assert gemm._lib.calls == []  # refused before calling into the library
    cutlass_fp8._check(0, "GEMM", 1, 2, 3)
    for status in (1, 2, 3, 4, 9):
        with pytest.raises(RuntimeError, match=f"M=1, N=2, K=3\\): status {status}"):
            cutlass_fp8._check(status, "GEMM", 1, 2, 3)


def test_library_config_says_prebuilt(monkeypatch):
    monkeypatch.setenv(cutlass_fp8.PREBUILT_ENV, "/some/lib.so")
    assert cutlass_fp8.library_config() == "prebuilt"


def test_source_patches_refuse_unexpected_text():
    """_round_product_first and _fix_evt_tile refuse source that does not hold the text they patch exactly once;
    a 1x1x1 cluster needs no fix."""
    with pytest.raises(RuntimeError, match="_round_product_first"):
        cutlass_fp8._round_product_first("no epilogue tree here")
    with pytest.raises(RuntimeError, match="_fix_evt_tile"):
        cutlass_fp8._fix_evt_tile("no descriptor here", (128, 128, 128), (2, 1, 1))
    assert cutlass_fp8._fix_evt_tile("anything", (128, 128, 128), (1, 1, 1)) == "anything"


def test_silu_pair_supported_rule():
    from mxc.kernels import cutlass_silu_pair

    pp = dict(schedule="pingpong")
    assert cutlass_silu_pair.supported([pp, dict(pp, tile=(64, 128, 128))])
    assert not cutlass_silu_pair.supported([dict(schedule="cooperative")])
    assert not cutlass_silu_pair.supported([pp, dict(pp, scheduler="persistent")])
    assert not cutlass_silu_pair.supported([pp, dict(pp, tile=(64, 64, 128))])  # one tile width, one interleave
    assert "SiluPairEpilogue<256>" in cutlass_silu_pair.kernel("ns", dict(tile=(64, 256, 128)), "Kernel")


@pytest.mark.parametrize("error, said", [
    (RuntimeError(), "RuntimeError"),
    (ImportError("no module named cuda.bindings\nmore"), "ImportError: no module named cuda.bindings"),
])
def test_a_generator_that_cannot_be_set_up_is_one_line_whatever_its_message(monkeypatch, error, said):
    """An exception with no message gives its type alone (not "RuntimeError: "), one with several lines its first."""
    import sys
    import types

    def fail():
        raise error

    monkeypatch.setattr(cutlass_fp8.nvcc_tool, "find", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setitem(sys.modules, "cutlass_library", types.ModuleType("cutlass_library"))
    monkeypatch.setattr(cutlass_fp8, "_cppgen", fail)
    assert cutlass_fp8.generator_available() == f"cutlass_cppgen cannot be set up: {said}"
