"""Layer 2: the vLLM tree patchkit works on: where it is, which release, its RECORD."""
