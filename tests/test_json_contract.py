"""Every command's --json keeps its contract: format 1, its schema, a code on every message.

The documents are real: each command runs on a real 0.26.0 tree (slim), a real
catalogue, a probe log, an adapter; each is checked against its schema in docs/json/
(draft 2020-12, the `jsonschema` package), and every message in it carries a code of
patchkit.codes.Code, whose words patchkit.cli.words makes. docs/json.md says the rules.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import jsonschema
import pytest
from referencing import Registry, Resource

from patchkit.catalogue import journal
from patchkit.cli.main import main
from patchkit.cli.words import TEXT, WORDS
from patchkit.codes import Code
from patchkit.patching import transaction
from tests import adapter_helpers as ah
from tests.canary_helpers import FakeVLLM
from tests.conftest import REPO, copy_tree, release_tree, run_cli, snapshot
from tests.error_helpers import error_codes
from tests.helpers import failing_lock, record, write_log
from tests.wheelserver_helpers import PIP_ENV

SCHEMAS = REPO / "docs" / "json"


def schema_name(command: str) -> str:
    return command.replace(" ", "-")


def registry() -> Registry:
    resources = []
    for path in SCHEMAS.glob("*.schema.json"):
        schema = json.loads(path.read_text())
        resources.append((schema["$id"], Resource.from_contents(schema)))
    return Registry().with_resources(resources)


def checked(command: str, result, exit_code: int = 0) -> dict:
    """The document ``result`` printed, after checking it against ``command``'s schema and
    every message's code."""
    assert result.exit_code == exit_code, result.output
    document = json.loads(result.stdout)
    assert list(document)[:2] == ["format", "command"], list(document)
    assert (document["format"], document["command"]) == (1, command)
    schema = json.loads((SCHEMAS / f"{schema_name(command)}.schema.json").read_text())
    jsonschema.Draft202012Validator(schema, registry=registry()).validate(document)
    for code in codes_in(document):
        assert code in CODES, f"{command}: {code!r} is no code of patchkit.codes.Code"
    return document


def codes_in(value) -> list[str]:
    """The code of every message (an object with "code" and "message") in a document."""
    found = []
    if isinstance(value, dict):
        if "code" in value and "message" in value:
            found.append(value["code"])
        for item in value.values():
            found += codes_in(item)
    elif isinstance(value, list):
        for item in value:
            found += codes_in(item)
    return found


CODES = {code.value for code in Code}


def commands(group=main, prefix: str = "") -> list[str]:
    """Every command as typed ("probe report"), from the group itself."""
    found = []
    for name, command in group.commands.items():
        typed = f"{prefix}{name}"
        if hasattr(command, "commands"):
            found += commands(command, typed + " ")
        else:
            found.append(typed)
    return found


# ----- the enumeration and its words -----


def test_every_code_is_kebab_case_and_one_of_a_kind():
    values = [code.value for code in Code]
    assert len(values) == len(set(values)) == len(Code.__members__)
    for value in values:
        assert value == value.lower() and " " not in value and "_" not in value, value


def test_every_code_has_its_words():
    """An error kind's code says the line the error was raised with (patchkit.errors);
    every other code has words of its own, or is a TEXT code."""
    lines = error_codes()
    missing = [code for code in Code if code not in TEXT and code not in set(WORDS) | lines]
    assert not missing, missing


def test_the_schema_lists_every_error_kind():
    common = json.loads((SCHEMAS / "common.schema.json").read_text())["$defs"]
    assert set(common["error-kind"]["enum"]) == {code.value for code in error_codes()}


def test_every_feature_adapter_config_refuses_has_its_words():
    from patchkit.adapters.adapterconfig import DROPPED_FEATURES
    from patchkit.cli.adapter_config_words import FEATURES

    assert set(FEATURES) == set(DROPPED_FEATURES)


