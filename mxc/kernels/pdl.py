"""Programmatic dependent launch (Hopper and later): a kernel may start before the one ahead of it ends.

With the build option ``pdl``, every Triton kernel is compiled with ``USE_PDL`` and
the runtime launches it with the programmatic-stream-serialization attribute, which
CUDA graphs keep as programmatic edges. Each kernel begins with ``pdl_enter``: it
waits until the previous kernel has finished and its writes are visible
(``griddepcontrol.wait``), then lets the next kernel be scheduled
(``griddepcontrol.launch_dependents``), so the next kernel's launch and block
scheduling overlap this kernel's tail instead of following it. Nothing touches
memory before the wait, so the order of reads and writes is the stream's.
A kernel without ``USE_PDL`` is launched the ordinary way. Off by default until it
is measured (docs/perf.md).
"""

import triton
import triton.language as tl


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def takes_pdl(kernel) -> bool:
    """Whether a Triton kernel has the ``USE_PDL`` constexpr (and so starts with ``pdl_enter``)."""
    return "USE_PDL" in getattr(kernel, "arg_names", ())
