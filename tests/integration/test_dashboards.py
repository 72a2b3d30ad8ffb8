"""The run's two windows, on the real platform (`ratchet up`'s dev server with its UI, Ray,
a `ratchet worker`), for one short real run:

- the Temporal UI: the run is found by its search attributes, and headless Chromium
  renders its workflow page with the run's summary, details, current details and an
  activity summary on every activity. The payloads are sealed with ratchet's key
  (platform/payload_codec.py); the UI reads them through `up`'s codec server.
- MLflow, the built-in dashboard: the run logs every step to the state folder's MLflow
  store, the MLflow UI that `ratchet up` starts (services/mlflow_ui.py) serves it on
  127.0.0.1, and Chromium renders the run's reward chart.

One run serves both (a run of its own for each cost a run's actor starts and told nothing
more). The screenshots are kept as test artifacts under $RATCHET_TEST_ARTIFACTS (default
`.ratchet/test-artifacts/`, git-ignored): `temporal_ui_run.png` (the workflow page and its
timeline), `temporal_ui_metadata.png` (the User Metadata tab: summary, details, current
details), `temporal_ui_search_attributes.png` (the Search Attributes tab) and
`mlflow_ui_reward.png`.
"""

from __future__ import annotations

import html
import json
import os
import re
import secrets
import subprocess
import time
from pathlib import Path
import urllib.parse
import urllib.request
from urllib.parse import parse_qs, urlsplit

import pytest

from ratchet.platform.client import RECIPE_PATH
from ratchet.platform.search import InvalidQuery
from ratchet.types import RunSummary
from ratchet.workflows import search_attributes as sa

from tests.browser import CHROMIUM, artifacts_dir, chromium

pytestmark = pytest.mark.integration

STEPS = 4
FAST = [
    "warmup.steps=2", "loop.prompts_per_step=4", "rollout.n=4", "data.eval_size=16", "loop.eval_every=2",
    "checkpoint.every=2", "resources.trainer_cpus=0.5",
]  # fmt: skip


def wait_for(find, what: str, limit_s: float = 60.0):
    """Poll `find()` until it returns something truthy (visibility is eventually consistent)."""
    deadline = time.monotonic() + limit_s
    while True:
        got = find()
        if got or time.monotonic() > deadline:
            assert got, f"not seen within {limit_s:.0f}s: {what}"
            return got
        time.sleep(0.3)


