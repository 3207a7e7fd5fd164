"""The package index settings pip would use for ``pip download``, read the way pip reads them.

fetch finds a wheel where ``pip download`` would, without starting pip (its
start-up alone is a large part of a range fetch): the index URL, the extra
index URLs, find-links, no-index, the proxy, the CA bundle and the timeout
come from pip's configuration files and its ``PIP_*`` environment
variables, with pip's precedence:

* files, later overriding earlier: the global ones (``$XDG_CONFIG_DIRS``'s
  ``pip/pip.conf``, then ``/etc/pip.conf``), the user's (``~/.pip/pip.conf``,
  then ``$XDG_CONFIG_HOME/pip/pip.conf``), the site's (``sys.prefix/pip.conf``),
  then ``$PIP_CONFIG_FILE`` (which, set to ``os.devnull``, turns every file off);
* in the merged result, ``[global]`` then ``[download]`` (the command's own
  section wins), then ``PIP_<NAME>`` variables over both.

Credentials in an index URL and ``~/.netrc`` (or ``$NETRC``) are the
transport's business; proxies from the environment too (``http_proxy``,
``https_proxy``, ``no_proxy``), with pip's ``proxy`` setting over them.
"""

from __future__ import annotations

import configparser
import math
import os
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.codes import Code
from patchkit.errors import PatchkitError
from patchkit.fs.files import read_regular

PYPI = "https://pypi.org/simple"
COMMAND = "download"
LIST_KEYS = ("extra-index-url", "find-links")
TRUE = ("1", "true", "yes", "y", "on")
FALSE = ("0", "false", "no", "n", "off")
MAX_CONFIG_BYTES = 1 << 20  # a pip.conf is a few lines


@dataclass(frozen=True)
class PipSettings:
    """What fetch takes from pip's configuration."""

    index_url: str = PYPI
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    no_index: bool = False
    proxy: str | None = None
    cert: str | None = None
    timeout: float = 15.0
    sources: tuple[str, ...] = field(default=(), compare=False)  # the files read, for messages

    @property
    def index_urls(self) -> tuple[str, ...]:
        """The indexes pip asks, in its order (none with no-index)."""
        return () if self.no_index else (self.index_url, *self.extra_index_urls)


def pip_settings(environ: dict[str, str] | None = None) -> PipSettings:
    """The settings ``pip download`` would run with in this environment."""
    env = os.environ if environ is None else environ
    files = config_files(env)
    merged: dict[str, str] = {}
    read = []
    for path in files:
        values = _read_file(path)
        if values is not None:
            merged.update(values)
            read.append(str(path))
    options: dict[str, str] = {}
    for section in ("global", COMMAND):
        for key, value in merged.items():
            if key.startswith(f"{section}."):
                options[key.split(".", 1)[1]] = value
    for name, value in env.items():
        if name.startswith("PIP_") and name != "PIP_CONFIG_FILE":
            options[_normal(name[4:])] = value
    return _settings(options, tuple(read))


