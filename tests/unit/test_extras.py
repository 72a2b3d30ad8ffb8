"""Optional features are extras (src/ratchet/extras.py, pyproject.toml): the core imports
and runs without them, and a feature asked for without its packages is refused naming the
field (or command) and the extra to install.

Absence is real where it matters: each check runs in a process of its own in which the
extras' packages cannot be imported (`sys.modules[name] = None` makes `import name` raise
ImportError and `importlib.util.find_spec(name)` answer None, as for a package that is not
installed), since this virtualenv has them all installed (`make venv` installs `[all]`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from ratchet.extras import EXTRAS

REPO = Path(__file__).resolve().parents[2]
OPTIONAL = sorted({m for e in EXTRAS.values() for m in e.modules})


def _without_extras(code: str) -> dict:
    """Run `code` (it prints one JSON line last) where no extra's package imports."""
    blocked = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in OPTIONAL)
    out = subprocess.run([sys.executable, "-c", blocked + textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pins(deps: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ]", d, maxsplit=1)[0].lower() for d in deps}


def test_pyproject_declares_each_extra_and_the_core_needs_none():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    distributions = {"sqlalchemy", "alembic", "optuna", "mlflow", "wandb", "matplotlib", "peft"}
    assert not _pins(project["dependencies"]) & distributions, "an optional package is a core dependency"
    for name in EXTRAS:
        assert name in optional, f"extras.py names extra {name!r}, pyproject.toml does not declare it"
    assert optional["all"] == [f"ratchet-rl[{','.join(n for n in optional if n in EXTRAS)}]"], "the `all` extra must name every extra"
    assert "all" in (REPO / "Makefile").read_text().split("EXTRAS := ", 1)[1].splitlines()[0], "make venv must install [all]"


def test_the_core_imports_and_a_plain_config_checks_without_any_extra(tmp_path):
    seen = _without_extras(
        """
        import json
        import ratchet.workers.trainer, ratchet.workers.rollout, ratchet.workers.reward, ratchet.workers.critic
        import ratchet.activities.training, ratchet.activities.sweep_trials, ratchet.platform.worker, ratchet.platform.cli
        import ratchet.workflows.training, ratchet.workflows.sweep
        from ratchet.activities.registry_calls import registry
        from ratchet.config import load_config
        from ratchet.platform.client import RECIPE_PATH

        cfg = load_config(RECIPE_PATH, ["model.path=m", "data.train_files=d.parquet", "tracking.mlflow=false"], check_files=False)
        print(json.dumps({"registry": registry(), "mlflow": cfg.tracking.mlflow}))
        """
    )
    assert seen == {"registry": None, "mlflow": False}  # no registry extra: not written, nothing fails


def test_a_feature_without_its_extra_is_refused_at_submit_naming_the_field_and_the_extra(tiny_model, tmp_path):
    from ratchet.tasks.generate import write_task_parquet

    data = write_task_parquet(tmp_path / "d.parquet", "copy", 64, seed=0)
    seen = _without_extras(
        f"""
        import json
        from ratchet.config import ConfigError, load_config
        from ratchet.platform.client import RECIPE_PATH

        base = ["model.path={tiny_model}", "data.train_files={data}", "data.eval_files=null"]
        try:
            load_config(RECIPE_PATH, base + ["tracking.wandb.enabled=true", "trainer.lora.rank=8"])
        except ConfigError as exc:
            print(json.dumps(dict(exc.issues)))
        """
    )
    assert set(seen) == {"tracking.mlflow", "tracking.wandb.enabled", "trainer.lora.rank"}, seen
    assert "pip install 'ratchet-rl[mlflow]'" in seen["tracking.mlflow"] and "set it false" in seen["tracking.mlflow"]
    assert "pip install 'ratchet-rl[wandb]'" in seen["tracking.wandb.enabled"]
    assert "pip install 'ratchet-rl[lora]'" in seen["trainer.lora.rank"] and "peft" in seen["trainer.lora.rank"]


def test_a_worker_without_the_extra_fails_the_run_naming_it_and_a_command_says_so():
    """Where only the worker lacks it (the client checked in another environment): the
    tracker's builder and LoRA raise MissingExtra, which the workflow does not retry; a
    CLI command that needs an extra exits 2 with the message."""
    seen = _without_extras(
        """
        import json
        from pathlib import Path
        from types import SimpleNamespace
        from ratchet.errors import NON_RETRYABLE, MissingExtra
        from ratchet.catalog.trackers import TRACKERS
        from ratchet.platform.cli_errors import explain

        try:
            TRACKERS.get("mlflow").builder()(SimpleNamespace(mlflow_uri=None))
        except MissingExtra as exc:
            tracker = str(exc)
        from ratchet.workers.lora import wrap
        try:
            wrap(None, None)
        except MissingExtra as exc:
            lora = str(exc)
        from ratchet.extras import require
        try:
            require("plots")
        except MissingExtra as exc:
            said = explain(exc)
        from ratchet.config.sweep_spec import SweepSpecError, compile_sweep, load_sweep_spec
        try:
            import ratchet

            compile_sweep(load_sweep_spec(Path(ratchet.__file__).parents[2] / "examples" / "sweep_copy.yaml")[0])
        except SweepSpecError as exc:
            sweep = dict(exc.issues)
        print(json.dumps({"tracker": tracker, "lora": lora, "cli": said, "sweep": sweep, "retried": "MissingExtra" not in NON_RETRYABLE}))
        """
    )
    assert "tracking.mlflow" in seen["tracker"] and "ratchet-rl[mlflow]" in seen["tracker"]
    assert "trainer.lora.rank > 0" in seen["lora"] and "ratchet-rl[lora]" in seen["lora"]
    assert seen["cli"][1] == 2 and "ratchet-rl[plots]" in seen["cli"][0] and "matplotlib" in seen["cli"][0]
    assert list(seen["sweep"]) == ["(sweep)"] and "ratchet-rl[sweeps]" in seen["sweep"]["(sweep)"] and "optuna" in seen["sweep"]["(sweep)"]
    assert seen["retried"] is False
