"""ratchet: durable RL post-training of language models.

The training loop is a Temporal workflow; rollout, reward and training run in Ray actors;
batches and models live in object storage. `ratchet.Client` submits and follows runs.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ratchet.platform.client import Client, RunHandle


def __getattr__(name: str):
    # Lazy, so that `import ratchet.types` inside the Temporal sandbox stays light.
    if name in ("Client", "RunHandle"):
        from ratchet.platform import client

        return getattr(client, name)
    raise AttributeError(f"module 'ratchet' has no attribute {name!r}")


__all__ = ["Client", "RunHandle", "__version__"]
