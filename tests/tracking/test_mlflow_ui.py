"""MLflow as the built-in dashboard, on the real platform (Temporal dev server, Ray, a
`ratchet worker` process): a short real run logs every step to the state folder's MLflow
store, the MLflow UI that `ratchet up` starts (services/mlflow_ui.py) serves it on
127.0.0.1, and headless Chromium renders the run's reward chart.

The screenshot is kept as a test artifact under $RATCHET_TEST_ARTIFACTS (default
`.ratchet/test-artifacts/`, git-ignored): `mlflow_ui_reward.png`.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from PIL import Image

from ratchet.platform.client import RECIPE_PATH
from ratchet.platform.services import ServiceSettings, free_ports, mlflow_ui_url, status
from ratchet.platform.services import mlflow_ui
from ratchet.tracking.uris import default_mlflow_uri
from tests.polling import wait_until

from tests.browser import CHROMIUM, artifacts_dir, chromium

pytestmark = pytest.mark.integration

STEPS = 6
FAST = ["warmup.steps=2", "loop.prompts_per_step=4", "rollout.n=4", "data.eval_size=16", "loop.eval_every=3", "resources.trainer_cpus=0.5"]


def metric_page(base: str, run_id: str, experiment_id: str, key: str) -> str:
    """The MLflow UI's page of one metric of one run (its route and query, as the UI's own
    links build them)."""
    q = {
        "runs": json.dumps([run_id]), "metric": json.dumps(key), "experiments": json.dumps([experiment_id]),
        "plot_metric_keys": json.dumps([key]), "plot_layout": "{}", "x_axis": "step", "y_axis_scale": "linear",
        "line_smoothness": "1", "show_point": "true", "deselected_curves": "[]", "last_linear_y_axis_range": "[]",
    }  # fmt: skip
    return f"{base}/#/metric?" + "&".join(f"{k}={urllib.parse.quote(v, safe='[]{},')}" for k, v in q.items())


def test_a_real_run_in_mlflow_and_its_ui(platform):
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed (Debian package chromium)")
    experiment = "mlflow-ui-test"
    handle = platform.client.submit(
        RECIPE_PATH,
        platform.overrides(
            f"loop.steps={STEPS}", *FAST, "tracking.mlflow=true", "tracking.name=mlflow-ui", f"tracking.experiment={experiment}"
        ),
    )
    summary = handle.result(timeout=600)
    lines = [json.loads(x) for x in (Path(summary.run_uri) / "metrics.jsonl").read_text().splitlines()]

    # The worker logged every step to the state folder's store, in one MLflow run.
    state = platform.settings.state_dir
    client = MlflowClient(tracking_uri=default_mlflow_uri(state))
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`ratchet.run_id` = '{summary.run_id}'")
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean"))
    assert history == [(r["step"], pytest.approx(r["reward_mean"])) for r in lines]
    assert [s for s, _ in history] == list(range(STEPS))
    evals = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_reward"))
    assert evals == [(r["step"], pytest.approx(r["eval_reward"])) for r in lines if "eval_reward" in r] and evals
    assert {"kl", "entropy", "response_length", "staleness", "generate_seconds", "train_seconds"} <= run.data.metrics.keys()
    assert run.data.params["loop.steps"] == str(STEPS) and run.info.status == "FINISHED"
    assert run.data.metrics["summary/steps"] == STEPS

    # The UI, as `ratchet up` starts it, on 127.0.0.1.
    settings = ServiceSettings(state_dir=state, mlflow_ui_port=free_ports(1)[0])
    rec = mlflow_ui.start(settings)
    assert "error" not in rec, rec
    try:
        base = mlflow_ui_url(settings)
        assert base.startswith("http://127.0.0.1:")
        wait_until(lambda: mlflow_ui.describe(rec)[0], timeout=180, every=0.5)
        api = f"{base}/ajax-api/2.0/mlflow/metrics/get-history?run_id={run.info.run_id}&metric_key=reward_mean"
        served = json.load(urllib.request.urlopen(api, timeout=30))["metrics"]
        assert sorted(m["step"] for m in served) == list(range(STEPS))

        page = metric_page(base, run.info.run_id, exp.experiment_id, "reward_mean")
        dom = chromium(page, budget_ms=30000)
        assert "Error while loading" not in dom
        assert f"(step={STEPS - 1})" in dom, "the metric table shows no point of the last step"
        png = artifacts_dir() / "mlflow_ui_reward.png"
        png.unlink(missing_ok=True)
        chromium(page, screenshot=png, budget_ms=30000)
        image = Image.open(png)
        assert image.size == (1600, 1000)
        assert len(set(image.convert("L").getdata())) > 20  # a drawn page, not a blank one
    finally:
        mlflow_ui.stop(rec, 10.0)
    assert not mlflow_ui.describe(rec)[0]
    assert status(ServiceSettings(state_dir=state)).mlflow_ui is None  # not asked for: not reported
