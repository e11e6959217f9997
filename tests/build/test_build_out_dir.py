"""The output directory: a build never replaces what is not an mxc artifact, writes nowhere it cannot finish
(disk space checked first, a full disk leaves nothing) and keeps the previous artifact when it fails."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import mxc
from mxc.errors import MxcError, size_text
from tests.build.helpers import DROPPED, build, edit_tensors, one_line


def test_out_is_not_an_artifact(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(MxcError, match=r"--out .*mine: exists and is not an mxc artifact"):
        build("llama.yaml", out)
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    assert (out / "precious.txt").read_text() == "keep me"


def test_out_with_another_programs_manifest_is_not_an_artifact(tmp_path):
    """A directory is replaced only when its manifest.json is mxc's: a web app's is the user's."""
    out = tmp_path / "webapp"
    (out / "src").mkdir(parents=True)
    (out / "manifest.json").write_text('{"name": "my-extension"}')
    (out / "src" / "app.js").write_text("keep me")
    with pytest.raises(MxcError, match=r"--out .*webapp: exists and is not an mxc artifact"):
        build("llama.yaml", out)
    assert (out / "src" / "app.js").read_text() == "keep me"


@pytest.mark.parametrize("content", [b'{"schema_version": 10}', b'{"mxc_version": "0.1.0"}',
                                     b'["schema_version", "mxc_version"]', b"{not json", b'{"\xff": 1}'],
                         ids=["no-mxc-version", "no-schema-version", "a-list", "not-json", "not-utf8"])
