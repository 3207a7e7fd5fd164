"""A hostile index or wheel: one line, exit 1, nothing written outside the cache, no staging left.

Each case serves the real test wheel (real vLLM 0.26.0 files) with one
thing wrong: a Content-Range that is not the range asked for, more or fewer
bytes than asked, sizes and hashes the index got wrong, a central directory
pointing outside the file, a member larger than a source file may be or
inflating past its declared size, a member whose name climbs out of the
tree, a member RECORD does not vouch for, redirects in a loop or to a file.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
import zipfile
from pathlib import Path

import pytest

from patchkit.errors import PatchkitError
from patchkit.releases import members, wheelzip
from patchkit.releases.pipconfig import pip_settings
from tests.conftest import run_cli, run_subprocess, slim_tree
from tests.wheelserver_helpers import (
    PIP_ENV,
    WHEEL,
    Index,
    build_wheel,
    only_this_index,
    serving,
    urlsafe,
)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return slim_tree(tmp_path_factory.mktemp("slim") / "tree")


@pytest.fixture(scope="module")
def wheel_bytes(tree, tmp_path_factory) -> bytes:
    return build_wheel(tree, tmp_path_factory.mktemp("w") / WHEEL).read_bytes()


def failed_fetch(tmp_path, monkeypatch, index: Index, *options: str) -> str:
    """Run `patchkit fetch [options]` against ``index``; its one error line. The cache
    directory holds nothing afterwards (no tree, no staging, no wheel) and nothing appeared
    beside it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    before = sorted(os.listdir(tmp_path))
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        result = run_cli("fetch", "0.26.0", "--dest", str(cache / "vllm-0.26.0"), *options)
    line = one_error_line(result)
    assert os.listdir(cache) == []
    assert sorted(os.listdir(tmp_path)) == before
    return line


def one_error_line(result) -> str:
    """Exit 1, no traceback, one error line; beside it only the line saying the whole
    wheel is downloaded."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("patchkit: error: ")]
    assert len(errors) == 1, result.stderr
    assert all(ln in errors or "does not serve byte ranges" in ln for ln in lines), lines
    return errors[0]


@pytest.mark.parametrize(
    "content_range,words",
    [
        (lambda a, b, t: f"bytes {a - 1}-{b - 2}/{t}", "to a request for the last"),
        (lambda a, b, t: f"bytes {a + 1}-{b}/{t}", "sent a Content-Range of 'bytes"),
        (lambda a, b, t: f"bytes {a}-{b - 1}/{t + 7}", "to a request for the last"),
        (lambda a, b, t: f"bytes {a}-{b - 1}/*", "sent a Content-Range of 'bytes"),
        (lambda a, b, t: "bytes 5-2/10", "sent a Content-Range of 'bytes 5-2/10'"),
    ],
)  # fmt: skip
def test_a_content_range_that_does_not_match(tmp_path, monkeypatch, wheel_bytes, content_range,
                                             words):  # fmt: skip
    index = Index(wheel_bytes, hostile={"content_range": content_range})
    assert words in failed_fetch(tmp_path, monkeypatch, index, "--trust-ranges")


def test_a_later_range_that_does_not_match(tmp_path, monkeypatch, wheel_bytes):
    """The tail is right; every later range is answered one byte off."""
    monkeypatch.setattr(members, "TAIL_READ", 4096)
    index = Index(wheel_bytes, hostile={
        "content_range": lambda a, b, t: f"bytes {a}-{b - 1}/{t}" if b == t
        else f"bytes {a + 1}-{b}/{t}"})  # fmt: skip
    line = failed_fetch(tmp_path, monkeypatch, index, "--trust-ranges")
    assert "127.0.0.1 answered bytes" in line and "to a request for" in line


@pytest.mark.parametrize("hostile,words", [
    ({"extra_bytes": 100}, "bytes for a range of"),
    ({"short_by": 100}, "bytes for a range of"),
])  # fmt: skip
def test_more_or_fewer_bytes_than_the_range(tmp_path, monkeypatch, wheel_bytes, hostile, words):
    index = Index(wheel_bytes, hostile=hostile)
    assert words in failed_fetch(tmp_path, monkeypatch, index, "--trust-ranges")


def test_a_size_the_index_got_wrong(tmp_path, monkeypatch, wheel_bytes):
    index = Index(wheel_bytes, page_size=len(wheel_bytes) + 1)
    line = failed_fetch(tmp_path, monkeypatch, index, "--trust-ranges")
    assert f"{WHEEL} is {len(wheel_bytes):,} bytes at 127.0.0.1, the index says" in line
    (tmp_path / "whole").mkdir()
    line = failed_fetch(tmp_path / "whole", monkeypatch, Index(wheel_bytes, page_size=7))
    assert f"127.0.0.1 sent {len(wheel_bytes):,} bytes, over 7" in line


def test_the_whole_wheel_must_match_the_index_sha256(tmp_path, monkeypatch, wheel_bytes):
    index = Index(wheel_bytes, ranges=False, page_sha256="0" * 64)
    line = failed_fetch(tmp_path, monkeypatch, index)
    assert line.endswith(f"fetch: {WHEEL} does not match its index's sha256")


def test_the_whole_wheel_is_read_no_further_than_the_index_size(tmp_path, monkeypatch, wheel_bytes):
    """A server sending more than the index's size: refused at the declared length."""
    index = Index(wheel_bytes, ranges=False, page_size=len(wheel_bytes) - 10)
    line = failed_fetch(tmp_path, monkeypatch, index)
    assert f"sent {len(wheel_bytes):,} bytes, over {len(wheel_bytes) - 10:,}" in line


