"""The GPU model's stand-in for nan-probe's CPU tests (both runners): a decoder stack
named as vLLM names it, with LoRA linear wrappers the probe finds by their class names."""

from __future__ import annotations

import torch


class BaseLayerWithLoRA(torch.nn.Module):
    """Stands in for vLLM's base of every LoRA wrapper (found by this class name)."""


class BaseLinearLayerWithLoRA(BaseLayerWithLoRA):
    """Stands in for vLLM's LoRA linear wrapper: the probe finds it by this class name
    (a BaseLayerWithLoRA too, as in vLLM)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.linear(x), None


class Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.qkv_proj = BaseLinearLayerWithLoRA(width)
        self.o_proj = BaseLinearLayerWithLoRA(width)

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        hidden, _ = self.qkv_proj(residual)
        hidden, _ = self.o_proj(hidden)
        return hidden, residual


class Model(torch.nn.Module):
    """A decoder stack as vLLM names it (``model.layers.N``), called with keywords."""

    def __init__(self, width: int = 8, layers: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(width) for _ in range(layers))

    def forward(self, positions, hidden_states):
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(
                positions=positions, hidden_states=hidden_states, residual=residual
            )
        return hidden_states
