"""The kernels: hand-written Triton (and CUDA/CUTLASS) kernels, each with its torch reference
(``torch_ref``, ``fp8_ref``, ``moe_ref``), the candidates ``select_kernels`` chooses among (``candidates``), and the
adapters the generated programs call (``cuda_ops``). Every launch goes through ``launch.launch``, so one wrapper
serves Triton's JIT (tests, the interpreter), the build's recorder and the runtime's precompiled binaries. Kernels
import neither the compiler nor the runtime.
"""