def _end_record(data: bytes) -> int:
    return data.rfind(b"PK\x05\x06")


def test_a_central_directory_outside_the_file(tmp_path, monkeypatch, wheel_bytes):
    data = bytearray(wheel_bytes)
    at = _end_record(data)
    struct.pack_into("<L", data, at + 16, len(data) + 4096)  # the directory's offset
    line = failed_fetch(tmp_path, monkeypatch, Index(bytes(data)))
    assert "directory" in line and "lies outside the file" in line


def test_a_directory_larger_than_the_bound(tmp_path, monkeypatch, wheel_bytes):
    data = bytearray(wheel_bytes)
    struct.pack_into("<L", data, _end_record(data) + 12, wheelzip.MAX_DIRECTORY + 1)
    line = failed_fetch(tmp_path, monkeypatch, Index(bytes(data)))
    assert f"in {wheelzip.MAX_DIRECTORY + 1:,} bytes" in line


def _central_entry(data: bytes, name: bytes) -> int:
    at = data.find(b"PK\x01\x02", data.rfind(b"PK\x05\x06") - 10**6)
    while True:
        at = data.find(b"PK\x01\x02", at)
        length = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + length] == name:
            return at
        at += 4


def test_a_member_larger_than_a_source_file_may_be(tmp_path, monkeypatch, wheel_bytes):
    data = bytearray(wheel_bytes)
    struct.pack_into("<L", data, _central_entry(data, b"vllm/__init__.py") + 24, 3 << 30)
    line = failed_fetch(tmp_path, monkeypatch, Index(bytes(data)))
    assert f"'vllm/__init__.py' is {3 << 30:,} bytes, over the" in line


def test_inflating_stops_at_the_declared_size(tree, tmp_path, monkeypatch):
    """A member declared 100 bytes that inflates to 8 MB: inflated to 101 bytes, refused."""
    bomb = b"\n" * (8 << 20)
    wheel = build_wheel(tree, tmp_path / WHEEL, extra={"vllm/bomb.py": bomb}).read_bytes()
    data = bytearray(wheel)
    struct.pack_into("<L", data, _central_entry(data, b"vllm/bomb.py") + 24, 100)
    line = failed_fetch(tmp_path, monkeypatch, Index(bytes(data)))
    assert "'vllm/bomb.py' holds 101+ bytes, not the 100 its directory entry says" in line


@pytest.mark.parametrize("name", ["vllm/../../evil.py", "vllm-0.26.0.dist-info/../../evil"])
def test_a_member_that_climbs_out_of_the_tree(tree, tmp_path, monkeypatch, name):
    wheel = build_wheel(tree, tmp_path / WHEEL, extra={name: b"print('escaped')\n"})
    line = failed_fetch(tmp_path, monkeypatch, Index(wheel.read_bytes()))
    assert "leaves the vLLM tree" in line and "(a member of the wheel)" in line
    assert not (tmp_path / "evil.py").exists() and not (tmp_path / "evil").exists()


