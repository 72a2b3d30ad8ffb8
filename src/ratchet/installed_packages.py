"""`importlib.metadata.packages_distributions()`, computed once per set of installed packages.

transformers calls it when first imported, to map import names to distributions; Python
computes it by reading the file list of every installed distribution: 0.5-0.7 CPU-s with
the ~260 distributions a full install has, in every process that imports transformers
(every actor start, a CLI command that checks a dataset). The mapping changes only when a
package is installed or removed, which changes the modification time of the folder holding
its `.dist-info`: so it is kept as JSON in the user's cache folder, under a name made from
those folders and their times, and computed afresh whenever one of them changed. A cache
that cannot be read or written costs only the time it was meant to save.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

_METADATA_SUFFIXES = (".dist-info", ".egg-info")


def cache_folder() -> Path:
    """`$XDG_CACHE_HOME/ratchet`, or `~/.cache/ratchet`: the user's own, not a shared temp path."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ratchet"


def installed_state() -> list[tuple[str, int]]:
    """(folder, modification time in ns) of each import-path folder holding distribution
    metadata, in path order: an install or removal there changes its time."""
    state = []
    for entry in sys.path:
        folder = entry or "."  # "": the working folder
        try:
            with os.scandir(folder) as it:
                if any(e.name.endswith(_METADATA_SUFFIXES) for e in it):
                    state.append((os.path.abspath(folder), os.stat(folder).st_mtime_ns))
        except OSError:  # not a folder (a zip), or gone
            continue
    return state


def packages_distributions(folder: Path | None = None) -> Mapping[str, list[str]]:
    """What `importlib.metadata.packages_distributions()` returns, from the cache in `folder`
    (default `cache_folder()`) when one was written for the packages installed now."""
    state = installed_state()
    key = hashlib.sha256(json.dumps([sys.prefix, state]).encode()).hexdigest()[:20]
    path = (folder or cache_folder()) / f"packages-distributions-{key}.json"
    with contextlib.suppress(OSError, ValueError):
        cached = json.loads(path.read_text())
        if isinstance(cached, dict) and all(isinstance(v, list) for v in cached.values()):
            return cached
    mapping = _original_packages_distributions()
    with contextlib.suppress(OSError):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".packages-distributions-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(mapping, f)
        os.replace(tmp, path)  # whole or not at all: another process may read it now
    return mapping


_original_packages_distributions = importlib.metadata.packages_distributions


@contextlib.contextmanager
def cached_packages_distributions() -> Iterator[None]:
    """Within: `importlib.metadata.packages_distributions` answers from the cache (for an
    import that calls it); the standard function is back afterwards."""
    importlib.metadata.packages_distributions = packages_distributions  # type: ignore[assignment]
    try:
        yield
    finally:
        importlib.metadata.packages_distributions = _original_packages_distributions
