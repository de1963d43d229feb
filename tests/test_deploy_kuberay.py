"""deploy/kuberay/: the manifests are valid for the APIs they target and wired together.

Nothing here runs Kubernetes (no cluster, no container engine): every check is offline.
Core objects (and each RayCluster pod template, as a core PodTemplate) go through
kubernetes-validate's strict schemas (unknown fields are errors) for the oldest and the
newest Kubernetes this deployment is checked against. The RayCluster and the PodMonitors
go through trimmed copies of their CRDs' schemas (tests/data/kuberay/, each file's header
says where it comes from and what was trimmed). The rest are the mistakes that valid YAML
still makes: a GPU too many, an event file that points at the wrong Service, a secret
that one pod never gets.
"""

from __future__ import annotations

import copy
import functools
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from orchestrator.config import EventConfig, parse_event

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
KUBERAY = ROOT / "deploy" / "kuberay"
DATA = Path(__file__).resolve().parent / "data" / "kuberay"
# The oldest Kubernetes the manifests are meant for, and the newest kubernetes-validate
# ships: a field added after the first or removed before the second fails one of them.
K8S_VERSIONS = ("1.30.0", "1.37.0")
CRDS = {"ray.io/v1": "raycluster-v1", "monitoring.coreos.com/v1": "podmonitor-v1"}
Doc = dict[str, Any]


@functools.cache
def manifests() -> tuple[tuple[str, Doc], ...]:
    out = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return tuple(out)


def one(kind: str, name: str) -> Doc:
    found = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def raycluster() -> Doc:
    return one("RayCluster", "babelcast")


def worker_group(name: str) -> Doc:
    groups: dict[str, Doc] = {g["groupName"]: g for g in raycluster()["spec"]["workerGroupSpecs"]}
    return groups[name]


def ray_templates() -> dict[str, Doc]:
    spec = raycluster()["spec"]
    out = {"head": spec["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    return out


def pod_template(kind: str, name: str) -> Doc:
    template: Doc = one(kind, name)["spec"]["template"]
    return template


def container(template: Doc, index: int = 0) -> Doc:
    # KubeRay runs Ray in a pod's first container; the other pods have one container.
    c: Doc = template["spec"]["containers"][index]
    return c


def event_text() -> str:
    text: str = one("ConfigMap", "babelcast-event")["data"]["event.yaml"]
    return text


@functools.cache
def event() -> EventConfig:
    return parse_event(event_text(), filename="event-configmap.yaml")


# ---- validators ---------------------------------------------------------------------

def core_problems(doc: Doc, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    return []


def _closed(schema: Any) -> Any:
    """Unknown fields are errors, as kubectl's strict field validation makes them."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_closed(v) for v in schema]
    return schema


def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


_FORMATS = jsonschema.FormatChecker()
_FORMATS.checks("int32")(_int32)
_FORMATS.checks("int64")(_int64)


@functools.cache
def crd_validator(api_version: str) -> jsonschema.Draft202012Validator:
    schema = _closed(yaml.safe_load((DATA / f"{CRDS[api_version]}.schema.yaml").read_text()))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=_FORMATS)


def crd_problems(doc: Doc) -> list[str]:
    errors = crd_validator(doc["apiVersion"]).iter_errors(doc)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]


def problems(doc: Doc, version: str = K8S_VERSIONS[0]) -> list[str]:
    """Every schema problem of one manifest, whichever API it belongs to."""
    if doc["apiVersion"] not in CRDS:
        return core_problems(doc, version)
    found = crd_problems(doc)
    if doc["kind"] == "RayCluster":
        spec = doc["spec"]
        templates = [spec["headGroupSpec"]["template"],
                     *(g["template"] for g in spec.get("workerGroupSpecs", []))]
        for t in templates:
            as_core = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": "ray-group"}, "template": t}
            found += core_problems(as_core, version)
    return found


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        op, has = e["operator"], e["key"] in labels
        if ((op == "In" and (not has or labels[e["key"]] not in e["values"]))
                or (op == "NotIn" and has and labels[e["key"]] in e["values"])
                or (op == "Exists" and not has) or (op == "DoesNotExist" and has)):
            return False
    return True


def secret_envs(c: Doc) -> dict[str, tuple[str, str]]:
    """env name -> (Secret name, key) for a container's variables taken from Secrets."""
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"],
                        e["valueFrom"]["secretKeyRef"]["key"])
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}


def mounted(c: Doc, path: str) -> bool:
    return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
               for m in c.get("volumeMounts", []))


# ---- schemas -------------------------------------------------------------------------

