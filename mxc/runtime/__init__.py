"""The slim runtime: an artifact loaded and verified (``artifact``, ``model``), its precompiled kernels launched through
the CUDA driver (``cuda_launch``, ``tensor_maps``), the KV cache, decode and prefill CUDA graphs, sampling, generate,
and the torch.distributed ranks. Nothing is compiled at load, and no compiler code runs here.
"""