@pytest.fixture(scope="module")
def ui_run(platform):
    """A 4-step sync run (checkpoint and evaluation every 2 steps, logged to MLflow), paused
    once after its first step: its live current details are read then (the query the UI
    makes), and its page is rendered once it completed (the UI long-polls an open
    workflow's history, so a headless render under virtual time never settles while the
    run is open)."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed (Debian package chromium)")
    from temporalio.api.sdk.v1 import WorkflowMetadata

    experiment = f"ui-{secrets.token_hex(3)}"
    client = platform.client
    handle = client.submit(
        RECIPE_PATH,
        platform.overrides(*FAST, f"loop.steps={STEPS}", "tracking.mlflow=true", "tracking.name=ui", f"tracking.experiment={experiment}"),
    )
    wait_for(lambda: handle.progress().step >= 1, "the run's first step", 300)
    handle.pause()
    paused = wait_for(lambda: client.find(f"ratchet_experiment = '{experiment}' AND ratchet_status = 'paused'"), "status paused", 120)
    live = client._run(handle._handle().query("__temporal_workflow_metadata", result_type=WorkflowMetadata)).current_details
    handle.resume()
    summary: RunSummary = handle.result(timeout=600)
    desc = client._run(handle._handle().describe())
    ui = f"http://{platform.settings.host}:{platform.settings.temporal_ui_port}/namespaces/default/workflows/{handle.run_id}/{desc.run_id}"
    shots = {}
    for name, page in (("run", ""), ("metadata", "/user-metadata"), ("search_attributes", "/search-attributes")):
        png = artifacts_dir() / f"temporal_ui_{name}.png"
        shots[name] = (chromium(ui + page), png)
        chromium(ui + page, screenshot=png)
    return {"handle": handle, "summary": summary, "experiment": experiment, "paused": paused, "live": live, "shots": shots}


def _attrs(platform, run_id: str) -> dict:
    desc = platform.client._run(platform.client.get(run_id)._handle().describe())
    return {p.key.name: p.value for p in desc.typed_search_attributes}


def test_up_registered_the_attributes(platform):
    from ratchet.platform.search import registered_attributes

    assert sa.missing_from(platform.client._run(registered_attributes(platform.client._temporal))) == []


def test_run_is_found_by_its_search_attributes(ui_run, platform):
    handle, summary, experiment = ui_run["handle"], ui_run["summary"], ui_run["experiment"]
    assert summary.steps == STEPS
    assert [r.run_id for r in ui_run["paused"]] == [handle.run_id]
    attrs = _attrs(platform, handle.run_id)
    assert attrs["ratchet_step"] == STEPS and attrs["ratchet_status"] == "completed", attrs
    assert (attrs["ratchet_experiment"], attrs["ratchet_algorithm"], attrs["ratchet_loop_mode"]) == (experiment, "grpo", "sync")
    assert attrs["ratchet_eval_reward"] == pytest.approx(summary.eval_rewards[str(STEPS)])
    reward = attrs["ratchet_reward"]
    assert 0.0 <= reward <= 1.0

    find = platform.client.find
    mine = f"ratchet_experiment = '{experiment}'"
    by_experiment = wait_for(lambda: [r for r in find(mine) if r.status == "completed"], "the completed run by experiment")
    assert [r.run_id for r in by_experiment] == [handle.run_id]
    row = by_experiment[0]
    assert (row.step, row.workflow_status, row.model) == (STEPS, "COMPLETED", Path(platform.assets.model).name)
    assert [r.run_id for r in find(f"{mine} AND ratchet_step >= {STEPS}")] == [handle.run_id]
    assert find(f"{mine} AND ratchet_step > {STEPS}") == []
    assert [r.run_id for r in find(f"{mine} AND ratchet_reward >= {reward!r}")] == [handle.run_id]
    assert find(f"{mine} AND ratchet_reward > {reward!r}") == []


def test_a_query_the_server_refuses_names_the_attributes(platform):
    with pytest.raises(InvalidQuery) as err:
        platform.client.find("NoSuchAttribute = 'x'")
    assert "the server refused it" in str(err.value) and "ratchet_reward (Double)" in str(err.value)


def test_live_current_details_while_paused(ui_run):
    """What the UI's User Metadata tab shows of an open run: the phase, the step, the policy
    version and the latest reward."""
    assert re.fullmatch(
        rf"\*\*paused\*\* · step (\d)/{STEPS} · policy v\1 · reward \d\.\d{{3}}( · eval reward \d\.\d{{3}})?", ui_run["live"]
    ), ui_run["live"]


def metadata_shown(dom: str, part: str) -> str:
    """The markdown the UI's User Metadata tab renders for `part` (summary, details,
    current-details): each is an iframe whose `src` carries it."""
    m = re.search(rf'<iframe[^>]*src="([^"]*)"[^>]*id="user-metadata-{part}"', dom)
    assert m, f"no {part} frame in the page"
    return parse_qs(urlsplit(html.unescape(m.group(1))).query)["content"][0]


def test_ui_shows_summary_and_details(ui_run):
    """The User Metadata tab: the run's one-line summary, its config in short, and the
    current details the finished run left (the worker answers the UI's query)."""
    dom, png = ui_run["shots"]["metadata"]
    summary = metadata_shown(dom, "summary")
    assert summary.startswith("GRPO on ") and summary.endswith(f"{STEPS} steps, sync loop · experiment {ui_run['experiment']}")
    details = metadata_shown(dom, "details")
    assert details.startswith(f"**ratchet run** `{ui_run['handle'].run_id}`")
    assert "- learning rate: `0.001`" in details and "- samples per prompt: `4`" in details
    current = metadata_shown(dom, "current-details")
    assert re.fullmatch(
        rf"\*\*completed\*\* · step {STEPS}/{STEPS} · policy v{STEPS} · reward \d\.\d{{3}} · eval reward \d\.\d{{3}}", current
    ), current
    assert png.stat().st_size > 20_000


def test_ui_timeline_shows_activity_summaries(ui_run):
    """The workflow page's timeline labels each activity by what it did, newest first."""
    dom, png = ui_run["shots"]["run"]
    for label in (
        f"finish: export the final policy v{STEPS}", f"evaluate step {STEPS}", f"checkpoint step {STEPS}",
        f"step {STEPS - 1} (generate, score, train, sync)",
    ):  # fmt: skip
        assert label in dom, label
    assert png.stat().st_size > 20_000


def test_ui_shows_the_search_attributes(ui_run):
    dom, png = ui_run["shots"]["search_attributes"]
    text = re.sub(r"<[^>]+>", " ", dom)
    for name in ("ratchet_experiment", "ratchet_step", "ratchet_reward", "ratchet_eval_reward", "ratchet_status"):
        assert name in text, name
    assert ui_run["experiment"] in text and "completed" in text
    assert png.stat().st_size > 20_000


def test_ui_decodes_the_sealed_payloads_the_server_keeps(ui_run, platform):
    """The payloads are sealed with ratchet's key (payload_codec): the server's own history
    (`temporal workflow show`, no codec) holds no config, while the UI's page, which `up`
    pointed at its codec server, shows the run's input readably (a config key and the
    run's storage folder)."""
    import sys

    from ratchet.platform.services import temporal_address

    run_id, root = ui_run["handle"].run_id, str(platform.runs_root)
    raw = subprocess.run(
        [str(Path(sys.executable).parent / "temporal"), "workflow", "show", "--workflow-id", run_id, "--output", "json",
         "--address", temporal_address(platform.settings), "--namespace", "default"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert raw.returncode == 0, raw.stderr
    assert "binary/encrypted" in raw.stdout or "YmluYXJ5L2VuY3J5cHRlZA" in raw.stdout  # the encoding, maybe base64
    assert root not in raw.stdout and "adv_estimator" not in raw.stdout
    dom, _ = ui_run["shots"]["run"]
    text = html.unescape(dom)
    assert "adv_estimator" in text and root in text


def test_up_runs_the_uis_codec_server(platform):
    """`up` recorded the codec server inside Temporal's entry, started the dev server with
    `--ui-codec-endpoint` pointing at it (127.0.0.1), `status` shows it; it refuses to
    encode; killed, the next `up` starts it again on the same port (the UI points there)."""
    import json
    import signal
    import urllib.error
    import urllib.request

    from ratchet.platform.services import processes, status, up
    from ratchet.platform.services.codec_server import healthy, url

    def recorded() -> dict:
        return json.loads((Path(platform.settings.state_dir) / "services.json").read_text())["services"]["temporal"]

    rec = recorded()
    codec = rec["codec_server"]
    assert codec["host"] == "127.0.0.1" and healthy(codec)
    assert rec["cmd"][rec["cmd"].index("--ui-codec-endpoint") + 1] == url(codec) == rec["ui_codec_endpoint"]
    shown = status(platform.settings).codec_server
    assert shown is not None and shown.running and shown.address == url(codec)
    req = urllib.request.Request(
        url(codec) + "/encode", data=b'{"payloads": []}', method="POST", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 403

    os.kill(codec["pid"], signal.SIGKILL)
    processes.wait_gone([codec["pid"]], 30)
    assert not healthy(codec)
    up(platform.settings)
    again = recorded()["codec_server"]
    assert healthy(again) and again["port"] == codec["port"] and again["pid"] != codec["pid"]
    assert recorded()["pid"] == rec["pid"]  # Temporal itself was left running


def test_ratchet_runs_where(ui_run, platform):
    """`ratchet runs --where`: the registry's rows for the runs the query selects."""
    import sys

    from ratchet.platform.services import temporal_address

    env = {**os.environ, "RATCHET_TEMPORAL_ADDRESS": temporal_address(platform.settings)}
    run_id, experiment = ui_run["handle"].run_id, ui_run["experiment"]

    def ratchet_runs(where: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "ratchet.platform.cli", "runs", "--where", where, "--state-dir", str(platform.settings.state_dir)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**env, "COLUMNS": "250"})

    hit = ratchet_runs(f"ratchet_experiment = '{experiment}' AND ratchet_step >= {STEPS}")
    assert hit.returncode == 0, hit.stderr
    assert run_id in hit.stdout and "not in the registry" not in hit.stdout, hit.stdout
    miss = ratchet_runs(f"ratchet_experiment = '{experiment}' AND ratchet_step > {STEPS}")
    assert miss.returncode == 0 and run_id not in miss.stdout, miss.stdout
    bad = ratchet_runs("ratchet_rewards > 0.3")
    assert bad.returncode == 2 and "'ratchet_rewards' is not one of ratchet's search attributes" in bad.stderr, bad.stderr


def metric_page(base: str, run_id: str, experiment_id: str, key: str) -> str:
    """The MLflow UI's page of one metric of one run (its route and query, as the UI's own
    links build them)."""
    q = {
        "runs": json.dumps([run_id]), "metric": json.dumps(key), "experiments": json.dumps([experiment_id]),
        "plot_metric_keys": json.dumps([key]), "plot_layout": "{}", "x_axis": "step", "y_axis_scale": "linear",
        "line_smoothness": "1", "show_point": "true", "deselected_curves": "[]", "last_linear_y_axis_range": "[]",
    }  # fmt: skip
    return f"{base}/#/metric?" + "&".join(f"{k}={urllib.parse.quote(v, safe='[]{},')}" for k, v in q.items())


def test_the_run_in_mlflow_and_its_ui(ui_run, platform):
    from mlflow import MlflowClient
    from PIL import Image

    from ratchet.platform.services import ServiceSettings, free_ports, mlflow_ui, mlflow_ui_url, status
    from ratchet.tracking.uris import default_mlflow_uri

    summary = ui_run["summary"]
    lines = [json.loads(x) for x in (Path(summary.run_uri) / "metrics.jsonl").read_text().splitlines()]

    # The worker logged every step to the state folder's store, in one MLflow run.
    state = platform.settings.state_dir
    client = MlflowClient(tracking_uri=default_mlflow_uri(state))
    exp = client.get_experiment_by_name(ui_run["experiment"])
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
        wait_for(lambda: mlflow_ui.describe(rec)[0], "the MLflow UI serving", 180)
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
