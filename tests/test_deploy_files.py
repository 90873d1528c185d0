"""deploy/ and the Dockerfile, checked without Docker or a cluster: the compose file against the compose
spec (the copy check-jsonschema ships), the Kubernetes manifests against Kubernetes' schemas (those
kubernetes-validate ships; strict: an unknown field fails), both offline. Then what a schema cannot say
and a deployment depends on: probes on /health at the port the server listens on, the Service reaching
that port, the GPU asked for, the store mounted at /models from a claim that exists, the image's user,
a grace period longer than the drain, the multi-host group's addresses and secret. Each expectation
is also planted broken (test_a_planted_error_is_caught) so the checks are known to fail.
"""

from __future__ import annotations

import copy
import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hkserve.cli.serve import DRAIN_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
SINGLE, MULTI = ROOT / "deploy" / "kubernetes" / "hkserve.yaml", ROOT / "deploy" / "kubernetes" / "multihost.yaml"
K8S_VERSION = "1.30.0"  # the pod-index label (HKSERVE_HOST_ID of a StatefulSet's pod) needs >= 1.28
DRAIN_BOUND_S = DRAIN_TIMEOUT_S + 60  # the drain, then uvicorn's graceful shutdown (cli/serve.py)
CONTROLLER_LABELS = {"apps.kubernetes.io/pod-index", "statefulset.kubernetes.io/pod-name"}  # set on pods


def dockerfile(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", text if text is not None else (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def image_env() -> dict[str, str]:
    env = {}
    for instruction, args in dockerfile():
        if instruction == "ENV":
            env.update(pair.split("=", 1) for pair in args.split())
    return env


def image_uid() -> int:
    run = " ".join(args for instruction, args in dockerfile() if instruction == "RUN")
    return int(re.search(r"useradd [^&]*--uid (\d+)", run).group(1))


# -- docker-compose.yml -------------------------------------------------------------------------------


def compose_problems(doc: dict) -> list[str]:
    problems = []
    svc = doc["services"]["hkserve"]
    port = int(svc.get("environment", {}).get("HKSERVE_PORT", image_env()["HKSERVE_PORT"]))
    published = [int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in svc.get("ports", [])]
    if port not in published:
        problems.append(f"the server's port {port} is not published (ports: {published})")
    if svc.get("healthcheck", {}).get("test") != ["CMD", "hkserve-healthcheck"]:  # /health on HKSERVE_PORT
        problems.append(f"healthcheck {svc.get('healthcheck')} is not the image's /health check")
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if not any("gpu" in d.get("capabilities", []) for d in devices):
        problems.append("no GPU reservation")
    targets = [v.split(":")[1] if isinstance(v, str) else v.get("target") for v in svc.get("volumes", [])]
    if "/models" not in targets:
        problems.append(f"no volume at /models (the store, HKSERVE_HOME): {targets}")
    if svc.get("restart") not in ("always", "unless-stopped", "on-failure"):
        problems.append(f"restart policy {svc.get('restart')!r} does not restart a failed server")
    grace = svc.get("stop_grace_period", "10s")
    if not re.fullmatch(r"\d+s", grace) or int(grace[:-1]) < DRAIN_BOUND_S:
        problems.append(f"stop_grace_period {grace} is shorter than the drain ({DRAIN_BOUND_S} s)")
    if svc.get("build", {}).get("args", {}).get("ACCEL") not in ("cuda12", "cuda13"):
        problems.append("the GPU host's image is not a CUDA build (ACCEL)")
    return problems


def compose_schema_errors(doc: dict) -> list[str]:
    schema = json.loads(
        resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    )
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]


def test_compose_file_is_valid_compose_spec_and_meets_our_expectations():
    doc = yaml.safe_load(COMPOSE.read_text())
    assert compose_schema_errors(doc) == []
    assert compose_problems(doc) == []


# -- Kubernetes ---------------------------------------------------------------------------------------


def _resolve_port(container: dict, port) -> int | None:
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _probe_problems(name: str, probe: dict | None, container: dict, port: int) -> list[str]:
    if probe is None:
        return [f"no {name}"]
    if "exec" in probe:  # the image's check: GET /health on HKSERVE_PORT
        return [] if probe["exec"]["command"] == ["hkserve-healthcheck"] else [f"{name} runs {probe['exec']}"]
    get = probe.get("httpGet", {})
    problems = [] if get.get("path") == "/health" else [f"{name} path {get.get('path')!r} is not /health"]
    if _resolve_port(container, get.get("port")) != port:
        problems.append(f"{name} port {get.get('port')!r} is not the server's port {port}")
    return problems


