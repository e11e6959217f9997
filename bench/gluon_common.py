"""What the Gluon labs share (``gemv_preload_lab``, ``moe_down_smem_lab``): PDL's two instructions, and the name
of the TMA load, which moved between Triton 3.6 (the GPU machines') and later releases."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# the TMA load: async_copy_global_to_shared in Triton 3.6, async_load from 3.7 or so
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def gdc_wait():
    """``griddepcontrol.wait``: the kernel ahead has finished and its writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def gdc_launch_dependents():
    """``griddepcontrol.launch_dependents``: the next kernel may launch."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)