@pytest.mark.parametrize("row,words", [
    (None, "vllm/extra.py is not in the wheel's RECORD"),
    (("sha256=" + "A" * 43, "6"), "vllm/extra.py does not match its hash in RECORD"),
    (("sha256=x", "7"), "vllm/extra.py is 6 bytes, RECORD says 7"),
    (("md5=x", "6"), "RECORD hashes vllm/extra.py with 'md5', not sha256"),
])  # fmt: skip
def test_a_member_record_does_not_vouch_for(tree, tmp_path, monkeypatch, row, words):
    wheel = build_wheel(tree, tmp_path / WHEEL, extra={"vllm/extra.py": b"x = 1\n"},
                        rows={"vllm/extra.py": row})  # fmt: skip
    assert words in failed_fetch(tmp_path, monkeypatch, Index(wheel.read_bytes()))


def test_a_member_whose_bytes_were_changed_fails_its_crc(tmp_path, monkeypatch, wheel_bytes):
    with zipfile.ZipFile(_as_file(tmp_path, wheel_bytes)) as archive:
        info = archive.getinfo("vllm/__init__.py")
    data = bytearray(wheel_bytes)
    data[info.header_offset + 30 + len(info.filename) + 5] ^= 0xFF
    line = failed_fetch(tmp_path, monkeypatch, Index(bytes(data)))
    assert "'vllm/__init__.py'" in line


def _as_file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "as-file.whl"
    path.write_bytes(data)
    return path


def test_a_redirect_loop_is_cut_short(tmp_path, monkeypatch, wheel_bytes):
    index = Index(wheel_bytes, hostile={"redirect": {"/simple/vllm/": "/simple/vllm/"}})
    line = failed_fetch(tmp_path, monkeypatch, index)
    assert line.endswith("fetch: 127.0.0.1 redirected more than 5 times")
    assert len(index.seen) <= 6


def test_a_redirect_to_a_local_file_is_not_followed(tmp_path, monkeypatch, wheel_bytes):
    index = Index(wheel_bytes, hostile={"redirect": {"/simple/vllm/": "file:///etc/passwd"}})
    line = failed_fetch(tmp_path, monkeypatch, index)
    assert "redirected to a file: URL, which fetch does not follow" in line


def test_an_index_page_past_its_bound(tmp_path, monkeypatch, wheel_bytes):
    monkeypatch.setattr("patchkit.releases.index.MAX_PAGE", 100)
    line = failed_fetch(tmp_path, monkeypatch, Index(wheel_bytes))
    assert "127.0.0.1 sent" in line and "over 100" in line


def test_a_file_name_that_climbs_out_is_no_candidate(tmp_path, monkeypatch, wheel_bytes):
    """The index names the wheel ../../vllm-...whl (the URL is the real one): not a wheel
    name pip would take, so no wheel; nothing written beside the cache either way."""
    index = Index(wheel_bytes, ranges=False, filename=f"../../{WHEEL}")
    line = failed_fetch(tmp_path, monkeypatch, index)
    assert "no wheel of vllm==0.26.0" in line


# ----- local files pip's settings name: a FIFO, a device, an endless file -----

# In the child: an alarm ends a hang (the old code waited on the FIFO for ever), and the
# address space is capped 512 MiB above what it holds (the old code read /dev/zero until
# MemoryError, exit 3).
GUARDED = """
import resource, signal
signal.alarm(60)
def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
limit = vm_bytes() + (512 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
"""


def fetch_in_child(tmp_path: Path, **env: str):
    """`patchkit fetch 0.26.0` in a child with pip's settings ``env`` and nothing of the
    machine's; the cache directory it was given holds nothing afterwards."""
    cache = tmp_path / "cache"
    cache.mkdir()
    settings = {name: None for name in PIP_ENV}
    settings.update(PIP_CONFIG_FILE=os.devnull, HOME=str(tmp_path), PIP_NO_INDEX="1")
    settings.update(env)
    result = run_subprocess(
        "fetch", "0.26.0", "--dest", str(cache / "vllm-0.26.0"), env=settings, code=GUARDED
    )
    assert os.listdir(cache) == []
    return result


