"""fetch reads only the members it keeps, by byte ranges, through the index pip is set to.

Against a local index serving a real wheel (real vLLM 0.26.0 files, a
compiled extension between them): the tree fetch makes by ranges is the one
unpacking the whole wheel makes, file by file and mode by mode; the
extension's bytes never cross the wire (the server counts what it sends); a
server without ranges gets the whole wheel and one line saying so; a proxy
from the environment, credentials in the index URL or in netrc, and pip's
configuration files are used as pip uses them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from patchkit.releases import members
from patchkit.releases.fetch import MARKER, fetch
from patchkit.releases.index import PLATFORMS, find_wheel
from patchkit.releases.pipconfig import PipSettings, pip_settings
from patchkit.releases.transport import Transport
from tests.conftest import release_tree, run_cli, slim_tree
from tests.wheelserver_helpers import (
    EXTENSION,
    EXTENSION_BYTES,
    WHEEL,
    Index,
    build_wheel,
    extracted,
    only_this_index,
    serving,
    tree_files,
)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """The test wheel, plain and with zip64 records, built once."""
    base = tmp_path_factory.mktemp("wheels")
    tree = slim_tree(base / "tree")
    built = {}
    for kind in ("plain", "zip64"):
        (base / kind).mkdir()
        built[kind] = build_wheel(tree, base / kind / WHEEL, zip64=kind == "zip64")
    return built


def _wheel_requests(index: Index) -> list[dict]:
    return [r for r in index.seen if r["path"].endswith(WHEEL)]


def requested_ranges(index: Index) -> list[tuple[int, int]]:
    """[start, end) of each range request for the wheel (a suffix range as the server took it)."""
    out = []
    for request in _wheel_requests(index):
        first, _, last = request["range"].removeprefix("bytes=").partition("-")
        if first:
            out.append((int(first), int(last) + 1))
        else:
            out.append((len(index.wheel) - int(last), len(index.wheel)))
    return out


def extension_span(wheel: Path) -> tuple[int, int]:
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(EXTENSION)
    return info.header_offset, info.header_offset + 30 + len(EXTENSION) + info.compress_size


@pytest.mark.parametrize("kind", ["plain", "zip64"])
@pytest.mark.parametrize("page", ["json", "html"])
def test_the_range_tree_is_the_full_extraction_and_skips_the_extension(
    tmp_path, monkeypatch, wheels, kind, page
):
    monkeypatch.setattr(members, "TAIL_READ", 64 << 10)  # the extension lies beyond the tail
    wheel = wheels[kind]
    index = Index(wheel.read_bytes(), json_page=page == "json")
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        dest = fetch("0.26.0", tmp_path / "cache" / "vllm-0.26.0", trust_ranges=True)
    assert tree_files(dest) == tree_files(extracted(wheel, tmp_path / "full"))
    assert (dest / MARKER).read_text() == f"{WHEEL}\n"
    assert all(r["range"] for r in _wheel_requests(index))
    assert index.sent <= len(index.wheel) - EXTENSION_BYTES + (64 << 10)  # the .so: no
    start, end = extension_span(wheel)
    assert not [r for r in requested_ranges(index) if r[0] < end and start < r[1]]
    assert sorted(os.listdir(dest.parent)) == ["vllm-0.26.0"]  # no staging left


def test_reads_are_coalesced_into_few_requests(tmp_path, monkeypatch, wheels):
    """Every member comes in a handful of requests: the tail (with the directory), and a
    span either side of the extension."""
    monkeypatch.setattr(members, "TAIL_READ", 64 << 10)
    index = Index(wheels["plain"].read_bytes())
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        dest = fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert sum(1 for _ in dest.rglob("*.py")) > 40
    assert 2 <= len(_wheel_requests(index)) <= 4, _wheel_requests(index)


def test_a_tail_of_the_end_record_alone(tmp_path, monkeypatch, wheels):
    """The directory and RECORD lie before the tail: read by their own ranges; members
    that come before RECORD wait for it."""
    monkeypatch.setattr(members, "TAIL_READ", 22)
    index = Index(wheels["plain"].read_bytes())
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        dest = fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert tree_files(dest) == tree_files(extracted(wheels["plain"], tmp_path / "full"))
    assert requested_ranges(index)[0] == (len(index.wheel) - 22, len(index.wheel))


@pytest.mark.parametrize("refusal", ["no ranges", "416", "Accept-Ranges: none"])
def test_a_server_without_ranges_gets_the_whole_wheel_and_one_line(
    tmp_path, monkeypatch, wheels, refusal
):
    wheel = wheels["plain"]
    index = Index(wheel.read_bytes(), ranges=refusal != "no ranges")
    if refusal == "416":
        index.hostile["status"] = 416
    if refusal == "Accept-Ranges: none":
        index.hostile["accept_ranges"] = "none"
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        dest = tmp_path / "d" / "vllm-0.26.0"
        result = run_cli("fetch", "0.26.0", "--dest", str(dest), "--trust-ranges")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "does not serve byte ranges" in lines[0], result.stderr
    assert WHEEL in lines[0]
    assert tree_files(dest) == tree_files(extracted(wheel, tmp_path / "full"))
    assert index.sent >= len(index.wheel)  # the whole file, once
    assert len(_wheel_requests(index)) == (1 if refusal == "no ranges" else 2)
    assert sorted(os.listdir(dest.parent)) == ["vllm-0.26.0"]  # the wheel went with staging


def test_a_proxy_from_the_environment_carries_every_request(tmp_path, monkeypatch, wheels):
    index = Index(wheels["plain"].read_bytes(), proxy=True)
    with serving(index):
        only_this_index(monkeypatch, "http://index.invalid/simple", tmp_path)
        monkeypatch.setenv("http_proxy", index.url)
        dest = fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert (dest / "vllm" / "__init__.py").is_file()
    assert index.seen and all(r["path"].startswith("http://index.invalid/") for r in index.seen)


def test_no_proxy_is_honoured(tmp_path, monkeypatch, wheels):
    """The proxy would refuse direct requests (502); no_proxy sends them to the index."""
    index = Index(wheels["plain"].read_bytes())
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
        monkeypatch.setenv("no_proxy", "127.0.0.1")
        dest = fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert (dest / "vllm" / "__init__.py").is_file()


def test_credentials_in_the_index_url_go_with_every_request(tmp_path, monkeypatch, wheels):
    index = Index(wheels["plain"].read_bytes(), credentials=("reader", "p@ss:word"))
    with serving(index):
        only_this_index(monkeypatch, f"http://reader:p%40ss%3Aword@127.0.0.1:{index.port}/simple",
                        tmp_path)  # fmt: skip
        dest = fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert (dest / "vllm" / "__init__.py").is_file()
    assert len({r["auth"] for r in index.seen}) == 1 and index.seen[0]["auth"]


def test_credentials_from_netrc(tmp_path, monkeypatch, wheels):
    index = Index(wheels["plain"].read_bytes(), credentials=("reader", "secret"))
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        netrc = tmp_path / "netrc"
        netrc.write_text("machine 127.0.0.1 login reader password secret\n")
        netrc.chmod(0o600)
        monkeypatch.setenv("NETRC", str(netrc))
        dest = fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert (dest / "vllm" / "__init__.py").is_file()


def test_without_credentials_the_401_is_one_line(tmp_path, monkeypatch, wheels):
    index = Index(wheels["plain"].read_bytes(), credentials=("reader", "secret"))
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        result = run_cli("fetch", "0.26.0", "--dest", str(tmp_path / "d" / "v"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip() == "patchkit: error: fetch: 127.0.0.1 answered 401 Unauthorized"
    assert not (tmp_path / "d" / "v").exists()


def test_a_redirect_to_another_host_does_not_carry_the_credentials(tmp_path, monkeypatch, wheels):
    files = Index(wheels["plain"].read_bytes())
    with serving(files):
        index = Index(b"", credentials=("reader", "secret"))
        with serving(index):
            index.hostile["redirect"] = {"/simple/vllm/": f"{files.url}/simple/vllm/"}
            only_this_index(monkeypatch, f"http://reader:secret@127.0.0.1:{index.port}/simple",
                            tmp_path)  # fmt: skip
            dest = fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert (dest / "vllm" / "__init__.py").is_file()
    assert index.seen[0]["auth"] and files.seen
    assert all(r["auth"] is None for r in files.seen)


def test_pip_configuration_files_and_variables_in_pips_order(tmp_path):
    """[download] over [global], a later file over an earlier, PIP_* over files;
    PIP_CONFIG_FILE=/dev/null turns the files off."""
    (tmp_path / "xdg" / "pip").mkdir(parents=True)
    (tmp_path / "xdg" / "pip" / "pip.conf").write_text(
        "[global]\nindex-url = http://global/simple\nextra-index-url = http://a http://b\n"
        "[download]\nproxy = http://p:1\n"
    )
    (tmp_path / "home" / ".config" / "pip").mkdir(parents=True)
    (tmp_path / "home" / ".config" / "pip" / "pip.conf").write_text(
        "[global]\nindex_url = http://user/simple\ntimeout = 60\n"
    )
    env = {"XDG_CONFIG_DIRS": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    settings = pip_settings(env)
    assert settings.index_url == "http://user/simple"
    assert settings.extra_index_urls == ("http://a", "http://b")
    assert (settings.proxy, settings.timeout) == ("http://p:1", 60.0)
    env["PIP_INDEX_URL"] = "http://env/simple"
    env["PIP_NO_INDEX"] = "yes"
    assert pip_settings(env).index_url == "http://env/simple"
    assert pip_settings(env).index_urls == ()
    assert pip_settings({**env, "PIP_CONFIG_FILE": os.devnull}).extra_index_urls == ()


def test_the_wheel_pip_would_take(tmp_path):
    """Of the candidates, the best tag for CPython 3.12 on x86_64 (cp312 before abi3),
    at exactly the version, no aarch64, no sdist; a +local version above, as pip takes it."""
    links = tmp_path / "links"
    links.mkdir()
    for name in (
        "vllm-0.26.0-cp38-abi3-manylinux_2_28_aarch64.whl",
        "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "vllm-0.26.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "vllm-0.26.0-cp313-cp313-manylinux_2_28_x86_64.whl",
        "vllm-0.26.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "vllm-0.26.0.post1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "vllm-0.26.0.tar.gz",
    ):
        (links / name).write_bytes(b"")
    settings = PipSettings(index_url="file:///nonexistent/simple", find_links=(str(links),))
    found = find_wheel("0.26.0", settings, Transport(settings, {}))
    assert (
        found.filename == "vllm-0.26.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
    )
    (links / "vllm-0.26.0+cu129-cp38-abi3-manylinux_2_39_x86_64.whl").write_bytes(b"")
    found = find_wheel("0.26.0", settings, Transport(settings, {}))
    assert found.filename == "vllm-0.26.0+cu129-cp38-abi3-manylinux_2_39_x86_64.whl"  # higher
    with pytest.raises(Exception, match=r"no wheel of vllm==0\.27\.0 .* at .*links"):
        find_wheel("0.27.0", settings, Transport(settings, {}))


def test_a_wheel_in_a_find_links_directory_is_read_in_place(tmp_path, monkeypatch, wheels):
    only_this_index(monkeypatch, "file:///nonexistent/simple", tmp_path)
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels["plain"].parent))
    dest = fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert tree_files(dest) == tree_files(extracted(wheels["plain"], tmp_path / "full"))


def test_a_find_links_wheel_whose_name_holds_a_plus_is_read(tmp_path, monkeypatch, wheels):
    """Its file: URL spells '+' as %2B; the path was taken from the URL undecoded, so a
    +local wheel (vllm-0.26.0+cu129-...) beside it was 'No such file or directory'."""
    links = tmp_path / "links"
    links.mkdir()
    local = links / WHEEL.replace("0.26.0-", "0.26.0+cu129-")
    local.write_bytes(wheels["plain"].read_bytes())
    only_this_index(monkeypatch, "file:///nonexistent/simple", tmp_path)
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    dest = fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert tree_files(dest) == tree_files(extracted(wheels["plain"], tmp_path / "full"))


@pytest.mark.network
@pytest.mark.slow
def test_the_real_wheel_by_ranges_is_the_whole_wheel_unpacked(tmp_path, monkeypatch):
    """vLLM 0.26.0 from the index pip is set to: by ranges, and by the whole wheel (the
    default, its sha256 checked), the same files with the same modes, and the same as the
    test cache's tree."""
    by_ranges = fetch("0.26.0", tmp_path / "ranges" / "vllm-0.26.0", trust_ranges=True)
    whole = fetch("0.26.0", tmp_path / "whole" / "vllm-0.26.0")
    files = tree_files(by_ranges)
    assert len(files) > 2000
    assert files == tree_files(whole)
    cached = {k: v[0] for k, v in tree_files(release_tree("0.26.0")).items()}
    assert {k: v[0] for k, v in files.items()} == cached