def config_files(env) -> list[Path]:
    """pip's configuration files on this machine, lowest precedence first."""
    explicit = env.get("PIP_CONFIG_FILE")
    if explicit == os.devnull:
        return []
    xdg_dirs = env.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    files = [Path(d) / "pip" / "pip.conf" for d in xdg_dirs.split(os.pathsep) if d]
    files.append(Path("/etc/pip.conf"))
    home = Path(env.get("HOME") or Path.home())
    files.append(home / ".pip" / "pip.conf")
    files.append(Path(env.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf")
    files.append(Path(sys.prefix) / "pip.conf")
    if explicit:
        files.append(Path(explicit))
    return files


class PipConfigInvalid(PatchkitError):
    """pip's configuration (a file, or a ``PIP_*`` variable) that fetch cannot use: the
    file's ``path`` and the ``error``, or the setting's ``key`` and ``value`` (a URL that
    may hold a password is not given)."""

    code = Code.PIP_CONFIG_INVALID


def _read_file(path: Path) -> dict[str, str] | None:
    """``section.key`` -> value of one file; None when it is not there (or a directory,
    which pip skips too).

    Read as :func:`patchkit.fs.files.read_regular` reads a file: a FIFO, a device
    (``PIP_CONFIG_FILE=/dev/zero``) or a file over MAX_CONFIG_BYTES is refused
    in one line, never waited on or read without end.
    """
    parser = configparser.RawConfigParser()
    try:
        text = read_regular(path, MAX_CONFIG_BYTES).decode("utf-8")
        parser.read_string(text, source=str(path))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as exc:
        raise PipConfigInvalid(
            f"fetch: pip's configuration {path} cannot be read: {exc.strerror}",
            path=path,
            error=exc.strerror,
        ) from None
    except (
        ValueError,
        configparser.Error,
    ) as exc:  # not a regular file, too large, UnicodeDecodeError, syntax
        raise PipConfigInvalid(
            f"fetch: pip's configuration {path} cannot be read: {_one_line(exc)}",
            path=path,
            error=_one_line(exc),
        ) from None
    return {
        f"{section}.{_normal(key)}": value
        for section in parser.sections()
        for key, value in parser.items(section)
    }


def _one_line(exc: Exception) -> str:
    """An error's text as one line of at most 200 characters (configparser's list
    every bad line of the file on lines of their own)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _normal(key: str) -> str:
    return key.lower().replace("_", "-").lstrip("-")


def _settings(options: dict[str, str], sources: tuple[str, ...]) -> PipSettings:
    def listed(key: str) -> tuple[str, ...]:
        return tuple(_url(u, key) for u in options.get(key, "").split())

    def one(key: str) -> str | None:
        return _url((options.get(key) or "").strip(), key) or None

    return PipSettings(
        index_url=one("index-url") or PYPI,
        extra_index_urls=listed("extra-index-url"),
        find_links=listed("find-links"),
        no_index=_flag(options.get("no-index"), "no-index"),
        proxy=one("proxy"),
        cert=(options.get("cert") or "").strip() or None,
        timeout=_timeout(options),
        sources=sources,
    )


def _url(value: str, key: str) -> str:
    """``value`` if it is no URL (a find-links path) or a URL whose parts can be told apart.

    A password holding an unescaped '#', '/', '?' or '@' ends the host part early: the
    rest of the password becomes a port (ValueError, which was exit 3) or the path (sent
    to a host named after the user, and shown in messages). Such a URL is refused without
    showing it, since it holds a password.
    """
    if "://" not in value:
        return value
    try:
        parts = urllib.parse.urlsplit(value)  # raises for a '[' host that is no IPv6 address
        parts.port  # noqa: B018 (it raises for a port that is no number)
        broken = "@" not in parts.netloc and "@" in value.split("://", 1)[1]
    except ValueError:
        broken = True
    if broken:
        raise PipConfigInvalid(
            f"fetch: pip's {key} setting is not a URL fetch can read (not shown: it may hold "
            "a password); in a password, write '#' as %23, '/' as %2F, '?' as %3F, '@' as %40",
            key=key,
        )
    return value


def _flag(value: str | None, key: str) -> bool:
    if value is None or value.strip() == "":
        return False
    word = value.strip().lower()
    if word in TRUE or (word.isdigit() and int(word) > 0):
        return True
    if word in FALSE:
        return False
    raise PipConfigInvalid(
        f"fetch: pip's {key} setting {value[:40]!r} is not true or false", key=key, value=value
    )


def _timeout(options: dict[str, str]) -> float:
    """pip's default-timeout (``PIP_DEFAULT_TIMEOUT``) or timeout, in seconds, 1 to 3600.

    float() reads 'nan' and 'inf', and min(max(nan, 1), 3600) is nan: a socket
    timeout nothing compares with. A value that is not a finite number is
    refused in one line naming the setting.
    """
    key = "default-timeout" if options.get("default-timeout") else "timeout"
    value = options.get(key)
    if not value:
        return 15.0  # pip's default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise PipConfigInvalid(
            f"fetch: pip's {key} setting {value[:40]!r} is not a number of seconds "
            f"(PIP_{key.upper().replace('-', '_')} or {key} in pip's configuration)",
            key=key,
            value=value,
        )
    return min(max(seconds, 1.0), 3600.0)