def refused_line(result) -> str:
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    return line


def fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "too large"])
def test_a_pip_configuration_that_is_no_settings_file_is_one_line(tmp_path, kind):
    """PIP_CONFIG_FILE is read with a plain open(): a FIFO hung fetch, /dev/zero ran it
    out of memory (exit 3). A regular file of at most 1 MiB is read, anything else
    refused in one line naming it, before any download."""
    if kind == "fifo":
        config = fifo(tmp_path / "pip.conf")
    elif kind == "/dev/zero":
        config = Path("/dev/zero")
    else:
        config = tmp_path / "pip.conf"
        config.write_text("[global]\n" + "# padding\n" * 120_000)
    line = refused_line(fetch_in_child(tmp_path, PIP_CONFIG_FILE=str(config)))
    assert line.startswith(f"patchkit: error: fetch: pip's configuration {config} cannot be read: ")
    words = {"fifo": "a FIFO, not a regular file", "/dev/zero": "not a regular file",
             "too large": "larger than the 1048576 bytes allowed"}[kind]  # fmt: skip
    assert words in line


@pytest.mark.parametrize("where", ["find-links wheel", "file: index page"])
def test_a_fifo_named_as_a_local_wheel_or_page_is_refused_not_waited_on(tmp_path, where):
    """A find-links wheel was opened without O_NONBLOCK, a file: index's page read with
    read_bytes(): a FIFO there hung fetch. Each is refused in one line naming it."""
    if where == "find-links wheel":
        planted = fifo(tmp_path / "links" / WHEEL)
        env = {"PIP_FIND_LINKS": str(planted.parent)}
    else:
        planted = fifo(tmp_path / "simple" / "vllm" / "index.html")
        env = {"PIP_INDEX_URL": (tmp_path / "simple").as_uri(), "PIP_NO_INDEX": ""}
    line = refused_line(fetch_in_child(tmp_path, **env))
    assert line == f"patchkit: error: fetch: cannot read {planted}: a FIFO, not a regular file"


@pytest.mark.parametrize(
    "env,words",
    [
        ({"PIP_DEFAULT_TIMEOUT": "nan"}, "pip's default-timeout setting 'nan' is not a number"),
        ({"PIP_TIMEOUT": "-inf"}, "pip's timeout setting '-inf' is not a number of seconds"),
        ({"PIP_DEFAULT_TIMEOUT": "soon"}, "(PIP_DEFAULT_TIMEOUT or default-timeout in pip's"),
    ],
)
def test_a_timeout_that_is_not_a_finite_number_names_the_setting(env, words):
    """min(max(nan, 1.0), 3600.0) is nan: a socket timeout no clock reaches."""
    with pytest.raises(PatchkitError, match=re.escape(words)):
        pip_settings({"PIP_CONFIG_FILE": os.devnull, **env})
    assert pip_settings({"PIP_CONFIG_FILE": os.devnull, "PIP_TIMEOUT": "1e9"}).timeout == 3600.0


# ----- as strict as pip: the index's sha256, one RECORD, bounded, escaped, one line -----


def test_ranges_never_publish_a_wheel_the_index_hash_does_not_vouch_for(
    tmp_path, monkeypatch, wheel_bytes
):
    """A server that serves ranges, an index whose sha256 the wheel does not have: the
    default downloads the whole wheel and refuses it, as pip does (range reads published
    it, RECORD agreeing with itself). Only --trust-ranges, asked for, takes the host's word."""
    index = Index(wheel_bytes, page_sha256="0" * 64)
    line = failed_fetch(tmp_path, monkeypatch, index)
    assert line.endswith(f"fetch: {WHEEL} does not match its index's sha256")
    assert not [r for r in index.seen if r["range"]]  # one whole download, no ranges
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        result = run_cli("fetch", "0.26.0", "--dest", str(tmp_path / "t"), "--trust-ranges")
    assert result.exit_code == 0, result.output


