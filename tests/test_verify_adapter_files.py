"""`patchkit verify --model` on hostile adapter and model files: bounded, one line, no GPU.

Every JSON file verify reads (adapter_config.json, config.json,
model.safetensors.index.json, safetensors headers) is capped by its size on
the descriptor before a byte is read, parsed with its nesting and numbers
bounded, and checked by type; every failure is one line naming the file and
the key, exit 1 (bad content) or 2 (bad usage), decided before torch is
imported and before anything is written. A rank_pattern key is matched
without backtracking (patchkit/adapters/patterns.py; its semantics are tested in
tests/test_peft_patterns.py). Bounds are shown with RLIMIT_CPU and RLIMIT_AS
in a child process, never with a clock.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_cli, run_subprocess

torch = pytest.importorskip("torch", reason="the test checkpoints are written with torch")
from tests.checkpoint_helpers import (  # noqa: E402
    HEAD_DIM,
    HEADS,
    VL,
    H,
    base_tensors,
    lin,
    write_adapter,
    write_checkpoint,
)

MODULE = f"{VL}layers.1.self_attn.q_proj"
SHARD = "model-00002-of-00003.safetensors"  # holds layer 1
DEEP = 100_000  # a RecursionError in json.loads, far past any real file's nesting
HOSTILE_KEY = "(.|.)*(.|.)*(.|.)*Q"  # Python's re backtracks on it for ever


@pytest.fixture
def user(tmp_path: Path) -> dict:
    """A tiny Qwen3.5 checkpoint and an adapter on layer 1's q_proj (a 46-character name)."""
    model = write_checkpoint(tmp_path / "model", base_tensors())
    adapter = write_adapter(tmp_path / "lora", {MODULE: lin((2 * HEADS * HEAD_DIM, H), 4, seed=1)})
    work = tmp_path / "work"
    work.mkdir()
    return {"model": model, "adapter": adapter, "work": work, "root": tmp_path}


def verify_args(user: dict) -> list[str]:
    return ["verify", "--model", str(user["model"]), "--lora", f"a={user['adapter']}",
            "--workdir", str(user["work"])]  # fmt: skip


def listing(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.lstat().st_mtime_ns) for p in root.rglob("*"))


def edit_json(path: Path, **values) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def edit_raw(path: Path, key: str, raw: str) -> None:
    """Set a key to JSON text json.dumps cannot write (1e400, NaN, deep nesting)."""
    data = json.loads(path.read_text())
    data[key] = "@@RAW@@"
    path.write_text(json.dumps(data).replace('"@@RAW@@"', raw))


def deep(n: int = DEEP) -> str:
    return "[" * n + "]" * n


def write_header(path: Path, header: bytes, length: int | None = None, size: int = 0) -> None:
    """A safetensors file with this header text, no tensor bytes; a hole up to `size`."""
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length))
        f.write(header)
        f.truncate(max(size, 8 + len(header)))


def adapter_config(user: dict) -> Path:
    return user["adapter"] / "adapter_config.json"


def index(user: dict) -> Path:
    return user["model"] / "model.safetensors.index.json"