def workload_problems(docs: list[dict], workload: dict) -> list[str]:
    spec = workload["spec"]["template"]["spec"]
    container = next(c for c in spec["containers"] if c["name"] == "hkserve")
    port = int(_env(container).get("HKSERVE_PORT") or image_env()["HKSERVE_PORT"])
    problems = []
    if _resolve_port(container, port) is None:
        problems.append(f"the server's port {port} is not a containerPort")
    for probe in ("startupProbe", "readinessProbe"):
        problems += _probe_problems(probe, container.get(probe), container, port)
    if workload["kind"] == "Deployment":  # a group's hosts have no liveness probe: a lost host ends the group
        live = container.get("livenessProbe", {}).get("httpGet", {})
        if live.get("path") not in ("/metrics", "/v1/models") or _resolve_port(container, live.get("port")) != port:
            problems.append(f"livenessProbe {live} does not reach the HTTP server (and must not be /health)")
    if int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) < 1:
        problems.append("no nvidia.com/gpu limit")
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    store = next((m for m in container.get("volumeMounts", []) if m["mountPath"] == "/models"), None)
    claim = volumes.get(store["name"], {}).get("persistentVolumeClaim", {}).get("claimName") if store else None
    if claim not in claims:
        problems.append(f"/models is not mounted from a claim of this file ({claim!r}; claims {sorted(claims)})")
    if spec.get("enableServiceLinks", True):  # a Service named hkserve* would set HKSERVE_* variables
        problems.append("enableServiceLinks is not false: the entrypoint refuses the HKSERVE_*_SERVICE_* it makes")
    security = spec.get("securityContext", {})
    if not security.get("runAsNonRoot") or security.get("runAsUser") != image_uid():
        problems.append(f"securityContext {security} is not the image's non-root user {image_uid()}")
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    wait = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
    if spec.get("terminationGracePeriodSeconds", 30) < DRAIN_BOUND_S + wait:
        problems.append(f"terminationGracePeriodSeconds is shorter than the drain ({DRAIN_BOUND_S} s + {wait} s)")
    return problems


def service_problems(service: dict, workloads: list[dict]) -> list[str]:
    selector = service["spec"]["selector"]
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        if all(labels.get(k) == v for k, v in selector.items() if k not in CONTROLLER_LABELS):
            container = next(c for c in w["spec"]["template"]["spec"]["containers"] if c["name"] == "hkserve")
            missing = [p for p in service["spec"]["ports"] if _resolve_port(container, p.get("targetPort", p["port"]))]
            if len(missing) != len(service["spec"]["ports"]):
                return [f"Service {service['metadata']['name']}: a port reaches no containerPort"]
            return []
    return [f"Service {service['metadata']['name']} selects no pods of this file ({selector})"]