def test_the_unpacked_total_is_bounded_before_anything_is_inflated(tree, tmp_path, monkeypatch):
    """Each member was capped, their sum was not (a 1 MB wheel wrote 1.1 GB): members
    declared at 200 MiB each, together over the bound, are refused from the directory."""
    extra = {f"vllm/bomb{n}.py": b"\n" * 100 for n in range(4)}
    data = bytearray(build_wheel(tree, tmp_path / WHEEL, extra=extra).read_bytes())
    for name in extra:
        struct.pack_into("<L", data, _central_entry(data, name.encode()) + 24, 200 << 20)
    line = failed_fetch(tmp_path, monkeypatch, Index(bytes(data)))
    assert f"bytes unpacked, over the {members.MAX_UNPACKED:,} a vLLM tree may have" in line


def test_another_packages_record_is_never_the_one_checked_against(tree, tmp_path, monkeypatch):
    """aaa-1.0.dist-info/RECORD came first in the zip and vouched for a vllm/extra.py the
    wheel's own RECORD does not: the members were checked against it, exit 0. A second
    dist-info is refused, as pip refuses it."""
    extra = {"vllm/extra.py": b"x = 1\n"}
    rows = {"vllm/extra.py": ("sha256=" + "A" * 43, "6")}
    first = build_wheel(tree, tmp_path / "first.whl", extra=extra, rows=rows)
    with zipfile.ZipFile(first) as archive:
        names = [n for n in archive.namelist() if not n.endswith("/RECORD")]
        table = [(n, f"sha256={urlsafe(hashlib.sha256(archive.read(n)).digest())}", "")
                 for n in names]  # fmt: skip
    forged = "".join(f"{n},{h},{z}\n" for n, h, z in table).encode()
    extra["aaa-1.0.dist-info/RECORD"] = forged
    rows["aaa-1.0.dist-info/RECORD"] = None
    wheel = build_wheel(tree, tmp_path / WHEEL, extra=extra, rows=rows)
    line = failed_fetch(tmp_path, monkeypatch, Index(wheel.read_bytes()))
    assert "must hold one .dist-info directory, vllm-0.26.0's; it holds 'aaa-1.0.dist-info'" in line


def test_a_file_named_record_elsewhere_in_the_dist_info_is_checked(tree, tmp_path, monkeypatch):
    """Any */RECORD under a .dist-info was written unchecked; only the wheel's own is."""
    extra = {"vllm-0.26.0.dist-info/sub/RECORD": b"x"}
    wheel = build_wheel(tree, tmp_path / WHEEL, extra=extra, rows=dict.fromkeys(extra))
    line = failed_fetch(tmp_path, monkeypatch, Index(wheel.read_bytes()))
    assert "vllm-0.26.0.dist-info/sub/RECORD is not in the wheel's RECORD" in line


def test_record_signatures_are_never_written(tree, tmp_path, monkeypatch):
    """RECORD.jws and RECORD.p7s cannot be in RECORD and nothing checks them: left out."""
    extra = {"vllm-0.26.0.dist-info/RECORD.jws": b"sig", "vllm-0.26.0.dist-info/RECORD.p7s": b"s"}
    wheel = build_wheel(tree, tmp_path / WHEEL, extra=extra, rows=dict.fromkeys(extra))
    index = Index(wheel.read_bytes())
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        result = run_cli("fetch", "0.26.0", "--dest", str(tmp_path / "t"))
    assert result.exit_code == 0, result.output
    assert not list((tmp_path / "t" / "vllm-0.26.0.dist-info").glob("RECORD.*"))


def test_the_wheel_name_from_the_index_is_printed_escaped(tmp_path, monkeypatch, wheel_bytes):
    """ESC and a carriage return fit in a wheel name's build tag: the line saying the
    whole wheel is downloaded carried them raw to the terminal."""
    name = WHEEL.replace("-cp38", "-1\x1b[2K\r-cp38")
    index = Index(wheel_bytes, ranges=False, filename=name)
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        result = run_cli("fetch", "0.26.0", "--dest", str(tmp_path / "t"), "--trust-ranges")
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stderr and "\r" not in result.stderr
    assert "-1\\x1b[2K\\r-cp38" in result.stderr


