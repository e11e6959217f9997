"""nvcc for the hand-written and generated CUDA libraries (the CUTLASS fp8 GEMM, the persistent fp8 MLP pair).

``find`` locates nvcc (``$CUDA_HOME``, ``$CUDA_PATH``, PATH, /usr/local/cuda); ``compile_so`` builds one .cu
source into a shared library for ``sm_90a``; ``cached_library`` is what a build ships: a prebuilt library an
environment variable names, else the source compiled once into a cache keyed by its sha256. Only machine code
for that target is embedded (no PTX: wgmma, setmaxnreg and the bulk-copy/mbarrier forms the kernels use exist
only for the ``a`` target), and cudart is linked statically, so a library needs only the driver
(``libcuda.so.1``) on the GPU machine, whatever CUDA runtime its torch ships, and opens (without a driver) on a
machine with none. No GPU is needed to build.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path


def find() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None)


def version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.split(" release ")[-1].split(",")[0].strip()


def compile_so(source: str, out_path, *, what: str, arch: str = "90a", include_dirs=(), timeout: float = 1800,
               nvcc: str | None = None, extra_flags=()) -> Path:
    """Compile ``source`` into a shared library at ``out_path`` (written to a temporary file, then renamed).

    ``what`` names the library in errors. Raises RuntimeError with nvcc's last lines when it fails; warns when
    ptxas reports register spills.
    """
    nvcc = nvcc or find()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mxc_nvcc_") as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(source)
        tmp_so = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
        cmd = [nvcc, "-O3", "-std=c++17", "--expt-relaxed-constexpr", f"-gencode=arch=compute_{arch},code=sm_{arch}",
               "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", "-DNDEBUG", "-Xptxas=-warn-spills",
               "-Xcudafe", "--diag_suppress=esa_on_defaulted_function_ignored",
               # no local symbols: they held nvcc's temporary file name (tmpxft_<pid>_...), so two compiles of one
               # source differed and so did the artifacts that ship the library; the exported ones stay for ctypes
               "-Xlinker=--discard-all",
               *[f"-I{d}" for d in include_dirs], *extra_flags, str(src), "-o", str(tmp_so)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            tmp_so.unlink(missing_ok=True)
            raise RuntimeError(f"nvcc timed out after {timeout} s compiling the {what}") from e
        if proc.returncode != 0:
            tmp_so.unlink(missing_ok=True)
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
            raise RuntimeError(f"nvcc failed ({proc.returncode}) compiling the {what}:\n{tail}")
        os.replace(tmp_so, out_path)
    spills = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if "spill" in line]
    if spills:
        warnings.warn(f"{out_path.name}: ptxas: {spills[0]}", stacklevel=2)
    return out_path


def cache_dir(name: str) -> Path:
    """Where compiled libraries are kept between builds, by their source's hash: ``$XDG_CACHE_HOME/mxc/<name>``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mxc" / name


def cached_library(what: str, cache_name: str, source, compile, prebuilt_env: str, out_path=None,
                   log=print, note: str = "") -> Path:
    """The library ``$prebuilt_env`` names (a machine without nvcc), else ``source()`` compiled by
    ``compile(text, path)`` into ``cache_dir(cache_name)`` under its sha256 (once); copied to ``out_path`` if given.
    ``source`` is called only when there is no prebuilt library (generating it may need more than nvcc)."""
    prebuilt = os.environ.get(prebuilt_env)
    if prebuilt:
        if not Path(prebuilt).is_file():
            raise RuntimeError(f"${prebuilt_env}={prebuilt} is not a file")
        cached = Path(prebuilt)
        log(f"{what}: the prebuilt library {prebuilt} (${prebuilt_env})")
    else:
        text = source()
        cached = cache_dir(cache_name) / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.so"
        if not cached.is_file():
            cached.parent.mkdir(parents=True, exist_ok=True)
            # one compile of a source at a time (two builds at once, the test suite's workers): the second waits for
            # the first's library instead of compiling it again; the lock goes with its process, even a killed one
            with open(cached.with_suffix(".lock"), "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    log(f"waiting for another process compiling the {what} (into {cached.parent})")
                    fcntl.flock(lock, fcntl.LOCK_EX)
                if not cached.is_file():
                    log(f"compiling the {what} with nvcc{note} (cached in {cached.parent})")
                    compile(text, cached)
    if out_path is None:
        return cached
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached, out_path)
    return out_path
