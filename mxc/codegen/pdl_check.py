"""What a PDL kernel touches before ``griddepcontrol.wait``, read from its PTX; the build's check of it.

Under programmatic dependent launch (``mxc.kernels.pdl``) a kernel starts while the kernel ahead of it
still runs: before its ``griddepcontrol.wait`` nothing that kernel writes is there yet. A kernel may read
early only memory no kernel of the step writes, and names those pointer arguments with
``pdl.reads_before_wait``. ``touched_before_wait`` follows each pointer parameter through the PTX's
register arithmetic up to the first wait and lists the memory instructions (loads, stores, atomics,
``cp.async`` copies) whose address comes from it; L2 prefetches are hints, not reads, and are left out.
``violations`` compares that with the declaration and adds any exit ahead of the wait; ``mxc.codegen.aot``
runs it on every PDL kernel it compiles, so a kernel that reads its input too early fails the build instead
of racing on the GPU.

The analysis is syntactic and errs towards reporting: any instruction's destination inherits the
parameters of all its sources (iterated to a fixed point, for loops before the wait), and a value loaded
from memory carries none (a loaded index is data, the pointer it offsets is what the access touches).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_REG = re.compile(r"%[A-Za-z_][\w$]*")
_ADDR = re.compile(r"\[([^\]]*)\]")
_PARAM_LOAD = re.compile(r"ld\.param[\w.]*\s+(%[\w$]+)\s*,\s*\[\s*(\w+)_param_(\d+)\s*(?:\+\s*\d+\s*)?\]")
_NO_MEMORY = ("prefetch", "prefetchu", "cp.async.bulk.prefetch", "applypriority", "discard", "createpolicy")
_LOCAL_SPACES = (".shared", ".local", ".param", ".const")


@dataclass(frozen=True)
class Access:
    """One memory instruction before the wait: its kind (load, store, atomic), the pointer parameters its
    address derives from, and the PTX line."""

    kind: str
    params: frozenset[int]
    line: str


def _instructions(ptx: str, entry: str) -> list[str]:
    """The entry's instructions up to (not including) its first ``griddepcontrol.wait``; [] if it has none."""
    start = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\(", ptx)
    if start is None:
        raise ValueError(f"entry {entry} not found in PTX")
    body = ptx[start.end():]
    out = []
    for raw in body.splitlines():
        line = raw.split("//", 1)[0].strip()
        if line.startswith((".visible", ".entry", ".func", ".weak")):
            break  # the next function: this one has no wait
        if not line or line.startswith((".", "$", "{", "}", ")")) or line.endswith(":"):
            continue
        if "griddepcontrol.wait" in line:
            return out
        out.append(line.rstrip(";").strip())
    return []


def _opcode(inst: str) -> tuple[str, str]:
    """(opcode, operands) of one instruction, its guard predicate dropped."""
    inst = re.sub(r"^@!?%[\w$]+\s+", "", inst)
    op, _, rest = inst.partition(" ")
    return op, rest.strip()


def _kind(op: str) -> str | None:
    """load / store / atomic for an instruction that may touch global memory, else None."""
    if op.startswith(_NO_MEMORY):
        return None
    if op.startswith(("atom.", "red.")) or op in ("atom", "red"):
        return None if any(s in op for s in (".shared",)) else "atomic"
    if op.startswith("cp.async"):
        return "load"
    if op.startswith(("ld.", "ldu.")) or op.startswith(("st.", "stu.")):
        if any(space in op for space in _LOCAL_SPACES):
            return None
        return "load" if op.startswith(("ld", "ldu")) else "store"
    return None


def touched_before_wait(ptx: str, entry: str) -> list[Access]:
    """The memory instructions of ``entry`` before its first ``griddepcontrol.wait`` whose address derives
    from a pointer parameter (``[]`` for a kernel without a wait)."""
    insts = _instructions(ptx, entry)
    taint: dict[str, frozenset[int]] = {}
    changed = True
    while changed:  # a fixed point: a loop before the wait may carry a pointer around its back edge
        changed = False
        for inst in insts:
            m = _PARAM_LOAD.search(inst)
            if m is not None:
                new = frozenset({int(m.group(3))})
                dests = [m.group(1)]
            else:
                op, rest = _opcode(inst)
                if op.startswith(("ld", "st", "cp.", "atom", "red", "prefetch", "bar", "fence", "membar")):
                    continue  # memory instructions define data (or nothing), not pointers
                regs = _REG.findall(rest)
                if not regs:
                    continue
                if rest.startswith("{"):  # a vector destination: { %a, %b }, sources...
                    dest_part, _, src_part = rest.partition("}")
                    dests, srcs = _REG.findall(dest_part), _REG.findall(src_part)
                else:
                    dests, srcs = regs[:1], regs[1:]
                new = frozenset().union(*(taint.get(r, frozenset()) for r in srcs))
            for d in dests:
                if not new <= taint.get(d, frozenset()):
                    taint[d] = taint.get(d, frozenset()) | new
                    changed = True
    accesses = []
    for inst in insts:
        op, rest = _opcode(inst)
        kind = _kind(op)
        if kind is None:
            continue
        params = frozenset().union(*(taint.get(r, frozenset()) for addr in _ADDR.findall(rest)
                                     for r in _REG.findall(addr)))
        if params:
            accesses.append(Access(kind, params, inst))
    return accesses


def exits_before_wait(ptx: str, entry: str) -> list[str]:
    """The ``ret`` / ``exit`` instructions (guarded or not) ahead of the first wait: a program that takes one
    finishes without waiting, and if every program did, the kernel would end before the one ahead of it, which
    breaks the chain's rule that a kernel past its wait has every earlier kernel finished (``mxc.kernels.pdl``)."""
    return [inst for inst in _instructions(ptx, entry) if _opcode(inst)[0] in ("ret", "exit")]


def violations(ptx: str, entry: str, arg_names: list[str], allowed: frozenset[str] = frozenset()) -> list[str]:
    """One line for each argument touched before the wait that ``allowed`` does not name, and for each exit
    ahead of the wait. ``arg_names``: the kernel's runtime (non-constexpr) arguments in order, as the PTX
    parameters list them."""
    found: dict[tuple[str, str], str] = {("exit", "the program"): inst for inst in exits_before_wait(ptx, entry)}
    for access in touched_before_wait(ptx, entry):
        for i in sorted(access.params):
            name = arg_names[i] if i < len(arg_names) else f"param_{i}"
            if access.kind == "load" and name in allowed:
                continue
            found.setdefault((access.kind, name), access.line)
    return [f"{kind}s {name} before griddepcontrol.wait ({line})" for (kind, name), line in sorted(found.items())]
