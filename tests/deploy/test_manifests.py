"""deploy/ validates, with the tools that run without a cluster or a Docker daemon:

- the compose file: `docker-compose config` (Debian's docker-compose 1.29) with the example
  env file, then the resolved file: only 127.0.0.1 ports, Ray token auth on every Ray
  process, no secret written inline, every required variable in `.env.example`;
- the images: every COPY source exists and passes the .dockerignore, the torch and Ray pins
  agree with the Makefile and pyproject.toml, the commands the manifests run exist;
- the Kubernetes manifests: rendered by `kubectl kustomize` (when kubectl is installed),
  core kinds against Kubernetes' own schemas (`kubernetes-validate`, strict), the
  RayCluster against tests/deploy/raycluster.schema.json (OUR schema of the KubeRay fields
  we use, not KubeRay's CRD, which no package ships) with each pod template against the
  core PodTemplateSpec schema, and every Secret and ConfigMap reference against the
  example Secret and the ConfigMap;
- the Temporal Helm values: YAML whose every key is a key of the official chart's values.

Each validator is also shown a broken copy, which it must refuse.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
IMAGES = DEPLOY / "images"
K8S_VERSION = "1.32.0"  # the oldest Kubernetes the manifests promise to work on

DOCKER_COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None, reason="docker-compose is not installed (Debian: apt-get install -y docker-compose)"
)
SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|_PWD|SECRET|TOKEN|API_KEY|ACCESS_KEY)")


def _pyproject_pin(name: str) -> str:
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(rf'"{re.escape(name)}==([0-9][^"]*)"', text)
    assert match, f"pyproject.toml pins no {name}"
    return match.group(1)


def _makefile_torch() -> str:
    match = re.search(r"pip install[^\n]*\btorch==([0-9.]+)", (REPO / "Makefile").read_text())
    assert match, "the Makefile installs no pinned torch"
    return match.group(1)


# ---------------------------------------------------------------- compose


def _compose(*args: str, env_file: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}  # no RATCHET_*/AWS_* leaking in
    return subprocess.run(
        [DOCKER_COMPOSE, "--env-file", str(env_file), "-f", str(COMPOSE_DIR / "compose.yaml"), *args],
        cwd=COMPOSE_DIR, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def compose_config() -> dict:
    if DOCKER_COMPOSE is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install -y docker-compose)")
    quiet = _compose("config", "-q", env_file=COMPOSE_DIR / ".env.example")
    assert quiet.returncode == 0, quiet.stderr
    done = _compose("config", env_file=COMPOSE_DIR / ".env.example")
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def _example_env() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in (COMPOSE_DIR / ".env.example").read_text().splitlines() if "=" in line and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def test_compose_validates_and_has_every_service(compose_config):
    assert set(compose_config["services"]) == {
        "postgresql", "temporal-schema", "temporal", "temporal-ui", "temporal-setup", "minio", "minio-init",
        "ray-head", "ray-worker", "ratchet-worker", "mlflow",
    }  # fmt: skip


@needs_compose
def test_compose_without_its_secrets_names_the_missing_variable(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    out = _compose("config", "-q", env_file=empty)
    assert out.returncode != 0
    assert re.search(r"set (POSTGRES_PASSWORD|MINIO_ROOT_\w+|RATCHET_S3_\w+|RAY_AUTH_TOKEN) in deploy/compose/.env", out.stderr), out.stderr


def test_compose_publishes_only_on_loopback_and_only_the_entry_points(compose_config):
    published = {}
    for name, svc in compose_config["services"].items():
        for port in svc.get("ports", []):
            text = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port['published']}:{port['target']}"
            assert text.startswith("127.0.0.1:"), f"{name} publishes {text} beyond this machine"
            published.setdefault(name, set()).add(int(text.split(":")[1]))
    # Temporal frontend and UI, MinIO's S3 API and console, Ray's dashboard, MLflow: nothing else
    # (PostgreSQL and Ray's GCS stay on the compose network).
    assert published == {"temporal": {7233}, "temporal-ui": {8080}, "minio": {9000, 9001}, "ray-head": {8265}, "mlflow": {5000}}


def test_every_ray_process_runs_with_the_token(compose_config):
    token = _example_env()["RAY_AUTH_TOKEN"]
    for name in ("ray-head", "ray-worker", "ratchet-worker"):
        env = compose_config["services"][name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == token, name
        assert env["RATCHET_RAY_ADDRESS"] == "ray-head:6379", name
    assert "--port=6379" in compose_config["services"]["ray-head"]["command"]


def test_compose_writes_no_secret_inline_and_the_example_env_has_every_variable():
    raw = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    text = (COMPOSE_DIR / "compose.yaml").read_text()

    def environments():
        yield "x-ratchet-env", raw["x-ratchet-env"]
        for name, svc in raw["services"].items():
            yield name, svc.get("environment") or {}

    for name, env in environments():
        for key, value in env.items():
            value = str(value)
            if SECRET_NAME.search(key) and key != "RAY_AUTH_MODE":
                assert value.startswith("${"), f"{name}: {key} is written inline; take it from .env as ${{{key}}}"
            if "://" in value and "@" in value:  # a URL with credentials
                assert "${" in value.split("@")[0], f"{name}: {key} holds a password inline"
    required = set(re.findall(r"\$\{(\w+):\?", text))
    assert required and required <= set(_example_env()), f"missing from .env.example: {required - set(_example_env())}"
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "RATCHET_S3_SECRET_KEY", "RAY_AUTH_TOKEN"} <= required


def test_compose_files_and_scripts_exist():
    raw = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    for name, svc in raw["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name} mounts {source}, which is missing"
    for script in ("deploy/images/ratchet-node.sh", "deploy/images/setup_temporal.py"):
        assert script in (COMPOSE_DIR / "compose.yaml").read_text() + (K8S / "ratchet-worker.yaml").read_text() + (
            K8S / "temporal-setup-job.yaml"
        ).read_text()
        assert (REPO / script).is_file()


# ---------------------------------------------------------------- images


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in dockerfile.read_text().splitlines():
        if line.strip().startswith("#"):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if current.strip():
                word, _, rest = current.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            current = ""
    return out


def _dockerignore_allows(dockerfile: Path, path: str) -> bool:
    """The whitelist .dockerignore next to the Dockerfile (`**`, then `!path` lines)."""
    lines = [l.strip() for l in Path(f"{dockerfile}.dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert lines[0] == "**", "the .dockerignore starts by excluding everything"
    allowed = [l[1:] for l in lines if l.startswith("!")]
    return any(path == a or path.startswith(a.rstrip("/") + "/") for a in allowed)


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_copy_what_exists_and_pin_what_the_project_pins(name):
    dockerfile = IMAGES / name
    steps = _instructions(dockerfile)
    copies = [args.split()[:-1] for word, args in steps if word == "COPY"]
    assert copies
    for sources in copies:
        for src in sources:
            assert (REPO / src).exists(), f"{name}: COPY {src}: not in the repository"
            assert _dockerignore_allows(dockerfile, src), f"{name}: COPY {src} is excluded by {name}.dockerignore"
    runs = " ".join(args for word, args in steps if word == "RUN")
    torch = re.findall(r"pip install torch==([0-9.]+)", runs)
    assert len(torch) == 1, f"{name}: torch must be installed once, alone and pinned, before the project"
    first_torch = runs.index("pip install torch==")
    assert first_torch < runs.index('pip install ".['), f"{name}: torch after the project would pull another build"
    ray = re.findall(r'"ray\[default\]==([0-9.]+)"', runs)
    assert ray == [_pyproject_pin("ray")], f"{name}: ray[default] must be pyproject's ray pin"
    extras = re.search(r"ARG EXTRAS=(\S+)", "\n".join(f"{w} {a}" for w, a in steps)).group(1).split(",")
    declared = re.findall(r"^([\w-]+) = \[", (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1], re.M)
    assert set(extras) <= set(declared), f"{name}: extras {set(extras) - set(declared)} are not in pyproject.toml"
    for script in ("deploy/images/ratchet-node.sh", "deploy/images/setup_temporal.py"):
        assert any(script in sources for sources in copies), f"{name} does not copy {script}, which the manifests run"
    if name == "Dockerfile.cpu":
        assert torch[0] == _makefile_torch(), "the CPU image's torch must be the Makefile's"
    else:
        from packaging.specifiers import SpecifierSet

        spec = re.search(r'"torch(>=[^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
        assert torch[0] in SpecifierSet(spec), f"the CUDA image's torch {torch[0]} is outside pyproject's torch{spec}"
        assert re.search(r'"vllm==[0-9.]+"', runs), "the CUDA image installs a pinned vllm"


def test_commands_the_images_and_manifests_run_exist_in_the_cli():
    import typer.main

    from ratchet.platform.cli import app

    commands = typer.main.get_command(app).commands
    options = {name: {opt for p in cmd.params for opt in getattr(p, "opts", [])} for name, cmd in commands.items()}
    files = (IMAGES / "Dockerfile.cpu", IMAGES / "Dockerfile.cuda", IMAGES / "ratchet-node.sh")
    used = "\n".join(l for p in files for l in p.read_text().splitlines() if not l.lstrip().startswith("#"))
    # `ratchet CMD --opt` where a shell command starts (line start, RUN, &&, ;, |).
    calls = re.findall(r"(?:^|RUN|&&|;|\|)\s*ratchet (\w[\w-]*)((?: --[\w-]+)*)", used, re.M)
    assert {c for c, _ in calls} >= {"prepare", "worker"}
    for command, opts in calls:
        assert command in commands, f"`ratchet {command}` is not a ratchet command"
        for opt in opts.split():
            assert opt in options[command], f"`ratchet {command} {opt}`: no such option"


def test_node_script_refuses_to_start_without_the_ray_token(tmp_path):
    script = IMAGES / "ratchet-node.sh"
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
    assert os.access(script, os.X_OK), "ratchet-node.sh must be executable (the manifests run it directly)"
    env = {"PATH": "/usr/bin:/bin", "RATCHET_RAY_ADDRESS": "ray-head:6379"}
    out = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in out.stderr
    out = subprocess.run(["sh", str(script)], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "set RATCHET_RAY_ADDRESS" in out.stderr


# ---------------------------------------------------------------- Kubernetes


def _load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def k8s_docs() -> list[dict]:
    """The kustomization rendered by `kubectl kustomize` (images and namespace set), or its
    resources as written where kubectl is missing."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        assert all(d["metadata"].get("namespace") == "ratchet" for d in docs if d["kind"] != "Namespace")
        return docs
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [d for name in kustomization["resources"] for d in _load_yaml_docs(K8S / name)]