def test_out_with_a_manifest_that_is_not_mxcs_is_not_replaced(content, tmp_path):
    """Only a manifest.json that is a JSON object with both schema_version and mxc_version marks an artifact: any
    other (someone else's, or unreadable) leaves the directory the user's, refused in one line."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "manifest.json").write_bytes(content)
    with pytest.raises(MxcError, match=r"--out .*mine: exists and is not an mxc artifact") as e:
        build("llama.yaml", out)
    one_line(e)
    assert (out / "manifest.json").read_bytes() == content


def test_out_inside_an_artifact(tmp_path):
    """A build into a folder of another artifact would add files its manifest does not list, so that it no longer
    loads: refused, and the artifact keeps loading."""
    art = build("llama.yaml", tmp_path / "art")
    with pytest.raises(MxcError, match=r"--out .*sub: is inside the artifact .*art; choose a path outside it") as e:
        build("llama.yaml", art / "sub")
    one_line(e)
    assert not (art / "sub").exists()
    mxc.load(art)


def test_out_is_a_file(tmp_path):
    out = tmp_path / "file"
    out.write_text("x")
    with pytest.raises(MxcError, match="exists and is not an mxc artifact"):
        build("llama.yaml", out)
    assert out.read_text() == "x"


def test_failed_build_keeps_previous_artifact(ckpt, tmp_path):
    out = tmp_path / "art"
    build(ckpt, out)
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    logits = mxc.load(out).logits([[1, 2, 3]])

    edit_tensors(ckpt, lambda t: t.pop(DROPPED))
    with pytest.raises(MxcError, match="missing tensor"):
        build(ckpt, out)

    after = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert torch.equal(mxc.load(out).logits([[1, 2, 3]]), logits)  # loads and verifies every file
    assert not list(tmp_path.glob(".*.building-*"))
    assert not list(tmp_path.glob(".*.old-*"))


def _tensor_bytes(art) -> int:
    from safetensors import safe_open

    total = 0
    for path in (art / "weights").glob("rank*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(f.get_tensor(name).nbytes for name in f.keys())
    return total


def test_too_little_disk_is_refused_before_the_build(tmp_path, monkeypatch):
    """Weights larger than the free space: one line naming --out, the bytes needed (the tensors the build writes)
    and free; nothing written."""
    import re
    import shutil

    from mxc import builder

    need = size_text(_tensor_bytes(build("llama.yaml", tmp_path / "ref")))
    real = shutil.disk_usage
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    out = tmp_path / "sub" / "art"
    # float32 weights: the check before compiling (at least the elements' bytes) is already exact
    with pytest.raises(MxcError, match=rf"--out .*art: the artifact's weights take at least {re.escape(need)} and "
                                       rf".* has 1\.0 KiB free; free some space") as e:
        build("llama.yaml", out)
    one_line(e)
    assert not (tmp_path / "sub").exists()
    # a filesystem that reports no size at all (total 0, as some pseudo mounts do) is not judged: the build runs
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(total=0, free=0))
    assert build("llama.yaml", out) == out


def test_free_space_of_exactly_the_weights_is_enough(tmp_path, monkeypatch):
    """The check refuses less room than the weights take: exactly their bytes free passes, one byte less does not."""
    import shutil

    from mxc import builder

    need = _tensor_bytes(build("llama.yaml", tmp_path / "ref"))
    real = shutil.disk_usage
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    with pytest.raises(MxcError, match="free some space"):
        build("llama.yaml", tmp_path / "art")
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(free=need))
    assert build("llama.yaml", tmp_path / "art") == tmp_path / "art"


@pytest.mark.parametrize("kw", [dict(quant="fp8"), dict(tp=2), dict(quant="fp8", tp=2)], ids=["fp8", "tp2", "fp8-tp2"])
def test_the_check_before_compiling_passes_what_fits(tmp_path, monkeypatch, kw):
    """The lower bound checked before compiling never refuses a build whose files fit: fp8 weights (a byte an
    element, scales on top) and tp ranks (replicated weights in each file) with exactly their bytes free."""
    import shutil

    from mxc import builder

    need = _tensor_bytes(build("llama.yaml", tmp_path / "ref", **kw))
    real = shutil.disk_usage
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(free=need))
    assert build("llama.yaml", tmp_path / "art", **kw) == tmp_path / "art"


def test_a_config_of_very_many_layers_is_refused_before_they_are_walked(tmp_path):
    """A config.json of 10**12 layers: refused at once for its size, not walked layer by layer for hours."""
    import signal

    config = json.loads((Path(mxc.__file__).parent / "models" / "configs" / "tiny-llama.json").read_text())
    (tmp_path / "big.json").write_text(json.dumps({**config, "num_hidden_layers": 10**12}))

    def too_slow(signum, frame):  # a build that walks the layers fails here rather than hangs the suite
        raise TimeoutError("the build walked the layers instead of refusing the size")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(60)
    try:
        with pytest.raises(MxcError, match=r"--out .*art: the artifact's weights take at least [\d.]+ [KMGTP]?i?B") as e:
            mxc.build("llama.yaml", config=str(tmp_path / "big.json"), out=tmp_path / "art", progress=False,
                      log=lambda m: None)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    one_line(e)


def test_an_out_whose_parent_cannot_be_written_is_refused_before_the_build(tmp_path, monkeypatch):
    """--out under an existing directory the user may not write: one line naming --out and that directory."""
    import os
    import re

    from mxc import builder

    real = os.access
    monkeypatch.setattr(builder.os, "access", lambda p, mode: os.fspath(p) != str(tmp_path) and real(p, mode))
    out = tmp_path / "sub" / "art"
    with pytest.raises(MxcError, match=rf"--out {re.escape(str(out))}: cannot be created "
                                       rf"\({re.escape(str(tmp_path))} is not writable\)") as e:
        build("llama.yaml", out)
    one_line(e)
    assert not (tmp_path / "sub").exists()


def test_a_stale_temporary_directory_of_this_pid_is_replaced(tmp_path):
    """A ``.art.building-PID`` left by an earlier process that had this build's pid (pids are reused, after a
    reboot or in a container) is not in the way: the build writes afresh and leaves no temporary directory."""
    import os

    stale = tmp_path / f".art.building-{os.getpid()}"
    (stale / "weights").mkdir(parents=True)
    (stale / "weights" / "rank0.safetensors").write_text("half-written")
    art = build("llama.yaml", tmp_path / "art")
    mxc.load(art)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_the_disk_check_counts_every_ranks_weights(ckpt, tmp_path, monkeypatch):
    """--tp 2 writes a weight file a rank: room for a little more than one of them is not enough."""
    import shutil

    from mxc import builder

    ref = build(str(ckpt), tmp_path / "ref", tp=2)
    files = sorted((ref / "weights").glob("rank*.safetensors"))
    assert len(files) == 2
    need = sum(f.stat().st_size for f in files)
    real = shutil.disk_usage
    short = (need + files[0].stat().st_size) // 2
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(free=short))
    with pytest.raises(MxcError, match="free some space"):
        build(str(ckpt), tmp_path / "o", tp=2)


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT"])
def test_disk_full_while_writing_is_one_line_and_leaves_nothing(code, tmp_path, monkeypatch):
    """ENOSPC (or EDQUOT, a quota reached) from the weight writer (the disk filled by something else mid-build)
    becomes a one-line error naming --out; the half-written directory goes, and an artifact already at --out
    stays."""
    import errno
    import os
    import re

    from mxc.loaders import safetensors_writer

    out = tmp_path / "art"
    build("llama.yaml", out)
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    need = size_text(_tensor_bytes(out))

    def full(self, name, tensor):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(safetensors_writer.SafetensorsWriter, "write", full)
    strerror = re.escape(os.strerror(getattr(errno, code)))
    want = rf"--out .*art: {strerror} while writing the artifact \(its weights take {re.escape(need)}\); "
    with pytest.raises(MxcError, match=want + "free some space or choose another --out") as e:
        build("llama.yaml", out)
    one_line(e)
    after = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert not list(tmp_path.glob(".*.building-*"))


@pytest.mark.parametrize("named", [True, False])
def test_other_write_errors_are_one_line_naming_the_file_where_it_would_be(named, tmp_path, monkeypatch):
    """An OSError other than a full disk while writing (EIO, EROFS remounted mid-build) is one line naming the file
    at its place in --out (not the temporary folder, gone by then), or --out; nothing is left (was a traceback)."""
    import errno
    import os

    from mxc.loaders import safetensors_writer

    out = tmp_path / "art"

    def failing(self, name, tensor):
        raise OSError(errno.EIO, os.strerror(errno.EIO), *([str(self.path)] if named else []))

    monkeypatch.setattr(safetensors_writer.SafetensorsWriter, "write", failing)
    where = re.escape(str(out / "weights" / "rank0.safetensors")) if named else re.escape(f"--out {out}")
    with pytest.raises(MxcError, match=rf"^{where}: {os.strerror(errno.EIO)} while building the artifact; fix that "
                                       r"and build again$") as e:
        build("llama.yaml", out)
    one_line(e)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_stale_old_directory_of_this_pid_is_replaced(tmp_path):
    import os

    art = build("llama.yaml", tmp_path / "art")
    stale = tmp_path / f".art.old-{os.getpid()}"
    stale.mkdir()
    (stale / "manifest.json").write_text("{}")
    assert build("llama.yaml", art, max_seq_len=64) == art
    assert json.loads((art / "manifest.json").read_text())["options"]["max_seq_len"] == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.parametrize("where", ["the-artifact", "inside-the-artifact"])
def test_dump_ir_into_an_artifact_is_refused(where, tmp_path):
    """An artifact's manifest would not list the dumps, so it would no longer load."""
    other = build("llama.yaml", tmp_path / "other")
    dump = other if where == "the-artifact" else other / "ir"
    is_ = "the" if where == "the-artifact" else "inside the"
    with pytest.raises(MxcError, match=rf"--dump-ir .*: is {is_} artifact .*other; choose a directory outside it") as e:
        build("llama.yaml", tmp_path / "new", dump_ir=dump)
    one_line(e)
    assert not (tmp_path / "new").exists() and not (other / "ir").exists() and not (other / "00-bound.yaml").exists()
    mxc.load(other)  # still loads


