"""Layer 5: fork mode: patches turned into commits on a vLLM git checkout."""