# Each case: what it does to the files, the exit code, the words of the one line.
# The file named in the line is checked too (the second element of the words).
CASES = {
    # adapter_config.json
    "adapter config nested 100,000 deep": (
        lambda u: edit_raw(adapter_config(u), "notes", deep()),
        1, "nested deeper than 64",
    ),
    "r 1e400": (lambda u: edit_raw(adapter_config(u), "r", "1e400"), 1, "r is inf"),
    "lora_alpha NaN": (
        lambda u: edit_raw(adapter_config(u), "lora_alpha", "NaN"),
        1, "lora_alpha is nan, not a finite number",
    ),
    "r beyond 64 bits": (
        lambda u: edit_raw(adapter_config(u), "r", "9" * 20),
        1, "r is " + "9" * 20 + ", an integer out of range",
    ),
    "r of 5,000 digits": (
        lambda u: edit_raw(adapter_config(u), "r", "1" * 5000),
        1, "r is an integer of 5000 digits, out of range",
    ),
    "r a string": (lambda u: edit_json(adapter_config(u), r="4"), 1, "r is '4'; it must be"),
    "r true": (lambda u: edit_json(adapter_config(u), r=True), 1, "r is True; it must be"),
    "r a list": (lambda u: edit_json(adapter_config(u), r=[4]), 1, "r is [4]; it must be"),
    "r negative": (lambda u: edit_json(adapter_config(u), r=-4), 1, "r is -4; it must be"),
    "r 4.7 (vLLM's r <= 0 test passes it; no factor has that rank)": (
        lambda u: edit_json(adapter_config(u), r=4.7),
        1, "r is 4.7; it must be a whole number above 0",
    ),
    # what `adapter check` names as a config finding, verify refuses in the same words
    "lora_bias": (
        lambda u: edit_json(adapter_config(u), lora_bias=True),
        1, "lora_bias is True: lora_B carries a bias; vLLM refuses it from 0.32.0",
    ),
    "init_lora_weights pissa": (
        lambda u: edit_json(adapter_config(u), init_lora_weights="pissa"),
        1, "init_lora_weights is 'pissa': PiSSA/OLoRA/CorDA/LoftQ change the base weights",
    ),
    "several problems": (
        lambda u: edit_json(adapter_config(u), use_qalora=True, use_bdlora={"nblocks": 2}),
        1, "use_qalora is True: QALoRA; vLLM refuses it from 0.32.0; earlier releases drop "
        "the key unread (1 more problem: `patchkit adapter check` names each)",
    ),
    "lora_alpha a string": (
        lambda u: edit_json(adapter_config(u), lora_alpha="8"),
        1, "lora_alpha is '8'; it must be a number",
    ),
    "use_rslora a string": (
        lambda u: edit_json(adapter_config(u), use_rslora="false"),
        1, "use_rslora is 'false', not true or false",
    ),
    "rank_pattern rank true": (
        lambda u: edit_json(adapter_config(u), rank_pattern={"q_proj": True}),
        1, "rank_pattern['q_proj'] is True",
    ),
    "rank_pattern key (": (
        lambda u: edit_json(adapter_config(u), rank_pattern={"(": 8}),
        1, "rank_pattern key '(' is refused: missing )",
    ),
    "alpha_pattern key with a lookbehind": (
        lambda u: edit_json(adapter_config(u), alpha_pattern={"(?<=self_attn.)q_proj": 8}),
        1, "alpha_pattern key '(?<=self_attn.)q_proj' is refused: (?...) other than (?:...)",
    ),
    "rank_pattern key with a possessive quantifier": (
        lambda u: edit_json(adapter_config(u), rank_pattern={"q.*+": 8}),
        1, "rank_pattern key 'q.*+' is refused: a possessive quantifier",
    ),
    # model.safetensors.index.json
    "index nested 100,000 deep": (
        lambda u: edit_raw(index(u), "metadata", deep()), 1, "nested deeper than 64",
    ),
    "index weight_map naming a number": (
        lambda u: edit_json(index(u), weight_map={"lm_head.weight": 5}),
        1, "weight_map is not a JSON object of tensor name to file name",
    ),
    "index metadata a string": (
        lambda u: edit_json(index(u), metadata="ab"), 1, "metadata is not a JSON object",
    ),
    "index total_size 1e400": (
        lambda u: edit_raw(index(u), "metadata", '{"total_size": 1e400}'),
        1, "metadata.total_size is inf, not a finite number",
    ),
    # a shard's safetensors header
    "header nested 100,000 deep": (
        lambda u: write_header(u["model"] / SHARD, b'{"__metadata__": ' + deep().encode() + b"}"),
        1, "nested deeper than 64",
    ),
    "header shape 1e400": (
        lambda u: write_header(
            u["model"] / SHARD,
            b'{"t": {"dtype": "BF16", "shape": [1e400], "data_offsets": [0, 0]}}',
        ),
        1, "t.shape[0] is inf, not a finite number",
    ),
    "header shape of strings": (
        lambda u: write_header(
            u["model"] / SHARD,
            b'{"t": {"dtype": "BF16", "shape": ["0"], "data_offsets": [0, 0]}}',
        ),
        1, "header entry 't' is not {dtype: name, shape: [counts], data_offsets: [begin, end]}",
    ),
    "header longer than the cap": (
        lambda u: write_header(u["model"] / SHARD, b"{}", length=(32 << 20) + 1, size=40 << 20),
        1, "at most 33554432",
    ),
    # config.json: a usage error (exit 2), like its other refusals
    "config rope_theta 1e400": (
        lambda u: edit_raw(u["model"] / "config.json", "rope_theta", "1e400"),
        2, "rope_theta is inf, not a finite number",
    ),
}  # fmt: skip


