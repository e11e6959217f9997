"""A build killed mid-write leaves the previous artifact intact and loadable; one terminated (SIGTERM, SIGHUP)
also removes its partial output and says so."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import mxc

ATTEMPTS = 3


def _kill_while_building(ckpt, out, sig=signal.SIGKILL):
    """Start ``mxc build`` and send it ``sig`` once its temporary directory appears: (exit code, stderr), or None if
    it finished first."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mxc", "build", str(ckpt), "--out", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    building = out.parent / f".{out.name}.building-{proc.pid}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if building.exists():
                os.kill(proc.pid, sig)
                _, err = proc.communicate(timeout=60)
                return proc.returncode, err
            if proc.poll() is not None:
                return None
            time.sleep(0.005)
        raise AssertionError("mxc build neither started writing nor finished within 60 s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigkill_during_build_keeps_previous_artifact(hf_checkpoint, tmp_path):
    # big enough that writing the weights takes a while (8 layers, hidden 256: ~20 MB)
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4)
    out = tmp_path / "art"
    mxc.build("llama.yaml", out=out, progress=False, log=lambda m: None)
    manifest = (out / "manifest.json").read_bytes()
    logits = mxc.load(out).logits([[5, 6, 7]])

    for _ in range(ATTEMPTS):
        if _kill_while_building(ckpt, out):
            break
        # the build won the race and replaced the artifact: restore the default and try again
        mxc.build("llama.yaml", out=out, progress=False, log=lambda m: None)
    else:
        pytest.skip(f"mxc build finished before it could be killed in {ATTEMPTS} attempts")

    assert list(tmp_path.glob(".art.building-*"))  # the dead build's half-written directory, never renamed
    assert (out / "manifest.json").read_bytes() == manifest
    model = mxc.load(out)  # verifies the sha256 of every file
    assert (model.logits([[5, 6, 7]]) == logits).all()

    # the next build into the same --out succeeds despite the dead build's leftovers
    mxc.build(str(ckpt), out=out, progress=False, log=lambda m: None)
    assert json.loads((out / "manifest.json").read_text())["source"]["weights"] == "checkpoint"
    assert mxc.load(out).vocab_size == 256


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_terminated_build_removes_its_partial_output(hf_checkpoint, tmp_path, sig):
    ckpt, _ = hf_checkpoint("LlamaForCausalLM", hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4)
    out = tmp_path / "art"
    for _ in range(ATTEMPTS):
        ended = _kill_while_building(ckpt, out, sig)
        if ended:
            break
        shutil.rmtree(out)  # the build won the race: try again
    else:
        pytest.skip(f"mxc build finished before it could be terminated in {ATTEMPTS} attempts")
    code, err = ended
    assert code == 128 + sig and f"mxc: terminated ({sig.name})" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".art.*"))


def test_signal_just_after_the_temporary_directory_is_made_leaves_nothing(tmp_path, monkeypatch):
    # a signal handler runs between two bytecodes: here, the one right after the temporary directory's mkdir
    # (the window in which the SIGHUP case above once left `.art.building-*` behind in CI)
    made = []
    mkdir = type(tmp_path).mkdir

    def mkdir_then_interrupt(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if self.name.startswith(".art.building-"):
            made.append(self)
            raise KeyboardInterrupt
    monkeypatch.setattr(type(tmp_path), "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        mxc.build("llama.yaml", out=tmp_path / "art", progress=False, log=lambda m: None)
    assert made and not made[0].exists() and not (tmp_path / "art").exists()


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_the_next_build_clears_dead_builds_leftovers_and_keeps_live_ones(tmp_path, monkeypatch):
    """Leftovers of builds that died (``.art.building-PID``, ``.art.old-PID`` beside an artifact) go with the next
    build into the same --out; those of a build still running stay: pid 1 (always alive), and a pid that signals
    cannot reach (another user's build: EPERM is alive)."""
    out = tmp_path / "art"
    mxc.build("llama.yaml", out=out, progress=False, log=lambda m: None)
    dead, others = _dead_pid(), _dead_pid()
    real_kill = os.kill

    def kill(pid, sig):
        if pid == others:
            raise PermissionError(1, "Operation not permitted")
        return real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    for name in (f".art.building-{dead}", f".art.old-{dead}", ".art.building-1", f".art.building-{others}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "part").write_text("x")
    mxc.build("llama.yaml", out=out, progress=False, log=lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".art.building-1", f".art.building-{others}", "art"])
    mxc.load(out)


def test_an_artifact_left_between_the_two_renames_is_put_back(hf_checkpoint, tmp_path):
    """A build killed after moving the old artifact aside (``.art.old-PID``) and before moving the new one in leaves
    no artifact at --out: the next build puts the old one back first, so that one failing keeps it."""
    ckpt, _ = hf_checkpoint("LlamaForCausalLM")
    out = tmp_path / "art"
    mxc.build("llama.yaml", out=out, progress=False, log=lambda m: None)
    manifest = (out / "manifest.json").read_bytes()
    out.rename(tmp_path / f".art.old-{_dead_pid()}")
    (ckpt / "model.safetensors").rename(ckpt / "elsewhere")  # the next build fails while writing
    with pytest.raises(mxc.MxcError, match="no checkpoint found"):
        mxc.build(str(ckpt), out=out, progress=False, log=lambda m: None)
    assert (out / "manifest.json").read_bytes() == manifest
    mxc.load(out)
    assert not list(tmp_path.glob(".art.*"))


def test_a_build_leaves_another_outputs_stranded_artifact_alone(tmp_path):
    """``art.v2``'s rebuild was killed between its two renames (its artifact waits in ``.art.v2.old-PID`` for the next
    build into art.v2 to put back); a build into ``art`` must not take it."""
    mxc.build("llama.yaml", out=tmp_path / "art.v2", progress=False, log=lambda m: None)
    manifest = (tmp_path / "art.v2" / "manifest.json").read_bytes()
    stranded = tmp_path / f".art.v2.old-{_dead_pid()}"
    (tmp_path / "art.v2").rename(stranded)
    mxc.build("llama.yaml", out=tmp_path / "art", progress=False, log=lambda m: None)
    assert (stranded / "manifest.json").read_bytes() == manifest
