"""transformers, imported without what ratchet does not use of it: scikit-learn and
SciPy, and the model registry where only a tokenizer is wanted.

transformers imports scikit-learn (for assisted generation's candidate selection) and
SciPy's optimizers (for object-detection losses, pulled in with every model class)
whenever they are installed, and MLflow installs both; ratchet's language models use
neither. That is about 1.5-2 s of CPU in every process that loads a tokenizer or a
model: each actor at start-up (every run starts three or more), the config check at
submit. `hide_sklearn_and_scipy()` tells transformers they are absent; call it before the
process's first `from transformers import ...`. Both stay importable for a user's own
code (a reward function may use them).

`load_tokenizer(folder)` gives what `AutoTokenizer.from_pretrained(folder)` gives. For a
folder whose tokenizer_config.json names the generic `tokenizers`-backed class (what
`tokenizers` saves, and the demo and test models), it builds that class directly: the
same object, without importing transformers' auto-model registry (AutoTokenizer imports
it with every model's configuration and generation utilities: about 2 CPU-s, for a
reward actor or a config check that only decodes or counts tokens). Any other class goes
through AutoTokenizer, so a model's own tokenizer class is never replaced.

transformers also maps every import name to its distribution when it is first imported
(`importlib.metadata.packages_distributions()`), reading the file list of every installed
distribution: 0.5-0.7 CPU-s with the ~260 a full install has, in every process that imports
it. `hide_sklearn_and_scipy()` makes that first import with the mapping kept in the user's
cache folder (`installed_packages.py`), computed once per set of installed packages.
"""

from __future__ import annotations

import json
from pathlib import Path

_CHECKS = ("is_sklearn_available", "is_scipy_available")


def hide_sklearn_and_scipy() -> None:
    from ratchet.installed_packages import cached_packages_distributions

    with cached_packages_distributions():  # the first import of transformers reads the mapping
        from transformers import utils as hf_utils
        from transformers.utils import import_utils as hf_imports

    for check in _CHECKS:
        if hasattr(hf_imports, check):  # a transformers without the check: nothing to hide
            setattr(hf_utils, check, _absent)
            setattr(hf_imports, check, _absent)


def _absent() -> bool:
    return False


# tokenizer_config.json's `tokenizer_class` values that mean transformers' generic fast
# tokenizer (TokenizersBackend since transformers 5, PreTrainedTokenizerFast its old name).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(folder: str | Path):
    """`AutoTokenizer.from_pretrained(folder)`, without the model registry when
    the folder's tokenizer is the generic one (see the module docstring)."""
    hide_sklearn_and_scipy()
    if _tokenizer_class(Path(folder)) in _GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _tokenizer_class(folder: Path) -> str | None:
    """The class tokenizer_config.json names, or None (no such file, unreadable, not saved
    with a tokenizer.json: AutoTokenizer decides then)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not (folder / "tokenizer.json").is_file():
        return None
    return config.get("tokenizer_class")
