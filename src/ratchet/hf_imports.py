"""transformers, imported without the scikit-learn and SciPy it does not need here.

transformers imports scikit-learn (for assisted generation's candidate selection) and
SciPy's optimizers (for object-detection losses, pulled in with every model class)
whenever they are installed, and MLflow installs both; ratchet's language models use
neither. That is about 1.5-2 s of CPU in every process that loads a tokenizer or a
model: each actor at start-up (every run starts three or more), the config check at
submit. `hide_sklearn_and_scipy()` tells transformers they are absent; call it before the
process's first `from transformers import ...`. Both stay importable for a user's own
code (a reward function may use them).
"""

from __future__ import annotations

_CHECKS = ("is_sklearn_available", "is_scipy_available")


def hide_sklearn_and_scipy() -> None:
    from transformers import utils as hf_utils
    from transformers.utils import import_utils as hf_imports

    for check in _CHECKS:
        if hasattr(hf_imports, check):  # a transformers without the check: nothing to hide
            setattr(hf_utils, check, _absent)
            setattr(hf_imports, check, _absent)


def _absent() -> bool:
    return False
