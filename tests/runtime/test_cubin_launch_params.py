"""The cubin launcher's argument packing, with a stand-in for the CUDA driver (no GPU needed): the
parameter array the driver would read holds each tensor's address, each number, and NULL for
Triton's trailing scratch pointers, launch after launch (the values are reused in place); a tensor
descriptor's TMA map (encoded once, as Triton encodes it), shape and strides."""

from __future__ import annotations

import ctypes

import pytest
import torch

from mxc.errors import MxcError
from mxc.runtime import cuda_launch


class _Driver:
    """Records what a launch passes: grid, threads and the parameter values read through the pointers."""

    def __init__(self, kinds):
        self.kinds, self.launches, self.configs = kinds, [], []

    def cuModuleLoadData(self, *_):
        return 0

    def cuModuleGetFunction(self, *_):
        return 0

    def cuFuncSetAttribute(self, *_):
        return 0

    def _read(self, params):
        types = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}
        return [ctypes.string_at(params[i], 128) if k == "tmap" else
                ctypes.cast(params[i], ctypes.POINTER(types[k])).contents.value for i, k in enumerate(self.kinds)]

    def cuTensorMapEncodeTiled(self, out, dtype, rank, address, dims, strides, box, elem_strides, interleave,
                               swizzle, l2, oob):
        """Records the call and writes a map that names it: its number, then the address."""
        self.encoded = getattr(self, "encoded", [])
        self.encoded.append(dict(dtype=dtype, rank=rank, address=address.value, dims=list(dims[:rank]),
                                 strides=list(strides[:rank - 1]), box=list(box[:rank]),
                                 elem_strides=list(elem_strides[:rank]), interleave=interleave, swizzle=swizzle,
                                 l2=l2, oob=oob, aligned=out.value % 64 == 0))
        ctypes.memmove(out.value, (len(self.encoded).to_bytes(8, "little") + address.value.to_bytes(8, "little")), 16)
        return 0

    def cuLaunchKernel(self, func, gx, gy, gz, tx, ty, tz, shared, stream, params, extra):
        self.launches.append(("plain", (gx, gy, gz), tx, self._read(params)))
        return 0

    def cuLaunchKernelEx(self, config, func, params, extra):
        c = ctypes.cast(config, ctypes.POINTER(cuda_launch._LaunchConfig)).contents
        self.launches.append(("pdl", (c.gridDimX, c.gridDimY, c.gridDimZ), c.blockDimX, self._read(params)))
        self.configs.append((c.blockDimY, c.blockDimZ, c.sharedMemBytes, c.hStream, c.numAttrs, c.attrs[0].id,
                             c.attrs[0].value.programmaticStreamSerializationAllowed))
        return 0


@pytest.fixture
def binary(monkeypatch):
    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    kinds = ["ptr", "ptr", "i32", "f32", "ptr", "ptr"]  # two tensors, an int, a float, two scratch pointers
    entry = {"kernel": "m:k", "entry": "k", "pdl": True, "shared": 0, "num_warps": 4, "params": kinds,
             "args": ["*bf16", "*bf16", "i32", "fp32"]}
    driver = _Driver(kinds)
    return cuda_launch._Binary(driver, b"", entry), driver


def test_parameters_reach_the_driver(binary):
    b, driver = binary
    x, y = torch.empty(8), torch.empty(4)
    b.launch((3, 2), [x, y, 7, 0.5], pdl=True)
    b.launch((5,), [y, x, -1, 2.0], pdl=False)
    assert driver.launches[0] == ("pdl", (3, 2, 1), 128, [x.data_ptr(), y.data_ptr(), 7, 0.5, None, None])
    assert driver.launches[1] == ("plain", (5, 1, 1), 128, [y.data_ptr(), x.data_ptr(), -1, 2.0, None, None])


