"""Layer 6: `patchkit doctor` and its kernel scan. Reads files and runs Triton's toolchain;
never imports vLLM or torch.
"""
