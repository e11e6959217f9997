"""The ``mxc`` command line: build, generate, inspect, models.

Each subcommand parses its arguments and calls the library (``mxc.build``,
``mxc.load``, ``mxc.inspect.summary``), holding no logic a library user could not
call. A user error (``MxcError``) prints one line, ``mxc: error: ...``, and
exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading

from mxc import __version__
from mxc.errors import MxcError


def _ids(text: str) -> list[int]:
    """``--ids``: comma-separated ASCII integers (spaces around them allowed); an empty item is refused by its
    position rather than skipped, and ``int``'s other forms (``+1``, ``1_000``, other scripts' digits) are not
    token ids."""
    if not text.strip():
        raise MxcError("--ids: give at least one token id")
    items = [t.strip() for t in text.split(",")]
    for n, t in enumerate(items, 1):
        if not re.fullmatch(r"-?[0-9]+", t, flags=re.ASCII):
            what = "is empty" if not t else f"{t!r} is not an integer"
            raise MxcError(f"--ids {text!r}: item {n} {what}; expected comma-separated integers like 1,2,3")
    return [int(t) for t in items]


def _prompt(text: str, flag: str = "--prompt") -> str:
    """``--prompt`` (or ``--system``) as text the tokenizer takes: bytes of the command line that are not text in
    the locale's encoding (a Latin-1 file's é in a UTF-8 shell) reach Python as lone surrogates, which the tokenizer
    refused with a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        enc = sys.getfilesystemencoding()
        raise MxcError(f"{flag}: {what} at character {e.start + 1} is not {enc} text; give the prompt in {enc} "
                       f"(e.g. iconv -t {enc})") from None
    return text


class StdoutClosed(Exception):
    """The reader of standard output went away (``mxc models | head -1``): the rest of the output is dropped."""


def emit(text: str) -> None:
    """Print a line of the command's result. A closed pipe raises StdoutClosed; another write error (a full disk)
    is a user error, in one line. Either way stdout then points at /dev/null, so that what stays in its buffer
    goes nowhere at the interpreter's exit rather than failing again there."""
    try:
        print(text, flush=True)
    except OSError as e:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        if isinstance(e, BrokenPipeError):
            raise StdoutClosed from None
        raise MxcError(f"standard output: cannot write the result ({e.strerror or e})") from None


def cmd_build(args) -> None:
    from mxc.builder import build

    build(args.source, out=args.out, checkpoint=args.checkpoint, config=args.config, dtype=args.dtype,
          target=args.target, dump_ir=args.dump_ir, max_batch=args.max_batch, max_seq_len=args.max_seq_len, tp=args.tp,
          quant=args.quant, quant_granularity=args.quant_granularity, quant_lm_head=args.quant_lm_head,
          disable_passes=args.disable_pass, pdl=args.pdl, tp_allreduce=args.tp_allreduce, mlp_pair=args.mlp_pair,
          prefill_graphs=args.prefill_graphs, jobs=args.jobs,
          progress=sys.stderr.isatty())  # bars on a terminal; a log or a pipe gets the phases' lines only


def _generate_and_print(rank: int, world_size: int, device: str, args, prompts: list[list[int]]) -> None:
    import mxc
    from mxc.tokenizer import load_tokenizer

    model = mxc.load(args.artifact, device=device, rank=rank, world_size=world_size)
    tokenizer = load_tokenizer(model.path) if args.prompt is not None else None
    new = model.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_at_eos=tokenizer is not None).tolist()
    if rank != 0:
        return
    for row in new:  # one line a prompt, in order
        if tokenizer is not None:  # up to the row's own end-of-sequence token: the padding after it is the batch's
            row = row[:next((i + 1 for i, t in enumerate(row) if t in model.eos_token_ids), len(row))]
        result = {"ids": row}
        if tokenizer is not None:
            result["text"] = tokenizer.decode(row)
        try:
            emit(json.dumps(result))
        except StdoutClosed:
            if world_size == 1:
                raise
            # a rank has no exit status of its own to give (``run_ranks``): the command ends as if it printed
            return


