"""wandb as a tracker: off unless `tracking.wandb.enabled`, offline unless
`tracking.wandb.mode=online`.

The wandb run id is the ratchet run id and `resume="allow"`, so a later process continues
the same wandb run (online: wandb appends to it; offline: each process writes its own run
folder under the same id, and `wandb sync` merges them into one run). Sweep trials share
`group` = the sweep id. The mode is passed to `wandb.init` explicitly, so a stray
`WANDB_MODE` cannot turn an offline run online.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from ratchet.private_paths import make_private_dirs

from .base import RunInfo
from .uris import WANDB_DIR, state_dir

if TYPE_CHECKING:
    from ratchet.config.schema import TrackingConfig

log = logging.getLogger(__name__)


def from_config(tracking: "TrackingConfig") -> "WandbTracker":
    """The catalog's builder (ratchet/catalog/trackers.py): the `tracking.wandb` section."""
    from ratchet.extras import require

    require("wandb", "tracking.wandb.enabled")
    w = tracking.wandb
    return WandbTracker(mode=w.mode, project=w.project, entity=w.entity, dir=w.dir)


class WandbTracker:
    name = "wandb"
    saves_last_step = True

    def __init__(
        self,
        *,
        mode: Literal["offline", "online"] = "offline",
        project: str | None = None,
        entity: str | None = None,
        dir: str | None = None,
    ):
        if mode not in ("offline", "online"):
            raise ValueError(f"tracking.wandb.mode must be offline or online, got {mode!r}")
        self.mode, self.project, self.entity = mode, project, entity
        self.dir = Path(dir) if dir else state_dir() / WANDB_DIR
        self.run: Any = None  # the wandb Run, once started
        self._last_step: int | None = None

    def start_or_continue(self, run: RunInfo, saved: Mapping[str, Any]) -> dict[str, Any]:
        import wandb

        make_private_dirs(self.dir)  # offline runs keep every logged value here
        settings = wandb.Settings(silent=True, console="off", save_code=False, disable_git=True, x_disable_stats=True)
        self.run = wandb.init(
            project=self.project or run.experiment,
            entity=self.entity,
            id=run.run_id,
            name=run.run_id,
            resume="allow",
            group=run.lineage.sweep_id,
            job_type="trial" if run.lineage.sweep_id else "train",
            tags=list(run.tags)[:64] or None,
            notes=f"ratchet run {run.run_id} ({run.run_uri})",
            dir=str(self.dir),
            mode=self.mode,
            reinit="create_new",  # several runs in one worker process, each its own
            settings=settings,
        )
        self.run.config.update(run.labels(), allow_val_change=True)
        # Offline, wandb cannot tell how far the run got in another process: the last
        # step this tracker logged is kept in tracking.json.
        self._last_step = saved.get("last_step")
        return {"id": run.run_id, "mode": self.mode, "project": self.project or run.experiment, "last_step": self._last_step}

    def last_step(self) -> int | None:
        return self._last_step

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_step(self, step: int, metrics: Mapping[str, float], time_unix: float | None = None) -> None:
        self.run.log(dict(metrics), step=step)
        self._last_step = step

    def log_summary(self, summary: Mapping[str, float]) -> None:
        self.run.summary.update(dict(summary))

    def close(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
