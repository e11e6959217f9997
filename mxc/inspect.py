"""``mxc inspect``: a readable summary of an artifact, from its manifest and IR."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from mxc.artifact_format import listed_files, safetensors_header
from mxc.errors import MxcError, size_text
from mxc.runtime.artifact import read_manifest
from mxc.runtime.model import DTYPES, kv_cache_bytes
from mxc.runtime_buckets import prefill_graph_buckets


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _kernel(choice) -> str:
    """A node's kernel: one name, none, or per token-count bucket ``name (<= 16 tokens) / ... / name``."""
    if choice is None:
        return "(none)"
    if isinstance(choice, str):
        return choice
    return " / ".join(name if hi is None else f"{name} (<= {hi} tokens)" for hi, name in choice)


def _compiled(path: Path) -> list[str]:
    """For a --target cuda artifact: how many binaries, and each kernel source rendered from a template; a damaged
    index shows as such, as a damaged weight file does (``mxc.load`` refuses it by its hash)."""
    index_path = path / "code" / "kernels" / "index.json"
    if not index_path.is_file():  # a FIFO there would block the read forever
        return []
    try:
        index = json.loads(index_path.read_text())
        rendered = {e["source"]: (e["template"], e["template_params"]) for e in index.values() if "source" in e}
        lines = [f"compiled     {len(index)} cubins ({len(rendered)} kernel modules rendered from templates)"]
        for source, (template, params) in sorted(rendered.items(), key=lambda kv: kv[1][0]):
            args = ", ".join(f"{k}={v}" for k, v in sorted(params.items()))
            lines.append(f"  {template}({args})  code/kernels/{source}")
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return ["compiled     code/kernels/index.json  DAMAGED (not a readable kernel index)"]
    return lines


def _cuda_options(options: dict, tp: int) -> list[str]:
    """The runtime's sizes and launch modes of a cuda artifact: its KV cache, graph buckets and PDL; with tp > 1 its
    all-reduce (--tp-allreduce), and --mlp-pair where given."""
    if options["target"] != "cuda":
        return []
    buckets = prefill_graph_buckets(options.get("prefill_graph_tokens", 0), options["max_seq_len"])
    more = f", all-reduce {options.get('tp_allreduce')}" if tp > 1 else ""
    more += ", --mlp-pair" if options.get("mlp_pair") else ""
    return [f"cuda         KV cache {options['max_batch']} x {options['max_seq_len']} tokens (decode graphs per "
            f"batch bucket), prefill graphs {f'up to {buckets[-1]} tokens' if buckets else 'off'}, "
            f"PDL {'on' if options.get('pdl') else 'off'}{more}"]


def _gpu_memory(path: Path, m: dict) -> list[str]:
    """What a cuda artifact's load takes of each GPU's memory: its rank's weights and the KV cache the decoder
    allocates (keys and values of every layer, ``--max-batch`` slots and the scratch slot of ``--max-seq-len`` rows:
    ``runtime.decode_graphs``), activations and CUDA graphs' buffers aside."""
    options, kv = m["options"], m["runtime"].get("kv_cache")
    if options["target"] != "cuda" or not kv:
        return []
    cache = kv_cache_bytes(kv, options["max_batch"] + 1, options["max_seq_len"], DTYPES[m["runtime"]["dtype"]])
    weights = path / "weights" / "rank0.safetensors"
    held = f"{size_text(weights.stat().st_size)} of weights + " if weights.is_file() else ""
    return [f"gpu memory   {held}{size_text(cache)} of KV cache a GPU (--max-batch {options['max_batch']} "
            f"+ 1 scratch slot x --max-seq-len {options['max_seq_len']} tokens), before activations"]


def _rope(c: dict) -> str:
    """RoPE's type, theta and its type's parameters (a linear or llama3 factor, yarn's ...), and the rotated part of
    a head where it is not all of it."""
    rope = c.get("rope") or {}
    params = [f"{k} {v}" for k, v in rope.items()
              if k not in ("type", "theta", "rotary_dim", "max_position_embeddings") and v is not None]
    if rope.get("rotary_dim") not in (None, c.get("head_dim")):
        params.insert(0, f"rotary_dim {rope['rotary_dim']} of head_dim {c.get('head_dim')}")
    return f"{rope.get('type')} (theta {rope.get('theta')}{''.join(', ' + p for p in params)})"


def _kernels(m: dict) -> list[str]:
    """The kernels chosen, each with its number of IR nodes: those in the layers (each of which runs once a layer),
    then those outside them."""
    layers = (m["runtime"].get("layers") or {}).get("count")
    groups = [("layers", f"in each of the {layers} layers" if layers is not None else "in the layers"),
              ("top", "outside the layers")]
    lines = []
    for where, title in groups:
        counts = Counter(_kernel(r["kernel"]) for r in m["kernels"] if (r.get("in") == "layers") == (where == "layers"))
        if counts:
            width = len(str(max(counts.values())))
            lines += [f"{'kernels' if not lines else '':12s} {title}"]
            lines += [f"  {n:>{width}} x {k}" for k, n in counts.items()]
    return lines or ["kernels      (none)"]


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _mlp(c: dict) -> str:
    """The MLP part of the shape line: the dense width, or for a mixture of experts its experts and routing."""
    if not c.get("moe"):
        return f"mlp {c.get('intermediate_size')}"
    renorm = ", renormalised" if c.get("norm_topk_prob") else ""
    shared = c.get("shared_expert_intermediate_size") or 0
    return (f"{c.get('num_experts')} experts of mlp {c.get('moe_intermediate_size')} (top-{c.get('num_experts_per_tok')}"
            f" {c.get('moe_scoring', 'softmax')}{renorm})" + (f" + a shared expert of mlp {shared}" if shared else ""))


