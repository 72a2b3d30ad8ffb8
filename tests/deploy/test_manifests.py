"""deploy/ validates, with the tools that run without a cluster or a Docker daemon:

- the compose file: `docker-compose config` (Debian's docker-compose 1.29) with the example
  env file, then the resolved file: only 127.0.0.1 ports, Ray token auth on every Ray
  process, every secret a file (make-secrets.sh writes them 0400) mounted only where it is
  needed, none in any environment;
- the images: every COPY source exists and passes the .dockerignore, the torch and Ray pins
  agree with the Makefile and pyproject.toml, the commands the manifests run exist;
- the Kubernetes manifests: rendered by `kubectl kustomize` (when kubectl is installed),
  core kinds against Kubernetes' own schemas (`kubernetes-validate`, strict), the
  RayCluster against tests/deploy/raycluster.schema.json (OUR schema of the KubeRay fields
  we use, not KubeRay's CRD, which no package ships) with each pod template against the
  core PodTemplateSpec schema, and every Secret and ConfigMap reference against the
  example Secret and the ConfigMap; no Secret value in any `env:`, each pod only the secret
  files it needs, every pod unprivileged (securityContext), and a NetworkPolicy admitting
  only ratchet's pods to each of Temporal's, Ray's and MinIO's ports;
- the Temporal Helm values: YAML whose every key is a key of the official chart's values.

Each validator is also shown a broken copy, which it must refuse.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
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
SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|_PWD|SECRET|TOKEN(?!IZERS)|API_KEY|ACCESS_KEY)")


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


def test_compose_validates_and_has_every_service(compose_config):
    assert set(compose_config["services"]) == {
        "postgresql", "temporal-schema", "temporal", "temporal-ui", "temporal-setup", "minio", "minio-init",
        "ray-head", "ray-worker", "ratchet-worker", "mlflow",
    }  # fmt: skip


@pytest.fixture(scope="module")
def made_secrets(tmp_path_factory) -> Path:
    """The secret files make-secrets.sh writes, in a folder of the test's."""
    folder = tmp_path_factory.mktemp("compose") / "secrets"
    out = subprocess.run(["sh", str(COMPOSE_DIR / "make-secrets.sh"), str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return folder


# Variables that hold where a secret is, or a mode, not the secret itself.
NOT_A_SECRET = re.compile(r"(_FILE|_PATH|_MODE)$")


def _secret_values(folder: Path) -> list[str]:
    import configparser

    values = []
    for path in folder.iterdir():
        text = path.read_text().strip()
        if path.name == "s3_credentials":
            section = configparser.ConfigParser()
            section.read_string(text)
            values += [v for v in section["default"].values() if len(v) > 8]
        else:
            values.append(text)
    return values


def test_make_secrets_writes_every_secret_file_private(made_secrets):
    raw = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    files = {Path(spec["file"]).name for spec in raw["secrets"].values()}
    assert files == {p.name for p in made_secrets.iterdir()}
    assert stat.S_IMODE(made_secrets.stat().st_mode) == 0o700
    for path in made_secrets.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o400, path
    password = (made_secrets / "postgres_password").read_text().strip()
    assert f":{password}@postgresql:5432/ratchet_registry" in (made_secrets / "registry_url").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", (made_secrets / "payload.key").read_text().strip())
    before = {p.name: p.read_text() for p in made_secrets.iterdir()}
    subprocess.run(["sh", str(COMPOSE_DIR / "make-secrets.sh"), str(made_secrets)], check=True, capture_output=True, timeout=60)
    assert {p.name: p.read_text() for p in made_secrets.iterdir()} == before  # kept, not replaced
    ignored = (COMPOSE_DIR / ".gitignore").read_text().split()
    assert "secrets/" in ignored and ".env" in ignored


def test_compose_has_no_secret_in_any_environment(compose_config, made_secrets):
    """Before: the Ray token and the S3 keys were environment values of every Ray process
    (`docker inspect` showed them, every actor inherited them), and the database password
    sat in URLs. Now every secret is a file under /run/secrets; a variable may only say
    where it is."""
    text = yaml.safe_dump(compose_config)
    for value in _secret_values(made_secrets):
        assert value not in text
    for name, svc in compose_config["services"].items():
        env = svc.get("environment") or {}
        for key, value in env.items():
            value = str(value)
            if SECRET_NAME.search(key):
                assert NOT_A_SECRET.search(key), f"{name}: {key} holds a secret in the environment; mount it as a file"
            if SECRET_NAME.search(key) or key.endswith("_FILE"):
                assert value.startswith("/run/secrets/"), f"{name}: {key}={value}"
            assert not re.search(r"://[^/\s]*@", value), f"{name}: {key} holds a URL with credentials"
    raw = (COMPOSE_DIR / "compose.yaml").read_text()
    assert not re.findall(r"\$\{(\w+):\?", raw), "a secret taken from .env: make it a file"
    for line in (COMPOSE_DIR / ".env.example").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            assert not SECRET_NAME.search(line.split("=")[0]), f".env.example holds a secret: {line}"


def test_compose_gives_each_service_only_the_secrets_it_needs(compose_config):
    def names(svc):
        return {s if isinstance(s, str) else s["source"] for s in svc.get("secrets", [])}

    services = compose_config["services"]
    assert names(services["ray-head"]) == {"ray_auth_token"}  # no actors there: no S3 keys
    assert names(services["ray-worker"]) == {"ray_auth_token", "s3_credentials"}
    assert names(services["ratchet-worker"]) == {"ray_auth_token", "s3_credentials", "registry_url", "payload_key"}
    assert names(services["mlflow"]) == {"mlflow_db_url"}
    for name in ("temporal-ui", "temporal-setup"):
        assert names(services[name]) == set(), name
    env = services["ratchet-worker"]["environment"]
    assert env["RATCHET_PAYLOAD_KEY_FILE"] == "/run/secrets/payload.key"
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == "/run/secrets/s3_credentials"
    for name in ("ray-head", "ray-worker", "ratchet-worker", "mlflow", "temporal-setup"):
        assert services[name]["cap_drop"] == ["ALL"] and "no-new-privileges:true" in services[name]["security_opt"], name


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
    for name in ("ray-head", "ray-worker", "ratchet-worker"):
        svc = compose_config["services"][name]
        env = svc["environment"]
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == "/run/secrets/ray_auth_token", name
        assert "RAY_AUTH_TOKEN" not in env and "ray_auth_token" in [s if isinstance(s, str) else s["source"] for s in svc["secrets"]]
        assert env["RATCHET_RAY_ADDRESS"] == "ray-head:6379", name
    assert "--port=6379" in compose_config["services"]["ray-head"]["command"]


def test_compose_files_and_scripts_exist():
    raw = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    for name, svc in raw["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name} mounts {source}, which is missing"
    for script in ("deploy/images/ratchet-node.sh", "deploy/images/setup_temporal.py"):
        assert (
            script
            in (COMPOSE_DIR / "compose.yaml").read_text()
            + (K8S / "ratchet-worker.yaml").read_text()
            + (K8S / "temporal-setup-job.yaml").read_text()
        )
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
    lines = [x.strip() for x in Path(f"{dockerfile}.dockerignore").read_text().splitlines() if x.strip() and not x.startswith("#")]
    assert lines[0] == "**", "the .dockerignore starts by excluding everything"
    allowed = [line[1:] for line in lines if line.startswith("!")]
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
    used = "\n".join(line for p in files for line in p.read_text().splitlines() if not line.lstrip().startswith("#"))
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
    assert sorted(kinds) == sorted(
        ["Namespace", "ServiceAccount", "ConfigMap", "RayCluster", "Deployment", "Job", "NetworkPolicy", "NetworkPolicy"]
    )
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


SECRET_DIR = "/var/run/ratchet"


def _pod_spec(doc: dict) -> list[dict]:
    if doc["kind"] == "RayCluster":
        return [g["template"]["spec"] for _, g in _ray_groups(doc)]
    if doc["kind"] in ("Deployment", "Job"):
        return [doc["spec"]["template"]["spec"]]
    return []


def _secret_items(volume: dict) -> list[tuple[str, str, bool]]:
    """(Secret, key, optional) of every key a volume mounts."""
    sources = [volume["secret"] | {"name": volume["secret"]["secretName"]}] if "secret" in volume else []
    sources += [src["secret"] for src in volume.get("projected", {}).get("sources", []) if "secret" in src]
    return [(src["name"], item["key"], bool(src.get("optional"))) for src in sources for item in src.get("items", [])]


def _mounted_secret_files(doc: dict, container: dict) -> set[str]:
    """The ratchet-secrets keys `container` sees under SECRET_DIR."""
    for spec in _pod_spec(doc):
        if container in spec["containers"]:
            mounted = {m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == SECRET_DIR and m.get("readOnly")}
            return {
                key
                for v in spec.get("volumes", [])
                if v["name"] in mounted
                for name, key, _ in _secret_items(v)
                if name == "ratchet-secrets"
            }
    return set()


def test_secret_and_config_references_resolve(k8s_docs):
    secrets = {d["metadata"]["name"]: set(d["stringData"]) for d in _load_yaml_docs(K8S / "secret.example.yaml")}
    config = next(d for d in k8s_docs if d["kind"] == "ConfigMap")
    for doc in k8s_docs:
        for where, container in _containers(doc):
            for ref in container.get("envFrom", []):
                assert ref["configMapRef"]["name"] == config["metadata"]["name"], where
        for spec in _pod_spec(doc):
            for volume in spec.get("volumes", []):
                for name, key, _ in _secret_items(volume):
                    assert key in secrets.get(name, set()), f"{doc['metadata']['name']}: {name}/{key} is not in secret.example.yaml"
                if "secret" in volume:
                    assert volume["secret"]["secretName"] in secrets
    # Every file the ConfigMap names (the commented lines too) is a key of the Secret.
    text = (K8S / "configmap.yaml").read_text()
    named = set(re.findall(rf"{SECRET_DIR}/([\w.-]+)", text))
    assert named == secrets["ratchet-secrets"], named ^ secrets["ratchet-secrets"]
    tls_files = re.findall(r"/etc/ratchet/temporal-tls/([\w.]+)", text)
    assert set(tls_files) == secrets["ratchet-temporal-tls"]


def _all_k8s_docs(k8s_docs: list[dict]) -> list[dict]:
    return k8s_docs + _load_yaml_docs(K8S / "networkpolicy-services.yaml")


def test_no_secret_is_an_environment_value_and_each_pod_gets_only_its_files(k8s_docs):
    """Before: the Ray token and the S3 keys were `secretKeyRef` environment values of every
    Ray container (shown by the pod spec, inherited by every actor). Now no container takes
    any environment value from a Secret; the ConfigMap names files; each pod mounts only
    the keys it needs, read-only, 0440."""
    config = next(d for d in k8s_docs if d["kind"] == "ConfigMap")["data"]
    for key, value in config.items():
        if SECRET_NAME.search(key) or key.endswith("_FILE"):
            assert NOT_A_SECRET.search(key) and value.startswith(f"{SECRET_DIR}/"), f"ConfigMap: {key}={value}"
        assert not re.search(r"://[^/\s]*@", value), f"ConfigMap: {key} holds a URL with credentials"
    for doc in _all_k8s_docs(k8s_docs):
        for where, container in _containers(doc):
            for ref in container.get("envFrom", []):
                assert "secretRef" not in ref, f"{where}: envFrom a Secret"
            for var in container.get("env", []):
                assert "secretKeyRef" not in var.get("valueFrom", {}), f"{where}: {var['name']} is a Secret's value in the environment"
                assert not SECRET_NAME.search(var["name"]) or NOT_A_SECRET.search(var["name"]), f"{where}: {var['name']}"
        for spec in _pod_spec(doc):
            for volume in spec.get("volumes", []):
                if _secret_items(volume):
                    mode = (volume.get("secret") or volume.get("projected"))["defaultMode"]
                    assert mode in (0o400, 0o440), f"{doc['metadata']['name']}: {volume['name']} mode {mode:o}"
    cluster = _raycluster(k8s_docs)
    groups = dict(_ray_groups(cluster))
    files = {name: _mounted_secret_files(cluster, g["template"]["spec"]["containers"][0]) for name, g in groups.items()}
    assert files == {"head": {"ray-auth-token"}, "cpu": {"ray-auth-token", "s3-credentials"}, "gpu": {"ray-auth-token", "s3-credentials"}}
    worker = next(d for d in k8s_docs if d["metadata"]["name"] == "ratchet-worker")
    assert _mounted_secret_files(worker, worker["spec"]["template"]["spec"]["containers"][0]) == {
        "ray-auth-token", "s3-credentials", "payload.key", "registry-url", "temporal-api-key"
    }  # fmt: skip
    optional = {key for v in worker["spec"]["template"]["spec"]["volumes"] for _, key, opt in _secret_items(v) if opt}
    assert optional == {"registry-url", "temporal-api-key"}
    setup = next(d for d in k8s_docs if d["kind"] == "Job")
    assert _mounted_secret_files(setup, setup["spec"]["template"]["spec"]["containers"][0]) == set()


def test_every_pod_runs_unprivileged(k8s_docs):
    for doc in k8s_docs:
        for spec in _pod_spec(doc):
            pod = spec["securityContext"]
            where = doc["metadata"]["name"]
            assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 1000 and pod["fsGroup"] == 1000, where
            assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
            writable = {m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            for container in spec["containers"]:
                sc = container["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}, where
                assert sc["readOnlyRootFilesystem"] is True, where
            assert "/tmp" in writable, f"{where}: a read-only root needs a writable /tmp"
    config = next(d for d in k8s_docs if d["kind"] == "ConfigMap")["data"]
    assert config["RATCHET_STATE_DIR"].startswith("/var/lib/ratchet/")  # an emptyDir's subfolder: 0700, not the 0777 mount


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
        if expr["operator"] != "In":
            raise AssertionError(f"operator {expr['operator']}: teach _selects it")
    return True


def _covers(rule: dict, port: int) -> bool:
    ports = rule.get("ports")
    return not ports or any(
        p.get("port") == port or (isinstance(p.get("port"), int) and p["port"] <= port <= p.get("endPort", p["port"])) for p in ports
    )


def _peer_is_ours(peer: dict, namespace: str) -> bool:
    """A rule's peer is ratchet's pods, or (Temporal, MinIO) the policy's own namespace."""
    if "ipBlock" in peer:
        return False
    ratchet_pods = peer.get("podSelector", {}).get("matchLabels") == {"app.kubernetes.io/part-of": "ratchet"}
    ns = peer.get("namespaceSelector")
    if ns is None:  # pods of the policy's own namespace
        return namespace == "ratchet" and ratchet_pods
    name = ns.get("matchLabels", {}).get("kubernetes.io/metadata.name")
    return name == namespace or (name == "ratchet" and ratchet_pods)


# (namespace, labels of the pod, port): Temporal's frontend, Ray's head and node ports, MinIO.
GUARDED_PORTS = [
    ("temporal", {"app.kubernetes.io/name": "temporal", "app.kubernetes.io/component": "frontend"}, 7233),
    ("ratchet", {"app.kubernetes.io/name": "ray-head", "app.kubernetes.io/part-of": "ratchet"}, 6379),
    ("ratchet", {"app.kubernetes.io/name": "ray-head", "app.kubernetes.io/part-of": "ratchet"}, 10001),
    ("ratchet", {"app.kubernetes.io/name": "ray-head", "app.kubernetes.io/part-of": "ratchet"}, 8265),
    ("ratchet", {"app.kubernetes.io/name": "ray-worker-cpu", "app.kubernetes.io/part-of": "ratchet"}, 12345),
    ("ratchet", {"app.kubernetes.io/name": "ray-worker-gpu", "app.kubernetes.io/part-of": "ratchet"}, 10002),
    ("ratchet", {"app.kubernetes.io/name": "ratchet-worker", "app.kubernetes.io/part-of": "ratchet"}, 40000),
    ("minio", {"app": "minio"}, 9000),
]


def test_each_service_port_has_a_network_policy_that_admits_only_ratchet(k8s_docs, kv):
    """Before: no NetworkPolicy: any pod of the cluster could reach Temporal, Ray and MinIO.
    Now each of those ports is selected by a policy (so the pod is isolated) whose rules for
    it admit only ratchet's pods (or the service's own namespace); ratchet's namespace
    denies everything else by default."""
    policies = [d for d in _all_k8s_docs(k8s_docs) if d["kind"] == "NetworkPolicy"]
    for policy in _load_yaml_docs(K8S / "networkpolicy-services.yaml"):
        _validate_core(kv, policy)
    for namespace, labels, port in GUARDED_PORTS:
        mine = [p for p in policies if p["metadata"]["namespace"] == namespace and _selects(p["spec"]["podSelector"], labels)]
        assert mine and all("Ingress" in p["spec"]["policyTypes"] for p in mine), f"{namespace} {labels}: no policy isolates it"
        rules = [r for p in mine for r in p["spec"].get("ingress", []) if _covers(r, port)]
        assert rules, f"{namespace} {labels} port {port}: no rule lets ratchet in"
        for rule in rules:
            assert rule.get("from"), f"{namespace} port {port}: a rule admits everyone"
            for peer in rule["from"]:
                assert _peer_is_ours(peer, namespace), f"{namespace} port {port}: admits {peer}"
    deny = [
        p for p in policies if p["metadata"]["namespace"] == "ratchet" and p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
    ]
    assert deny, "namespace ratchet has no default-deny policy"
    # What the check refuses: any address, every namespace, every pod of namespace ratchet.
    for peer in ({"ipBlock": {"cidr": "0.0.0.0/0"}}, {"namespaceSelector": {}}, {"podSelector": {}}):
        assert not _peer_is_ours(peer, "ratchet") and not _peer_is_ours(peer, "temporal"), peer


def test_every_ray_container_has_token_auth_and_the_gpu_group_gpus(k8s_docs):
    config = next(d for d in k8s_docs if d["kind"] == "ConfigMap")["data"]
    assert config["RAY_AUTH_MODE"] == "token"
    cluster = _raycluster(k8s_docs)
    ray_users = [cluster, next(d for d in k8s_docs if d["metadata"]["name"] == "ratchet-worker")]
    assert config["RAY_AUTH_TOKEN_PATH"] == f"{SECRET_DIR}/ray-auth-token"
    for doc in ray_users:
        for where, container in _containers(doc):
            assert any(r["configMapRef"]["name"] == "ratchet-config" for r in container.get("envFrom", [])), where
            assert "ray-auth-token" in _mounted_secret_files(doc, container), f"{where}: no Ray token file"
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
