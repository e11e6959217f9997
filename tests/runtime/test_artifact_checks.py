"""Loading refuses tampered, incomplete, foreign or incompatible artifacts with a one-line MxcError."""

from __future__ import annotations

import json
import re
import shutil

import pytest

import mxc
from mxc.artifact_format import SCHEMA_VERSION, manifest_digest
from mxc.errors import MxcError
from tests.runtime.helpers import refused as _refused  # the fixtures, pristine and art: tests/runtime/conftest.py


def _edit_manifest(art, **changes):
    """``changes`` written into the manifest, and its manifest_sha256 made to match: what the field checks behind the
    digest see (a manifest written by another tool)."""
    path = art / "manifest.json"
    m = json.loads(path.read_text())
    m.update(changes)
    path.write_text(json.dumps(resigned(m)))


def resigned(m: dict) -> dict:
    return {**m, "manifest_sha256": manifest_digest(m)}


def test_pristine_copy_loads(art):
    assert mxc.load(art).logits([[1, 2]]).shape == (1, 2, 256)


def test_flipped_weight_byte(art):
    path = art / "weights" / "rank0.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    _refused(art, r"weights/rank0\.safetensors was modified")


def test_edited_forward_py(art):
    path = art / "code" / "forward.py"
    path.write_text(path.read_text() + "\nimport os  # sneaky\n")
    _refused(art, r"code/forward\.py was modified")


def test_edited_graph_yaml(art):
    path = art / "graph.yaml"
    path.write_text(path.read_text().replace("dtype: float32", "dtype: float16", 1))
    _refused(art, r"graph\.yaml was modified")


def test_missing_graph_yaml(art):
    (art / "graph.yaml").unlink()
    _refused(art, r"graph\.yaml is missing")


def test_missing_weights(art):
    (art / "weights" / "rank0.safetensors").unlink()
    _refused(art, r"weights/rank0\.safetensors is missing")


def test_stray_file(art):
    (art / "weights" / "extra.safetensors").write_bytes(b"x")
    _refused(art, r"file weights/extra\.safetensors is not part of the artifact")


def test_a_stray_file_whose_name_holds_a_newline_is_named_in_one_line(art):
    (art / "code" / "evil\nmxc: ok").write_text("x")
    _refused(art, r"file 'code/evil\\nmxc: ok' is not part of the artifact")


def test_stray_file_named_manifest_in_subdir(art):
    (art / "code" / "manifest.json").write_text("{}")
    _refused(art, r"code/manifest\.json is not part of the artifact")


def test_newer_mxc_version(art):
    _edit_manifest(art, mxc_version="9.9.0")
    msg = _refused(art, r"built by mxc 9\.9\.0, incompatible with mxc")
    assert mxc.__version__ in msg


def test_another_minor_version_is_refused_and_another_patch_loads(pristine, tmp_path):
    """Compatibility is major.minor: an artifact of the next minor version is refused, one of another patch loads."""
    major, minor, *_ = mxc.__version__.split(".")
    newer_minor = tmp_path / "minor"
    shutil.copytree(pristine, newer_minor)
    _edit_manifest(newer_minor, mxc_version=f"{major}.{int(minor) + 1}.0")
    _refused(newer_minor, "incompatible with mxc")
    other_patch = tmp_path / "patch"
    shutil.copytree(pristine, other_patch)
    _edit_manifest(other_patch, mxc_version=f"{major}.{minor}.99")
    mxc.load(other_patch)


