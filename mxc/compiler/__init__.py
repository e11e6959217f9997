"""The compiler: build options, the pipeline (``pipeline.PIPELINE``, one plain list) and the passes.

Every pass (``passes/``, one per file) is a pure ``Graph -> Graph`` function over the IR: fusions, tensor-parallel
sharding, quantization and kernel selection all show in the IR dump after each pass (``--dump-ir``). The compiler
touches no tensors and no files but the dumps; the weights' transforms it declares are applied by ``mxc.loaders``.
"""
