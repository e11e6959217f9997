"""The compiler's passes, one per file, each ``run(graph, options) -> Graph`` with what it matches, what it
rewrites to, what it requires and what it preserves in its module docstring; ``mxc.compiler.pipeline`` orders them.
"""