def group_problems(docs: list[dict], group: dict) -> list[str]:
    """A StatefulSet of hosts: one pod per node, host ids from the ordinals, pod 0 the coordinator
    through the headless Service, the control secret from a Secret."""
    spec, problems = group["spec"]["template"]["spec"], []
    container = next(c for c in spec["containers"] if c["name"] == "hkserve")
    env = {e["name"]: e for e in container.get("env", [])}
    if int(env["HKSERVE_NUM_HOSTS"]["value"]) != group["spec"]["replicas"]:
        problems.append("HKSERVE_NUM_HOSTS is not the number of replicas")
    field = env.get("HKSERVE_HOST_ID", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if field != "metadata.labels['apps.kubernetes.io/pod-index']":
        problems.append(f"HKSERVE_HOST_ID is not the pod's ordinal ({field})")
    headless = next((d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"), {})
    host, _, port = env["HKSERVE_COORDINATOR"]["value"].partition(":")
    if (
        host != f"{group['metadata']['name']}-0.{group['spec']['serviceName']}"
        or headless.get("metadata", {}).get("name") != group["spec"]["serviceName"]
    ):
        problems.append(f"HKSERVE_COORDINATOR {host} is not pod 0 of the headless Service")
    if int(port) not in [p["port"] for p in headless.get("spec", {}).get("ports", [])]:
        problems.append("the coordinator port is not on the headless Service")
    anti = spec.get("affinity", {}).get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])
    if not any(t.get("topologyKey") == "kubernetes.io/hostname" for t in anti):
        problems.append("pods are not spread one per node")
    secret_dir = str(Path(env["HKSERVE_CONTROL_SECRET_FILE"]["value"]).parent)
    mount = next((m for m in container["volumeMounts"] if m["mountPath"] == secret_dir), {})
    volume = next((v for v in spec["volumes"] if v["name"] == mount.get("name")), {})
    if "secretName" not in volume.get("secret", {}):
        problems.append("HKSERVE_CONTROL_SECRET_FILE is not from a Secret")
    if group["spec"].get("podManagementPolicy") != "Parallel":
        problems.append("hosts do not start together (podManagementPolicy)")
    return problems


def manifest_problems(docs: list[dict]) -> list[str]:
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    problems = [p for w in workloads for p in workload_problems(docs, w)]
    problems += [p for d in docs if d["kind"] == "Service" for p in service_problems(d, workloads)]
    problems += [p for w in workloads if w["kind"] == "StatefulSet" for p in group_problems(docs, w)]
    return problems


def schema_errors(docs: list[dict]) -> list[str]:
    errors = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
            errors.append(f"{doc.get('kind')}: {e}")
    return errors


@pytest.mark.parametrize("path", [SINGLE, MULTI], ids=["single-host", "multi-host"])
def test_manifests_are_valid_kubernetes_and_meet_our_expectations(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert {d["kind"] for d in docs} >= {"PersistentVolumeClaim", "Service"}
    assert schema_errors(docs) == []
    assert manifest_problems(docs) == []


# -- Dockerfile ---------------------------------------------------------------------------------------


def dockerfile_problems(instructions: list[tuple[str, str]]) -> list[str]:
    problems = []
    stages = [i for i, (ins, _) in enumerate(instructions) if ins == "FROM"]
    final = instructions[stages[-1] :]
    first = next(args for ins, args in instructions if ins == "FROM")
    if not first.startswith("${BASE}") or not any(i == "ARG" and a.startswith("BASE=") for i, a in instructions):
        problems.append("the base is not the build argument BASE")
    order = [args for ins, args in instructions if ins in ("COPY", "RUN")]
    deps = next((n for n, a in enumerate(order) if "requirements.txt" in a and "pip install" in a), None)
    source = next((n for n, a in enumerate(order) if a.startswith("hkserve ")), None)
    if deps is None or source is None or deps > source:
        problems.append("the dependency layer is not installed before the source is copied")
    env = {}
    for ins, args in final:
        if ins == "ENV":
            env.update(pair.split("=", 1) for pair in args.split())
    last = {ins: args for ins, args in final}
    if last.get("USER") in (None, "root", "0"):
        problems.append(f"the final stage runs as {last.get('USER', 'root')}")
    if env.get("HKSERVE_HOME") not in json.loads(last.get("VOLUME", "[]")):
        problems.append("the store (HKSERVE_HOME) is not a VOLUME")
    if last.get("EXPOSE") != env.get("HKSERVE_PORT"):
        problems.append(f"EXPOSE {last.get('EXPOSE')} is not HKSERVE_PORT {env.get('HKSERVE_PORT')}")
    if not last.get("HEALTHCHECK", "").endswith('CMD ["hkserve-healthcheck"]'):
        problems.append(f"HEALTHCHECK {last.get('HEALTHCHECK')!r} is not the image's /health check")
    if last.get("STOPSIGNAL") != "SIGTERM":  # the signal hkserve drains on
        problems.append(f"STOPSIGNAL {last.get('STOPSIGNAL')}")
    if json.loads(last.get("ENTRYPOINT", "[]"))[-1:] != ["hkserve-entrypoint"]:
        problems.append("the entrypoint is not hkserve-entrypoint (HKSERVE_* variables to flags)")
    return problems


def test_dockerfile_meets_our_expectations():
    assert dockerfile_problems(dockerfile()) == []
    assert image_uid() != 0


def test_the_build_context_holds_what_the_dockerfile_copies_and_nothing_else():
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert patterns[0] == "*"  # an allowlist: no .venv, .git, runs/ or data/ in the context
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = {
        src.rstrip("/")
        for ins, args in dockerfile()
        if ins == "COPY" and not args.startswith("--from")
        for src in args.split()[:-1]
    }
    assert copied <= allowed, copied - allowed
    assert all((ROOT / p).exists() for p in allowed)


# -- every check, planted broken ----------------------------------------------------------------------


def _container(docs, kind="Deployment"):
    return next(d for d in docs if d["kind"] == kind)["spec"]["template"]["spec"]["containers"][0]


def _set(mapping: dict, key, value):
    mapping[key] = value


PLANTED = {  # name: (file, how it is broken)
    "compose: no published port": (COMPOSE, lambda d: d["services"]["hkserve"].pop("ports")),
    "compose: port not the server's": (
        COMPOSE,
        lambda d: _set(d["services"]["hkserve"]["environment"], "HKSERVE_PORT", "9000"),
    ),
    "compose: no GPU": (COMPOSE, lambda d: d["services"]["hkserve"].pop("deploy")),
    "compose: no store volume": (COMPOSE, lambda d: d["services"]["hkserve"].pop("volumes")),
    "compose: short grace": (COMPOSE, lambda d: _set(d["services"]["hkserve"], "stop_grace_period", "30s")),
    "compose: no restart": (COMPOSE, lambda d: d["services"]["hkserve"].pop("restart")),
    "compose: misspelt key": (COMPOSE, lambda d: _set(d["services"]["hkserve"], "healtcheck", {})),
    "k8s: wrong probe path": (SINGLE, lambda d: _set(_container(d)["readinessProbe"]["httpGet"], "path", "/healthz")),
    "k8s: probe on another port": (SINGLE, lambda d: _set(_container(d)["readinessProbe"]["httpGet"], "port", 9000)),
    "k8s: no container port": (SINGLE, lambda d: _container(d).pop("ports")),
    "k8s: liveness on /health": (SINGLE, lambda d: _set(_container(d)["livenessProbe"]["httpGet"], "path", "/health")),
    "k8s: Service to no port": (SINGLE, lambda d: _set(d[2]["spec"]["ports"][0], "targetPort", "web")),
    "k8s: Service selects nothing": (SINGLE, lambda d: _set(d[2]["spec"], "selector", {"app": "other"})),
    "k8s: no GPU": (SINGLE, lambda d: _container(d).pop("resources")),
    "k8s: claim not defined": (SINGLE, lambda d: d.pop(0)),
    "k8s: root": (SINGLE, lambda d: d[1]["spec"]["template"]["spec"].pop("securityContext")),
    "k8s: short grace": (SINGLE, lambda d: _set(d[1]["spec"]["template"]["spec"], "terminationGracePeriodSeconds", 30)),
    "k8s: service links": (SINGLE, lambda d: d[1]["spec"]["template"]["spec"].pop("enableServiceLinks")),
    "k8s: misspelt field": (SINGLE, lambda d: _set(_container(d), "readinesProbe", {})),
    "k8s: wrong type": (SINGLE, lambda d: _set(d[1]["spec"], "replicas", "one")),
    "group: coordinator not pod 0": (
        MULTI,
        lambda d: _set(_container(d, "StatefulSet")["env"][2], "value", "hkserve-group-1.hkserve-hosts:8476"),
    ),
    "group: hosts != replicas": (MULTI, lambda d: _set(d[2]["spec"], "replicas", 3)),
    "group: two pods on a node": (MULTI, lambda d: d[2]["spec"]["template"]["spec"].pop("affinity")),
    "group: secret not a Secret": (MULTI, lambda d: d[2]["spec"]["template"]["spec"]["volumes"][1].pop("secret")),
    "group: host id not the ordinal": (
        MULTI,
        lambda d: _set(_container(d, "StatefulSet")["env"], 0, {"name": "HKSERVE_HOST_ID", "value": "0"}),
    ),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_planted_error_is_caught(name):
    path, plant = PLANTED[name]
    if path == COMPOSE:
        doc = copy.deepcopy(yaml.safe_load(path.read_text()))
        plant(doc)
        assert compose_schema_errors(doc) + compose_problems(doc) != []
    else:
        docs = list(yaml.safe_load_all(path.read_text()))
        plant(docs)
        assert schema_errors(docs) + manifest_problems(docs) != []


@pytest.mark.parametrize(
    "old, new",
    [
        ("USER hkserve", "USER root"),
        ('VOLUME ["/models"]', 'VOLUME ["/data"]'),
        ("EXPOSE 8000", "EXPOSE 8080"),
        ("STOPSIGNAL SIGTERM", "STOPSIGNAL SIGKILL"),
        ('CMD ["hkserve-healthcheck"]', 'CMD ["true"]'),
        ("COPY pyproject.toml ./", "COPY pyproject.toml ./\nCOPY hkserve ./hkserve"),
        ("FROM ${BASE} AS deps", "FROM python:3.12 AS deps"),
    ],
)
def test_a_planted_dockerfile_error_is_caught(old, new):
    text = (ROOT / "Dockerfile").read_text()
    assert old in text
    assert dockerfile_problems(dockerfile(text.replace(old, new, 1))) != []
