"""The shipped catalogue is complete: every patch documented, every release decided."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from patchkit.catalogue.load import load_catalogue
from patchkit.errors import PatchkitError
from tests.conftest import run_cli

CATALOGUE = load_catalogue()


def test_every_patch_has_why_upstream_remove_when():
    for patch in CATALOGUE.patches:
        assert len(patch.why) > 100, patch.id
        assert patch.upstream and all(u.startswith("https://") for u in patch.upstream)
        assert patch.remove_when, patch.id


def test_variant_diffs_parse_and_stay_inside_vllm():
    for patch in CATALOGUE.patches:
        for variant in patch.variants:
            assert variant.paths and all(p.startswith("vllm/") for p in variant.paths)


def broken_catalogue(tmp_path: Path, edit) -> str:
    """The shipped catalogue copied and edited by ``edit``; the load error (one line)."""
    root = tmp_path / "patches"
    shutil.copytree(CATALOGUE.root, root)
    edit(root)
    with pytest.raises(PatchkitError) as caught:
        load_catalogue(root)
    message = str(caught.value)
    assert "\n" not in message
    return message


def replace_in(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


BLOCK_N = "expand-block-n/patch.toml"
MATMUL = "matmul-add-lora-linear/patch.toml"
BROKEN = [
    (BLOCK_N, '">=0.18.0,<0.33.0"', '">=0.19.0,<0.33.0"', "release 0.18.0 must be decided"),
    (BLOCK_N, '">=0.18.0,<0.33.0"', '">=0.17.0,<0.33.0"', "found variant block-k-16"),
    (BLOCK_N, 'versions = ">=0.33.0"', 'versions = "0.33+"', "invalid version specifier"),
    ("bugs.toml", "pattern = 'is_device", "pattern = '(is_device", "evidence pattern"),
    ("bugs.toml", 'file = "vllm/lora/ops', 'file = "../vllm/lora/ops', "evidence file: path"),
    ("expand-block-n/block-k-32.diff", "+++ b/vllm/", "+++ b/../vllm/", "leaves the vLLM tree"),
    ("series.toml", '"0.26.0", "0.27.0"', '"0.26.0", "latest"', "'latest' is not a version"),
    (MATMUL, 'unless = ["", "0"]', 'unless = ["0"], values = ["1"]', "values or unless, not both"),
    (MATMUL, 'env = "VLLM_BATCH_INVARIANT"', 'name = "VLLM_BATCH_INVARIANT"', "unknown key 'name'"),
    (BLOCK_N, 'made_on = "0.18.0"', 'made_on = "0.17.0"', "made_on 0.17.0 must be a tested"),
    (MATMUL, 'patchkit_lora_matmul.py"]', 'nowhere.py"]', "cannot read the created file"),
    (MATMUL, "context = 2", "context = 0", "variants.context: 1 to 10 lines"),
    (MATMUL, '"0.26.0", "0.32.0"]', '"0.26.0", "0.33.0"]', "families 0.33.0 must be a tested"),
    (MATMUL, '"0.26.0", "0.32.0"]', '"0.26.0", "0.32.1"]', "families 0.32.1 must be a tested"),
    (MATMUL, 'families = ["0.17.0"', 'families = [17, "0.17.0"', "a list of tested releases"),
    (BLOCK_N, 'bugs = ["vllm#48590"]', 'bugs = ["vllm#48590"]\ntitle = "x"', "written once"),
    (BLOCK_N, 'evidence_from = "vllm#48590"', 'evidence_from = "vllm#1"', "no upstream_fix"),
    (BLOCK_N, 'bugs = ["vllm#48590"]', 'bugs = ["vllm#1"]', "no [[bug]] with ids"),
]


@pytest.mark.parametrize("file, old, new, expected", BROKEN)
def test_a_broken_catalogue_fails_to_load_naming_file_and_key(tmp_path, file, old, new, expected):
    message = broken_catalogue(tmp_path, lambda root: replace_in(root / file, old, new))
    assert file.split("/")[-1] in message and expected in message, message


def test_a_notice_needs_a_version_range(tmp_path):
    def drop_range(root):
        path = root / "split-in-proj-qkvz/patch.toml"
        text = path.read_text()
        start = text.index("[[notices]]")
        line = next(ln for ln in text[start:].splitlines() if ln.startswith("versions"))
        path.write_text(text[:start] + text[start:].replace(line + "\n", "", 1))

    assert "missing or empty 'versions'" in broken_catalogue(tmp_path, drop_range)


def test_expand_block_n_records_its_config_override():
    patch = CATALOGUE.get("expand-block-n")
    assert patch.overridden_by.env == "VLLM_TUNED_CONFIG_FOLDER"
    assert patch.overridden_by.versions.contains("0.26.0")
    assert not patch.overridden_by.versions.contains("0.33.0")


def test_list_command_prints_the_catalogue():
    result = run_cli("list")
    assert result.exit_code == 0
    for patch in CATALOGUE.patches:
        assert f"{patch.id}: " in result.stdout
    full = run_cli("list", "-v")
    assert full.exit_code == 0
    assert full.stdout.count("    remove when: ") == len(CATALOGUE.patches)
