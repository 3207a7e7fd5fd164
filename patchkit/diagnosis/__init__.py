"""Diagnosis without a GPU: ``patchkit doctor`` and its kernel scan (layer 5).

Reads files and runs Triton's toolchain; never imports vLLM or torch. Uses
the engine (to know patch states) and the target, never the CLI.
"""
