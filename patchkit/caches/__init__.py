"""Layer 3: vLLM's and Triton's compile caches, found and cleared without crossing links."""