def test_file_digests_cover_every_chunk(tmp_path):
    """A file longer than the hash's read size is hashed whole (weights are GBs; the artifacts in tests are not)."""
    import hashlib

    import torch

    from mxc.artifact_format import sha256_file

    path = tmp_path / "blob"
    path.write_bytes(torch.randint(0, 256, (10_000,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sha256_file(path, chunk=1024) == want
    assert sha256_file(path) == want


def test_schema_version(art):
    _edit_manifest(art, schema_version=99)
    _refused(art, r"artifact schema 99 is not readable")


def test_corrupt_manifest(art):
    (art / "manifest.json").write_text("{not json")
    _refused(art, r"manifest\.json: corrupt")


@pytest.mark.parametrize("text, why", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"schema_version": ' + "9" * 5000 + "}", "Exceeds the limit (4300 digits) for integer string conversion"),
])
def test_manifest_json_the_parser_gives_up_on(art, text, why):
    """JSON nested past the recursion limit, or a number past Python's digit limit, is a corrupt manifest in one line
    (was a RecursionError or a ValueError traceback in load, inspect and generate); a build may not replace it."""
    from mxc.build_output import check_out
    from mxc.inspect import summary

    (art / "manifest.json").write_text(text)
    _refused(art, rf"manifest\.json: corrupt \(not JSON mxc can read: {re.escape(why)}.*\); rebuild the artifact$")
    with pytest.raises(MxcError, match=r"manifest\.json: corrupt"):
        summary(art)
    with pytest.raises(MxcError, match=r"exists and is not an mxc artifact"):
        check_out(art)


def test_a_program_that_does_not_compile_or_has_no_forward_is_named(art):
    """A code/forward.py that is not a Python program, or defines no ``forward``, under a manifest re-signed over it
    (another tool's artifact) is refused in one line, not a SyntaxError or AttributeError traceback."""
    from mxc.artifact_format import sha256_file

    program = art / "code" / "forward.py"
    for text, pattern in ((b"def (:\n", r"not a Python program \(SyntaxError: "),
                          (b"\xff\xfe", r"not a Python program"), (b"x = 1\n", r"defines no forward function")):
        program.write_bytes(text)
        _manifest_edit(lambda m: m["files"].update({"code/forward.py": sha256_file(program)}))(art)
        msg = _refused(art, pattern)
        assert msg.startswith(str(program)) and msg.endswith("rebuild it")


def test_manifest_not_utf8(art):
    from mxc.inspect import summary

    path = art / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"llama"', b'"ll\xffama"', 1))
    _refused(art, r"manifest\.json: corrupt \(not UTF-8 text: invalid start byte at byte \d+\); rebuild")
    with pytest.raises(MxcError, match=r"manifest\.json: corrupt \(not UTF-8 text"):
        summary(art)


def test_not_an_artifact(tmp_path):
    (tmp_path / "plain").mkdir()
    _refused(tmp_path / "plain", r"not an mxc artifact \(no manifest\.json\)")
    _refused(tmp_path / "missing", r"no such artifact directory")
    (tmp_path / "plain" / "manifest.json").write_text("{}")
    _refused(tmp_path / "plain" / "manifest.json", r"a file, not an artifact directory \(give the folder that holds it\)")


def test_world_size_must_match_tp(art):
    _refused(art, r"built for tp=1, but loaded with world_size=2", world_size=2)


def test_rank_out_of_range(art):
    _refused(art, r"rank", rank=1)


def test_weights_larger_than_the_gpus_free_memory_are_refused_before_loading(pristine, monkeypatch):
    """On a GPU whose free memory is under the rank's weight file, load stops with one line naming the artifact, the
    sizes and what would make them fit, before it allocates anything there (here a CPU-target artifact loaded as if
    onto a GPU with 1 KiB free: the refusal comes before any CUDA call but the free-memory query)."""
    import contextlib
    import re

    import torch

    from mxc.errors import size_text
    from mxc.runtime import artifact

    queried = []

    def mem_get_info(device):
        queried.append(device)
        return 1024, 80 << 30

    def no_cuda(*args, **kwargs):
        raise AssertionError("loaded onto the GPU after the refusal should have come")

    monkeypatch.setattr(artifact, "_device", lambda name: torch.device("cuda:0"))
    monkeypatch.setattr(artifact, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(artifact, "safe_open", no_cuda)
    size = re.escape(size_text((pristine / "weights" / "rank0.safetensors").stat().st_size))
    msg = _refused(pristine, rf"{pristine.name}: rank 0's weights take {size}, more than the 1\.0 KiB free on cuda:0; "
                             r"free the GPU, or rebuild with --quant fp8 or a larger --tp", device="cuda")
    assert queried == [torch.device("cuda:0")], msg


def _manifest_edit(edit):
    def apply(art):
        path = art / "manifest.json"
        m = json.loads(path.read_text())
        edit(m)
        path.write_text(json.dumps(resigned(m)))
    return apply


def _cuda_target(m, **options):
    """A cpu artifact's manifest relabelled as a --target cuda build for sm_90 (its files untouched)."""
    m["target"] = {**m["target"], "name": "cuda", "arch": "sm_90"}
    m["options"].update(target="cuda", **options)


@pytest.mark.parametrize("edit,pattern", [
    (lambda m: m.update(schema_version=SCHEMA_VERSION - 1), rf"artifact schema {SCHEMA_VERSION - 1} is not readable "
                                                            rf"by this mxc \(schema {SCHEMA_VERSION}\)"),
    (lambda m: m.pop("schema_version"), r"artifact schema None is not readable"),
    (lambda m: m.pop("mxc_version"), r"field mxc_version: expected the version string"),
    (lambda m: m.update(mxc_version=1), r"field mxc_version: expected the version string"),
    (lambda m: m["files"].pop("code/forward.py"), r"field files: expected .*holding code/forward\.py"),
    (lambda m: m["files"].update({"graph.yaml": 5}), r"field files"),
    (lambda m: m.update(tp=1.0), r"field tp: expected a positive integer"),
    (lambda m: m.update(tp=True), r"field tp: expected a positive integer"),
    (lambda m: m["runtime"].update(vocab_size=0), r"field runtime\.vocab_size"),
    (lambda m: m["runtime"].update(eos_token_id=["2"]), r"field runtime\.eos_token_id"),
    (lambda m: m["runtime"].update(pad_token_id=-1), r"field runtime\.pad_token_id: expected null or a token id"),
    (lambda m: m["runtime"].update(pad_token_id=10 ** 9), r"field runtime\.pad_token_id"),
    (lambda m: m["runtime"]["kv_cache"].update(head_dim=0), r"field runtime\.kv_cache"),
    (lambda m: m["runtime"]["layers"].update(prefix="layers."), r"field runtime\.layers"),
    (lambda m: m["runtime"]["layers"].update(count=0), r"field runtime\.layers"),
    (lambda m: m["target"].update(name="cuda"), r"field target\.arch"),
    (lambda m: m["options"].update(dtype="bfloat16"), r"field options\.dtype: expected 'float32', as runtime\.dtype"),
    (lambda m: _cuda_target(m, max_batch=0), r"field options\.max_batch: expected a positive integer"),
    (lambda m: _cuda_target(m, max_seq_len=0), r"field options\.max_seq_len: expected a positive integer"),
    (lambda m: m["options"].update(max_seq_len="512"), r"field options\.max_seq_len: expected a positive integer"),
    (lambda m: _cuda_target(m, prefill_graph_tokens="x"), r"field options\.prefill_graph_tokens: expected a token "
                                                           r"count >= 0"),
    (lambda m: m.pop("ir_sha256"), r"field ir_sha256: expected a string"),
    (lambda m: m.update(architecture=["LlamaForCausalLM"]), r"field architecture: expected a string, or null"),
    (lambda m: m["source"].pop("checkpoint"), r"field source"),
    (lambda m: m["kernels"][0].update(kernel=[[16, "a", "b"]]), r"field kernels"),
    (lambda m: m["kernels"][0].update(kernel=[["16", "a"]]), r"field kernels"),
    (lambda m: m["kernels"][0].update(kernel=[[True, "a"]]), r"field kernels"),
    (lambda m: m["kernels"][0].pop("kernel"), r"field kernels"),
], ids=["older-schema", "no-schema", "no-mxc-version", "mxc-version-int", "no-forward-py", "digest-not-str",
        "tp-float", "tp-bool", "vocab-0", "eos-str", "pad-negative", "pad-past-vocab", "kv-head-dim-0",
        "layers-prefix-no-index", "layers-count-0",
        "cuda-no-arch", "options-dtype", "cuda-max-batch-0", "cuda-max-seq-len-0", "cpu-max-seq-len-str",
        "cuda-prefill-graph-tokens-str", "no-ir-sha256", "architecture-list", "source-no-checkpoint",
        "kernel-bucket-3-items", "kernel-bucket-str-bound", "kernel-bucket-bool-bound", "kernel-row-no-kernel"])
def test_damaged_manifest_fields_are_refused_by_name(art, edit, pattern):
    """Each field the runtime reads, damaged, is refused in one line naming the manifest and the field."""
    _manifest_edit(edit)(art)
    msg = _refused(art, pattern)
    assert str(art / "manifest.json") in msg


def test_a_manifest_naming_no_architecture_loads(art):
    """A model file built from a config.json that names no architectures records ``architecture: null``."""
    _edit_manifest(art, architecture=None)
    assert mxc.load(art).vocab_size == 256


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside.txt", "weights/../../outside.txt", "..", ""])
def test_manifest_file_paths_stay_inside_the_artifact(art, name):
    """A ``files`` entry naming a file outside the artifact (absolute, or out through ``..``) is refused before the
    verifier reads it: it would hash that file and call it modified, or pass it as the artifact's own."""
    outside = art.parent / "outside.txt"
    outside.write_text("not the artifact's")
    from mxc.artifact_format import sha256_file

    _manifest_edit(lambda m: m["files"].update({name: sha256_file(outside)}))(art)
    msg = _refused(art, rf"manifest\.json: field files: expected paths inside the artifact, not "
                        rf"{re.escape(repr(name))}; the manifest was edited or damaged, rebuild the artifact")
    assert str(art / "manifest.json") in msg
    _manifest_edit(lambda m: m["files"].pop(name))(art)
    assert mxc.load(art).vocab_size == 256


@pytest.mark.parametrize("entry", ["cutlass", "mlp_pair"])
def test_libraries_the_runtime_loads_are_listed_files(art, entry):
    """The manifest's cutlass / mlp_pair library (a shared library the runtime opens) must be one of the verified
    files, not a path elsewhere."""
    _manifest_edit(lambda m: m.update({entry: {"library": "/tmp/elsewhere.so"}}))(art)
    _refused(art, rf"field {entry}\.library: expected one of the files the manifest lists")


def test_manifest_not_an_object(art):
    path = art / "manifest.json"
    path.write_text(json.dumps([json.loads(path.read_text())]))
    _refused(art, r"manifest\.json: corrupt \(expected a JSON object\); rebuild")


def test_a_cuda_artifact_on_the_cpu_is_refused(art):
    """A --target cuda manifest is a valid one (read_manifest accepts it); loading it onto the CPU says to use a GPU."""
    from mxc.runtime.artifact import read_manifest

    _manifest_edit(_cuda_target)(art)
    assert read_manifest(art)["target"]["name"] == "cuda"
    _refused(art, r"built for --target cuda; load it with device='cuda' \(or rebuild with --target cpu\)$",
             device="cpu")


def test_a_cuda_artifact_loads_onto_the_gpu_by_default(art, monkeypatch):
    """``device`` left out is the artifact's target's: the current GPU for a cuda artifact (it was "cpu", refused),
    and on a machine without one the refusal says that no device would do."""
    import torch

    from mxc.runtime import artifact

    _manifest_edit(_cuda_target)(art)
    if not torch.cuda.is_available():
        _refused(art, r"built for --target cuda, and no CUDA GPU is usable here \(torch\.cuda\.is_available\(\) is "
                      r"false\); load it on a machine with one, or rebuild with --target cpu$")
    asked = []

    def device(name, flags=False):
        asked.append(name)
        raise MxcError("stop here")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(artifact, "_device", device)
    with pytest.raises(MxcError, match="stop here"):
        mxc.load(art)
    assert asked == ["cuda"]


def test_a_float16_artifact_loads(tmp_path):
    art = mxc.build("llama.yaml", out=tmp_path / "art", dtype="float16", progress=False, log=lambda m: None)
    assert json.loads((art / "manifest.json").read_text())["runtime"]["dtype"] == "float16"
    model = mxc.load(art)
    assert model.logits([[1, 2]]).shape == (1, 2, 256)


def test_device_names_other_than_cpu_and_cuda_are_refused(art):
    """Named as load's argument (``mxc generate`` names its --device: tests/cli)."""
    import torch

    _refused(art, r"^device='meta': expected cpu, cuda or cuda:N$", device="meta")
    _refused(art, r"^device=meta: expected cpu, cuda or cuda:N$", device=torch.device("meta"))
    _refused(art, r"^device=True: expected cpu, cuda or cuda:N$", device=True)
    _refused(art, r"^device=-1: expected cpu, cuda or cuda:N$", device=-1)


def test_an_integer_device_is_that_cuda_device(art, monkeypatch):
    """device=N is cuda:N, as torch.device(N) is on a CUDA machine; the errors name ``device``, not ``--device``."""
    import torch

    from mxc.runtime import artifact

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused(art, r"^device=0: no CUDA GPU is usable here \(torch\.cuda\.is_available\(\) is false\); use "
                  r"device='cpu'$", device=0)
    with pytest.raises(MxcError, match=r"^--device cuda: no CUDA GPU is usable here .*; use --device cpu$"):
        artifact._device("cuda", flags=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert artifact._device(1) == torch.device("cuda", 1)
    with pytest.raises(MxcError, match=r"^device=2: this machine has 2 CUDA device\(s\)$"):
        artifact._device(2)


def test_cuda_device_index_must_exist(monkeypatch):
    import torch

    from mxc.runtime import artifact

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert artifact._device("cuda:1") == torch.device("cuda", 1)
    assert artifact._device("cuda") == torch.device("cuda", 1)
    with pytest.raises(MxcError, match=r"^--device cuda:2: this machine has 2 CUDA device\(s\)"):
        artifact._device("cuda:2", flags=True)
    with pytest.raises(MxcError, match=r"^device='cuda:2': this machine has 2 CUDA device\(s\)"):
        artifact._device("cuda:2")


def test_tensor_parallel_ranks_need_one_gpu_each(monkeypatch, tmp_path):
    import torch

    from mxc.runtime import artifact

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    artifact.check_rank_devices("cuda", 2, tmp_path)  # two GPUs for two ranks
    artifact.check_rank_devices("cpu", 4, tmp_path)  # the CPU takes any number
    with pytest.raises(MxcError, match=r"built for --tp 3, whose ranks take one GPU each; this machine has 2"):
        artifact.check_rank_devices("cuda", 3, tmp_path)


def test_generate_checks_the_device_and_a_gpu_a_rank_before_loading(monkeypatch, tmp_path):
    """``mxc generate --device``: a device this machine has, and one GPU for each of a --tp artifact's ranks."""
    import torch

    from mxc.runtime import artifact

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    artifact.check_generate_device("cuda", {"target": {"name": "cuda"}, "tp": 2}, tmp_path)
    artifact.check_generate_device("cpu", {"target": {"name": "cpu"}, "tp": 4}, tmp_path)
    with pytest.raises(MxcError, match=r"built for --tp 3, whose ranks take one GPU each; this machine has 2"):
        artifact.check_generate_device("cuda", {"target": {"name": "cuda"}, "tp": 3}, tmp_path)
    with pytest.raises(MxcError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\)"):
        artifact.check_generate_device("cuda:2", {"target": {"name": "cpu"}}, tmp_path)


def test_program_bytes_are_rechecked_before_they_run(art):
    """The program is executed from bytes checked against the manifest's digest as read, not as verified earlier."""
    import hashlib

    from mxc.runtime import artifact

    program = art / "code" / "forward.py"
    module = artifact._exec_program(program, hashlib.sha256(program.read_bytes()).hexdigest())
    assert callable(module.forward)
    with pytest.raises(MxcError, match=r"forward\.py: does not match the sha256 the manifest records for it"):
        artifact._exec_program(program, "0" * 64)


def test_negative_rank_is_refused(art):
    _refused(art, r"rank -1 is out of range for world_size=1", rank=-1)


def test_kernels_for_another_gpu_architecture_are_refused(pristine, monkeypatch):
    """A cuda artifact's cubins run only on the architecture they were compiled for (or JIT with rebuild_kernels);
    on a matching GPU the cubin launcher gets the manifest's pdl option."""
    import json as _json

    import torch

    from mxc.runtime import artifact, cuda_launch

    manifest = _json.loads((pristine / "manifest.json").read_text())
    _cuda_target(manifest, pdl=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(MxcError, match=r"kernels were compiled for sm_90, this GPU is sm_80; rebuild"):
        artifact._kernel_launcher(pristine, manifest, torch.device("cuda", 0), rebuild_kernels=False)
    made = []
    monkeypatch.setattr(cuda_launch, "CubinLauncher", lambda root, pdl: made.append((root, pdl)) or "launcher")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert artifact._kernel_launcher(pristine, manifest, torch.device("cuda", 0), rebuild_kernels=False) == "launcher"
    assert made == [(pristine / "code" / "kernels", True)]


def test_weights_that_just_fit_the_gpus_free_memory_are_not_refused(tmp_path, monkeypatch):
    import torch

    from mxc.runtime import artifact

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4096, 80 << 30))
    artifact._check_weights_fit(tmp_path, 0, 4096, torch.device("cuda", 0))
    with pytest.raises(MxcError, match=r"rank 0's weights take 4\.0 KiB, more than the 4\.0 KiB free"):
        artifact._check_weights_fit(tmp_path, 0, 4097, torch.device("cuda", 0))


def test_python_caches_are_not_part_of_the_artifact(art):
    """__pycache__ folders (Python may write them next to an artifact's code) are neither listed nor refused."""
    from mxc.artifact_format import listed_files

    cache = art / "code" / "__pycache__"
    cache.mkdir()
    (cache / "forward.cpython-311.pyc").write_bytes(b"\0" * 16)
    assert not any("__pycache__" in rel for rel in listed_files(art))
    assert mxc.load(art).logits([[1, 2]]).shape == (1, 2, 256)


def test_file_digests_reuse_the_ones_already_computed(tmp_path, monkeypatch):
    """The build passes the weights' digests computed while writing: those files are not hashed a second time."""
    import hashlib

    from mxc import artifact_format

    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "big.bin").write_bytes(b"weights")
    (tmp_path / "small.txt").write_bytes(b"code")
    hashed = []
    real = artifact_format.sha256_file
    monkeypatch.setattr(artifact_format, "sha256_file", lambda path, *a: hashed.append(path) or real(path, *a))
    known = hashlib.sha256(b"weights").hexdigest()
    assert artifact_format.file_digests(tmp_path, {"w/big.bin": known}) == {
        "small.txt": hashlib.sha256(b"code").hexdigest(), "w/big.bin": known}
    assert hashed == [tmp_path / "small.txt"]


@pytest.mark.parametrize("edit", [
    lambda m: m["runtime"].update(vocab_size=m["runtime"]["vocab_size"] + 44),  # logits past the weights' rows
    lambda m: m["runtime"]["kv_cache"].update(head_dim=8),
    lambda m: m["runtime"].update(eos_token_id=[7]),
    lambda m: m.update(manifest_sha256="0" * 64),
    lambda m: m.pop("manifest_sha256"),
], ids=["vocab_size", "head_dim", "eos", "digest", "no-digest"])
@pytest.mark.parametrize("verify", [True, False])
def test_a_hand_edited_manifest_is_refused_whatever_verify_says(art, edit, verify):
    """The manifest's fields are covered by its own sha256, so an edit that type-checks (a vocabulary larger than
    the weights, another head size) is refused in one line instead of failing in an IndexError, or giving wrong ids;
    the check is cheap, so verify=False skips only the files' hashes."""
    path = art / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m, indent=1))
    _refused(art, r"manifest\.json: edited since the build \(its contents do not match its manifest_sha256\); "
                  r"rebuild the artifact", verify=verify)