def test_every_command_has_a_schema_and_every_schema_is_valid():
    names = {schema_name(c) for c in commands()}
    have = {p.name.removesuffix(".schema.json") for p in SCHEMAS.glob("*.schema.json")}
    assert names <= have, sorted(names - have)
    for path in SCHEMAS.glob("*.schema.json"):
        jsonschema.Draft202012Validator.check_schema(json.loads(path.read_text()))


def test_the_changelog_names_the_current_format():
    from patchkit.cli.render import FORMAT

    assert f"## format {FORMAT}" in (SCHEMAS / "CHANGELOG.md").read_text()


# ----- real documents -----


def test_list_and_show():
    checked("list", run_cli("list", "--json"))
    shown = checked("show", run_cli("show", "expand-block-n", "--json"))
    assert [p["id"] for p in shown["patches"]] == ["expand-block-n"]


def test_status_apply_revert_on_a_real_tree(slim_tree_0260):
    target = ("--target", str(slim_tree_0260))
    status = checked("status", run_cli("status", *target, "--json"))
    reasons = [p["reason"] for p in status["patches"] if p["reason"]]
    assert reasons and all(r["code"] in CODES for r in reasons)
    checked("apply", run_cli("apply", *target, "--dry-run", "--json"))
    applied = checked("apply", run_cli("apply", *target, "--json"))
    assert any(p["action"] == "applied" and p["hunks"] for p in applied["patches"])
    checked("revert", run_cli("revert", *target, "--json"))


def test_a_refusal_is_a_message_with_its_facts(slim_tree_0260):
    """A conflict refused by apply: the error's code and the conflict it refuses, nested:
    a hunk that does not fit, with its file and its number."""
    utils = slim_tree_0260 / "vllm/lora/ops/triton_ops/utils.py"
    utils.write_text(utils.read_text().replace("block_n", "block_m"))  # an edit of a real file
    document = checked("apply", run_cli("apply", "--target", str(slim_tree_0260), "--json"), 1)
    error = document["error"]
    assert error["code"] == "refused-conflict" and error["patch"] == "expand-block-n"
    conflict = error["conflict"]
    assert conflict["code"] == "hunk-mismatch" and conflict["message"] in error["message"]
    assert conflict["path"] == "vllm/lora/ops/triton_ops/utils.py" and conflict["hunk"] >= 1
    assert error["fit"] == ["matmul-add-lora-linear", "partial-gdn-adapter", "partial-moe-adapter"]
    assert error["reinstall"] is True


def test_a_usage_error_and_an_error(tmp_path):
    usage = checked("status", run_cli("status", "--vllm-version", "abc", "--json"), 2)
    assert usage["error"]["code"] == "usage"
    log = write_log(tmp_path, "not a probe record")
    error = checked("probe report", run_cli("probe", "report", str(log), "--json"), 1)["error"]
    assert (error["code"], error["path"], error["line"]) == ("probe-log-invalid", str(log), 1)


# ----- an error is its kind's code and its facts -----


def failed(command: str, result, exit_code: int = 1) -> dict:
    """The error of a document that is one, checked as :func:`checked` checks any (its
    message exactly the line on stderr)."""
    error = checked(command, result, exit_code)["error"]
    assert result.stderr == f"patchkit: error: {error['message']}\n"
    return error