def cmd_generate(args) -> None:
    from pathlib import Path

    from mxc.runtime.artifact import check_generate_device, default_device, read_manifest
    from mxc.runtime.model import check_capacity
    from mxc.runtime.sampling import check_generate_args
    from mxc.tokenizer import load_tokenizer, missing_reason

    if (args.ids is None) == (args.prompt is None):
        raise MxcError("give exactly one of --ids or --prompt (either repeatable: one prompt each)")
    chat_flags = [flag for flag, given in (("--chat", args.chat), ("--system", args.system is not None),
                                           ("--chat-template", args.chat_template is not None)) if given]
    if args.prompt is None and chat_flags:
        raise MxcError(f"{chat_flags[0]}: renders --prompt text with the chat template; give --prompt, not --ids")
    if args.system is not None and not args.chat:
        raise MxcError("--system: the system message of a --chat prompt; add --chat")
    if args.chat_template is not None and not args.chat:
        raise MxcError("--chat-template: picks the chat template a --chat prompt is rendered with; add --chat")
    path = Path(args.artifact)
    manifest = read_manifest(path)
    tokenizer = load_tokenizer(path) if args.prompt is not None else None
    if args.prompt is not None and tokenizer is None:
        raise MxcError(f"{args.artifact}: {missing_reason(path, manifest.get('files', {}))}; use --ids")
    template = None
    if args.chat:
        from mxc.chat_template import load_chat_template

        template = load_chat_template(path, manifest.get("files", {}), args.chat_template)
    prompts = [_ids(t) for t in args.ids] if args.ids is not None else \
        [_encode(tokenizer, t, template, args.system) for t in args.prompt]
    vocab = manifest["runtime"]["vocab_size"]
    flag, texts = ("--ids", args.ids) if args.ids is not None else ("--prompt", args.prompt)
    for text, ids in zip(texts, prompts):
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:  # named by its prompt (of several, which one)
            raise MxcError(f"{flag} {text!r}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    check_generate_args(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, flags=True)
    device = default_device(manifest) if args.device is None else args.device
    check_generate_device(device, manifest, path)
    options = manifest["options"]
    on_gpu = options.get("target") == "cuda" and not str(device).startswith("cpu")  # the decoder's --max-batch slots
    check_capacity(len(prompts), max(map(len, prompts)), args.max_new_tokens, options.get("max_seq_len"),
                   options.get("max_batch") if on_gpu else None)
    tp = manifest.get("tp", 1)
    if tp == 1:
        _generate_and_print(0, 1, device, args, prompts)
    else:  # one command starts every rank; rank 0 prints
        from mxc.runtime.ranks import run_ranks

        run_ranks(_generate_and_print, tp, device, args, prompts)


def _encode(tokenizer, text: str, template=None, system: str | None = None) -> list[int]:
    """A ``--prompt``'s ids: the text encoded, or with ``--chat`` the chat ``template`` rendered around it."""
    if template is None:
        ids = tokenizer.encode(_prompt(text))
    else:
        from mxc.chat_template import chat_ids

        ids = chat_ids(tokenizer, template, _prompt(text), None if system is None else _prompt(system, "--system"))
    if not ids:
        raise MxcError(f"--prompt {text!r}: encodes to no tokens; give some text")
    return ids


def cmd_inspect(args) -> None:
    from mxc.inspect import summary

    emit(summary(args.artifact))


def cmd_models(args) -> None:
    from mxc.models import registry

    for arch, entry in sorted(registry().items()):
        note = "" if entry.tested else "  (same graph; not parity-tested here)"
        emit(f"{arch:28s} {entry.model}{note}")


class _Version(argparse.Action):
    """``--version``, printed through ``emit`` (argparse's own prints with no care for a closed or full stdout)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        raise _VersionAsked


class _VersionAsked(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse with the project's one-line error format (``mxc: error: ...``, exit 2)."""

    def error(self, message):
        self.exit(2, f"mxc: error: {message} (see `{self.prog} --help`)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mxc", description="Ahead-of-time model builder for LLM inference.")
    p.add_argument("--version", action=_Version, help="show mxc's version and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    b = sub.add_parser("build", help="build an artifact from a model definition and a checkpoint")
    b.add_argument("source", help="bundled definition (llama.yaml), a YAML path, an HF checkpoint directory, or a Hub "
                                  "model id (owner/name) downloaded into the local HF cache")
    b.add_argument("--checkpoint", help="HF checkpoint directory, or a Hub model id in the local HF cache (default: "
                                        "bundled tiny config, random weights)")
    b.add_argument("--config", help="a config.json to build with deterministic random weights (no checkpoint)")
    b.add_argument("--out", help="artifact directory (default: build/<definition>)")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="weight/activation dtype (default: float32 on cpu; on cuda config.json's dtype where it is "
                        "bfloat16 or float16, else bfloat16)")
    b.add_argument("--target", choices=["cpu", "cuda"], default="cpu")
    b.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: writes weights/rank{r}.safetensors")
    b.add_argument("--quant", choices=["fp8"], help="fp8 e4m3 linear weights, activations quantized per token")
    b.add_argument("--quant-granularity", choices=["channel", "tensor", "block128"],
                   help="fp8 weight scales: per output channel (default), per tensor, or per 128x128 block")
    b.add_argument("--quant-lm-head", action="store_true", help="quantize the LM head too")
    b.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass into DIR")
    b.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="cuda: programmatic dependent launch, each kernel starting while the one before it ends "
                        "(default: on for sm_90 and later)")
    b.add_argument("--tp-allreduce", choices=["auto", "nccl", "one_shot", "push"], default="auto",
                   help="cuda, --tp > 1: decode all-reduces (up to 32 tokens) pushed into the peers' memory and "
                        "fused with the residual add and RMSNorm (push), one-shot over peer memory (bf16/fp32), or "
                        "by NCCL (default auto: push for bf16/fp16, one_shot for float32, on cuda with --tp > 1, else "
                        "nccl; the runtime falls back to NCCL where peer memory is not usable)")
    b.add_argument("--mlp-pair", action="store_true",
                   help="fp8, tp 1 (experimental; slower than the default kernels on an H200, docs/perf.md): run "
                        "each layer's fused MLP op on cuda at <= 8 tokens as one persistent launch "
                        "(mxc.kernels.mlp_pair_fp8, compiled with nvcc at build)")
    b.add_argument("--disable-pass", metavar="PASS", action="append", default=[],
                   help="skip an optional pass (repeatable), e.g. fuse_linear_io")
    b.add_argument("--max-batch", type=int, default=32, help="cuda: sequences decoded together (default 32)")
    b.add_argument("--max-seq-len", type=int,
                   help="longest sequence, prompt + new tokens, generate accepts; on cuda the KV-cache length per "
                        "sequence (default: min(4096, max_position_embeddings))")
    b.add_argument("--prefill-graphs", type=int, metavar="TOKENS",
                   help="cuda: one-prompt prefills up to TOKENS tokens replay a CUDA graph per length bucket "
                        "(powers of two from 16 to 512, then every 256, none past TOKENS or --max-seq-len), padded "
                        "up to it (short prompts wait on the host's ~8-20 ms of launches otherwise; default 2048, "
                        "0: off)")
    b.add_argument("--jobs", "-j", type=int, metavar="N",
                   help="cuda: processes compiling the kernels (default: one a core; 1: no worker processes)")
    b.set_defaults(fn=cmd_build)

    g = sub.add_parser("generate", help="generate tokens with a built artifact")
    g.add_argument("artifact")
    g.add_argument("--ids", action="append", help="prompt token ids, comma-separated (repeatable: prompts of any "
                                                  "lengths generated together, one JSON line each, in order)")
    g.add_argument("--prompt", action="append",
                   help="prompt text (needs a tokenizer.json in the artifact), encoded as that file says (a BOS where "
                        "it adds one), as transformers' tok(TEXT); prints \"text\" too, the new tokens decoded "
                        "without special tokens, and stops at the end-of-sequence token (repeatable, as --ids)")
    g.add_argument("--chat", action="store_true",
                   help="with --prompt: each prompt is a user message rendered with the artifact's chat template "
                        "(the checkpoint's chat_template.jinja, or tokenizer_config.json's chat_template) and the "
                        "assistant's header, as transformers' apply_chat_template(messages, "
                        "add_generation_prompt=True)")
    g.add_argument("--chat-template", metavar="NAME",
                   help="with --chat: render with the checkpoint's chat template of this name (one of "
                        "additional_chat_templates/NAME.jinja, e.g. tool_use, or of a named list in "
                        "tokenizer_config.json), as apply_chat_template(..., chat_template=NAME) (default: "
                        "\"default\", chat_template.jinja or the only template; needed where there are several and "
                        "none is \"default\")")
    g.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each prompt")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default 0: greedy)")
    g.add_argument("--top-k", type=int, help="with --temperature: sample from the K most likely tokens")
    g.add_argument("--top-p", type=float, help="with --temperature: sample from the smallest set of tokens whose "
                                               "probabilities sum to at least P")
    g.add_argument("--seed", type=int, help="with --temperature: seed the sampling, for repeatable output")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: the artifact's target's, cuda for --target cuda)")
    g.set_defaults(fn=cmd_generate)

    i = sub.add_parser("inspect", help="print a readable summary of an artifact")
    i.add_argument("artifact")
    i.set_defaults(fn=cmd_inspect)

    m = sub.add_parser("models", help="list supported Hugging Face architectures")
    m.set_defaults(fn=cmd_models)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the command is so that it cleans up as after Ctrl-C (a build removes its
    partial output)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate(signum, frame):
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except _VersionAsked:
        return _run(lambda: emit(f"mxc {__version__}"))
    return _run(lambda: args.fn(args))


def _run(command) -> int:
    """Run ``command`` with the project's exits: a user error in one line (2), a closed stdout quietly (141, as a
    command killed by SIGPIPE), SIGTERM/SIGHUP and Ctrl-C after the command cleaned up (128 + the signal)."""
    handled = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {}
    if threading.current_thread() is threading.main_thread():  # handlers can only be set from the main thread
        previous = {s: signal.signal(s, _terminate) for s in handled}
    try:
        command()
    except MxcError as e:
        print(f"mxc: error: {e}", file=sys.stderr)
        return 2
    except StdoutClosed:
        return 128 + 13
    except Terminated as e:
        print(f"mxc: terminated ({signal.Signals(e.signum).name})", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("mxc: interrupted", file=sys.stderr)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