@pytest.mark.parametrize("exists", [False, True])
def test_dump_ir_inside_out_is_refused(exists, tmp_path):
    """The finished build replaces --out, which would take the dumps with it (and --out's first build would find a
    folder that is not an artifact)."""
    out = tmp_path / "art"
    if exists:
        build("llama.yaml", out)
    with pytest.raises(MxcError, match=r"--dump-ir .*ir: is inside --out .*art, which the build replaces") as e:
        build("llama.yaml", out, dump_ir=out / "ir")
    one_line(e)
    assert not (out / "ir").exists() and out.exists() == exists


def test_dump_ir_that_is_a_file_is_refused_before_the_build(tmp_path):
    """``--dump-ir`` naming a file: one line before anything is built, the file untouched."""
    dump = tmp_path / "ir"
    dump.write_text("notes")
    with pytest.raises(MxcError) as e:
        build("llama.yaml", tmp_path / "art", dump_ir=dump)
    assert one_line(e) == f"--dump-ir {dump}: exists and is not a directory"
    assert dump.read_text() == "notes" and sorted(p.name for p in tmp_path.iterdir()) == ["ir"]


def test_dump_ir_write_error_is_one_line(tmp_path, monkeypatch):
    from pathlib import Path

    real = Path.write_text

    def full(self, *a, **kw):
        if self.suffix == ".yaml" and self.parent.name == "ir":
            raise OSError(28, "No space left on device")
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(MxcError, match=r"--dump-ir .*ir: cannot write 00-bound.yaml \(No space left on device\)") as e:
        build("llama.yaml", tmp_path / "art", dump_ir=tmp_path / "ir")
    one_line(e)
    assert not (tmp_path / "art").exists()


