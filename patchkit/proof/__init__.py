"""Proof on a GPU: ``patchkit verify`` (layer 5).

Runs the installed vLLM's LoRA ops and a served model against references.
torch, transformers and vLLM are imported lazily, inside functions.
"""
