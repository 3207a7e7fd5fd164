"""Which wheel ``pip download vllm==VERSION`` would take, and where it is.

pip's rules, for the wheels fetch wants (CPython 3.12 on x86_64 Linux, no
sdist): the candidates are the find-links locations' files, then each
index's project page (``INDEX/vllm/``, PEP 691 JSON where the index offers
it, else PEP 503 HTML), in that order; of those named ``vllm`` at exactly
VERSION (or VERSION+local, as ``==`` admits), whose tags fit and whose
Requires-Python admits 3.12, a non-yanked one beats a yanked one, then the
higher version, then the better tag (pip's order of supported tags), then
the first found. An index without the project
(404) is skipped, as pip skips it.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from patchkit.fs.files import read_regular
from patchkit.releases.pipconfig import PipSettings
from patchkit.releases.transport import (
    FetchError,
    Transport,
    WheelNotFound,
    host_of,
    without_credentials,
)

PROJECT = "vllm"
PYTHON = (3, 12)
# vLLM wheels are cp38-abi3 manylinux x86_64; 0.21.0 is tagged manylinux_2_39.
PLATFORMS = ["manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)
]
SHA256 = re.compile(r"[0-9a-fA-F]{64}")
MAX_PAGE = 64 << 20  # PyPI's vllm page is 0.13 MB as JSON; torch's is a few MB
ACCEPT = (
    "application/vnd.pypi.simple.v1+json, "
    "application/vnd.pypi.simple.v1+html; q=0.1, text/html; q=0.01"
)


@dataclass(frozen=True)
class WheelLink:
    filename: str
    url: str  # http(s) or file
    sha256: str | None
    size: int | None
    yanked: bool
    rank: int  # the best of its tags in pip's order (lower is better)
    version: Version | None = None  # 0.26.0, or 0.26.0+cu129 which ==0.26.0 admits too

    @property
    def is_local(self) -> bool:
        return urllib.parse.urlsplit(self.url).scheme == "file"

    @property
    def host(self) -> str:
        return host_of(self.url)


def supported_tags() -> list[Tag]:
    """What pip supports with --python-version 3.12 --implementation cp --platform ... ."""
    platforms = []
    for platform in PLATFORMS:
        if platform.startswith("manylinux2014_"):
            arch = platform.split("_", 1)[1]
            platforms += [platform, f"manylinux2010_{arch}", f"manylinux1_{arch}"]
        else:
            platforms.append(platform)
    tags = list(cpython_tags(PYTHON, platforms=platforms))
    return tags + list(compatible_tags(PYTHON, f"cp{PYTHON[0]}{PYTHON[1]}", platforms))


def find_wheel(version: str, settings: PipSettings, transport: Transport) -> WheelLink:
    """The wheel pip would download; a one-line error naming the indexes when there is none."""
    wanted = SpecifierSet(f"=={Version(version)}")  # as pip reads vllm==VERSION: +local too
    found = _candidates(wanted, settings, transport)
    if not found:
        raise WheelNotFound(
            f"fetch: no wheel of vllm=={version} for CPython 3.12 on x86_64 Linux "
            f"at {where(settings)}",
            version=version,
        )
    # pip's order: not yanked, then the higher version (a +local one), then the better tag;
    # max keeps the first of equals
    return max(found, key=lambda link: (not link.yanked, link.version, -link.rank))


def wheels(settings: PipSettings, transport: Transport) -> list[WheelLink]:
    """Every wheel of vllm, of any version (pre-releases and yanked ones too), that fetch
    could take from the places pip is configured with, in the order found: what
    ``find_wheel`` chooses among, for every release at once."""
    return _candidates(SpecifierSet(), settings, transport)


def where(settings: PipSettings) -> str:
    """The places pip looks, for a message: find-links, then the indexes, no credentials."""
    places = [*settings.find_links, *settings.index_urls]
    return ", ".join(without_credentials(p) for p in places) or "no index (no-index is set)"


def _candidates(wanted: SpecifierSet, settings: PipSettings, transport: Transport):
    ranks = {tag: n for n, tag in enumerate(supported_tags())}
    found: list[WheelLink] = []
    for location in settings.find_links:
        found += _fitting(_links_at(location, transport), wanted, ranks)
    for index in settings.index_urls:
        found += _fitting(_project_page(index, transport), wanted, ranks)
    return found


def _fitting(links, version: SpecifierSet, ranks: dict[Tag, int]) -> list[WheelLink]:
    out = []
    for filename, url, sha256, size, requires, yanked in links:
        try:
            name, found, _, tags = parse_wheel_filename(filename)
        except (InvalidWheelFilename, InvalidVersion):
            continue
        if canonicalize_name(name) != PROJECT or not version.contains(found, prereleases=True):
            continue
        sha256, requires = _checked(filename, url, sha256, requires)
        rank = min((ranks[t] for t in tags if t in ranks), default=None)
        if rank is None or not _admits(requires):
            continue
        out.append(WheelLink(filename, url, sha256, size, yanked, rank, found))
    return out


def _admits(requires: str | None) -> bool:
    if not requires:
        return True
    try:
        return SpecifierSet(requires).contains(".".join(map(str, PYTHON)), prereleases=True)
    except InvalidSpecifier:
        return True  # pip ignores a Requires-Python it cannot parse


def _project_page(index: str, transport: Transport):
    url = index.rstrip("/") + f"/{PROJECT}/"
    if urllib.parse.urlsplit(index).scheme == "file" or "://" not in index:
        return _local_page(url)
    page = transport.page(url, MAX_PAGE, ACCEPT)
    if page is None:
        return []
    base = page.url
    if "json" in page.content_type.lower():
        return _json_links(page.body, base, url)
    return _html_links(page.body, base)


def _links_at(location: str, transport: Transport):
    """find-links: a local directory (or file: URL of one) lists its files; a URL is a page."""
    if "://" in location and urllib.parse.urlsplit(location).scheme != "file":
        page = transport.page(location, MAX_PAGE, "text/html")
        return [] if page is None else _html_links(page.body, page.url)
    path = Path(_local_path(location))
    if path.is_dir():
        return [(p.name, p.as_uri(), None, None, None, False) for p in sorted(path.iterdir())]
    if path.is_file() and path.name.endswith(".whl"):
        return [(path.name, path.as_uri(), None, None, None, False)]
    if path.is_file():
        try:
            return _html_links(_read_page(path), path.as_uri())
        except OSError as exc:
            raise FetchError(
                f"fetch: cannot read find-links {path}: {exc.strerror}", path=path
            ) from None
    return []


def _local_path(location: str) -> str:
    if location.startswith("file:"):
        return urllib.parse.unquote(urllib.parse.urlsplit(location).path)
    return os.path.expanduser(location)


def _local_page(url: str):
    page = Path(_local_path(url)) / "index.html"
    try:
        return _html_links(_read_page(page), page.as_uri())
    except OSError:
        return []


def _read_page(path: Path) -> bytes:
    """A local index or find-links page, read as fs.files.read_regular reads a file: a FIFO or a
    device is refused in one line (it hung, or was read until memory ran out), as is a
    page over MAX_PAGE (an index's page over the network is held to the same bound)."""
    try:
        return read_regular(path, MAX_PAGE)
    except ValueError as exc:
        raise FetchError(f"fetch: cannot read {path}: {exc}", path=path) from None


def _json_links(body: bytes, base: str, url: str):
    try:
        files = json.loads(body).get("files", [])
        links = []
        for entry in files:
            yanked = entry.get("yanked", False)
            links.append(
                (
                    str(entry["filename"]),
                    urllib.parse.urljoin(base, str(entry["url"])),
                    (entry.get("hashes") or {}).get("sha256"),
                    entry.get("size") if isinstance(entry.get("size"), int) else None,
                    entry.get("requires-python"),
                    bool(yanked),
                )
            )
        return links
    except (ValueError, AttributeError, KeyError, TypeError, RecursionError):
        raise FetchError(
            f"fetch: {host_of(url)}'s page for {PROJECT} is not the JSON simple API",
            host=host_of(url),
        ) from None


def _checked(filename: str, url: str, sha256, requires) -> tuple[str | None, str | None]:
    """A candidate's sha256 (64 hex digits or none) and Requires-Python (a string or none),
    as the index gave them; anything else is one line naming the file, never taken as
    'no hash' (the check it stands for would silently go)."""
    if sha256 is not None and not (isinstance(sha256, str) and SHA256.fullmatch(sha256)):
        raise FetchError(
            f"fetch: {host_of(url)} gives {filename[:120]} a sha256 that is not 64 hex "
            f"digits: {str(sha256)[:80]!r}",
            host=host_of(url),
        )
    if requires is not None and not isinstance(requires, str):
        raise FetchError(
            f"fetch: {host_of(url)} gives {filename[:120]} a requires-python that is not "
            f"a string: {str(requires)[:40]!r}",
            host=host_of(url),
        )
    return (sha256.lower() if sha256 else None), requires


def _html_links(body: bytes, base: str):
    parser = _Anchors()
    parser.feed(body.decode("utf-8", errors="replace"))
    links = []
    for href, attrs in parser.anchors:
        url = urllib.parse.urljoin(base, href)
        parts = urllib.parse.urlsplit(url)
        filename = urllib.parse.unquote(parts.path.rsplit("/", 1)[-1])
        algorithm, _, digest = parts.fragment.partition("=")
        links.append(
            (
                filename,
                urllib.parse.urlunsplit(parts._replace(fragment="")),
                digest if algorithm == "sha256" else None,
                None,
                attrs.get("data-requires-python"),
                "data-yanked" in attrs,
            )
        )
    return links


class _Anchors(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.anchors: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            values = {k: (v or "") for k, v in attrs}
            if values.get("href"):
                self.anchors.append((values["href"], values))