def test_every_manifest_is_in_the_kustomization() -> None:
    listed = yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted({name for name, _ in manifests()})


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_passes_strict_validation(version: str) -> None:
    kinds = {d["kind"] for _, d in manifests()}
    assert {"Deployment", "Service", "StatefulSet", "ConfigMap", "RayCluster",
            "PodMonitor"} <= kinds
    found = {f"{name} {d['kind']}/{d['metadata']['name']}": problems(d, version)
             for name, d in manifests()}
    assert {k: v for k, v in found.items() if v} == {}


def _mutations() -> Iterator[tuple[str, str, Any]]:
    def typo_in_container(d: Doc) -> None:
        c = d["spec"]["template"]["spec"]["containers"][0]
        c["commnd"] = c.pop("command")

    def typo_in_ray_pod_template(d: Doc) -> None:
        c = d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        c["volumeMount"] = c.pop("volumeMounts")

    def gpu_as_list(d: Doc) -> None:
        c = d["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]
        c["resources"]["limits"]["nvidia.com/gpu"] = [1]

    def no_min_replicas(d: Doc) -> None:
        del d["spec"]["workerGroupSpecs"][0]["minReplicas"]

    def typo_in_raycluster(d: Doc) -> None:
        d["spec"]["workerGroupSpec"] = d["spec"].pop("workerGroupSpecs")

    def replicas_as_string(d: Doc) -> None:
        d["spec"]["workerGroupSpecs"][1]["replicas"] = "2"

    def replicas_past_int32(d: Doc) -> None:
        d["spec"]["workerGroupSpecs"][1]["replicas"] = 2**31

    def head_service_unchecked(d: Doc) -> None:
        d["spec"]["headGroupSpec"]["headService"] = {"spec": {"type": "NodePort"}}

    def typo_in_podmonitor(d: Doc) -> None:
        d["spec"]["podMetricEndpoints"] = d["spec"].pop("podMetricsEndpoints")

    def bad_interval(d: Doc) -> None:
        d["spec"]["podMetricsEndpoints"][0]["interval"] = "10 seconds"

    def no_selector(d: Doc) -> None:
        del d["spec"]["selector"]

    yield "gateway.yaml", "Deployment", typo_in_container
    yield "raycluster.yaml", "RayCluster", typo_in_ray_pod_template
    yield "raycluster.yaml", "RayCluster", gpu_as_list
    yield "raycluster.yaml", "RayCluster", no_min_replicas
    yield "raycluster.yaml", "RayCluster", typo_in_raycluster
    yield "raycluster.yaml", "RayCluster", replicas_as_string
    yield "raycluster.yaml", "RayCluster", replicas_past_int32
    yield "raycluster.yaml", "RayCluster", head_service_unchecked
    yield "podmonitor.yaml", "PodMonitor", typo_in_podmonitor
    yield "podmonitor.yaml", "PodMonitor", bad_interval
    yield "podmonitor.yaml", "PodMonitor", no_selector


@pytest.mark.parametrize(("file", "kind", "mutate"), list(_mutations()),
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_broken_manifest_is_rejected(file: str, kind: str, mutate: Any) -> None:
    doc = copy.deepcopy(next(d for name, d in manifests() if name == file and d["kind"] == kind))
    assert problems(doc) == []
    mutate(doc)
    assert problems(doc) != []


# ---- Ray -----------------------------------------------------------------------------

def test_the_gpu_worker_group_asks_for_exactly_one_gpu_per_pod() -> None:
    resources = container(worker_group("gpu")["template"])["resources"]
    assert resources["limits"]["nvidia.com/gpu"] in (1, "1")
    assert resources.get("requests", {}).get("nvidia.com/gpu", "1") in (1, "1")


def test_only_the_gpu_group_has_gpus() -> None:
    for group, template in ray_templates().items():
        if group == "gpu":
            continue
        for c in template["spec"]["containers"]:
            for part in ("limits", "requests"):
                assert not any("gpu" in r for r in c.get("resources", {}).get(part, {})), group
        assert "num-gpus" not in (raycluster()["spec"]["headGroupSpec"]["rayStartParams"])


def test_the_gpu_group_has_one_gpu_per_asr_actor_of_the_event() -> None:
    e = event().engine
    assert e.kind == "vllm" and e.vllm is not None
    per_gpu = e.vllm.engines_per_gpu
    group = worker_group("gpu")
    needed = -(-e.actors // per_gpu)
    # No autoscaler: a fixed pool, as many pods as the event's ASR actors need.
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == needed
    assert raycluster()["spec"]["enableInTreeAutoscaling"] is False


def test_gpu_workers_mount_the_model_folder_read_only() -> None:
    c = container(worker_group("gpu")["template"])
    model = event().engine.model
    mount = next(m for m in c["volumeMounts"] if model.startswith(m["mountPath"] + "/"))
    assert mount.get("readOnly") is True


def test_the_event_points_at_the_head_services_ray_client_port() -> None:
    ports = {p["name"]: p["containerPort"] for p in container(ray_templates()["head"])["ports"]}
    # KubeRay names the head Service <cluster>-head-svc and gives it the declared ports.
    assert event().ray.address == f"ray://{raycluster()['metadata']['name']}-head-svc:" \
                                  f"{ports['client']}"


def test_the_event_points_at_the_redis_service() -> None:
    url = urlsplit(event().redis.url or "")
    service = one("Service", url.hostname or "")
    port = next(p for p in service["spec"]["ports"] if p["port"] == url.port)
    redis = one("StatefulSet", url.hostname or "")
    labels = redis["spec"]["template"]["metadata"]["labels"]
    assert selects({"matchLabels": service["spec"]["selector"]}, labels)
    c = container(redis["spec"]["template"])
    assert port["targetPort"] in {p["name"] for p in c["ports"]}


def test_every_object_is_in_one_namespace() -> None:
    # The event file names Services by their short names, which resolve within one.
    spaces = {d["metadata"].get("namespace") for _, d in manifests() if d["kind"] != "Namespace"}
    assert spaces == {one("Namespace", "babelcast")["metadata"]["name"]}


def test_ray_and_the_orchestrator_run_the_same_ray() -> None:
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    pinned = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    assert pinned and raycluster()["spec"]["rayVersion"] == pinned.group(1)
    # Ray Client wants the same Ray and Python on both ends: one image (the gpu tag adds
    # vLLM on top of the same build).
    images = {container(t)["image"] for t in ray_templates().values()}
    images |= {container(pod_template("Deployment", n))["image"]
               for n in ("babelcast-orchestrator", "babelcast-gateway")}
    assert {i.removesuffix("-vllm") for i in images} == {"registry.example.org/babelcast:0.1.0"}


def test_the_dockerfile_copies_every_package_the_project_installs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed |= {"pyproject.toml", project["project"]["readme"]}
    copied: set[str] = set()
    for line in (KUBERAY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied |= set(shlex.split(line)[1:-1])
    assert needed <= copied


# ---- the event, its pods and its secrets -------------------------------------------

def test_the_configmaps_event_passes_the_projects_validator() -> None:
    cfg = event()
    assert cfg.ray.address and cfg.redis.url and cfg.auth is not None
    assert cfg.gateway.host == "0.0.0.0"


@pytest.mark.parametrize(("name", "argv0"), [("babelcast-gateway", ["babelcast", "gateway"]),
                                             ("babelcast-orchestrator", ["babelcast", "run"])])
def test_each_deployment_runs_its_command_on_the_mounted_event(name: str,
                                                               argv0: list[str]) -> None:
    template = pod_template("Deployment", name)
    c = container(template)
    assert c["command"][:2] == argv0
    path = Path(c["command"][2])
    mount = next(m for m in c["volumeMounts"] if str(path.parent) == m["mountPath"])
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "babelcast-event"
    assert path.name in one("ConfigMap", "babelcast-event")["data"]
    assert {p["containerPort"] for p in c["ports"]} == {event().gateway.port}


def test_one_orchestrator_at_a_time() -> None:
    spec = one("Deployment", "babelcast-orchestrator")["spec"]
    # Two runs of one event would make actors under the same names.
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"


def test_archives_are_written_to_a_volume_of_the_orchestrator() -> None:
    template = pod_template("Deployment", "babelcast-orchestrator")
    archive_dir = event().outputs.archive.resolved_dir
    assert archive_dir is not None and mounted(container(template), str(archive_dir))


def test_the_gateway_service_routes_to_the_gateways_only() -> None:
    selector = {"matchLabels": one("Service", "babelcast-gateway")["spec"]["selector"]}
    assert selects(selector, pod_template("Deployment", "babelcast-gateway")["metadata"]["labels"])
    assert not selects(selector,
                       pod_template("Deployment", "babelcast-orchestrator")["metadata"]["labels"])


def _needed_envs(cfg: EventConfig) -> dict[str, set[str]]:
    """Pod -> the environment variables the event names that it reads."""
    auth = cfg.auth
    assert auth is not None
    auth_envs = {auth.admin_token_env, auth.scrape_token_env, auth.signing_key_env,
                 *auth.publish_token_env.values()} - {None}
    run_envs = {s.key_env for s in cfg.streams} | {cfg.engine.token_env}
    run_envs |= {y.url_env for y in cfg.outputs.youtube}
    mt = {cfg.translation.openai.api_key_env} if cfg.translation.openai else set()
    needed = {"gateway": set(auth_envs), "orchestrator": auth_envs | run_envs}
    # Translators run on whichever Ray pod Ray picks, and read their key there.
    needed.update({f"ray-{group}": set(mt) for group in ray_templates()})
    return {pod: {e for e in envs if e} for pod, envs in needed.items()}


def _pod_containers() -> dict[str, Doc]:
    pods = {"gateway": container(pod_template("Deployment", "babelcast-gateway")),
            "orchestrator": container(pod_template("Deployment", "babelcast-orchestrator"))}
    pods.update({f"ray-{g}": container(t) for g, t in ray_templates().items()})
    return pods


def test_every_variable_the_event_names_comes_from_a_secret_in_the_pods_that_read_it() -> None:
    needed = _needed_envs(event())
    assert {"BABELCAST_ADMIN_TOKEN", "BABELCAST_SIGNING_KEY"} <= needed["gateway"]
    pods = _pod_containers()
    missing = {pod: sorted(envs - secret_envs(pods[pod]).keys())
               for pod, envs in needed.items()}
    assert {p: m for p, m in missing.items() if m} == {}
    # One variable, one secret key, in every pod that has it.
    sources: dict[str, set[tuple[str, str]]] = {}
    for c in pods.values():
        for name, ref in secret_envs(c).items():
            sources.setdefault(name, set()).add(ref)
    assert {n: s for n, s in sources.items() if len(s) > 1} == {}


def test_no_secret_is_committed_and_the_docs_create_every_key_the_manifests_use() -> None:
    assert not [d for _, d in manifests() if d["kind"] == "Secret"]
    for c in _pod_containers().values():
        assert not [e for e in c.get("env", []) if "value" in e and e["name"].endswith(
            ("TOKEN", "KEY"))]
    used = {ref for c in _pod_containers().values() for ref in secret_envs(c).values()}
    used |= {(ep["authorization"]["credentials"]["name"], ep["authorization"]["credentials"]["key"])
             for _, d in manifests() if d["kind"] == "PodMonitor"
             for ep in d["spec"]["podMetricsEndpoints"] if "authorization" in ep}
    docs = (ROOT / "docs" / "deployment.md").read_text()
    command = re.search(r"kubectl -n babelcast create secret generic (\S+)(.*?)\n\n", docs, re.S)
    assert command, "docs/deployment.md must show the kubectl command that makes the Secret"
    keys = set(re.findall(r"--from-literal=([a-z0-9-]+)=", command.group(2)))
    assert used == {(command.group(1), k) for k in keys}


# ---- Redis ---------------------------------------------------------------------------

def test_redis_keeps_an_append_only_file_on_a_persistent_volume() -> None:
    redis = one("StatefulSet", "babelcast-redis")
    assert redis["spec"]["replicas"] == 1
    c = container(redis["spec"]["template"])
    argv = [*c.get("command", []), *c.get("args", [])]
    assert argv[argv.index("--appendonly") + 1] == "yes"
    data_dir = argv[argv.index("--dir") + 1]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == data_dir)
    claims = {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims


# ---- Prometheus ----------------------------------------------------------------------

def _rules_jobs() -> set[str]:
    rules = (ROOT / "deploy" / "prometheus" / "rules" / "babelcast.rules.yml").read_text()
    return set(re.findall(r'up\{job="([a-z]+)"\}', rules))


def test_prometheus_scrapes_the_gateways_and_the_orchestrator_with_the_scrape_token() -> None:
    monitor = one("PodMonitor", "babelcast")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["path"] == "/metrics"
    auth = event().auth
    assert auth is not None and auth.scrape_token_env
    for name in ("babelcast-gateway", "babelcast-orchestrator"):
        template = pod_template("Deployment", name)
        assert selects(monitor["spec"]["selector"], template["metadata"]["labels"]), name
        c = container(template)
        assert endpoint["port"] in {p["name"] for p in c["ports"]}
        token = endpoint["authorization"]["credentials"]
        assert secret_envs(c)[auth.scrape_token_env] == (token["name"], token["key"])
    assert not selects(monitor["spec"]["selector"], ray_templates()["head"]["metadata"]["labels"])


def test_prometheus_scrapes_every_ray_pods_metrics_port() -> None:
    monitor = one("PodMonitor", "babelcast-ray")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    spec = raycluster()["spec"]
    params = [spec["headGroupSpec"]["rayStartParams"],
              *(g["rayStartParams"] for g in spec["workerGroupSpecs"])]
    for params_, (group, template) in zip(params, ray_templates().items(), strict=True):
        assert selects(monitor["spec"]["selector"], template["metadata"]["labels"]), group
        ports = {p["name"]: p["containerPort"] for p in container(template)["ports"]}
        assert str(ports[endpoint["port"]]) == params_["metrics-export-port"], group


def test_scrape_jobs_are_named_as_the_alert_rules_expect() -> None:
    jobs = {r["replacement"] for _, d in manifests() if d["kind"] == "PodMonitor"
            for ep in d["spec"]["podMetricsEndpoints"] for r in ep.get("relabelings", [])
            if r.get("targetLabel") == "job"}
    assert jobs == _rules_jobs() == {"babelcast", "ray"}
