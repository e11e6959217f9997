"""``mxc build``: model definition + checkpoint -> artifact directory.

Takes the source ``mxc.source`` resolves (a bundled definition name, a YAML path, or an HF checkpoint
directory, a Hub model id's snapshot in the local HF cache included, whose config.json picks the definition), checks
the build's inputs and its output directory (``build_output``), binds the graph, runs the compiler
pipeline, renders the forward program, converts the weights
and writes the manifest. Everything is written into a temporary sibling
directory that replaces ``out`` only at the end: a failed or killed build
leaves the previous artifact intact, or nothing.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import numbers
import operator
import os
import shutil
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

import mxc
from mxc.artifact_format import SCHEMA_VERSION, file_chunks, file_digests, manifest_digest
from mxc.build_output import check_dump_dir, check_out, check_space, recover, replace_with
from mxc.codegen.render import render_forward
from mxc.compiler.options import BuildOptions
from mxc.compiler.pipeline import check_disabled, compile_graph
from mxc.errors import MxcError, first_line, size_text
from mxc.ir import Graph, dump_graph, verify
from mxc.kernels.candidates import ONE_SHOT_DTYPES
from mxc.loaders.checkpoint import open_checkpoint
from mxc.loaders.convert import DTYPES, check_checkpoint, weight_bytes, weight_elements, write_weights
from mxc.loaders.dummy import DummyCheckpoint
from mxc.loaders.prequantized import checkpoint_quantization, unquantized_linears
from mxc.models import bind_model
from mxc.runtime_buckets import PREFILL_GRAPH_MIN, PREFILL_GRAPH_TOKENS
from mxc.source import Source, check_eos, checkpoint_name, eos_ids, pad_id, resolve_source

# a Hugging Face tokenizer directory (the chat template, for --chat and any runtime that imports the artifact,
# included) and the generation config; the named chat templates (additional_chat_templates/*.jinja) too:
# ``_tokenizer_files``
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


def _tensor_names(directory) -> list[str]:
    with open_checkpoint(directory) as ckpt:
        return ckpt.names()


_EMPTY_HINT = {
    "source": " (a bundled definition such as llama.yaml, a YAML file or a checkpoint directory)",
    "out": ", or leave --out out for build/<definition>",
    "checkpoint": ", or leave --checkpoint out for deterministic random weights",
    "config": ", or leave --config out",
    "dump_ir": ", or leave --dump-ir out",
}

# The cuda kernels address the KV cache's rows ((max_batch + 1) sequences of max_seq_len, the scratch slot
# included) in 32 bits (the prefill attention's tensor-map rows).
KV_ROWS_LIMIT = 2**31


def _check_argument_types(**given) -> None:
    """``build``'s path and count arguments as the Python API may pass them (the command line gives strings and
    ints): a one-line error naming the argument, not a TypeError from deep inside."""
    for name in ("source", "out", "checkpoint", "config", "dump_ir"):
        value = given[name]
        if not (isinstance(value, (str, os.PathLike)) or (value is None and name != "source")):
            raise MxcError(f"{name} must be a path (str or Path){'' if name == 'source' else ' or None'}, got "
                           f"{type(value).__name__}")
        if value is not None and not str(value).strip():  # an unset shell variable: never "no such option"
            flag = "SOURCE" if name == "source" else f"--{name.replace('_', '-')}"
            raise MxcError(f"{flag} {str(value)!r}: empty; give a path{_EMPTY_HINT[name]}")
    if not isinstance(given["arch"], int) or isinstance(given["arch"], bool):
        raise MxcError(f"arch must be an integer, got {given['arch']!r}")
    passes = given["disable_passes"]
    if not isinstance(passes, (list, tuple)) or not all(isinstance(p, str) for p in passes):
        raise MxcError(f"disable_passes must be a list of pass names, got {passes!r}")
    for name in ("quant_lm_head", "mlp_pair", "progress", "pdl"):  # "no" would count as true
        value = given[name]
        if not (isinstance(value, bool) or (value is None and name == "pdl")):
            raise MxcError(f"{name} must be True or False{' (or None: the default)' if name == 'pdl' else ''}, got "
                           f"{value!r}")
    if not callable(given["log"]):
        raise MxcError(f"log must be a callable taking one message (str), got {given['log']!r}")


def _integer(value):
    """An integral count as a Python int (numpy's int64 from a script is as good as an int); anything else as it
    is, for the checks that name it."""
    return operator.index(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def _got(value) -> str:
    """`` (got str)`` for a value that prints like a number but is not an int (``tp="2"``), else nothing."""
    return "" if isinstance(value, int) and not isinstance(value, bool) else f" (got {type(value).__name__})"


def _tokenizer_names(checkpoint: Path) -> list[str]:
    """The checkpoint's files, relative to it, that may go to the artifact's ``tokenizer/``: ``TOKENIZER_FILES`` and
    the named chat templates transformers reads (``additional_chat_templates/*.jinja``), whatever each is."""
    from mxc.chat_template import folder_templates

    return [*TOKENIZER_FILES, *folder_templates(checkpoint)]


def _tokenizer_files(checkpoint: Path) -> list[str]:
    """Of ``_tokenizer_names``, those the build copies: regular files (symlinks followed; not a folder, a FIFO or a
    device of the name, which are left out)."""
    return [name for name in _tokenizer_names(checkpoint) if (checkpoint / name).is_file()]


def _check_tokenizer(checkpoint: Path | None) -> None:
    """The checkpoint's tokenizer.json, which the artifact carries for ``--prompt``, reads as the runtime reads it
    (``mxc.tokenizer``): an unreadable one is refused before the build's long work, not met at ``--prompt``,
    where rebuilding would not help."""
    from mxc.tokenizer import read_tokenizer

    for name in _tokenizer_names(checkpoint) if checkpoint is not None else ():  # copied where they are files,
        # else left out (a folder of the name), but a broken symlink (a Hub cache snapshot's blob gone) is named, not
        # left out
        if os.path.islink(checkpoint / name) and not os.path.exists(checkpoint / name):
            raise MxcError(f"{checkpoint / name}: is a broken symlink; expected the checkpoint's {name} there "
                           f"(download it again, or remove it to build without it)")
    if checkpoint is not None and (checkpoint / "tokenizer.json").is_file():
        read_tokenizer(checkpoint / "tokenizer.json", "replace it with a good copy, or remove it to build without a "
                                                      "tokenizer (then generate with --ids)")


RUNTIME_INPUTS = ("tokens", "positions", "logit_rows")  # what the runtime passes the forward program, in order


def _check_runtime_contract(graph: Graph, types: dict) -> None:
    """The graph takes what the runtime gives and returns what it reads: int64 ``tokens [T]``, ``positions [T]``
    and ``logit_rows [R]``, in that order, and one output, the logits ``[R, vocab]`` of the rows asked for."""
    got = ", ".join(f"{name} {t}" for name, t in graph.inputs.items())
    shapes = [graph.inputs[n].shape for n in RUNTIME_INPUTS if n in graph.inputs]
    if tuple(graph.inputs) != RUNTIME_INPUTS or any(t.dtype != "int64" for t in graph.inputs.values()) \
            or any(len(s) != 1 for s in shapes) or shapes[0] != shapes[1] or shapes[0] == shapes[2]:
        raise MxcError(f"{graph.source}: inputs: expected, in this order, tokens [T] int64, positions [T] int64, "
                       f"logit_rows [R] int64; got {got}")
    rows = graph.inputs["logit_rows"].shape[0]
    out = types[graph.outputs[0]] if len(graph.outputs) == 1 else None
    if out is None or len(out.shape) != 2 or out.shape[0] != rows:
        raise MxcError(f"{graph.source}: outputs: expected one value, the logits [{rows}, vocab] of the logit_rows "
                       f"(gather_rows before the LM head); got "
                       f"{', '.join(f'{o} {types[o]}' for o in graph.outputs)}")


def _runtime_info(graph: Graph, src: Source) -> dict:
    """What the runtime needs without reading the IR: KV cache geometry, vocabulary, stop tokens."""
    types = verify(graph)
    _check_runtime_contract(graph, types)
    layers, kv = 0, None
    for node, rep in graph.nodes():
        if node.op == "attention":  # unfused: k is [T, kv_heads, head_dim]
            layers += rep.count if rep else 1
            kv = types[node.ins[1]].shape[1:]
        elif node.op == "qkv_rope_cache":
            layers += rep.count if rep else 1
            kv = (node.attrs["kv_heads"], node.attrs["head_dim"])
    if kv is None:
        raise MxcError(f"{graph.source}: the graph has no attention over the KV cache (the runtime decodes with one)")
    reps = graph.repeats()
    if len(reps) > 1:
        raise MxcError(f"{graph.source}: {len(reps)} repeat blocks ({', '.join(r.loc for r in reps)}); the runtime's "
                       f"weight layout supports one")
    prefix = None
    if reps:
        local, w = next(iter(reps[0].weights.items()))
        prefix = w.name[: len(w.name) - len(local)]
    logits = types[graph.outputs[0]]
    return {"vocab_size": logits.shape[-1], "dtype": graph.dtype, "inputs": list(graph.inputs),
            "layers": {"count": reps[0].count, "index": reps[0].index, "prefix": prefix} if reps else None,
            "kv_cache": {"layers": layers, "kv_heads": kv[0], "head_dim": kv[1]} if kv else None,
            "max_position_embeddings": src.config.get("max_position_embeddings"),
            "eos_token_id": eos_ids(src), "pad_token_id": pad_id(src)}  # eos checked by check_eos


def _kernel_table(graph: Graph) -> list[dict]:
    rows = []
    for node, rep in graph.nodes():
        rows.append({"node": ", ".join(node.outs), "op": node.op, "in": "layers" if rep else "top",
                     "kernel": node.attrs.get("kernel"), "reason": node.attrs.get("kernel_reason"), "loc": node.loc})
    return rows


def _target_info(options: BuildOptions, arch: int | None) -> dict:
    import torch

    info = {"name": options.target, "torch": torch.__version__.split("+")[0]}
    if options.target == "cuda":
        from mxc.codegen.aot import triton_version

        info.update(arch=f"sm_{arch}", triton=triton_version(), cuda=torch.version.cuda)
    return info


def _log(msg: str) -> None:
    print(f"mxc: {msg}", file=sys.stderr)


def resolve_tp_allreduce(choice: str, target: str, tp, dtype: str = "bfloat16") -> str:
    """``--tp-allreduce``: "auto" is push on cuda with tp > 1 for bf16/fp16 (the all-reduce fused with
    the residual add and RMSNorm, no barrier), one_shot for fp32 (both measured faster than NCCL),
    else nccl."""
    if choice not in ("auto", "nccl", "one_shot", "push"):
        raise MxcError(f"--tp-allreduce {choice}: expected auto, nccl, one_shot or push")
    if choice == "auto":
        if not (target == "cuda" and isinstance(tp, int) and tp > 1):
            return "nccl"
        return "push" if dtype in ("bfloat16", "float16") else "one_shot" if dtype == "float32" else "nccl"
    return choice


def default_dtype(target: str, config: dict) -> str:
    """The dtype of a build given no ``--dtype``: float32 on the CPU (it holds every checkpoint's values exactly); on
    cuda config.json's own 16-bit dtype (``dtype``, or transformers 4's ``torch_dtype``), as transformers loads
    it by default, else bfloat16: a float16 checkpoint was built in bfloat16, every weight rounded to 8 bits of
    mantissa from its 11."""
    if target == "cpu":
        return "float32"
    said = config.get("dtype")
    if said is None:  # as transformers 5 reads it: torch_dtype where dtype is absent or null
        said = config.get("torch_dtype")
    return said if said in ("bfloat16", "float16") else "bfloat16"


def build(source: str, *, out: str | Path | None = None, checkpoint: str | None = None, config: str | None = None,
          dtype: str | None = None, target: str = "cpu", dump_ir: str | Path | None = None,
          max_batch: int = 32, max_seq_len: int | None = None, arch: int = 90, tp: int = 1,
          quant: str | None = None, quant_granularity: str | None = None, quant_lm_head: bool = False,
          disable_passes: tuple[str, ...] | list[str] = (), pdl: bool | None = None,
          tp_allreduce: str = "auto", mlp_pair: bool = False, prefill_graphs: int | None = None,
          jobs: int | None = None, progress: bool = True, log=_log) -> Path:
    """Build an artifact and return its directory.

    ``pdl=None`` turns programmatic dependent launch on where it exists (``--target cuda``, sm_90+).
    ``tp_allreduce="auto"`` is ``push`` for ``--target cuda`` with ``tp > 1`` in bf16/fp16 (one_shot
    in fp32; on two H200s a tp=2 Llama-3-8B token took 3.09 ms with one_shot, 3.27 ms with NCCL),
    else ``nccl``. ``mlp_pair`` (fp8, tp=1; experimental, measured slower on an H200): each layer's MLP op
    (``fuse_mlp``, in every fp8 build) runs on cuda at <= 8 tokens as one persistent launch
    (``mxc.kernels.mlp_pair_fp8``) instead of its kernel chain. ``prefill_graphs=None`` is
    ``PREFILL_GRAPH_TOKENS`` for ``--target cuda`` (0 elsewhere): batch-1 prompts up to the largest length bucket
    within that many tokens and ``max_seq_len`` replay the CUDA graph of their bucket
    (``runtime_buckets.prefill_graph_buckets``); longer ones run eagerly. ``jobs``: processes compiling the
    kernels (None: one a core; 1: the calling process, no pool), which changes no file of the artifact.
    """
    arch, tp, max_batch, max_seq_len, prefill_graphs, jobs = map(
        _integer, (arch, tp, max_batch, max_seq_len, prefill_graphs, jobs))
    _check_argument_types(source=source, out=out, checkpoint=checkpoint, config=config, dump_ir=dump_ir, arch=arch,
                          disable_passes=disable_passes, quant_lm_head=quant_lm_head, mlp_pair=mlp_pair,
                          progress=progress, pdl=pdl, log=log)
    if target not in ("cpu", "cuda"):
        raise MxcError(f"--target {target}: expected cpu or cuda")
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise MxcError(f"--dtype {dtype}: expected float32, bfloat16 or float16")
    src = resolve_source(source, checkpoint, config)
    dtype = dtype or default_dtype(target, src.config)
    if max_seq_len is None:
        mpe = src.config.get("max_position_embeddings")
        mpe = 4096 if mpe is None else mpe
        if isinstance(mpe, bool) or not isinstance(mpe, int) or mpe < 2:
            raise MxcError(f"{src.config_path}: max_position_embeddings {mpe!r}: expected an integer >= 2 (a prompt "
                           f"token and a new one), or pass --max-seq-len")
        max_seq_len = min(4096, mpe)
    if quant not in (None, "fp8") or quant_granularity not in (None, "channel", "tensor", "block128"):
        raise MxcError(f"--quant {quant} / --quant-granularity {quant_granularity}: expected fp8 with "
                       f"channel, tensor or block128")
    if pdl is None:
        pdl = target == "cuda" and arch >= 90
    if pdl and (target != "cuda" or arch < 90):
        raise MxcError(f"--pdl: programmatic dependent launch needs --target cuda on sm_90 or later "
                       f"(got --target {target}, sm_{arch})")
    tp_allreduce = resolve_tp_allreduce(tp_allreduce, target, tp, dtype)
    if tp_allreduce in ("one_shot", "push") and target != "cuda":
        raise MxcError(f"--tp-allreduce {tp_allreduce}: the peer-memory all-reduce needs --target cuda (got {target})")
    if tp_allreduce == "one_shot" and dtype not in ONE_SHOT_DTYPES:
        raise MxcError(f"--tp-allreduce one_shot: torch's one-shot all-reduce sums {' or '.join(ONE_SHOT_DTYPES)}, "
                       f"not {dtype}; use push (the default for {dtype}) or nccl")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise MxcError(f"--tp {tp}: expected a positive integer{_got(tp)}")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in (max_batch, max_seq_len)):
        raise MxcError(f"--max-batch {max_batch} / --max-seq-len {max_seq_len}: expected positive integers"
                       f"{_got(max_batch) or _got(max_seq_len)}")
    if max_seq_len < 2:
        raise MxcError(f"--max-seq-len {max_seq_len}: a sequence needs room for a prompt token and a new one; give "
                       f"at least 2")
    if target == "cuda" and (max_batch + 1) * max_seq_len >= KV_ROWS_LIMIT:
        raise MxcError(f"--max-batch {max_batch} / --max-seq-len {max_seq_len}: the KV cache would hold "
                       f"{max_batch + 1} x {max_seq_len} rows a layer (the scratch slot included), past the "
                       f"{KV_ROWS_LIMIT - 1} the cuda kernels address; lower one")
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1):
        raise MxcError(f"--jobs {jobs}: expected a positive number of processes{_got(jobs)}")
    if prefill_graphs is None:
        prefill_graphs = PREFILL_GRAPH_TOKENS if target == "cuda" else 0
    if not isinstance(prefill_graphs, int) or isinstance(prefill_graphs, bool) or prefill_graphs < 0:
        raise MxcError(f"--prefill-graphs {prefill_graphs}: expected a token count >= 0 (0: off){_got(prefill_graphs)}")
    if 0 < prefill_graphs < PREFILL_GRAPH_MIN:
        raise MxcError(f"--prefill-graphs {prefill_graphs}: the smallest prompt bucket replayed as a CUDA graph is "
                       f"{PREFILL_GRAPH_MIN} tokens; give 0 (off) or at least {PREFILL_GRAPH_MIN}")
    if prefill_graphs and target != "cuda":
        raise MxcError(f"--prefill-graphs {prefill_graphs}: prompts replayed as CUDA graphs, with --target cuda "
                       f"(got --target {target}); drop it")
    tensor_names = functools.cache(lambda: _tensor_names(src.checkpoint))  # read once, where asked
    prequant = checkpoint_quantization(src.config, src.config_path, tensor_names) if src.checkpoint else None
    scale_suffix = None
    if prequant is not None:
        if quant_granularity is not None and quant_granularity != prequant[0]:
            raise MxcError(f"{src.config_path}: the checkpoint is already fp8 ({prequant[0]} scales); "
                           f"--quant-granularity {quant_granularity} cannot change that")
        quant, (quant_granularity, scale_suffix) = "fp8", prequant
    elif quant is None and (quant_lm_head or quant_granularity is not None):
        flag = "--quant-lm-head" if quant_lm_head else f"--quant-granularity {quant_granularity}"
        raise MxcError(f"{flag}: applies to fp8 weights; add --quant fp8, or drop it")
    if mlp_pair and quant != "fp8":
        raise MxcError("--mlp-pair: the fused MLP kernel runs fp8 weights, and no --quant fp8 was given; add it, "
                       "or drop --mlp-pair")
    quant_granularity = quant_granularity or "channel"
    if mlp_pair and target != "cuda":
        raise MxcError(f"--mlp-pair: the fused MLP kernel is a cuda kernel (got --target {target}); add --target "
                       f"cuda, or drop --mlp-pair")
    if mlp_pair and tp != 1:
        raise MxcError(f"--mlp-pair: the fused MLP kernel runs at --tp 1 only (got --tp {tp}); drop --mlp-pair")
    options = BuildOptions(target=target, dtype=dtype,
                           max_batch=max_batch, max_seq_len=max_seq_len, tp=tp, quant=quant,
                           quant_granularity=quant_granularity, quant_lm_head=quant_lm_head,
                           quant_scale_suffix=scale_suffix, disable_passes=check_disabled(disable_passes), pdl=pdl,
                           tp_allreduce=tp_allreduce, arch=arch, mlp_pair=mlp_pair,
                           prefill_graph_tokens=prefill_graphs)
    out = Path(out) if out else Path("build") / src.model_file.stem
    check_out(out)
    if dump_ir:
        check_dump_dir(Path(dump_ir), out)
    check_eos(src)
    _check_tokenizer(src.checkpoint)

    mpe = src.config.get("max_position_embeddings")
    if isinstance(mpe, int) and not isinstance(mpe, bool) and max_seq_len > mpe:
        log(f"note: --max-seq-len {max_seq_len} is above {src.config_path}'s max_position_embeddings {mpe}: "
            f"positions past it are outside what the model was trained on")
    log(f"binding {src.model_file.name} to {src.config_path}")
    graph = bind_model(src.model_file, src.config, options.dtype, src.entry, src.config_path)
    # before anything walks the layers: the ranks' files together hold every element at least once, in at least a
    # byte (fp8) or the dtype's (a config of 10**12 layers would otherwise be walked for hours before check_space)
    least = weight_elements(graph) * (1 if options.quant else DTYPES[options.dtype].itemsize)
    check_space(out, least, at_least=True)
    if options.quant_scale_suffix:  # an fp8 checkpoint: which linear weights it left unquantized
        keep = unquantized_linears(graph, tensor_names(), options.quant_scale_suffix, src.checkpoint)
        if keep:
            log(f"note: the checkpoint stores {len(keep)} of the layers' linear weights unquantized ({keep[0]}, ...); "
                f"they stay in {options.dtype}")
            options = replace(options, quant_unquantized=keep)
    log("compiling" + (f" (IR after each pass in {dump_ir})" if dump_ir else ""))
    graph = compile_graph(graph, options, Path(dump_ir) if dump_ir else None)

    need = options.tp * weight_bytes(graph)
    check_space(out, need)
    tmp = out.parent / f".{out.name}.building-{os.getpid()}"
    created = [p for p in (out.parent.absolute(), *out.parent.absolute().parents) if not p.exists()]  # innermost first
    try:  # the temporary directory goes on any exit, even a signal handled just after its mkdir
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            recover(out)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            raise MxcError(f"--out {out}: cannot write an artifact there ({e.strerror or e})") from None
        try:
            _write(tmp, graph, src, options, arch, jobs, progress, log)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise MxcError(f"--out {out}: {e.strerror} while writing the artifact (its weights take "
                               f"{size_text(need)}); free some space or choose another --out") from None
            where = str(e.filename).replace(str(tmp), str(out)) if e.filename else f"--out {out}"
            raise MxcError(f"{where}: {e.strerror or e} while building the artifact; fix that and build "
                           f"again") from None  # EIO, EROFS, ...: the environment's, one line
        except MxcError as e:  # a file being written is named where it would have been
            raise MxcError(str(e).replace(str(tmp), str(out))) from None
        replace_with(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in created:  # the folders this build made for --out, where nothing else went since
            try:
                parent.rmdir()
            except OSError:
                break
        raise
    log(f"wrote {out}")
    return out


def _write(tmp: Path, graph: Graph, src: Source, options: BuildOptions, arch: int, jobs: int | None, progress: bool,
           log) -> None:
    (tmp / "code").mkdir()
    (tmp / "weights").mkdir()
    ir_text = dump_graph(graph)
    (tmp / "graph.yaml").write_text(ir_text)
    ir_hash = hashlib.sha256(ir_text.encode()).hexdigest()
    program_text = render_forward(graph, ir_hash)
    (tmp / "code" / "forward.py").write_text(program_text)
    cutlass = mlp_pair = None
    ckpt = open_checkpoint(src.checkpoint) if src.checkpoint else DummyCheckpoint(graph)
    with ckpt:
        check_checkpoint(graph, ckpt)  # what the headers say, before the kernels' minutes of compiling
        if options.target == "cuda":
            _compile_kernels(graph, program_text, tmp / "code" / "kernels", options, arch, jobs, progress, log)
            cutlass = _cutlass_library(graph, tmp, log)
            mlp_pair = _mlp_pair_library(graph, options, tmp, log)
        log("writing weights" + (f" from {src.checkpoint}" if src.checkpoint else
                                 " (deterministic random: no --checkpoint)"))
        digests = write_weights(graph, ckpt, [tmp / "weights" / f"rank{r}.safetensors" for r in range(options.tp)],
                                progress=progress, checked=True)
    if src.checkpoint:
        for f in _tokenizer_files(src.checkpoint):
            (tmp / "tokenizer" / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src.checkpoint / f, tmp / "tokenizer" / f)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "mxc_version": mxc.__version__,
        "family": graph.family,
        "architecture": (src.config.get("architectures") or [None])[0],  # None: a model file built from a config
        # that names none
        "model_file": src.model_file.name,
        "config": graph.config,
        "hf_config": src.config,
        "options": options.to_dict(),
        "target": _target_info(options, arch),
        "ir_sha256": ir_hash,
        "runtime": _runtime_info(graph, src),
        "kernels": _kernel_table(graph),
        **({"cutlass": cutlass} if cutlass else {}),
        **({"mlp_pair": mlp_pair} if mlp_pair else {}),
        # the checkpoint folder's name, not its path: an artifact that is shipped tells neither where nor by whom
        # (/home/<user>) it was built, and builds from two copies of a checkpoint are the same bytes
        "source": {"checkpoint": checkpoint_name(src.checkpoint) if src.checkpoint else None,
                   "weights": "checkpoint" if src.checkpoint else "dummy"},
        "tp": options.tp,
        "files": file_digests(tmp, {p.relative_to(tmp).as_posix(): d for p, (d, _) in digests.items()}),
        **file_chunks({p.relative_to(tmp).as_posix(): pieces for p, (_, pieces) in digests.items()}),
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def _compile_kernels(graph, program_text, out_dir, options, arch, jobs, progress, log) -> None:
    """Record the launches of the generated program and compile each kernel for sm_<arch>."""
    from mxc.codegen import aot

    program = types.ModuleType("mxc_build_program")
    exec(compile(program_text, "forward.py", "exec"), program.__dict__)
    specs = aot.record(program, graph, options.max_batch, options.max_seq_len, pdl=options.pdl,
                       prefill_graph_tokens=options.prefill_graph_tokens)
    log(f"compiling {len(specs)} kernels for sm_{arch} (Triton {aot.triton_version()})")
    start = time.perf_counter()
    aot.compile_specs(specs, out_dir, arch=arch, progress=progress, workers=jobs)
    log(f"compiled {len(specs)} kernels in {time.perf_counter() - start:.1f} s")


def _chosen_kernels(graph) -> set[str]:
    kernels = [n.attrs.get("kernel") for n, _ in graph.nodes()]
    return {k for k in kernels if isinstance(k, str)} | {name for k in kernels if isinstance(k, list) for _, name in k}


def _cutlass_library(graph, tmp: Path, log) -> dict | None:
    """When ``select_kernels`` chose the CUTLASS fp8 GEMM anywhere, its library in the artifact
    (``cutlass_fp8.LIBRARY``) and the manifest's record of it; else None."""
    from mxc.kernels import cutlass_fp8
    from mxc.kernels.candidates import CUTLASS_KERNELS

    if not _chosen_kernels(graph) & set(CUTLASS_KERNELS):
        return None

    try:
        gemm = cutlass_fp8.load(cutlass_fp8.build_library(tmp / cutlass_fp8.LIBRARY, log))
    except (RuntimeError, OSError) as e:
        raise MxcError(f"building the CUTLASS fp8 GEMM failed ({first_line(e)}); "
                       f"set MXC_CUTLASS_LIBRARY=none to build with torch._scaled_mm instead") from e
    return {"library": cutlass_fp8.LIBRARY, "kernel": gemm.name, "config": cutlass_fp8.library_config()}


def _mlp_pair_library(graph, options: BuildOptions, tmp: Path, log) -> dict | None:
    """When ``select_kernels`` chose the persistent fp8 MLP kernel, its library in the artifact
    (``mlp_pair_fp8.LIBRARY``) and the manifest's record of it; else None."""
    from mxc.kernels import mlp_pair_fp8
    from mxc.kernels.candidates import MLP_PAIR_KERNEL

    if MLP_PAIR_KERNEL not in _chosen_kernels(graph):
        if options.mlp_pair:
            log("--mlp-pair: no node runs the persistent MLP kernel (graph.yaml's rms_norm_mlp nodes say which kernels "
                "do; it needs hidden and intermediate sizes that are multiples of 1024, bf16, one scale a row, sm_90)")
        return None
    try:
        mlp_pair_fp8.library(tmp / mlp_pair_fp8.LIBRARY, log)
    except (RuntimeError, OSError) as e:
        raise MxcError(f"building the fp8 MLP pair kernel failed ({first_line(e)}); "
                       f"build without --mlp-pair") from e
    return {"library": mlp_pair_fp8.LIBRARY, "source": mlp_pair_fp8.library_source()}
