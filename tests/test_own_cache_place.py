"""patchkit's own cache is where PATCHKIT_CACHE_DIR, or the XDG spec, puts it: never the
working directory.

An empty XDG_CACHE_HOME (set so by images and scripts) made the cache ``./patchkit``
of whatever directory patchkit ran in: fetch wrote its trees there, and handed out a
tree found there as the pristine release. Empty and relative values are ignored, as
the spec says, and the cache is ~/.cache/patchkit.
"""

from __future__ import annotations

import pytest

from tests.conftest import copy_tree, run_subprocess


@pytest.mark.parametrize("xdg", ["", "relative/cache"])
def test_an_empty_or_relative_xdg_cache_home_is_ignored(tmp_path, xdg):
    """The real 0.26.0 tree, fetched earlier into ~/.cache/patchkit, is the one fetch
    gives; the working directory stays empty (the index is unreachable: a fetch that
    looked elsewhere fails)."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    cached = copy_tree("0.26.0", home / ".cache" / "patchkit" / "trees" / "vllm-0.26.0")
    env = {
        "HOME": str(home),
        "XDG_CACHE_HOME": xdg,
        "PATCHKIT_CACHE_DIR": None,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_CONFIG_FILE": "/dev/null",
    }
    done = run_subprocess("fetch", "0.26.0", env=env, cwd=work)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(cached)
    assert list(work.iterdir()) == []
