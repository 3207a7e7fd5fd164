"""The catalogue refuses what it does not understand: every table's keys are checked.

A key the loader does not know (a typo of an optional key: `opt-in` for
`opt_in`, `disabled-by`, `runtime-gate`) was ignored, and the catalogue
loaded without it: nan-probe's `opt-in = true` made `list --json` say
`opt_in: false`, and every plain `apply` would have put the diagnostic into
the tree. Now such a key is one line naming the file, the table and the key,
and nothing loads. The keys live in one table (load.SCHEMA), one entry per
table; a file the loader does not read is not checked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from patchkit.catalogue import load
from patchkit.errors import PatchkitError
from tests.conftest import CATALOGUE, run_cli

NAN_PROBE = "nan-probe/patch.toml"
MATMUL = "matmul-add-lora-linear/patch.toml"
BLOCK_N = "expand-block-n/patch.toml"
GDN = "partial-gdn-adapter/patch.toml"
# partial-gdn-adapter's not-applicable evidence: made an absent-file one by the tests
NO_EXPAND = (
    '{ file = "vllm/lora/layers/column_parallel_linear.py", '
    "pattern = '\\A(?![\\s\\S]*def\\s+expand_packed_lora\\b)' }"
)


def copied(tmp_path: Path) -> Path:
    root = tmp_path / "patches"
    shutil.copytree(CATALOGUE.root, root)
    return root


def edited(root: Path, relpath: str, old: str, new: str) -> None:
    path = root / relpath
    text = path.read_text()
    assert old in text, (relpath, old)
    path.write_text(text.replace(old, new, 1))


def test_the_reported_typo_no_longer_ships_the_diagnostic(tmp_path):
    root = copied(tmp_path)
    edited(root, NAN_PROBE, "opt_in = true", "opt-in = true")
    env = {"PATCHKIT_PATCHES_DIR": str(root)}
    for command in (["list", "--json"], ["apply", "--dry-run", "--target", str(tmp_path)]):
        result = run_cli(*command, env=env)
        assert result.exit_code == 1, (command, result.output)
        [line] = result.stderr.strip().splitlines()
        assert f"{root / NAN_PROBE}: unknown key 'opt-in' in the top-level table" in line
        assert "did you mean 'opt_in'?" in line and "nothing was loaded" in line
    assert json.loads(run_cli("list", "--json", env=env).stdout)["ok"] is False


# (file, text, the same text with a key misspelt, the key, the table the line names)
TYPOS = [
    (NAN_PROBE, "opt_in = true", "opt-in = true", "opt-in", "the top-level table"),
    (NAN_PROBE, "runtime_gate =", "runtime-gate =", "runtime-gate", "the top-level table"),
    (NAN_PROBE, "covers =", "cover =", "cover", "the top-level table"),
    (NAN_PROBE, "context = 1", "contexts = 1", "contexts", "[[variants]] #1"),
    (NAN_PROBE, "made_on = ", "made-on = ", "made-on", "[[variants]] #1"),
    (GDN, NO_EXPAND, '{ file = "vllm/lora/x.py", absnt = true }', "absnt",
     "[[decisions]] #2, evidence #1"),
    (MATMUL, "disabled_by = [", "disabled-by = [", "disabled-by", "[diagnosis]"),
    (MATMUL, "replaces_kernels =", "replace_kernels =", "replace_kernels", "[diagnosis]"),
    (MATMUL, '"VLLM_BATCH_INVARIANT", unless', '"VLLM_BATCH_INVARIANT", unles', "unles",
     "[diagnosis], disabled_by #2"),
    (MATMUL, "evidence_from =", "evidence-from =", "evidence-from", "[[decisions]] #1"),
    (BLOCK_N, "check =", "checks =", "checks", "[overridden_by]"),
    (GDN, "fixed_by =", "fixed-by =", "fixed-by", "[[notices]] #1"),
    (GDN, "message =", "mesage =", "mesage", "[[notices]] #1"),
    ("bugs.toml", "kernel_scan = true", "kernel-scan = true", "kernel-scan", "[[bug]] #1"),
    ("bugs.toml", "needs_compute_capability", "needs_compute_capabilty",
     "needs_compute_capabilty", "[[bug]] #1"),
    ("bugs.toml", "[bug.upstream_fix]", "[bug.upstream-fix]", "upstream-fix", "[[bug]] #1"),
    ("bugs.toml", "pattern = 'is_device", "patern = 'is_device", "patern",
     "[[bug]] #1, upstream_fix, evidence #1"),
    ("series.toml", "tested_releases =", "tested-releases =", "tested-releases",
     "the top-level table"),
]  # fmt: skip


@pytest.mark.parametrize("file, old, new, key, table", TYPOS)
def test_an_unknown_key_anywhere_is_one_line_naming_file_table_and_key(
    tmp_path, file, old, new, key, table
):
    root = copied(tmp_path)
    edited(root, file, old, new)
    result = run_cli("list", env={"PATCHKIT_PATCHES_DIR": str(root)})
    assert result.exit_code == 1 and result.stdout == "", result.output
    [line] = result.stderr.strip().splitlines()
    assert f"{root / file}: unknown key '{key}' in {table}" in line, line
    assert "Traceback" not in result.output


def test_a_table_where_a_value_goes_or_a_value_where_a_table_goes_is_one_line(tmp_path):
    cases = [
        (MATMUL, 'id = "matmul', 'variants = "torch-ops"\nid = "matmul'),
        (NAN_PROBE, 'id = "nan-probe"', 'overridden_by = 1\nid = "nan-probe"'),
        (MATMUL, 'disabled_by = [\n    { env = "PATCHKIT_LORA_BACKEND", values = ["triton"] },',
         'disabled_by = [\n    "PATCHKIT_LORA_BACKEND",'),
    ]  # fmt: skip
    for number, (file, old, new) in enumerate(cases):
        root = copied(tmp_path / str(number))
        edited(root, file, old, new)
        if new.startswith("variants ="):  # the file's array of tables renamed away
            edited(root, file, "[[variants]]", "[[oops]]")
        result = run_cli("list", env={"PATCHKIT_PATCHES_DIR": str(root)})
        assert result.exit_code == 1, (file, result.output)
        [line] = result.stderr.strip().splitlines()
        assert str(root / file) in line and "expected" in line, line


def test_evidence_is_a_pattern_or_an_absent_file_never_both(tmp_path):
    root = copied(tmp_path)
    edited(root, GDN, NO_EXPAND, "{ file = 'vllm/x.py', absent = true, pattern = 'x' }")
    result = run_cli("list", env={"PATCHKIT_PATCHES_DIR": str(root)})
    assert result.exit_code == 1 and "a pattern or absent = true, not both" in result.stderr
    edited(root, GDN, "absent = true, pattern = 'x' }", 'absent = "yes" }')
    result = run_cli("list", env={"PATCHKIT_PATCHES_DIR": str(root)})
    assert result.exit_code == 1 and "absent: true or false expected" in result.stderr


def test_the_shipped_catalogue_uses_every_table_of_the_schema_and_no_other(tmp_path):
    """Each SCHEMA entry is a table some shipped file holds, and each names its nested
    tables by entries that exist: the schema neither lags the files nor lists dead tables."""
    used: set[str] = set()
    real = load.check_keys

    def recording(table, schema, origin, where=()):
        used.add(schema)
        return real(table, schema, origin, where)

    load.check_keys = recording
    try:
        load.load_catalogue(CATALOGUE.root)
    finally:
        load.check_keys = real
    assert used == set(load.SCHEMA)
    for keys in load.SCHEMA.values():
        for inner in filter(None, keys.values()):
            assert inner.strip("[]") in load.SCHEMA, inner


def test_a_new_optional_key_is_one_word_in_the_schema(tmp_path, monkeypatch):
    root = copied(tmp_path)
    edited(root, BLOCK_N, 'id = "expand-block-n"', 'id = "expand-block-n"\nfamilies = ["x"]')
    with pytest.raises(Exception, match="unknown key 'families'"):
        load.load_catalogue(root)
    monkeypatch.setitem(load.SCHEMA, "patch.toml", {**load.SCHEMA["patch.toml"], "families": None})
    assert load.load_catalogue(root).get("expand-block-n")


def test_a_file_the_loader_does_not_read_is_left_alone(tmp_path):
    root = copied(tmp_path)
    (root / "survey.toml").write_text("anything = 'the loader never reads this file'\n")
    assert run_cli("list", env={"PATCHKIT_PATCHES_DIR": str(root)}).exit_code == 0


def test_a_value_of_the_wrong_type_is_one_line_not_taken_for_another(tmp_path):
    """`replaces_kernels = "false"` was true (bool of a string), `covers = 1` an
    internal error (exit 3)."""
    cases = [
        (MATMUL, "replaces_kernels = true", 'replaces_kernels = "false"',
         "replaces_kernels: bool expected, got str"),
        (BLOCK_N, 'id = "expand-block-n"', 'id = "expand-block-n"\ncovers = 1',
         "covers: str expected, got int"),
        ("bugs.toml", "kernel_scan = true", "kernel_scan = 1", "kernel_scan: bool expected"),
        (MATMUL, 'values = ["triton"]', 'values = "triton"', "missing or empty 'values'"),
        (MATMUL, 'values = ["triton"]', "values = [1]", "values: a list of strings expected"),
    ]  # fmt: skip
    for number, (file, old, new, expected) in enumerate(cases):
        root = copied(tmp_path / str(number))
        edited(root, file, old, new)
        result = run_cli("list", env={"PATCHKIT_PATCHES_DIR": str(root)})
        assert result.exit_code == 1, (file, new, result.output)
        [line] = result.stderr.strip().splitlines()
        assert expected in line, line


WRONG = [1, "x", True, [], {}, [1], [{}], ["a"], {"a": 1}, 1.5, -1, "", [[]]]


def key_paths(data, prefix=()):
    """Every key and list index of a TOML document, as paths."""
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for key, value in items:
        yield (*prefix, key)
        if isinstance(value, (dict, list)):
            yield from key_paths(value, (*prefix, key))


@pytest.mark.slow
def test_any_value_of_any_type_anywhere_is_a_load_or_one_line_never_a_crash(monkeypatch):
    """Every key of every shipped file given each of a dozen wrong values, in turn: the
    catalogue loads or refuses with a PatchkitError (one line, exit 1); nothing else
    (an AttributeError was exit 3)."""
    import copy

    import tomllib

    real = load._read_toml
    crashes = []
    for path in sorted(CATALOGUE.root.glob("**/*.toml")):
        data = tomllib.loads(path.read_text())
        for where in list(key_paths(data)):
            for value in WRONG:
                mutated = copy.deepcopy(data)
                holder = mutated
                for key in where[:-1]:
                    holder = holder[key]
                holder[where[-1]] = value

                def read(file, schema, _path=path, _data=mutated):
                    if Path(file) != _path:
                        return real(file, schema)
                    load.check_keys(_data, schema, file)
                    return copy.deepcopy(_data)

                monkeypatch.setattr(load, "_read_toml", read)
                try:
                    load.load_catalogue(CATALOGUE.root)
                except PatchkitError:
                    pass
                except Exception as exc:  # noqa: BLE001 -- what the test looks for
                    crashes.append((path.name, where, value, repr(exc)[:80]))
    assert not crashes, crashes[:10]