def test_the_manifest_digest_reads_back_whatever_the_layout(art):
    """What the build writes (indented) and the same fields written any other way (compact, other key order) keep
    one digest: the check is of the contents."""
    path = art / "manifest.json"
    m = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(m.items())))))
    assert mxc.load(art).logits([[1, 2]]).shape == (1, 2, 256)


def test_cpu_with_an_index_is_the_cpu(art):
    """cpu:0 (and torch.device("cpu", 0)) is the one CPU device, where safetensors refused "cpu:0"."""
    import torch

    want = mxc.load(art).logits([[1, 2]])
    for device in ("cpu:0", torch.device("cpu", 0)):
        model = mxc.load(art, device=device)
        assert model.device == torch.device("cpu") and torch.equal(model.logits([[1, 2]]), want)


@pytest.mark.parametrize("kw, pattern", [
    (dict(path=None), r"path must be an artifact directory \(str or Path\), got NoneType"),
    (dict(path=123), r"path must be an artifact directory \(str or Path\), got int"),
    (dict(rank="0"), r"rank must be an integer, got '0'"),
    (dict(rank=0.0), r"rank must be an integer, got 0\.0"),
    (dict(rank=False), r"rank must be an integer, got False"),
    (dict(world_size=1.0), r"world_size must be an integer, got 1\.0"),
    (dict(world_size=True), r"world_size must be an integer, got True"),
])
def test_load_arguments_of_the_wrong_type_are_named(art, kw, pattern):
    """Not a TypeError from Path(), nor weights/rank0.0.safetensors looked for, nor world_size=True accepted."""
    path = kw.pop("path", art)
    with pytest.raises(MxcError, match=pattern) as e:
        mxc.load(path, **kw)
    assert "\n" not in str(e.value)


def test_verify_false_still_names_a_missing_or_damaged_file(art):
    """verify=False skips the hashing only: a missing file is named (not a FileNotFoundError), and a weight file
    damaged after the build is one line (not a SafetensorError)."""
    weights = art / "weights" / "rank0.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _refused(art, r"rank0\.safetensors: not a readable safetensors file .*; the artifact is damaged, rebuild it",
             verify=False)
    weights.unlink()
    _refused(art, r"weights/rank0\.safetensors is missing; the artifact is incomplete, rebuild it", verify=False)


def test_an_artifact_without_pad_token_id_loads_and_pads_with_the_first_eos_id(art):
    """Artifacts of this schema built before the manifest named a pad id load as before."""
    manifest = json.loads((art / "manifest.json").read_text())
    _manifest_edit(lambda m: m["runtime"].pop("pad_token_id"))(art)
    assert "pad_token_id" in manifest["runtime"] and mxc.load(art).pad_token_id is None
