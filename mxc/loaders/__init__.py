"""Weights in: reading checkpoints (safetensors, ``.bin`` with ``weights_only=True``, already-fp8 ones,
deterministic random), the streaming transforms the passes declared (merge, shard, quantize), applied tensor by
tensor, and writing each rank's safetensors shards. Never holds a whole checkpoint in memory.
"""