def test_the_pdl_config_is_reused_with_each_launch_s_grid_and_stream(binary, monkeypatch):
    """The PDL launch's config is built once a thread and refilled in place: every launch still gets its own
    grid and stream, one block of threads, and the programmatic-serialization attribute."""
    b, driver = binary
    x = torch.empty(8)
    for grid, stream in (((3, 2), 0x10), ((7,), 0x20), ((1, 2, 3), 0x30)):
        monkeypatch.setattr(cuda_launch, "stream_handle", lambda s=stream: s)
        b.launch(grid, [x, x, 1, 1.0], pdl=True)
    assert [g for _, g, _, _ in driver.launches] == [(3, 2, 1), (7, 1, 1), (1, 2, 3)]
    assert [c[3] for c in driver.configs] == [0x10, 0x20, 0x30]
    assert {c[:3] + c[4:] for c in driver.configs} == {(1, 1, 0, 1, cuda_launch._PROGRAMMATIC_STREAM_SERIALIZATION, 1)}


@pytest.mark.parametrize("offset", [1, 2, 3])  # float32 elements: 4, 8 and 12 bytes past a 16-byte boundary
def test_misaligned_tensor_is_refused(binary, offset):
    b, _ = binary
    base = torch.empty(16)
    with pytest.raises(MxcError, match="not 16-byte aligned"):
        b.launch((1,), [base[offset:], base, 1, 1.0])


@pytest.mark.parametrize("n", [2**31, -2**31 - 1, 2**32 + 7])
def test_an_int_past_32_bits_is_refused_not_truncated(binary, n):
    """An int argument the kernel takes as i32 (as launch types every int): ctypes would keep its low 32 bits, so
    the kernel would run on a wrong size; the launch refuses it. The extremes of i32 still pass."""
    b, driver = binary
    x = torch.empty(8)
    with pytest.raises(MxcError, match=rf"m:k: argument {n} does not fit the 32-bit integer"):
        b.launch((1,), [x, x, n, 1.0])
    for ok in (2**31 - 1, -2**31):
        b.launch((1,), [x, x, ok, 1.0])
    assert [launch[3][2] for launch in driver.launches] == [2**31 - 1, -2**31]


_DESC_META = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [64, 64], "fp4_padded": False,
              "is_im2col": False}


def _descriptor_binary(padding="zero"):
    """A kernel taking (tensor, descriptor of rank 2, int), as Triton compiles it: the map, the shape (i32) and
    strides (i64) after it, two scratch pointers at the end."""
    kinds = ["ptr", "tmap", "i32", "i32", "i64", "i64", "i32", "ptr", "ptr"]
    entry = {"kernel": "m:k", "entry": "k", "pdl": False, "shared": 0, "num_warps": 4, "params": kinds,
             "args": ["*bf16", "tensordesc<bf16[64, 128]>", "i32"], "tensordesc": [dict(_DESC_META)]}
    driver = _Driver(kinds)
    return cuda_launch._Binary(driver, b"", entry), driver


def test_descriptor_becomes_its_tma_map_shape_and_strides(monkeypatch):
    from triton.tools.tensor_descriptor import TensorDescriptor

    monkeypatch.setattr(cuda_launch, "stream_handle", lambda: 0)
    b, driver = _descriptor_binary()
    x, cache = torch.empty(8), torch.empty(16, 2, 2, 256, dtype=torch.bfloat16)
    desc = TensorDescriptor.from_tensor(cache.view(32, 512), [64, 128])
    b.launch((1,), [x, desc, 5], pdl=False)
    b.launch((1,), [x, desc, 6], pdl=False)  # the same tensor: its map is encoded once
    other = TensorDescriptor.from_tensor(cache[:8].view(16, 512), [64, 128])
    b.launch((1,), [x, other, 7], pdl=False)
    assert [e["address"] for e in driver.encoded] == [cache.data_ptr()] * 2
    first = driver.encoded[0]
    # innermost first, strides in bytes without the innermost; the box is the compiled one (Triton splits the
    # [64, 128] block into [64, 64] copies under the 128-byte swizzle); bf16 is the driver's type 9
    assert first == dict(dtype=9, rank=2, address=cache.data_ptr(), dims=[512, 32], strides=[1024], box=[64, 64],
                         elem_strides=[1, 1], interleave=0, swizzle=3, l2=2, oob=0, aligned=True)
    assert driver.encoded[1]["dims"] == [512, 16]
    maps = [launch[3][1] for launch in driver.launches]
    assert [int.from_bytes(m[:8], "little") for m in maps] == [1, 1, 2]
    assert [launch[3][2:7] for launch in driver.launches] == [[32, 512, 512, 1, 5], [32, 512, 512, 1, 6],
                                                              [16, 512, 512, 1, 7]]
    assert all(launch[3][0] == x.data_ptr() and launch[3][7:] == [None, None] for launch in driver.launches)


