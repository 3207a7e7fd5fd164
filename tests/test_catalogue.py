"""The shipped catalogue is complete: every patch documented, every release decided."""

from __future__ import annotations

from packaging.version import Version

from patchkit.catalogue import load_catalogue
from tests.conftest import run_cli

CATALOGUE = load_catalogue()


def test_every_patch_has_why_upstream_remove_when():
    for patch in CATALOGUE.patches:
        assert len(patch.why) > 100, patch.id
        assert patch.upstream and all(u.startswith("https://") for u in patch.upstream)
        assert patch.remove_when, patch.id


def test_every_tested_release_has_exactly_one_decision_per_patch():
    for patch in CATALOGUE.patches:
        for release in CATALOGUE.tested_releases:
            version = Version(release)
            matches = [
                entry
                for entry in (*patch.variants, *patch.decisions)
                if entry.versions.contains(version)
            ]
            assert len(matches) == 1, (patch.id, release, matches)


def test_variant_diffs_parse_and_stay_inside_vllm():
    for patch in CATALOGUE.patches:
        for variant in patch.variants:
            assert variant.paths and all(p.startswith("vllm/") for p in variant.paths)


def test_patches_touch_disjoint_files():
    """Backups and records are per patch; two patches on one file would fight over it."""
    owner = {}
    for patch in CATALOGUE.patches:
        for path in {p for v in patch.variants for p in v.paths}:
            assert path not in owner, (path, owner.get(path), patch.id)
            owner[path] = patch.id


def test_expand_block_n_records_its_config_override():
    patch = CATALOGUE.get("expand-block-n")
    assert patch.overridden_by.env == "VLLM_TUNED_CONFIG_FOLDER"
    assert patch.overridden_by.versions.contains("0.26.0")
    assert not patch.overridden_by.versions.contains("0.33.0")


def test_list_command_prints_the_catalogue():
    result = run_cli("list")
    assert result.exit_code == 0
    for patch in CATALOGUE.patches:
        assert patch.id in result.stdout
    assert "remove when:" in result.stdout