@pytest.fixture(scope="module")
def kv():
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pyproject's dev extra)")


def _validate_core(kv, doc: dict) -> None:
    kv.validate(doc, K8S_VERSION, strict=True)


def test_core_manifests_pass_kubernetes_schemas(k8s_docs, kv):
    kinds = [d["kind"] for d in k8s_docs]
    assert sorted(kinds) == sorted(["Namespace", "ServiceAccount", "ConfigMap", "RayCluster", "Deployment", "Job"])
    for doc in k8s_docs + _load_yaml_docs(K8S / "secret.example.yaml"):
        if doc["kind"] != "RayCluster":
            _validate_core(kv, doc)
    broken = copy.deepcopy(next(d for d in k8s_docs if d["kind"] == "Deployment"))
    broken["spec"]["replica"] = broken["spec"].pop("replicas")
    with pytest.raises(kv.ValidationError):
        _validate_core(kv, broken)


def _raycluster(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "RayCluster")


def _ray_groups(cluster: dict) -> list[tuple[str, dict]]:
    spec = cluster["spec"]
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


def test_raycluster_passes_our_schema_and_its_pod_templates_the_core_one(k8s_docs, kv):
    import jsonschema

    schema = json.loads((Path(__file__).parent / "raycluster.schema.json").read_text())
    cluster = _raycluster(k8s_docs)
    jsonschema.validate(cluster, schema)
    for name, group in _ray_groups(cluster):
        _validate_core(kv, {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"ray-{name}"}, "template": group["template"]})
    broken = copy.deepcopy(cluster)
    broken["spec"]["workerGroupSpec"] = broken["spec"].pop("workerGroupSpecs")  # a typo KubeRay would drop silently
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    broken = copy.deepcopy(cluster)
    broken["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def _containers(doc: dict) -> list[tuple[str, dict]]:
    if doc["kind"] == "RayCluster":
        return [(f"ray {name}", c) for name, g in _ray_groups(doc) for c in g["template"]["spec"]["containers"]]
    spec = doc["spec"]["template"]["spec"] if doc["kind"] in ("Deployment", "Job") else None
    return [(doc["metadata"]["name"], c) for c in spec["containers"]] if spec else []


def test_secret_and_config_references_resolve(k8s_docs):
    secrets = {d["metadata"]["name"]: set(d["stringData"]) for d in _load_yaml_docs(K8S / "secret.example.yaml")}
    config = next(d for d in k8s_docs if d["kind"] == "ConfigMap")
    for doc in k8s_docs:
        for where, container in _containers(doc):
            for ref in container.get("envFrom", []):
                assert ref["configMapRef"]["name"] == config["metadata"]["name"], where
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get(ref["name"], set()), f"{where}: {ref['name']}/{ref['key']} is not in secret.example.yaml"
                    assert ref["key"] == var["name"], f"{where}: {var['name']} read from key {ref['key']}"
        for volume in doc.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
    # Files named in the ConfigMap's (commented) TLS lines are the keys of the TLS Secret.
    tls_files = re.findall(r"/etc/ratchet/temporal-tls/([\w.]+)", (K8S / "configmap.yaml").read_text())
    assert set(tls_files) == secrets["ratchet-temporal-tls"]


def test_every_ray_container_has_token_auth_and_the_gpu_group_gpus(k8s_docs):
    config = next(d for d in k8s_docs if d["kind"] == "ConfigMap")["data"]
    assert config["RAY_AUTH_MODE"] == "token"
    cluster = _raycluster(k8s_docs)
    ray_users = [cluster, next(d for d in k8s_docs if d["metadata"]["name"] == "ratchet-worker")]
    for doc in ray_users:
        for where, container in _containers(doc):
            assert any(r["configMapRef"]["name"] == "ratchet-config" for r in container.get("envFrom", [])), where
            token = [v for v in container.get("env", []) if v["name"] == "RAY_AUTH_TOKEN"]
            assert token and token[0]["valueFrom"]["secretKeyRef"]["key"] == "RAY_AUTH_TOKEN", f"{where}: no Ray token"
    groups = dict(_ray_groups(cluster))
    gpu = groups["gpu"]["template"]["spec"]["containers"][0]
    assert int(gpu["resources"]["limits"]["nvidia.com/gpu"]) >= 1 and gpu["image"].endswith(":cuda")
    assert "nvidia.com/gpu" not in str(groups["cpu"]["template"])
    assert groups["head"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["spec"]["rayVersion"] == _pyproject_pin("ray")
    # The workers find the head where KubeRay puts it: Service <cluster>-head-svc, GCS port 6379.
    host, port = config["RATCHET_RAY_ADDRESS"].rsplit(":", 1)
    assert host.split(".")[0] == f"{cluster['metadata']['name']}-head-svc" and port == "6379"
    assert host.split(".")[1] == "ratchet"


# ---------------------------------------------------------------- Temporal Helm values

# The official chart's values (temporalio/helm-charts, charts/temporal/values.yaml, chart for
# server 1.29): the keys ratchet's values may set. A key outside it is a typo the chart
# would ignore without a word.
CHART_KEYS = {
    "server.enabled", "server.replicaCount", "server.image.repository", "server.image.tag", "server.image.pullPolicy",
    "server.resources", "server.nodeSelector", "server.tolerations", "server.affinity", "server.additionalEnv",
    "server.additionalVolumes", "server.additionalVolumeMounts", "server.securityContext",
    "server.config.logLevel", "server.config.numHistoryShards", "server.config.tls", "server.config.authorization",
    "server.config.persistence.defaultStore", "server.config.persistence.additionalStores",
    *(
        f"server.config.persistence.{store}.{key}"
        for store in ("default", "visibility")
        for key in (
            "driver", "sql.driver", "sql.host", "sql.port", "sql.database", "sql.user", "sql.password",
            "sql.existingSecret", "sql.secretName", "sql.maxConns", "sql.maxIdleConns", "sql.maxConnLifetime",
            "sql.connectAttributes", "sql.tls",
        )
    ),
    "server.config.namespaces.create", "server.config.namespaces.namespace",
    *(f"server.frontend.service.{k}" for k in ("type", "port", "annotations", "membershipPort", "httpPort")),
    "server.frontend.ingress.enabled", "server.frontend.resources",
    *(f"server.{svc}.resources" for svc in ("history", "matching", "worker")),
    "admintools.enabled", "admintools.image.repository", "admintools.image.tag",
    "web.enabled", "web.replicaCount", "web.image.repository", "web.image.tag", "web.service.type", "web.service.port",
    "web.ingress.enabled", "web.additionalEnv",
    "schema.createDatabase.enabled", "schema.setup.enabled", "schema.setup.backoffLimit", "schema.update.enabled",
    "schema.update.backoffLimit",
    "elasticsearch.enabled", "cassandra.enabled", "mysql.enabled", "prometheus.enabled", "grafana.enabled",
}  # fmt: skip


def _leaf_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in CHART_KEYS:
            keys += _leaf_keys(value, path + ".")
        else:
            keys.append(path)
    return keys


def test_temporal_helm_values_use_the_charts_keys():
    values = yaml.safe_load((K8S / "temporal-values.yaml").read_text())
    unknown = [k for k in _leaf_keys(values) if k not in CHART_KEYS]
    assert not unknown, f"not keys of the Temporal chart: {unknown}"
    persistence = values["server"]["config"]["persistence"]
    for store in ("default", "visibility"):
        sql = persistence[store]["sql"]
        assert persistence[store]["driver"] == "sql" and sql["driver"] == "postgres12"
        assert "password" not in sql and sql["existingSecret"], f"{store}: the password comes from a Secret"
    assert values["elasticsearch"]["enabled"] is False  # visibility on SQL: the chart would add Elasticsearch
    assert [k for k in _leaf_keys({"server": {"config": {"persistance": {}}}}) if k not in CHART_KEYS]  # the check bites
    # The ConfigMap points at the frontend this release makes: <release>-frontend.<namespace>.
    config = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]
    assert config["RATCHET_TEMPORAL_ADDRESS"].startswith("temporal-frontend.temporal.")
    assert config["RATCHET_TEMPORAL_ADDRESS"].endswith(f":{values['server']['frontend']['service']['port']}")