def test_a_link_in_the_trees_state_is_an_unsafe_path(slim_tree_0260, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (slim_tree_0260 / ".patchkit").symlink_to(tmp_path / "elsewhere")
    error = failed("apply", run_cli("apply", "--target", str(slim_tree_0260), "--json"))
    assert error["code"] == "unsafe-path" and error["kind"] == "a symbolic link"
    assert (error["path"], error["target"]) == (
        str(slim_tree_0260 / ".patchkit"),
        str(tmp_path / "elsewhere"),
    )


def test_a_broken_catalogue_file_is_catalogue_invalid(tmp_path):
    root = tmp_path / "patches"
    shutil.copytree(REPO / "patches", root)
    bugs = root / "bugs.toml"
    bugs.write_text(bugs.read_text() + "\n[[bug]]\nids = ['vllm#1']\nunknown_key = 1\n")
    error = failed("list", run_cli("list", "--json", env={"PATCHKIT_PATCHES_DIR": str(root)}))
    assert (error["code"], error["path"]) == ("catalogue-invalid", str(bugs))
    assert error["message"] == f"{bugs}: {error['detail']}" and "unknown_key" in error["detail"]


def test_a_bad_model_or_adapter_file_names_its_kind_and_path(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = {"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": "wide"}
    (model / "config.json").write_text(json.dumps(config))
    adapter = ah.write_adapter(tmp_path / "adapter", ah.dense_tensors())
    error = failed(
        "adapter check",
        run_cli("adapter", "check", str(adapter), "--model", str(model), "--json"),
    )
    assert (error["code"], error["key"]) == ("model-config-invalid", "hidden_size")
    assert (error["path"], error["option"]) == (str(model / "config.json"), "--model")
    (adapter / "adapter_config.json").unlink()
    (adapter / "adapter_config.json").symlink_to("/etc/hostname")  # a link out of it
    lora = f"a={adapter}"
    error = failed("verify", run_cli("verify", "--model", str(model), "--lora", lora, "--json"), 2)
    assert (error["code"], error["option"]) == ("usage", "--lora")
    assert error["cause"]["code"] == "unsafe-path"
    assert error["cause"]["path"] == str(adapter / "adapter_config.json")


def test_a_fetch_that_reaches_no_server_is_fetch_failed(tmp_path):
    """No network needed: the index is a closed port on this machine."""
    env = {name: None for name in PIP_ENV}
    env |= {"PIP_CONFIG_FILE": os.devnull, "HOME": str(tmp_path)}
    env |= {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PATCHKIT_CACHE_DIR": str(tmp_path)}
    error = failed("fetch", run_cli("fetch", "0.26.0", "--json", env=env))
    assert (error["code"], error["host"]) == ("fetch-failed", "127.0.0.1")
    env["PATCHKIT_FETCH_DEADLINE"] = "soon"
    error = failed("fetch", run_cli("fetch", "0.26.0", "--json", env=env))
    assert (error["code"], error["value"]) == ("fetch-deadline-invalid", "soon")


def test_doctor_on_a_real_tree(slim_tree_0260):
    report = checked("doctor", run_cli("doctor", "--target", str(slim_tree_0260), "--json"))
    assert {v["status"] for v in report["verdicts"]} <= {
        "exposed", "protected", "not-affected", "unknown"
    }  # fmt: skip


def test_a_runner_value_vllm_refuses_at_start_is_a_message_with_its_facts():
    """0.34.0 refuses VLLM_USE_V2_MODEL_RUNNER=0 at start: status's and doctor's runner
    say so as runner-env-refused, each document checked against its schema."""
    tree = str(release_tree("0.34.0"))
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    for command in ("status", "doctor"):
        document = checked(command, run_cli(command, "--target", tree, "--json", env=env))
        reason = document["runner"]["environment"]["reason"]
        assert reason["code"] == "runner-env-refused" and reason["value"] == "0"


def test_fetch_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    copy_tree("0.26.0", cache / "trees" / "vllm-0.26.0")
    checked("fetch", run_cli("fetch", "0.26.0", "--json", env={"PATCHKIT_CACHE_DIR": str(cache)}))


def test_refresh_and_its_recovery(tmp_path, slim_tree_0260):
    root = tmp_path / "patches"
    shutil.copytree(REPO / "patches", root)
    env = {"PATCHKIT_PATCHES_DIR": str(root)}
    target = ("--target", str(slim_tree_0260))
    assert run_cli("apply", *target, "--only", "expand-block-n", env=env).exit_code == 0
    refreshed = checked("refresh", run_cli("refresh", "expand-block-n", *target, "--json", env=env))
    assert refreshed["recover"] is False and refreshed["patch"] == "expand-block-n"
    recovered = checked("refresh", run_cli("refresh", "--recover", "--json", env=env))
    assert recovered == {
        "format": 1, "command": "refresh", "ok": True, "recover": True, "recovered": []
    }  # fmt: skip
    (root / ".patchkit-refresh").mkdir()  # a refresh killed before it wrote its journal
    recovered = checked("refresh", run_cli("refresh", "--recover", "--json", env=env))
    assert [r["code"] for r in recovered["recovered"]] == ["catalogue-staging-removed"]


def test_probe_report(tmp_path):
    log = write_log(tmp_path, record(1, 3, "self_attn.qkv", "lora", ["a"]), '{"step": 2, "cut')
    report = checked("probe report", run_cli("probe", "report", str(log), "--json"))
    assert report["warnings"][0]["code"] == "probe-last-line-cut"
    finding = report["affected_requests"][0]
    reason = finding["reason"]
    assert (reason["code"], reason["module"]) == ("probe-projection-bad", "self_attn.qkv")
    assert reason["message"] == f"{finding['verdict']}; look at {finding['look_at']}"


def test_probe_report_of_a_quarantined_adapter(tmp_path):
    quarantine = {
        "event": "quarantine", "rank": 0, "adapter": "poisoned", "adapter_id": 3,
        "adapter_path": "/work/poisoned", "layer": 1, "module": "mlp.down_proj",
        "tensor": "lora_B", "nan": 0, "inf": 1,
    }  # fmt: skip
    bad = record(1, 0, "self_attn.qkv", "lora", ["a"], adapters={"a": "poisoned"})
    log = write_log(tmp_path, quarantine, bad)
    report = checked("probe report", run_cli("probe", "report", str(log), "--json"))
    [listed] = report["quarantines"]
    assert listed["code"] == "probe-quarantine"
    reason = report["affected_requests"][0]["reason"]
    assert (reason["code"], reason["quarantine"]["tensor"]) == ("probe-quarantined", "lora_B")


def test_adapter_check(tmp_path):
    model = ah.write_model(tmp_path / "dense", moe=False)
    tensors = ah.dense_tensors()
    key = f"{ah.P}1.self_attn.o_proj.lora_B.weight"
    tensors[key] = ah.tensor((ah.H, 4), poison={9: ah.BF16_NAN})
    adapter = ah.write_adapter(tmp_path / "a", tensors)
    result = run_cli("adapter", "check", str(adapter), "--model", str(model), "--json")
    report = checked("adapter check", result, 1)
    found = report["findings"][0]
    assert (found["code"], found["kind"], found["tensor"]) == (
        "adapter-nonfinite-values",
        "nonfinite",
        key,
    )
    assert (found["nan"], found["first"], found["first_value"]) == (1, 9, "nan")


def test_adapter_check_with_a_release_its_targets_and_finer_codes(tmp_path):
    model = ah.write_model(tmp_path / "dense", moe=False)
    tensors = ah.dense_tensors(zero_b=True)
    text_only = {k.replace(ah.P, "base_model.model.model.layers."): v for k, v in tensors.items()}
    adapter = ah.write_adapter(tmp_path / "a", text_only)
    target = str(release_tree("0.26.0"))
    result = run_cli(
        "adapter", "check", str(adapter), "--model", str(model), "--target", target, "--json"
    )
    report = checked("adapter check", result, 1)
    codes = [f["code"] for f in report["findings"]]
    assert codes == ["adapter-zero-factors", "adapter-served-as-base"]
    assert {t["outcome"] for t in report["targets"]} == {"ignored"}


@pytest.mark.parametrize(
    "models, args, exit_code",
    [
        ({"base": "ok", "sql-lora": "ok"}, (), 0),
        ({"base": "ok", "bad-lora": "nan400", "inert-lora": "inert"}, (), 1),
        ({"base": "ok", "inert-lora": "inert"}, ("--model", "inert-lora", "--model", "x"), 1),
    ],
)
def test_canary(models, args, exit_code):
    with FakeVLLM(models) as server:
        result = run_cli("canary", "--url", server.url, *args, "--json")
    checked("canary", result, exit_code)


def test_canary_that_cannot_reach_its_server_is_an_error_document():
    checked("canary", run_cli("canary", "--url", "http://127.0.0.1:9", "--json"), 1)


def test_verify_without_a_gpu_is_an_error_document():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: verify runs")
    checked("verify", run_cli("verify", "--json"), 1)


def test_schemas_say_the_state_words_as_the_vocabulary_does():
    from patchkit.vocabulary import Action, PatchState, Verdict

    common = json.loads((SCHEMAS / "common.schema.json").read_text())["$defs"]
    assert common["patch-state"]["enum"] == [s.value for s in PatchState]
    assert common["action"]["enum"] == [a.value for a in Action]
    assert common["bug-status"]["enum"] == [v.value for v in Verdict]


def test_docs_json_page_lists_every_schema():
    page = (REPO / "docs" / "json.md").read_text()
    for path in Path(SCHEMAS).glob("*.schema.json"):
        assert f"json/{path.name}" in page, path.name


def test_an_adapter_check_document_says_a_code_for_every_finding_note_and_check_skipped(
    tmp_path,
):
    """Config problems, shapes against the model, notes and the checks skipped: each its
    own code and the facts its words are made from, none the kind's or `note`'s."""
    model = ah.write_model(tmp_path / "dense", moe=False)
    tensors = ah.dense_tensors()
    tensors[f"{ah.P}9.self_attn.o_proj.lora_A.weight"] = ah.tensor((4, ah.H))
    tensors[f"{ah.P}9.self_attn.o_proj.lora_B.weight"] = ah.tensor((ah.H, 4))
    adapter = ah.write_adapter(tmp_path / "a", tensors, r="4", use_dora=True)
    result = run_cli("adapter", "check", str(adapter), "--model", str(model), "--json")
    report = checked("adapter check", result, 1)
    found = {f["code"]: f for f in report["findings"]}
    assert found["adapter-config-bad-r"]["value"] == "'4'"
    assert found["adapter-config-dora"]["tensor"] == "use_dora"
    layer = found["adapter-no-such-layer"]
    assert (layer["layer"], layer["layers"]) == (9, ah.LAYERS)
    assert [s["code"] for s in report["skipped"]] == ["adapter-skipped-no-target"]
    kinds = {f"adapter-{f['kind']}" for f in report["findings"]}
    assert not kinds & set(found), "a finding says its kind's code"


def test_a_config_verify_and_doctor_refuse_is_one_message_with_adapter_checks_problem(
    tmp_path,
):
    adapter = ah.write_adapter(tmp_path / "a", ah.dense_tensors(), r=0)
    target = str(release_tree("0.26.0"))  # read only: the adapter is refused before a scan
    result = run_cli("doctor", "--kernels", "--adapter", str(adapter), "--target", target, "--json")
    error = checked("doctor", result, 1)["error"]
    assert (error["code"], error["key"], error["problem"]["code"]) == (
        "adapter-config-refused",
        "r",
        "adapter-config-bad-r",
    )
    assert error["message"] == f"{adapter / 'adapter_config.json'}: r {error['problem']['message']}"


def test_a_lock_timeout_that_is_no_number_is_a_message_with_its_value(slim_tree_0260):
    env = {"PATCHKIT_LOCK_TIMEOUT": "abc"}
    result = run_cli("apply", "--target", str(slim_tree_0260), "--json", env=env)
    error = checked("apply", result, 1)["error"]
    assert (error["code"], error["value"], error["variable"]) == (
        "lock-timeout-invalid",
        "abc",
        "PATCHKIT_LOCK_TIMEOUT",
    )


# ----- an error that quotes a lower one keeps it as its cause, a message -----


def test_a_read_only_tree_quotes_the_lock_error_naming_the_lock(slim_tree_0260, monkeypatch):
    """apply on a read-only file system: refused-read-only, its cause the lock-unavailable
    error as a message (it was its words alone), naming the lock's full path (it named
    the relative path the lock was opened by)."""
    failing_lock(monkeypatch)
    lock = str(slim_tree_0260 / ".patchkit" / "lock")
    error = failed("apply", run_cli("apply", "--target", str(slim_tree_0260), "--json"))
    assert (error["code"], error["cause"]["code"], error["cause"]["path"]) == (
        "refused-read-only",
        "lock-unavailable",
        lock,
    )
    assert error["message"].startswith(f"creating the lock {lock} failed: the file system is")


def test_a_lock_that_cannot_be_made_quotes_the_os_error(slim_tree_0260, monkeypatch):
    failing_lock(monkeypatch, errno.ENOSPC)
    lock = str(slim_tree_0260 / ".patchkit" / "lock")
    error = failed("apply", run_cli("apply", "--target", str(slim_tree_0260), "--json"))
    cause = error["cause"]
    assert (error["code"], cause["code"], cause["errno"], cause["path"]) == (
        "lock-not-created",
        "os-error",
        "ENOSPC",
        lock,
    )
    assert error["message"].startswith(f"creating the lock {lock} failed: no space left")


def full_disk(monkeypatch, failing) -> None:
    """The writes into the tree (apply's, then its roll-back's: 1, 2, ...) whose number
    ``failing`` takes fail as on a full disk."""
    real, calls = transaction._write, []

    def write(fs, relpath, data):
        calls.append(relpath)
        if failing(len(calls)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(fs.full(relpath)))
        return real(fs, relpath, data)

    monkeypatch.setattr(transaction, "_write", write)


def test_a_write_undone_quotes_the_os_error(slim_tree_0260, monkeypatch):
    before = snapshot(slim_tree_0260)
    full_disk(monkeypatch, lambda n: n == 2)  # the second file; the roll-back's go through
    error = failed("apply", run_cli("apply", "--target", str(slim_tree_0260), "--json"))
    cause = error["cause"]
    assert (error["code"], error["written"], cause["code"], cause["errno"]) == (
        "write-undone",
        2,
        "os-error",
        "ENOSPC",
    )
    assert snapshot(slim_tree_0260) == before


def test_a_failed_restore_quotes_the_os_error(slim_tree_0260, monkeypatch):
    full_disk(monkeypatch, lambda n: n >= 2)  # the roll-back's writes fail too
    error = failed("apply", run_cli("apply", "--target", str(slim_tree_0260), "--json"))
    assert (error["code"], error["cause"]["code"], error["cause"]["errno"]) == (
        "restore-failed",
        "os-error",
        "ENOSPC",
    )


def test_a_refresh_not_written_quotes_the_os_error(tmp_path, slim_tree_0260, monkeypatch):
    root = tmp_path / "patches"
    shutil.copytree(REPO / "patches", root)
    env = {"PATCHKIT_PATCHES_DIR": str(root)}
    target = ("--target", str(slim_tree_0260))
    assert run_cli("apply", *target, "--only", "expand-block-n", env=env).exit_code == 0

    def full(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root / "expand-block-n"))

    monkeypatch.setattr(journal.CatalogueWrite, "prepare", full)
    result = run_cli("refresh", "expand-block-n", *target, "--json", env=env)
    error = failed("refresh", result)
    assert (error["code"], error["cause"]["code"], error["cause"]["errno"]) == (
        "refresh-not-written",
        "os-error",
        "ENOSPC",
    )


def verify_judges(monkeypatch, served: dict) -> None:
    """`patchkit verify` here judges ``served`` (the wide MoE's recorded answers, as
    `verify --model` judges them) on an H200's environment, with no GPU."""
    from patchkit.verify import runner
    from tests.verify_helpers import judge_wide

    env = {"gpu": "H200", "compute_capability": "9.0", "torch": "2.11.0", "triton": "3.6.0",
           "vllm": "0.26.0", "vllm_path": "/v", "lora_backend": "torch", "seed": 11}  # fmt: skip
    report = runner.VerifyReport(env, [], model=judge_wide(served))
    monkeypatch.setattr(runner, "run", lambda catalogue, request, say: report)


def strict_json(text: str):
    """``text`` read as RFC 8259 JSON: Python's json reads bare NaN and Infinity, which jq,
    JavaScript and most other readers refuse."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is no JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_distance_measured_as_inf_is_strict_json(monkeypatch):
    """The wide MoE's recorded answers with one NaN log-probability in the 50 %-strength
    control's (what a control gives where a fault makes NaN): its distance is inf. verify
    --json says "Infinity", not Python's bare Infinity, and stays valid for its schema.
    (The run is FAILED: verify's NaN check counts every served answer, controls too.)"""
    from tests.verify_helpers import WIDE_SERVED

    served = json.loads(json.dumps(WIDE_SERVED))
    for engine in ("eager", "cudagraph"):
        for answer in served[engine]["runs"]["control:a0+half"].values():
            answer["prompt_logprobs"][3] = float("nan")
    verify_judges(monkeypatch, served)
    result = run_cli("verify", "--json")
    checked("verify", result, 1)  # FAILED: the NaN check counts the control's NaN
    rows = strict_json(result.stdout)["model_checks"]
    half = [r for r in rows if r["control"] == "50 % strength" and r["adapter"] == "a0"]
    assert [r["value"] for r in half] == ["Infinity", "Infinity"]


def test_every_non_finite_float_is_written_as_protobuf_writes_it_numpy_s_too():
    """Python's floats and numpy's (a float subclass whose repr is np.float64(inf)), at any
    depth: strict JSON with the three strings, finite numbers unchanged."""
    from patchkit.cli.render import json_text

    np = pytest.importorskip("numpy")
    values = [float("inf"), -float("inf"), float("nan"), np.float64("inf"), np.float64("-inf"),
              np.float64("nan"), 0.5, np.float64(0.25)]  # fmt: skip
    document = strict_json(json_text({"a": {"b": values}, "c": (float("nan"),)}))
    assert document == {"a": {"b": ["Infinity", "-Infinity", "NaN"] * 2 + [0.5, 0.25]},
                        "c": ["NaN"]}  # fmt: skip


def test_verify_says_each_adapters_why_and_reference_as_messages(monkeypatch):
    """verify's document on a real judgement (the 35B-A3B-wide MoE's answers recorded on the
    H200, judged as `verify --model` judges): the verdict's reason, its reference's reason
    (the merged verdict it set aside nested in it) and what decides instead are messages."""
    from tests.verify_helpers import WIDE_SERVED

    verify_judges(monkeypatch, WIDE_SERVED)
    document = checked("verify", run_cli("verify", "--json"), 0)
    adapter = document["adapters"][0]
    assert adapter["why"]["code"] == "verify-within"
    assert adapter["why"]["controls"] == "past-failure-line"
    assert adapter["reference_why"]["code"] == "verify-peft-decides"
    because = adapter["reference_why"]["because"]
    assert because["code"] == "verify-merged-undecided"
    assert because["verdict"]["code"] == "verify-check-open"
    assert adapter["reference_why"]["message"].endswith("; the PEFT reference decides")
    assert adapter["decides_instead"] is None
    text = run_cli("verify").stdout
    assert f"  why: {adapter['why']['message']}\n" in text
    assert f"  reference: peft ({adapter['reference_why']['message']})\n" in text