def test_nan_padding_reaches_the_map(monkeypatch):
    from triton.tools.tensor_descriptor import TensorDescriptor

    monkeypatch.setattr(cuda_launch, "stream_handle", lambda: 0)
    b, driver = _descriptor_binary()
    t = torch.empty(64, 128, dtype=torch.bfloat16)
    b.launch((1,), [t, TensorDescriptor(t, t.shape, t.stride(), [64, 128], padding="nan"), 1], pdl=False)
    assert driver.encoded[0]["oob"] == 1


def test_descriptor_entry_that_does_not_match_its_parameters_is_refused():
    b, _ = _descriptor_binary()
    entry = dict(b.entry, params=["ptr", "i64", "i32", "i32", "i64", "i64", "i32"])
    with pytest.raises(MxcError, match="does not match the compiled parameters"):
        cuda_launch._Binary(_Driver(entry["params"]), b"", entry)
    entry = {k: v for k, v in b.entry.items() if k != "tensordesc"}  # the parameters fit, but no map's metadata
    with pytest.raises(MxcError, match="does not match the compiled parameters"):
        cuda_launch._Binary(_Driver(entry["params"]), b"", entry)
    entry = dict(b.entry, tensordesc=[dict(b.entry["tensordesc"][0], is_im2col=True)])
    with pytest.raises(MxcError, match="im2col"):
        cuda_launch._Binary(_Driver(entry["params"]), b"", entry)


class _FailingDriver(_Driver):
    """Answers ``failing`` with a CUDA error code (700: CUDA_ERROR_ILLEGAL_ADDRESS), the rest with success."""

    def __init__(self, kinds, failing):
        super().__init__(kinds)
        setattr(self, failing, lambda *_: 700)


def _entry(kinds=("ptr", "ptr", "i32", "f32", "ptr", "ptr"), **fields):
    """The ``binary`` fixture's index entry (two tensors, an int, a float, two scratch pointers), ``fields`` changed."""
    return {"kernel": "m:k", "entry": "k", "pdl": True, "shared": 0, "num_warps": 4, "params": list(kinds),
            "args": ["*bf16", "*bf16", "i32", "fp32"], **fields}


@pytest.mark.parametrize("failing", ["cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel", "cuLaunchKernelEx"])
def test_a_driver_error_is_raised(failing, monkeypatch):
    monkeypatch.setattr(cuda_launch, "stream_handle", lambda: 0)
    entry = _entry()
    driver = _FailingDriver(entry["params"], failing)
    with pytest.raises(RuntimeError, match="CUDA driver error 700"):
        cuda_launch._Binary(driver, b"", entry).launch((1,), [torch.empty(4), torch.empty(4), 1, 1.0],
                                                        pdl=failing == "cuLaunchKernelEx")


@pytest.mark.parametrize("shared, opt_in", [(0, False), (48 * 1024, False), (48 * 1024 + 16, True),
                                            (100 * 1024, True)])
