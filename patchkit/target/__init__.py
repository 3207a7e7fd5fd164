"""The vLLM tree patchkit works on: where it is, which release, its caches, its git checkout.

tree (layer 2) finds a tree and its version without importing vLLM; fetch
gets a pristine release tree; caches clears vLLM's and Triton's compile
caches; forkmode turns patches into commits on a checkout (layer 4, above
the engine's operations).
"""