def test_an_index_without_the_project_is_skipped_for_the_next(tmp_path, monkeypatch, wheels):
    """pip's way: a 404 for the project page is no candidate; the extra index has it."""
    index = Index(wheels["plain"].read_bytes())
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/elsewhere", tmp_path)
        monkeypatch.setenv("PIP_EXTRA_INDEX_URL", f"{index.url}/simple")
        dest = fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert (dest / "vllm" / "__init__.py").is_file()
    assert [r["path"] for r in index.seen[:2]] == ["/elsewhere/vllm/", "/simple/vllm/"]


@pytest.mark.slow
def test_pip_takes_the_same_wheel(tmp_path):
    """pip itself, offline on the same find-links directory, picks the file fetch picks
    (it then finds the empty file invalid, naming it)."""
    links = tmp_path / "links"
    links.mkdir()
    for name in (
        "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "vllm-0.26.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "vllm-0.26.0-cp313-cp313-manylinux_2_28_x86_64.whl",
        "vllm-0.26.0+cu129-cp38-abi3-manylinux_2_39_x86_64.whl",
        "vllm-0.26.0+cu129-cp38-abi3-manylinux_2_39_aarch64.whl",
    ):
        (links / name).write_bytes(b"")
    settings = PipSettings(no_index=True, find_links=(str(links),))
    ours = find_wheel("0.26.0", settings, Transport(settings, {})).filename
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "vllm==0.26.0", "--no-deps", "--only-binary",
         ":all:", "--python-version", "3.12", "--implementation", "cp", *platforms,
         "--no-index", "--find-links", str(links), "-d", str(tmp_path / "out")],
        capture_output=True, text=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
    )  # fmt: skip
    assert f"located at {links / ours} is invalid" in done.stdout + done.stderr, done.stderr


def test_each_host_is_looked_up_once(tmp_path, monkeypatch, wheels):
    """A connection a request, but one DNS lookup a host: a lost answer costs a resolver
    retry (5 s here for one lookup in about 40) once a fetch, not once a request."""
    looked_up = []
    real = socket.getaddrinfo

    def counting(host, *args, **kwargs):
        looked_up.append(host)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counting)
    monkeypatch.setattr(members, "TAIL_READ", 64 << 10)
    index = Index(wheels["plain"].read_bytes())
    with serving(index):
        only_this_index(monkeypatch, f"{index.url}/simple", tmp_path)
        fetch("0.26.0", tmp_path / "vllm-0.26.0", trust_ranges=True)
    assert len(index.seen) >= 3
    assert looked_up == ["127.0.0.1"]


def test_a_cert_setting_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    only_this_index(monkeypatch, "https://index.invalid/simple", tmp_path)
    monkeypatch.setenv("PIP_CERT", str(tmp_path / "missing.pem"))
    result = run_cli("fetch", "0.26.0", "--dest", str(tmp_path / "d" / "v"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.startswith(f"patchkit: error: fetch: pip's cert {tmp_path}/missing.pem")
    assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "d" / "v").exists()
