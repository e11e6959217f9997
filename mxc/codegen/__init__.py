"""Code generation: the lowered IR rendered to the artifact's Python program (jinja2 templates, ``render``), the
recorded kernel launches compiled ahead of time for the target (``aot``), and the build-time check of what each
PDL kernel reads before its wait (``pdl_check``). Fusion decisions are the compiler's, not made here.
"""