def test_a_failed_build_removes_the_folders_it_made_for_out(ckpt, tmp_path):
    """--out a/b/art where a does not exist: a failed build leaves no empty a/b behind, and a folder that was there
    stays."""
    edit_tensors(ckpt, lambda t: t.pop(DROPPED))
    with pytest.raises(MxcError, match="missing tensor"):
        build(ckpt, tmp_path / "a" / "b" / "art")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork") or __import__("sys").platform != "linux",
                    reason="RLIMIT_FSIZE and Python's ignored SIGXFSZ, on Linux")
def test_a_weights_file_past_the_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
    """A rank's file larger than the filesystem takes (FAT32's 4 GiB) or than ``ulimit -f`` (here: 64 KiB, the tiny
    model's is 418 KiB) fails its write with EFBIG: one line naming the file and its size, status 2, the previous
    artifact kept and no temporary directory left (was a traceback)."""
    import os
    import resource
    import subprocess
    import sys

    out = tmp_path / "art"
    build("llama.yaml", out)
    manifest = (out / "manifest.json").read_bytes()
    limit = 64 << 10
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "mxc", "build", "llama.yaml", "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.splitlines()[-1]
    assert last.startswith(f"mxc: error: {out / 'weights' / 'rank0.safetensors'}: 418.4 KiB"), last  # not the temp dir
    assert last.startswith("mxc: error: ") and "rank0.safetensors: 418.4 KiB: larger than its filesystem or the file " \
        "size limit (ulimit -f) allows (File too large at tensor " in last and last.endswith("or raise the limit"), last
    assert (out / "manifest.json").read_bytes() == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_the_disk_check_counts_a_killed_builds_leftovers_as_free(tmp_path, monkeypatch):
    """A build killed while writing (OOM, SIGKILL) leaves ``.art.building-PID``, which the next build into the same
    --out removes before it writes: its room counts as free. On a 300 MiB disk, a rebuild of a 211 MiB artifact after
    one killed at 126 MiB was refused ("175.0 MiB free"), the space held by a hidden folder it never named."""
    import os
    import shutil
    import subprocess
    import sys

    from mxc import builder

    out = tmp_path / "art"
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    left = tmp_path / f".art.building-{dead.pid}" / "weights"
    left.mkdir(parents=True)
    (left / "rank0.safetensors").write_bytes(os.urandom(1 << 20))  # more than the tiny model's weights (incompressible)
    real = shutil.disk_usage
    monkeypatch.setattr(builder.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    assert build("llama.yaml", out) == out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]

    left.mkdir(parents=True)  # not enough with it: the message counts it
    (left / "rank0.safetensors").write_bytes(os.urandom(100 << 10))
    with pytest.raises(MxcError, match=r"has 1\d\d\.\d KiB free, counting the \d+\.\d KiB of killed builds' leftovers "
                                       r"it removes first; free some space or choose another --out$") as e:
        build("llama.yaml", out)
    one_line(e)