def _quant(options: dict, moe: bool = False) -> str:
    if not options.get("quant"):
        return "none"
    lm_head = ", LM head too" if options.get("quant_lm_head") else ""
    granularity = options.get("quant_granularity")
    # --quant fp8 gives the experts of a mixture one scale a row whatever the granularity (quantize's _expert_rule);
    # an fp8 checkpoint's experts keep its scales
    imported = options.get("quant_scale_suffix") is not None
    experts = "; channel scales for the experts" if moe and granularity != "channel" and not imported else ""
    kept = len(_list(options.get("quant_unquantized")))  # what an fp8 checkpoint left in the model dtype
    kept = f"; {kept} of the layers' linear weights left in {options.get('dtype')} by it" if kept else ""
    return f"{options['quant']} ({granularity} scales{lm_head}{', from the checkpoint' * imported}{experts}{kept})"


def summary(path) -> str:
    path = Path(path)
    m = read_manifest(path)
    c = m["config"]
    rt = m["runtime"]
    lines = [
        f"artifact     {path}",
        f"model        {m['architecture'] or '(no architectures in config.json)'} ({m['model_file']}, family {m['family']})",
        f"shape        {c.get('num_hidden_layers')} layers, hidden {c.get('hidden_size')}, "
        f"heads {c.get('num_attention_heads')}/{c.get('num_key_value_heads')} kv, head_dim {c.get('head_dim')}, "
        + (f"sliding window {c['attention_window']} tokens, " if c.get("attention_window") else "")
        + f"{_mlp(c)}, vocab {rt['vocab_size']}",
        f"rope         {_rope(c)}",
        f"build        target {m['options']['target']}, dtype {m['options']['dtype']}, tp {m.get('tp', 1)}, "
        f"quant {_quant(m['options'], bool(c.get('moe')))}, max-seq-len {m['options'].get('max_seq_len')}"
        + "".join(f", --disable-pass {name}" for name in _list(m["options"].get("disable_passes"))),
        *_cuda_options(m["options"], m.get("tp", 1)),
        *_gpu_memory(path, m),
        f"built by     mxc {m['mxc_version']} (torch {m['target'].get('torch')}), IR sha256 {m['ir_sha256'][:16]}",
        f"weights      {m['source']['weights']}" + (f" from {m['source']['checkpoint']}" if m['source']['checkpoint'] else ""),
        f"tokenizer    {_tokenizer(path, m.get('files', {}))}",
        *_kernels(m),
    ]
    lines += _compiled(path)
    lines.append("files")
    extra = sorted(set(listed_files(path)) - set(m["files"]))  # mxc.load refuses these (verify_files)
    width = max([32, *map(len, [*m["files"], *extra])])  # one column of sizes, however long a name
    for rel in m["files"]:
        f = path / rel
        lines.append(f"  {rel:{width}s} {_file_state(f)}")
    for rel in extra:
        lines.append(f"  {rel:{width}s} EXTRA (not in manifest.json: loading refuses the artifact; remove it)")
    return "\n".join(lines)


def _tokenizer(path: Path, files) -> str:
    """What ``mxc generate`` can take text with: tokenizer.json (``--prompt``) and the chat templates by name
    (``--chat``, ``--chat-template NAME``), or why not; a damaged file is named, as the files listing does."""
    from mxc.chat_template import chat_templates
    from mxc.tokenizer import missing_reason

    if not (path / "tokenizer" / "tokenizer.json").is_file():
        return f"none: generate takes --ids only ({missing_reason(path, files)})"
    try:
        names = sorted(chat_templates(path, files))
    except MxcError as e:
        return f"tokenizer.json (--prompt); chat templates UNREADABLE ({e})"
    if not names:
        return "tokenizer.json (--prompt); no chat template (--chat cannot run)"
    if "default" not in names:
        how = '--chat needs --chat-template NAME: none is "default"'
    else:
        how = "--chat; --chat-template NAME picks another" if len(names) > 1 else "--chat"
    return f"tokenizer.json (--prompt); chat templates {', '.join(map(repr, names))} ({how})"


def _file_state(f: Path) -> str:
    """A file's size, MISSING (not a regular file either: ``mxc.load`` calls a directory or a FIFO there missing, and
    reading a FIFO would block), or for a safetensors file whose size is not what its header says, TRUNCATED or
    OVERSIZED (read from the header: no hashing of gigabytes; ``mxc.load`` verifies the hashes)."""
    if not f.is_file():
        return "MISSING"
    size = f.stat().st_size
    if f.suffix == ".safetensors":
        want = _safetensors_size(f)
        if want is None:
            return f"{_size(size)}  DAMAGED (no readable safetensors header)"
        if want != size:
            return f"{_size(size)}  {'TRUNCATED' if size < want else 'OVERSIZED'} (its header says {_size(want)})"
    return _size(size)


def _safetensors_size(f: Path) -> int | None:
    """The size a safetensors file's header implies (8 + header + the data's end), or None if unreadable."""
    try:
        n, header = safetensors_header(f)
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return 8 + n + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
