"""The kernels: Triton kernels, hand-written or rendered from jinja2 templates (``kernel_templates``,
``templates/``), and CUDA/CUTLASS libraries called through ctypes (``cutlass_fp8``, ``mlp_pair_fp8``), each with its
torch reference (``torch_ref``, ``fp8_ref``, ``moe_ref``); the candidates ``select_kernels`` chooses among
(``candidates``); and the adapters the generated programs call (``cuda_ops``). Every Triton launch goes through
``launch.launch``, so one wrapper serves Triton's JIT (tests, the interpreter), the build's recorder and the
runtime's precompiled binaries. Kernels import neither the compiler nor the runtime.
"""
