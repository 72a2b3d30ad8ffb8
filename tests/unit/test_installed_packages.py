"""The mapping of import names to distributions that transformers reads at its first
import, kept in the user's cache folder (src/ratchet/installed_packages.py): the same as
Python's, read back while nothing was installed, computed afresh after an install, and a
broken cache file only costs a recomputation."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from ratchet import installed_packages


@pytest.fixture(scope="module")
def pythons() -> dict:
    """Python's own mapping, computed once here (0.5-0.7 CPU-s a call)."""
    return dict(importlib.metadata.packages_distributions())


@pytest.fixture
def computed(monkeypatch, pythons) -> list:
    """Each computation of the mapping, recorded (it returns Python's, computed once above)."""
    calls: list[int] = []

    def compute():
        calls.append(1)
        return pythons

    monkeypatch.setattr(installed_packages, "_original_packages_distributions", compute)
    return calls


def test_the_cached_mapping_is_pythons_and_is_read_back(tmp_path, pythons, computed):
    assert installed_packages.packages_distributions(tmp_path) == pythons
    [written] = tmp_path.glob("packages-distributions-*.json")
    assert installed_packages.packages_distributions(tmp_path) == pythons
    assert len(computed) == 1, "computed again although nothing was installed"
    assert list(tmp_path.glob("*.json")) == [written]


def test_an_install_makes_a_new_mapping(tmp_path, monkeypatch):
    """Python's function itself here: the new distribution must be in what it computes."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    installed_packages.packages_distributions(tmp_path / "cache")
    info = site / "ratchet_probe-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ratchet-probe\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("ratchet_probe_pkg\n")
    os.utime(site, ns=(1, 1))  # a time the first call cannot have seen, however coarse the clock
    after = installed_packages.packages_distributions(tmp_path / "cache")
    assert after["ratchet_probe_pkg"] == ["ratchet-probe"]
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2


def test_a_broken_cache_file_is_computed_again(tmp_path, pythons, computed):
    installed_packages.packages_distributions(tmp_path)
    [written] = tmp_path.glob("packages-distributions-*.json")
    for content in ("{not json", '{"torch": "not a list"}', "[]"):
        written.write_text(content)
        before = len(computed)
        assert installed_packages.packages_distributions(tmp_path) == pythons, content
        assert len(computed) == before + 1 and json.loads(written.read_text()) == pythons, content


@pytest.mark.slow
def test_transformers_imported_through_the_cache_has_the_real_mapping(tmp_path):
    """A fresh process, as an actor's: transformers' own mapping equals Python's, the cache
    file was written, and the standard function is back afterwards."""
    probe = (
        "import importlib.metadata as md, json\n"
        "original = md.packages_distributions\n"
        "from ratchet.hf_imports import hide_sklearn_and_scipy\n"
        "hide_sklearn_and_scipy()\n"
        "from transformers.utils import import_utils\n"
        "assert md.packages_distributions is original\n"
        "print(json.dumps(import_utils.PACKAGE_DISTRIBUTION_MAPPING == md.packages_distributions()))\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "true"
    assert len(list((tmp_path / "ratchet").glob("packages-distributions-*.json"))) == 1
