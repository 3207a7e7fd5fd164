"""Layer 6: `patchkit verify` on a GPU. torch, transformers and vLLM are imported lazily,
inside functions.
"""