def named_file(user: dict, name: str) -> Path:
    if name.startswith("header"):
        return user["model"] / SHARD
    if name.startswith("index"):
        return index(user)
    if name.startswith("config"):
        return user["model"]  # read_config names the --model directory and config.json
    return adapter_config(user)


@pytest.mark.parametrize("name", CASES)
def test_a_hostile_file_is_one_line_naming_file_and_key(user, name):
    """Nesting raised RecursionError, 1e400 OverflowError, "(" re.error (exit 3); "4", true
    and "false" were read as 4, 1 and true; a header shape of strings was read as numbers."""
    damage, code, words = CASES[name]
    damage(user)
    before = listing(user["root"])
    result = run_cli(*verify_args(user))
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == code, (name, result.output)
    assert len(lines) == 1 and lines[0].startswith("patchkit: error: "), lines
    assert str(named_file(user, name)) in lines[0], lines[0]
    assert words in lines[0], lines[0]
    assert len(lines[0]) < 400, lines[0]
    assert listing(user["root"]) == before


NO_TORCH = """
import atexit, resource, sys

class NoTorch:  # any import of torch raises ImportError, and is remembered
    asked = False

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            NoTorch.asked = True
            raise ImportError("torch is blocked in this test")

sys.meta_path.insert(0, NoTorch())
atexit.register(lambda: print("torch asked for:", NoTorch.asked, file=sys.stderr))
"""


def test_a_backtracking_rank_pattern_key_is_matched_in_bounded_time(user):
    """rank_pattern {"(.|.)*(.|.)*(.|.)*Q": 8} hung verify before any GPU check (PEFT's
    re.match on a 46-character module name). Under a 20 s CPU limit the old code is killed
    by SIGXCPU; now the adapter is planned (the key matches nothing, as in PEFT) and
    verify goes on to look for torch."""
    edit_json(adapter_config(user), rank_pattern={HOSTILE_KEY: 8})
    limit = "resource.setrlimit(resource.RLIMIT_CPU, (20, 20))\n"
    result = run_subprocess(*verify_args(user), code=NO_TORCH + limit)
    assert result.returncode != -signal.SIGXCPU, "killed by the CPU limit: it backtracked"
    assert result.returncode == 1, result.stderr[-2000:]
    assert "merged references: 1 adapter(s)" in result.stderr  # planned, then the GPU
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "torch asked for: True"  # after the plan


@pytest.mark.parametrize(
    "name",
    ["rank_pattern key (", "alpha_pattern key with a lookbehind", "adapter config nested "
     "100,000 deep", "r 1e400", "index nested 100,000 deep", "header shape 1e400"],
)  # fmt: skip
def test_a_refusal_comes_before_torch_and_before_any_file_is_written(user, name):
    """Refused in a child that records any import of torch: the line is the refusal, torch
    was never asked for, and nothing under the user's directories or the workdir was
    created or changed."""
    damage, code, words = CASES[name]
    damage(user)
    before = listing(user["root"])
    result = run_subprocess(*verify_args(user), code=NO_TORCH)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, result.stderr[-2000:]
    assert lines[-2].startswith("patchkit: error: ") and words in lines[-2], lines
    assert lines[-1] == "torch asked for: False"
    assert listing(user["root"]) == before


