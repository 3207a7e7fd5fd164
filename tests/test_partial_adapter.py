"""partial-gdn-adapter on the real code of 0.21.0, 0.26.0, 0.29.0 and 0.33.0.

``MergedColumnParallelLinearWithLoRA.set_lora`` and ``expand_packed_lora``
(with patchkit's helper, when patched) are taken from each release's real
``vllm/lora/layers/column_parallel_linear.py``, pristine and as the
catalogue's variant leaves it, and run on CPU against a stand-in layer
shaped like a GDN ``in_proj_qkvz``: four output slices Q, K, V, Z, two
packed adapter members (in_proj_qkv over Q+K+V, in_proj_z over Z), a
missing member passed as None as vLLM's PackedLoRALayerWeights.pack does.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import patched_text, release_tree
from tests.punica_harness import methods

RELPATH = "vllm/lora/layers/column_parallel_linear.py"
CLASS = "MergedColumnParallelLinearWithLoRA"
SIZES = [8, 8, 16, 16]  # Q, K, V, Z output slices (key, key, value, value)
RANK, HIDDEN, SLOTS = 4, 12, 2


METHODS = ("set_lora", "expand_packed_lora", "_patchkit_slices_after")


class GdnLayer:
    """What set_lora touches on a 4-slice in_proj_qkvz LoRA layer, tp_size 1."""

    def __init__(self, source: str):
        for name, function in methods(source, RELPATH, CLASS, METHODS).items():
            setattr(self, name, function.__get__(self))
        self.n_slices, self.output_sizes, self.tp_size = 4, SIZES, 1
        self.lora_a_stacked = tuple(torch.zeros(SLOTS, 1, RANK, HIDDEN) for _ in SIZES)
        self.lora_b_stacked = tuple(torch.zeros(SLOTS, 1, size, RANK) for size in SIZES)

    def reset_lora(self, index: int) -> None:
        for stacked in (*self.lora_a_stacked, *self.lora_b_stacked):
            stacked[index] = 0


def adapter(members: str):
    """Packed lora_a / lora_b lists for 'qkv', 'z' or 'both' (None for a missing member)."""
    torch.manual_seed(0)
    a_qkv, b_qkv = torch.randn(RANK, HIDDEN), torch.randn(sum(SIZES[:3]), RANK)
    a_z, b_z = torch.randn(RANK, HIDDEN), torch.randn(SIZES[3], RANK)
    qkv = members in ("qkv", "both")
    z = members in ("z", "both")
    return (
        [a_qkv if qkv else None, a_z if z else None],
        [b_qkv if qkv else None, b_z if z else None],
    )


def load(source: str, members: str) -> GdnLayer:
    layer = GdnLayer(source)
    lora_a, lora_b = adapter(members)
    layer.set_lora(1, lora_a, lora_b)
    return layer


def slices_of(layer: GdnLayer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (a[1, 0], b[1, 0]) for a, b in zip(layer.lora_a_stacked, layer.lora_b_stacked, strict=True)
    ]


VERSIONS = ["0.21.0", "0.26.0", "0.29.0", "0.33.0"]


@pytest.mark.parametrize("version", VERSIONS)
def test_qkv_only_fills_q_k_v_and_leaves_z_at_base(version):
    layer = load(patched_text(version, "partial-gdn-adapter", RELPATH), "qkv")
    (a_qkv, _), (b_qkv, _) = adapter("qkv")
    start = 0
    for (a, b), size in zip(slices_of(layer)[:3], SIZES[:3], strict=True):
        assert torch.equal(a, a_qkv) and torch.equal(b, b_qkv[start : start + size])
        start += size
    a_z, b_z = slices_of(layer)[3]
    assert not a_z.any() and not b_z.any()  # Z stays at base weights


@pytest.mark.parametrize("version", VERSIONS)
def test_z_only_fills_z_and_leaves_q_k_v_at_base(version):
    layer = load(patched_text(version, "partial-gdn-adapter", RELPATH), "z")
    (_, a_z), (_, b_z) = adapter("z")
    for a, b in slices_of(layer)[:3]:
        assert not a.any() and not b.any()
    a, b = slices_of(layer)[3]
    assert torch.equal(a, a_z) and torch.equal(b, b_z)


@pytest.mark.parametrize("version", VERSIONS)
def test_both_members_load_exactly_as_before(version):
    pristine = load((release_tree(version) / RELPATH).read_text(), "both")
    patched = load(patched_text(version, "partial-gdn-adapter", RELPATH), "both")
    for (a0, b0), (a1, b1) in zip(slices_of(pristine), slices_of(patched), strict=True):
        assert torch.equal(a0, a1) and torch.equal(b0, b1) and b0.any()


@pytest.mark.parametrize(
    "version, members, error",
    [
        ("0.21.0", "qkv", "'NoneType' object has no attribute 'shape'"),
        ("0.26.0", "z", "'NoneType' object has no attribute 'shape'"),
        ("0.29.0", "z", "Cannot determine how to split lora_b"),
        ("0.33.0", "z", "Cannot determine how to split lora_b"),
    ],
)
def test_the_unpatched_code_reproduces_the_crash(version, members, error):
    with pytest.raises((AttributeError, ValueError), match=error):
        load((release_tree(version) / RELPATH).read_text(), members)


def test_unpatched_0290_already_takes_a_qkv_only_adapter():
    """#47640's half: the trailing member may be missing (the patch keeps that)."""
    layer = load((release_tree("0.29.0") / RELPATH).read_text(), "qkv")
    assert not slices_of(layer)[3][1].any() and slices_of(layer)[0][1].any()
