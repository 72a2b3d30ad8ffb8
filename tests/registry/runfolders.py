"""Tiny run folders as ratchet writes them (config.json, metrics.jsonl, committed
checkpoints, a final model manifest), for the registry tests: no Ray, no torch."""

from __future__ import annotations

from pathlib import Path

from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from tests.configs import make_cfg


def stored_config(root: Path, **sections) -> dict:
    """A validated run config as prepare_run stores it, with storage.root = `root`; no
    MLflow tracker unless a test asks (it takes seconds to open its store)."""
    sections.setdefault("storage", {})["root"] = str(root)
    sections["tracking"] = {"mlflow": False, **sections.get("tracking", {})}
    return make_cfg("/models/tiny", **sections).model_dump(mode="json")


def write_run(
    root: Path,
    run_id: str,
    *,
    rewards: list[float],
    evals: dict[int, float] | None = None,
    checkpoints: tuple[int, ...] = (),
    final: bool = False,
    **sections,
) -> ObjectStore:
    run = ObjectStore(str(root)).child(run_id)
    run.put_json(RunLayout.CONFIG, stored_config(root, **sections))
    log = MetricsLog(run)
    for step, reward in enumerate(rewards):
        line = {"reward_mean": reward, "kl": 0.01 * step}
        if evals and step in evals:
            line["eval_reward"] = evals[step]
        log.write(step, line)
    for step in checkpoints:
        local = root.parent / f"ckpt-{run_id}-{step}"
        (local / "trainer").mkdir(parents=True, exist_ok=True)
        (local / "trainer" / "state.bin").write_bytes(b"x" * 16)
        CheckpointStore(run).commit(RunLayout.checkpoint_name(step), local, {"step": step, "policy_version": step})
    if final:
        run.put_json(f"{RunLayout.FINAL_MODEL}/{RunLayout.MODEL_MANIFEST}", {"files": {}})
    return run
