"""Layer 3: pristine vLLM release trees, fetched from the real PyPI wheels."""