def test_shared_memory_reaches_the_driver(shared, opt_in, monkeypatch):
    """CUDA's rule: a kernel may use up to 48 KiB of dynamic shared memory by default, more only after
    cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes); both launch paths pass the entry's bytes."""
    monkeypatch.setattr(cuda_launch, "stream_handle", lambda: 0)
    entry = _entry(shared=shared)
    driver = _Driver(entry["params"])
    attributes, launched = [], []
    driver.cuFuncSetAttribute = lambda func, attr, value: attributes.append((attr, value)) or 0
    driver.cuLaunchKernel = lambda func, gx, gy, gz, tx, ty, tz, smem, *rest: launched.append(smem) or 0
    b = cuda_launch._Binary(driver, b"", entry)
    assert attributes == ([(cuda_launch._MAX_DYNAMIC_SHARED, shared)] if opt_in else [])
    x = torch.empty(4)
    b.launch((1,), [x, x, 1, 1.0], pdl=False)
    b.launch((1,), [x, x, 1, 1.0], pdl=True)
    assert launched == [shared] and [c[2] for c in driver.configs] == [shared]


def test_the_carveout_knob_reaches_the_driver_once_a_change(monkeypatch):
    """``CARVEOUT`` (an A/B knob) is read at each launch: a change sets the function's preferred carveout once,
    None goes back to the driver's choice (-1), and the default sets nothing."""
    monkeypatch.setattr(cuda_launch, "stream_handle", lambda: 0)
    entry = _entry()
    driver = _Driver(entry["params"])
    attributes = []
    driver.cuFuncSetAttribute = lambda func, attr, value: attributes.append((attr, value)) or 0
    b = cuda_launch._Binary(driver, b"", entry)
    x = torch.empty(4)
    for knob in (None, 100, 100, 50, None, None):
        monkeypatch.setattr(cuda_launch, "CARVEOUT", knob)
        b.launch((1,), [x, x, 1, 1.0], pdl=True)
    assert attributes == [(cuda_launch._PREFERRED_CARVEOUT, v) for v in (100, 50, -1)]
    assert len(driver.launches) == 6


@pytest.mark.parametrize("tail", [("ptr", "i32"), ("i32", "ptr"), ("i64",)])
def test_parameters_past_the_arguments_must_be_scratch_pointers(tail):
    """Triton appends only scratch pointers after a kernel's arguments; anything else means the index entry
    does not describe its cubin."""
    kinds = ("ptr", "ptr", "i32", "f32", *tail)
    with pytest.raises(MxcError, match="scratch pointers"):
        cuda_launch._Binary(_Driver(list(kinds)), b"", _entry(kinds))


def test_a_cubin_built_without_pdl_launches_plain(monkeypatch):
    monkeypatch.setattr(cuda_launch, "stream_handle", lambda: 0)
    entry = _entry()
    del entry["pdl"]
    driver = _Driver(entry["params"])
    x = torch.empty(4)
    cuda_launch._Binary(driver, b"", entry).launch((1,), [x, x, 1, 1.0], pdl=True)
    assert [kind for kind, *_ in driver.launches] == ["plain"]


def _rms_norm_call(dtype):
    """The launch ``triton_norm.rms_norm`` makes for 3 rows of 64 ``dtype`` values (meta tensors: no data)."""
    from mxc.kernels import launch, triton_norm

    calls = []
    meta = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    with launch.using(lambda *call: calls.append(call)):
        triton_norm.rms_norm(meta(3, 64), meta(64), 1e-5)
    (call,) = calls
    return call