def _zip64_extra_at(data: bytes, name: bytes) -> int:
    """Where the zip64 extra field (tag 1) of ``name``'s directory entry starts."""
    at = _central_entry(data, name)
    name_len = struct.unpack_from("<H", data, at + 28)[0]
    extra = at + 46 + name_len
    assert struct.unpack_from("<H", data, extra)[0] == 1
    return extra


@pytest.mark.parametrize("case", ["record size", "short zip64 extra"])
def test_a_broken_number_in_the_wheel_is_one_line_not_exit_3(tree, tmp_path, monkeypatch, case):
    """A RECORD size of '²' (str.isdigit() says yes, int() says no) and a zip64 extra
    field longer than the extra data were ValueError and struct.error: exit 3."""
    if case == "record size":
        row = ("sha256=" + "A" * 43, "²")
        wheel = build_wheel(tree, tmp_path / WHEEL, extra={"vllm/x.py": b"1\n"},
                            rows={"vllm/x.py": row})  # fmt: skip
        data = wheel.read_bytes()
        words = "RECORD gives 'vllm/x.py' the size '²', not a number"
    else:
        data = bytearray(build_wheel(tree, tmp_path / WHEEL, zip64=True).read_bytes())
        struct.pack_into("<H", data, _zip64_extra_at(data, b"vllm/__init__.py") + 2, 4000)
        words = "member b'vllm/__init__.py' lacks its zip64 sizes"
    assert words in failed_fetch(tmp_path, monkeypatch, Index(bytes(data)))


@pytest.mark.parametrize("entry,words", [
    ({"requires-python": 3}, f"gives {WHEEL} a requires-python that is not a string: '3'"),
    ({"hashes": {"sha256": 5}}, f"gives {WHEEL} a sha256 that is not 64 hex digits: '5'"),
])  # fmt: skip
def test_a_json_index_value_of_the_wrong_type_is_one_line(
    tmp_path, monkeypatch, wheel_bytes, entry, words
):
    index = Index(wheel_bytes, page_entry=entry)
    assert words in failed_fetch(tmp_path, monkeypatch, index)


@pytest.mark.parametrize("password", ["s3cr#et", "s3cr/et", "12/s3cret"])
def test_an_index_url_with_an_unescaped_password_is_one_line_without_it(
    tmp_path, monkeypatch, wheel_bytes, password
):
    """'#' or '/' in a password ends the URL's host part: the rest became a port (exit 3,
    the message quoting it) or a path sent to a host named after the user."""
    index = Index(wheel_bytes, credentials=("user", password))
    cache = tmp_path / "cache"
    with serving(index):
        only_this_index(monkeypatch, f"http://user:{password}@127.0.0.1:{index.port}/simple",
                        tmp_path)  # fmt: skip
        result = run_cli("fetch", "0.26.0", "--dest", str(cache / "vllm-0.26.0"))
    line = one_error_line(result)
    assert "pip's index-url setting is not a URL fetch can read" in line
    assert "s3cr" not in result.output and "et@" not in result.output
    assert not cache.exists() and index.seen == []


def test_one_deadline_bounds_the_whole_fetch(tmp_path, monkeypatch, wheel_bytes):
    """A server sending a byte every 50 ms never lets a socket timeout fire (600 s here):
    fetch stopped only when the server did. PATCHKIT_FETCH_DEADLINE bounds the whole
    fetch; the server here goes on until fetch hangs up (or 120 s, for the old code)."""
    until = threading.Event()
    threading.Timer(120, until.set).start()
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "600")
    monkeypatch.setenv("PATCHKIT_FETCH_DEADLINE", "1")
    try:
        index = Index(wheel_bytes, hostile={"drip": until})
        line = failed_fetch(tmp_path, monkeypatch, index)
    finally:
        until.set()
    assert line.endswith("fetch: stopped after 1 s, the bound on one whole fetch "
                         "(PATCHKIT_FETCH_DEADLINE)")  # fmt: skip


def test_a_deadline_that_is_no_number_is_one_line(tmp_path, monkeypatch, wheel_bytes):
    monkeypatch.setenv("PATCHKIT_FETCH_DEADLINE", "nan")
    line = failed_fetch(tmp_path, monkeypatch, Index(wheel_bytes))
    assert "PATCHKIT_FETCH_DEADLINE='nan' is not a positive number of seconds" in line