def sparse(path: Path, size: int = 512 << 20) -> None:
    """A file of `size` bytes that takes no disk: one '{' and a hole."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.write(b"{")
        f.truncate(size)


RLIMIT_AS_256M_MORE = """
def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
limit = vm_bytes() + (256 << 20)  # what this Python holds now, plus 256 MiB
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
"""


@pytest.mark.parametrize("which", ["adapter_config.json", "model.safetensors.index.json"])
def test_a_512_mb_sparse_file_is_refused_by_its_size_under_256_mb_of_address_space(user, which):
    """adapter_config.json and the index were read whole (read_text: 1.08 GB of memory for
    a 512 MB sparse file). With the address space capped at 256 MiB above what the child
    holds, the old code fails with MemoryError (exit 3); now the size on the descriptor
    refuses the file before a byte is read."""
    path = adapter_config(user) if which == "adapter_config.json" else index(user)
    sparse(path)
    result = run_subprocess(*verify_args(user), code=NO_TORCH + RLIMIT_AS_256M_MORE)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr[-2000:]
    assert lines[-2].startswith(f"patchkit: error: {path}: "), lines
    limit = 1 << 20 if which == "adapter_config.json" else 32 << 20
    assert f"{512 << 20} bytes, larger than the {limit} bytes allowed" in lines[-2]
    assert lines[-1] == "torch asked for: False"


def refused_in_a_child(imports: str, call: str):
    """Run ``call`` (one line, after ``imports``) in a child with an alarm as the guard of a
    hang; the child prints the PatchkitError it raises and exits 0."""
    code = textwrap.dedent(
        f"""
        import signal, sys
        from pathlib import Path
        signal.alarm(60)
        from patchkit.errors import PatchkitError
        {imports}
        try:
            {call}
        except PatchkitError as exc:
            print(exc)
        sys.exit(0)
        """
    )
    return run_subprocess(code=code)


def test_a_fifo_named_like_a_shard_is_refused_not_waited_on(user):
    """SafetensorsFile opened the path with open(): a FIFO swapped in for a shard after the
    directory was listed blocked for ever. Checked in a child with an alarm as the hang's
    guard; the FIFO is refused on the descriptor at once."""
    fifo = user["root"] / "fifo.safetensors"
    os.mkfifo(fifo)
    result = refused_in_a_child(
        "from patchkit.adapters import safetensorsfile",
        f"safetensorsfile.SafetensorsFile({str(fifo)!r})",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"{fifo}: a FIFO, not a regular file"


def test_a_small_json_file_of_many_deeply_nested_numbers_is_read_in_bounded_memory():
    """A 200 kB adapter_config.json of 100,000 numbers nested 60 deep: the check of its
    numbers holds one key path per open container, not one per number (4 kB each, about
    400 MB in all, before); the first bad number is still named by its whole path."""
    import tracemalloc

    from patchkit.fs.files import decode_user_json

    key = "k" * 60 + "-"
    text = "[" + "0," * 100_000 + "1e400]"
    for _ in range(60):
        text = f'{{"{key}":{text}}}'
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            decode_user_json(text.encode(), 1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB"
    assert str(refused.value).endswith("[100000] is inf, not a finite number")


# ----- the adapter's files are read through its directory, as `adapter check` reads them -----


def moved_out(user: dict, name: str) -> Path:
    """``name`` moved out of the adapter, a link to it left in its place (what a
    link to /etc/... or another tenant's file looks like to verify)."""
    inside = user["adapter"] / name
    outside = user["root"] / f"outside-{name}"
    inside.rename(outside)
    inside.symlink_to(outside)
    return inside


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_link_out_of_the_adapter_is_refused_by_every_reader(user, name):
    """--lora's check, the merge's config and tensor readers, and the controls followed a
    link out of the adapter (read_bytes and is_file by path); each refuses it in one
    line naming the file, and the controls write nothing."""
    from patchkit.cli.words import say
    from patchkit.errors import PatchkitError, Refused, UsageProblem
    from patchkit.verify import adaptercontrols, adapterfiles, usermodel

    path = moved_out(user, name)
    readers = [lambda: adaptercontrols.build("a", user["adapter"], user["work"])]
    if name == "adapter_config.json":
        readers.append(lambda: adapterfiles.read_adapter_config(user["adapter"]))
        with pytest.raises(UsageProblem, match="out of the directory") as refused:
            usermodel.parse_lora(f"a={user['adapter']}")
        assert str(path) in str(refused.value)
    else:
        readers.append(lambda: adapterfiles.AdapterTensors(user["adapter"]).close())
    for read in readers:
        with pytest.raises(PatchkitError) as refused:
            read()
        error = refused.value  # adapter_config.json's rule refuses with a reason: its words
        said = say(error.reason) if isinstance(error, Refused) else str(error)
        assert re.search(f"{path}: a link to .*out of the directory", said), said
    assert list(user["work"].iterdir()) == []


def test_a_fifo_as_adapter_config_is_refused_by_the_controls_not_waited_on(user):
    """The controls read adapter_config.json with read_bytes(): a FIFO there blocked for
    ever. Checked in a child with an alarm as the hang's guard."""
    config = adapter_config(user)
    config.unlink()
    os.mkfifo(config)
    adapter, work = str(user["adapter"]), str(user["work"])
    result = refused_in_a_child(
        "from patchkit.verify import adaptercontrols",
        f'adaptercontrols.build("a", Path({adapter!r}), Path({work!r}))',
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"{config}: a FIFO, not a regular file"
    assert list(user["work"].iterdir()) == []