def _launcher_for(tmp_path, calls, n_args=None):
    """A launcher over an empty artifact, given one binary for each of ``calls`` (``n_args`` arguments: default
    the call's own) and the driver that records that binary's launches."""
    from mxc.kernels import launch

    (tmp_path / "index.json").write_text("{}")
    launcher = cuda_launch.CubinLauncher(tmp_path, driver=_Driver([]))
    drivers = []
    for kernel, _, args, constexprs, num_warps, num_stages in calls:
        spec = launch.spec_of(kernel, args, launch.with_pdl(kernel, constexprs, False), num_warps, num_stages)
        types_ = [t for t in spec["signature"].values() if t != "constexpr"][:n_args]
        types_ += ["i32"] * ((n_args or 0) - len(types_))
        kinds = [k for t in types_ for k in (["tmap", "i32", "i32", "i64", "i64"] if t.startswith("tensordesc") else
                                             ["ptr"] if t.startswith("*") else ["f32"] if t == "fp32" else ["i32"])]
        entry = {"kernel": spec["kernel"], "entry": "k", "shared": 0, "num_warps": num_warps, "params": kinds,
                 "args": types_, "tensordesc": [dict(_DESC_META) for t in types_ if t.startswith("tensordesc")]}
        drivers.append(_Driver(kinds))
        launcher.binaries[launch.spec_key(spec)] = cuda_launch._Binary(drivers[-1], b"", entry)
    return launcher, drivers


def test_each_dtype_launches_its_own_binary(tmp_path, monkeypatch):
    """The same kernel called with fp32 and with bf16 tensors is two binaries (the dtype is in the compiled
    signature), also once the first call has been looked up."""
    monkeypatch.setattr(cuda_launch, "stream_handle", lambda: 0)
    calls = [_rms_norm_call(torch.float32), _rms_norm_call(torch.bfloat16)]
    launcher, drivers = _launcher_for(tmp_path, calls)
    for call in calls + calls:
        launcher(*call)
    assert [len(d.launches) for d in drivers] == [2, 2]


def test_each_descriptor_type_launches_its_own_binary(tmp_path, monkeypatch):
    """A descriptor argument's dtype and block shape are in the compiled signature
    (``tensordesc<bf16[64, 64]>``): another dtype or block is another binary, also once the first has been
    looked up. (The kernel's first argument is a descriptor here only for the launcher's sake.)"""
    from triton.tools.tensor_descriptor import TensorDescriptor

    monkeypatch.setattr(cuda_launch, "stream_handle", lambda: 0)
    calls = []
    for dtype, block in ((torch.bfloat16, [64, 64]), (torch.float16, [64, 64]), (torch.bfloat16, [32, 64])):
        kernel, grid, args, *rest = _rms_norm_call(torch.float32)
        desc = TensorDescriptor.from_tensor(torch.empty(128, 64, dtype=dtype), block)
        calls.append((kernel, grid, [desc, *args[1:]], *rest))
    launcher, drivers = _launcher_for(tmp_path, calls)
    for call in calls + calls:
        launcher(*call)
    assert [len(d.launches) for d in drivers] == [2, 2, 2]


@pytest.mark.parametrize("extra", [-1, 1])
def test_argument_count_must_match_the_binary(tmp_path, extra):
    call = _rms_norm_call(torch.float32)
    n = len([a for a in call[2] if a is not None])
    launcher, _ = _launcher_for(tmp_path, [call], n_args=n + extra)
    with pytest.raises(MxcError, match=f"takes {n + extra} arguments in the artifact, the launch gives {n}"):
        launcher(*call)


def test_plain_restores_the_state_before_it(tmp_path):
    """Leaving ``plain`` (after an error too) restores what was in force before it: an inner block leaves the
    outer one plain."""
    (tmp_path / "index.json").write_text("{}")
    launcher = cuda_launch.CubinLauncher(tmp_path, pdl=True, driver=_Driver([]))
    with launcher.plain():
        with pytest.raises(ValueError):
            with launcher.plain():
                raise ValueError
        assert launcher.pdl_launch is False
    assert launcher.pdl_launch is True
    with pytest.raises(ValueError):
        with launcher.plain():
            raise ValueError
    assert launcher.pdl_launch is True
