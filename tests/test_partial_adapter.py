"""partial-gdn-adapter on the real code of every tested release that has expand_packed_lora.

``MergedColumnParallelLinearWithLoRA.set_lora`` and ``expand_packed_lora``
(with patchkit's helper, when patched) are taken from each release's real
``vllm/lora/layers/column_parallel_linear.py``, pristine and as the
catalogue's variant leaves it, and run on CPU against a stand-in layer
shaped like a GDN ``in_proj_qkvz``: four output slices Q, K, V, Z, two
packed adapter members (in_proj_qkv over Q+K+V, in_proj_z over Z), a
missing member passed as None as vLLM's PackedLoRALayerWeights.pack does.

The releases come from the catalogue: the patched code is tested on each release
it gives a variant, the pristine code on each it decides ``upstream`` (where it
must load a partial adapter on its own slices, or the decision is wrong).
"""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from tests.conftest import (
    CATALOGUE,
    patched_text,
    release_tree,
    releases_decided,
    releases_with_variant,
)
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


PATCH = "partial-gdn-adapter"
VERSIONS = releases_with_variant(PATCH)  # the patched code
UPSTREAM = releases_decided(PATCH, "upstream")  # the pristine code, fixed upstream
# What the pristine code of each variant's releases does with a partial adapter: the
# exception it raises, or None where it loads (0.29.0's PR #47640 takes a qkv-only one).
UNPATCHED = {
    "backport-47640": {"qkv": "'NoneType' object has no attribute 'shape'",
                       "z": "'NoneType' object has no attribute 'shape'"},
    "coverage-after": {"qkv": None, "z": "Cannot determine how to split lora_b"},
}  # fmt: skip


def pristine(version: str) -> str:
    return (release_tree(version) / RELPATH).read_text()


def code(version: str) -> str:
    """The code that must load partial adapters: patched where the catalogue has a variant,
    pristine where it decides upstream."""
    return pristine(version) if version in UPSTREAM else patched_text(version, PATCH, RELPATH)


def test_every_variant_says_what_its_pristine_code_does():
    assert {v.name for v in CATALOGUE.get(PATCH).variants} == set(UNPATCHED)


@pytest.mark.parametrize("version", VERSIONS + UPSTREAM)
def test_qkv_only_fills_q_k_v_and_leaves_z_at_base(version):
    layer = load(code(version), "qkv")
    (a_qkv, _), (b_qkv, _) = adapter("qkv")
    start = 0
    for (a, b), size in zip(slices_of(layer)[:3], SIZES[:3], strict=True):
        assert torch.equal(a, a_qkv) and torch.equal(b, b_qkv[start : start + size])
        start += size
    a_z, b_z = slices_of(layer)[3]
    assert not a_z.any() and not b_z.any()  # Z stays at base weights


@pytest.mark.parametrize("version", VERSIONS + UPSTREAM)
def test_z_only_fills_z_and_leaves_q_k_v_at_base(version):
    layer = load(code(version), "z")
    (_, a_z), (_, b_z) = adapter("z")
    for a, b in slices_of(layer)[:3]:
        assert not a.any() and not b.any()
    a, b = slices_of(layer)[3]
    assert torch.equal(a, a_z) and torch.equal(b, b_z)


@pytest.mark.parametrize("version", VERSIONS + UPSTREAM)
def test_both_members_load_exactly_as_before(version):
    before = load(pristine(version), "both")
    after = load(code(version), "both")
    for (a0, b0), (a1, b1) in zip(slices_of(before), slices_of(after), strict=True):
        assert torch.equal(a0, a1) and torch.equal(b0, b1) and b0.any()


@pytest.mark.parametrize("members", ["qkv", "z"])
@pytest.mark.parametrize("version", VERSIONS)
def test_the_unpatched_code_reproduces_the_crash(version, members):
    variant = CATALOGUE.get(PATCH).expected_for(Version(version)).name
    error = UNPATCHED[variant][members]
    if error is None:  # #47640's half: the trailing member may be missing (the patch keeps that)
        layer = load(pristine(version), members)
        assert not slices_of(layer)[3][1].any() and slices_of(layer)[0][1].any()
        return
    with pytest.raises((AttributeError, ValueError), match=error):
        load(pristine(version), members)
