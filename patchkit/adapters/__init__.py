"""LoRA adapters read as files: safetensors headers checked, tensors scanned, shapes judged."""
