"""deploy/kubernetes checked without a cluster: each overlay is rendered (a small kustomize in Python below,
checked against the real `kubectl kustomize` where one is installed), every document is validated against the
pinned Kubernetes API schemas (kubernetes-validate), and the objects are checked against each other, the image
(docker/Dockerfile, docker/healthcheck.py) and the settings shared/config.py reads."""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagoda.services.api.tenants import add_key
from pagoda.shared.config import env_names

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (test extra) missing")

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
KUBERNETES_VERSION = "1.31.0"  # the API the manifests target; kubernetes-validate ships its schemas
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
COMPONENTS = {"api", "tokenizer", "scheduler", "worker"}
Doc = dict[str, Any]


# ------------------------------------------------------------------ a small kustomize


def kustomize(folder: Path) -> list[Doc]:
    """Render a kustomization: the subset these manifests use (resources, configMapGenerator without hash
    suffixes, JSON 6902 patches, replicas, images), applied in kustomize's order."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - {"apiVersion", "kind", "resources", "patches", "images", "replicas", "configMapGenerator",
                           "generatorOptions"}
    assert not unknown, f"{folder}: the test's renderer does not know {sorted(unknown)}"
    docs: list[Doc] = []
    for resource in spec.get("resources", []):
        path = (folder / resource).resolve()
        docs += kustomize(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for generator in spec.get("configMapGenerator", []):
        assert spec.get("generatorOptions", {}).get("disableNameSuffixHash"), "hash suffixes are not rendered here"
        assert generator.get("behavior", "create") == "create"
        data = {Path(name).name: (folder / name).read_text() for name in generator.get("files", [])}
        data.update(literal.split("=", 1) for literal in generator.get("literals", []))
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    for patch in spec.get("patches", []):
        operations = yaml.safe_load(patch["patch"])
        assert isinstance(operations, list), "only JSON 6902 patches are rendered here"
        targets = [d for d in docs if _is_target(d, patch["target"])]
        assert targets, f"{folder}: a patch matches nothing: {patch['target']}"
        for doc in targets:
            for operation in operations:
                json_patch(doc, operation)
    for replicas in spec.get("replicas", []):
        [doc] = [d for d in docs if d["kind"] in WORKLOAD_KINDS and d["metadata"]["name"] == replicas["name"]]
        doc["spec"]["replicas"] = replicas["count"]
    for image in spec.get("images", []):
        for doc in docs:
            for container in pod_spec(doc).get("containers", []) if doc["kind"] in WORKLOAD_KINDS else []:
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}".rstrip(":")
    return docs


def _is_target(doc: Doc, target: dict[str, str]) -> bool:
    return doc["kind"] == target.get("kind", doc["kind"]) and doc["metadata"]["name"] == target.get(
        "name", doc["metadata"]["name"])


def json_patch(doc: Any, operation: dict[str, Any]) -> None:
    """One RFC 6902 operation (add, remove, replace, test) in place."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]]
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    op = operation["op"]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op == "add":
            node.insert(index, copy.deepcopy(operation["value"]))
            return
        assert 0 <= index < len(node), operation["path"]
    else:
        index = last
        assert op == "add" or index in node, f"{op}: no {operation['path']}"
    if op in ("add", "replace"):
        node[index] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del node[index]
    elif op == "test":
        assert node[index] == operation["value"], f"test failed at {operation['path']}"
    else:
        raise AssertionError(f"unsupported patch op {op}")


# ------------------------------------------------------------------ helpers


def pod_spec(doc: Doc) -> Doc:
    return doc["spec"]["template"]["spec"]


def workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def by_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def component(container: Doc) -> str:
    """Which pagoda service a container runs, from its args."""
    match = re.search(r"-m pagoda\.services\.(\w+)", " ".join(container.get("args", [])))
    assert match, f"container {container['name']} runs no pagoda service"
    return match.group(1)


def container_env(doc: Doc, container: Doc, docs: list[Doc]) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: envFrom ConfigMaps, then env (which wins), with
    $(VAR) references to earlier variables expanded; values from secrets or fields stay as '<from ...>'."""
    config_maps = by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]]["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[item["name"]] = f"{doc['metadata']['name']}-<ordinal>"
        else:
            env[item["name"]] = f"<from {next(iter(item['valueFrom']))}>"
    return env


def pagoda_containers(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    return [(doc, c) for doc in workloads(docs) for c in pod_spec(doc)["containers"]]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, kustomize(K8S / "overlays" / request.param)


# ------------------------------------------------------------------ rendering and schema validation


def test_there_are_the_overlays_the_operations_guide_names() -> None:
    assert {"cpu-smollm2", "gpu-tp2", "replicas"} <= set(OVERLAYS)
    guide = (REPO / "docs" / "operations.md").read_text()
    for name in OVERLAYS:
        assert f"overlays/{name}" in guide, f"docs/operations.md does not mention overlay {name}"


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("name", OVERLAYS)
def test_renderer_agrees_with_real_kustomize(name: str) -> None:
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed: the Python renderer stands alone")
    result = subprocess.run([*command, str(K8S / "overlays" / name)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

    def keyed(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    real = keyed([d for d in yaml.safe_load_all(result.stdout) if d])
    ours = keyed(kustomize(K8S / "overlays" / name))
    assert sorted(real) == sorted(ours)
    for key in real:
        assert real[key] == ours[key], key


def test_every_document_is_valid_kubernetes(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "PersistentVolumeClaim", "Service", "Deployment", "StatefulSet", "HorizontalPodAutoscaler",
            "PodDisruptionBudget"} <= kinds, name
    for doc in docs:
        # strict: unknown fields are errors too (a misspelt key would otherwise be dropped by the API server)
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_broken_documents() -> None:
    docs = kustomize(K8S / "overlays" / "cpu-smollm2")
    engine = by_kind(docs, "StatefulSet")["pagoda-engine"]
    kubernetes_validate.validate(engine, KUBERNETES_VERSION, strict=True)  # the unbroken one passes
    breaks = [
        lambda d: pod_spec(d)["containers"][0].update(readinesProbe={}),  # misspelt key
        lambda d: d["spec"].update(replicas="two"),
        lambda d: pod_spec(d)["containers"][0].pop("name"),
        lambda d: pod_spec(d)["containers"][0]["livenessProbe"].update(periodSeconds="10s"),
    ]
    for index, change in enumerate(breaks):
        broken = copy.deepcopy(engine)
        change(broken)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
            pytest.fail(f"break {index} passed validation")


# ------------------------------------------------------------------ workloads


def test_every_container_runs_a_service_from_the_image_with_probes(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    healthcheck_services = set(re.findall(r"\w+", re.search(
        r"api\|tokenizer\|scheduler\|worker", (REPO / "docker" / "healthcheck.py").read_text()).group(0)))
    copied = (REPO / "docker" / "Dockerfile").read_text()
    assert "COPY docker/healthcheck.py /opt/pagoda/healthcheck.py" in copied
    seen = set()
    for doc, container in pagoda_containers(docs):
        service = component(container)
        seen.add(service)
        assert container["image"] == "pagoda:latest", (name, container["name"])
        # args, not command: the image's ENTRYPOINT (tini, which forwards SIGTERM for a clean drain) stays
        assert "command" not in container, (name, container["name"])
        assert "readinessProbe" in container and "livenessProbe" in container, (name, container["name"])
        for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = container.get(probe_name)
            if probe is None:
                continue
            if "httpGet" in probe:
                ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
                assert probe["httpGet"]["port"] in ports, (name, container["name"], probe_name)
                continue
            command = probe["exec"]["command"]
            script = next(a for a in command if a.endswith(".py"))
            argument = command[command.index(script) + 1]
            assert argument == service, (name, container["name"], probe_name, command)
            if script == "/opt/pagoda/healthcheck.py":
                assert argument in healthcheck_services
            else:
                assert script == "/opt/pagoda-probes/liveness.py", script
                mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                volumes = {v["name"]: v for v in pod_spec(doc)["volumes"]}
                config_map = by_kind(docs, "ConfigMap")[volumes[mounts["/opt/pagoda-probes"]]["configMap"]["name"]]
                assert "liveness.py" in config_map["data"]
        security = container.get("securityContext", {})
        assert security.get("allowPrivilegeEscalation") is False, (name, container["name"])
        assert pod_spec(doc)["securityContext"]["runAsNonRoot"] is True
    assert seen == COMPONENTS, name


def test_api_readiness_is_health_and_liveness_does_not_depend_on_peers(overlay: tuple[str, list[Doc]],
                                                                       tmp_path: Path) -> None:
    from tests.test_metrics_access import OPERATOR_KEY, serve

    _, docs = overlay
    [api] = [c for _, c in pagoda_containers(docs) if component(c) == "api"]
    assert api["readinessProbe"]["httpGet"]["path"] == "/health"
    # The kubelet sends no key: each probe's path is asked, without one, of an api whose every other route is
    # closed (a keys file, an operator key, /metrics by key) and that has no tokenizer or scheduler behind it.
    probes = {name: api[name]["httpGet"] for name in ("readinessProbe", "livenessProbe", "startupProbe") if name in api}
    assert all(not probe.get("httpHeaders") for probe in probes.values())  # no key written into a manifest
    keys_path = tmp_path / "keys.json"
    add_key(keys_path, "acme", {})
    answers = serve(tmp_path, [("GET", probe["path"], {}) for probe in probes.values()],
                    api_keys_file=str(keys_path), api_key=OPERATOR_KEY, metrics_access="key")
    statuses = dict(zip(probes, (status for status, _ in answers), strict=True))
    # /health is 503 while a tokenizer or the worker is missing (here): as liveness it would restart a healthy api
    assert statuses["readinessProbe"] == 503
    assert statuses["livenessProbe"] == 200, statuses


def test_engine_pods_request_gpus_per_worker_rank(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    engine = by_kind(docs, "StatefulSet")["pagoda-engine"]
    containers = pod_spec(engine)["containers"]
    workers = [c for c in containers if component(c) == "worker"]
    schedulers = [c for c in containers if component(c) == "scheduler"]
    assert len(schedulers) == 1
    envs = [container_env(engine, c, docs) for c in workers]
    tp_size = int(envs[0].get("PAGODA_TENSOR_PARALLEL_SIZE", "1"))
    assert len(workers) == tp_size, name
    assert sorted(int(env.get("PAGODA_WORKER_RANK", "0")) for env in envs) == list(range(tp_size))
    on_cpu = envs[0].get("PAGODA_DEVICE") == "cpu"
    for worker in workers:
        gpus = worker["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (None if on_cpu else 1), (name, worker["name"], gpus)
    assert all("nvidia.com/gpu" not in c["resources"].get("limits", {}) for c in schedulers)
    assert not any(component(c) == "worker" for d in by_kind(docs, "Deployment").values()
                   for c in pod_spec(d)["containers"])
    if tp_size > 1:
        addresses = {env["PAGODA_TP_INIT_ADDRESS"] for env in envs}
        assert len(addresses) == 1 and addresses.pop().startswith("tcp://127.0.0.1:")  # ranks share the pod
        assert all(any(m["mountPath"] == "/dev/shm" for m in w["volumeMounts"]) for w in workers)


def test_the_models_come_read_only_from_the_claim(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    claims = by_kind(docs, "PersistentVolumeClaim")
    for doc, container in pagoda_containers(docs):
        env = container_env(doc, container, docs)
        volumes = {v["name"]: v for v in pod_spec(doc).get("volumes", [])}
        mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
        if component(container) in ("worker", "tokenizer"):  # the processes that read weights or a tokenizer
            assert env["PAGODA_MODEL"].startswith("/models/"), (name, container["name"])
            mount = mounts["/models"]
            assert mount["readOnly"] is True
            claim = volumes[mount["name"]]["persistentVolumeClaim"]
            assert claim["claimName"] in claims and claim["readOnly"] is True
    for claim in claims.values():
        assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]  # pods on several nodes mount it at once


def test_environment_names_only_real_settings(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    known = set(env_names())
    for config_map in by_kind(docs, "ConfigMap").values():
        keys = {k for k in config_map.get("data", {}) if k.startswith("PAGODA_")}
        assert keys <= known, f"{name}: ConfigMap sets variables no service reads: {sorted(keys - known)}"
    for doc, container in pagoda_containers(docs):
        env = container_env(doc, container, docs)
        for key in env:
            assert key in known or not key.startswith("PAGODA_"), (name, container["name"], key)
        # Per-process identities: a tokenizer id in a template would be shared by every replica of the pod.
        assert "PAGODA_TOKENIZER_ID" not in env and "PAGODA_API_INDEX" not in env
        if component(container) != "worker":
            assert "PAGODA_WORKER_RANK" not in env


def _endpoint(value: str) -> tuple[str, int]:
    match = re.fullmatch(r"tcp://([^:/]+):(\d+)", value)
    assert match, f"not a tcp:// endpoint: {value}"
    return match.group(1), int(match.group(2))


def _reaches(key: str, value: str, docs: list[Doc], own_pod: Doc) -> set[str]:
    """The services a connect address reaches: on loopback, the containers of the same pod that bind the same
    address; otherwise those behind a Service (pod-N.headless names one pod of a StatefulSet)."""
    host, port = _endpoint(value)
    pods = pagoda_containers(docs)
    if host == "127.0.0.1":
        def binds_here(bound: str | None) -> bool:  # the same address, or a host name (binds every interface)
            return bound == value or (bound is not None and _endpoint(bound)[1] == port
                                      and not re.fullmatch(r"[\d.]+", _endpoint(bound)[0]))

        return {component(c) for d, c in pods if d is own_pod and binds_here(container_env(d, c, docs).get(key))}
    pod_name, _, service_name = host.rpartition(".")
    service = by_kind(docs, "Service")[service_name]
    if pod_name:
        assert service["spec"]["clusterIP"] == "None", f"{host}: per-pod names need a headless Service"
        owner, _, ordinal = pod_name.rpartition("-")
        stateful = by_kind(docs, "StatefulSet")[owner]
        assert stateful["spec"]["serviceName"] == service_name
        assert ordinal == "<ordinal>" or int(ordinal) < stateful["spec"]["replicas"], host
    [service_port] = [p for p in service["spec"]["ports"] if p["port"] == port]
    return {component(c) for d, c in pods
            if selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
            and any(p["name"] == service_port["targetPort"] and p["containerPort"] == port
                    for p in c.get("ports", []))}


def test_every_endpoint_reaches_the_service_that_binds_it(overlay: tuple[str, list[Doc]]) -> None:
    """Who binds what (shared/config.py): scheduler: scheduler, plan, result, stats endpoints; api: its api
    endpoint. Every connecting side's address must lead to a container of the binding service."""
    name, docs = overlay
    binder = {"PAGODA_SCHEDULER_ENDPOINT": "scheduler", "PAGODA_PLAN_ENDPOINT": "scheduler",
              "PAGODA_RESULT_ENDPOINT": "scheduler", "PAGODA_STATS_ENDPOINT": "scheduler",
              "PAGODA_API_ENDPOINTS": "api", "PAGODA_REGISTRY_ENDPOINT": "scheduler"}
    # apis and tokenizers are given no list of each other: they meet in the registry
    needs = {"api": {"PAGODA_STATS_ENDPOINT", "PAGODA_API_ENDPOINTS", "PAGODA_REGISTRY_ENDPOINT"},
             # workers and tokenizers: their liveness probes read the scheduler's stats
             "tokenizer": {"PAGODA_REGISTRY_ENDPOINT", "PAGODA_STATS_ENDPOINT"},
             "worker": {"PAGODA_PLAN_ENDPOINT", "PAGODA_RESULT_ENDPOINT", "PAGODA_STATS_ENDPOINT"},
             "scheduler": {"PAGODA_SCHEDULER_ENDPOINT", "PAGODA_PLAN_ENDPOINT", "PAGODA_RESULT_ENDPOINT",
                           "PAGODA_STATS_ENDPOINT", "PAGODA_REGISTRY_ENDPOINT"}}
    plan_ports: set[int] = set()
    for doc, container in pagoda_containers(docs):
        service = component(container)
        env = container_env(doc, container, docs)
        for key in needs[service]:
            for value in env[key].split(","):
                host, port = _endpoint(value)
                if service == binder[key]:
                    # the binding side: its container must declare the port it binds, unless pod-local
                    if host != "127.0.0.1":
                        assert port in {p["containerPort"] for p in container["ports"]}, (name, key)
                    continue
                reached = _reaches(key, value, docs, doc)
                assert binder[key] in reached, f"{name}: {container['name']} {key}={value} reaches {reached}"
                if key in ("PAGODA_PLAN_ENDPOINT", "PAGODA_RESULT_ENDPOINT"):
                    assert host == "127.0.0.1", f"{name}: {key} leaves the engine pod"
                    plan_ports.add(port)
    # Worker endpoints stay inside the engine pod: plans and results never cross the network.
    assert plan_ports


def test_services_and_disruption_budgets_select_real_pods(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    templates = [(d, d["spec"]["template"]["metadata"]["labels"]) for d in workloads(docs)]
    for kind in ("Service", "PodDisruptionBudget"):
        for obj_name, obj in by_kind(docs, kind).items():
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector) if kind == "PodDisruptionBudget" else selector
            matched = [d["metadata"]["name"] for d, labels in templates if selects(selector, labels)]
            assert len(matched) == 1, f"{name}: {kind} {obj_name} selects {matched}"
    for doc in workloads(docs):
        assert selects(doc["spec"]["selector"]["matchLabels"], doc["spec"]["template"]["metadata"]["labels"])
        assert any(selects(p["spec"]["selector"]["matchLabels"], doc["spec"]["template"]["metadata"]["labels"])
                   for p in by_kind(docs, "PodDisruptionBudget").values()), f"{name}: no PDB for {doc['kind']}"
    for service in by_kind(docs, "Service").values():
        for port in service["spec"]["ports"]:
            targets = [p for d, labels in templates if selects(service["spec"]["selector"], labels)
                       for c in pod_spec(d)["containers"] for p in c.get("ports", [])
                       if p["name"] == port["targetPort"]]
            assert len(targets) == 1, (service["metadata"]["name"], port)
    assert "PAGODA_API_ENDPOINTS" not in by_kind(docs, "ConfigMap")["pagoda-config"]["data"]  # no fixed list
    assert by_kind(docs, "Service")["pagoda-engine"]["spec"]["publishNotReadyAddresses"] is True


def test_autoscalers_target_deployments_with_cpu_requests(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    deployments = by_kind(docs, "Deployment")
    scaled = set()
    for hpa in by_kind(docs, "HorizontalPodAutoscaler").values():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in deployments, (name, target)
        scaled.add(target["name"])
        deployment = deployments[target["name"]]
        assert hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["spec"]["maxReplicas"], name
        # a CPU utilization target is relative to the request: every container needs one
        assert all("cpu" in c["resources"]["requests"] for c in pod_spec(deployment)["containers"])
    assert scaled == set(deployments) == {"pagoda-api", "pagoda-tokenizer"}
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    # Until registry discovery lands each tokenizer reaches one api: keep more tokenizers than apis.
    assert hpas["pagoda-tokenizer"]["spec"]["minReplicas"] >= hpas["pagoda-api"]["spec"]["maxReplicas"]


def test_engine_replicas_have_stable_names(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    engine = by_kind(docs, "StatefulSet")["pagoda-engine"]
    assert engine["spec"]["replicas"] == (2 if name == "replicas" else 1)
    assert by_kind(docs, "Service")[engine["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"


def test_tokenizer_ids_carry_the_host_name_the_liveness_probe_looks_for(overlay: tuple[str, list[Doc]]) -> None:
    _, docs = overlay
    [tokenizer] = [c for _, c in pagoda_containers(docs) if component(c) == "tokenizer"]
    # Kubernetes turns $$ into $; the shell then adds a start time, so each start of the process differs.
    assert '--tokenizer-id "${HOSTNAME}-$$(date +%s%N)"' in tokenizer["args"][-1]
    assert tokenizer["args"][-1].startswith("exec ")  # the process gets tini's SIGTERM, not the shell


# ------------------------------------------------------------------ the liveness probe script


def _liveness_module() -> Any:
    spec = importlib.util.spec_from_file_location("pagoda_k8s_liveness", K8S / "base" / "liveness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stats(**changes: Any) -> Any:
    from pagoda.shared.messages import SchedulerStats

    fields = dict(time=0.0, num_running=0, num_waiting=0, kv_blocks_free=10, kv_blocks_total=10, kv_cache_usage=0.0,
                  prefix_hit_tokens_total=0, prefix_query_tokens_total=0, num_preemptions_total=0,
                  prompt_tokens_total=0, generation_tokens_total=0, num_steps_total=0, worker_ready=True,
                  worker_alive=True, tokenizer_ids=["pagoda-tokenizer-abc-1700000000"], tokenizer_requests_total=[0])
    fields.update(changes)
    return SchedulerStats(**fields)


def test_liveness_verdicts() -> None:
    live = _liveness_module()
    host = "pagoda-tokenizer-abc"
    assert live.is_alive("worker", _stats(), host)
    assert not live.is_alive("worker", _stats(worker_alive=False), host)  # hung: silent past the timeout
    assert live.is_alive("worker", _stats(worker_ready=False, worker_alive=False), host)  # still loading
    assert live.is_alive("tokenizer", _stats(), host)
    assert not live.is_alive("tokenizer", _stats(tokenizer_ids=["pagoda-tokenizer-abcd-1"]), host)  # not a prefix
    assert not live.is_alive("tokenizer", _stats(tokenizer_ids=[]), host)
    for service in ("worker", "tokenizer"):  # no scheduler: its own probe acts; this one must not restart us
        assert live.is_alive(service, None, host)
    with pytest.raises(ValueError):
        live.is_alive("api", _stats(), host)


def test_liveness_reads_the_schedulers_stats(tmp_path: Path) -> None:
    import zmq

    from pagoda.shared.transport import Codec

    live = _liveness_module()
    endpoint = f"ipc://{tmp_path}/stats.sock"
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(endpoint)
    done = threading.Event()
    sent = _stats(worker_alive=False, num_waiting=3)

    def publish() -> None:  # as the scheduler does, again and again: a subscriber joins at any time
        codec = Codec(type(sent))
        publisher.send(b"not msgpack")  # a malformed frame is dropped, not fatal
        while not done.wait(0.02):
            publisher.send(codec.encode(sent))

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        assert live.latest_stats(endpoint) == sent
    finally:
        done.set()
        thread.join()
        publisher.close(linger=0)
        context.term()
    # nobody publishes: None once the timeout passes (setting live.TIMEOUT_S did not shorten it: the probe's own
    # default, 3 s, is bound in pagoda.probes; main() passes TIMEOUT_S explicitly)
    assert live.latest_stats(f"ipc://{tmp_path}/nobody.sock", 0.2) is None


# ------------------------------------------------------------------ trust: the cluster key and who may connect


def test_every_container_holds_the_cluster_key_where_the_config_says(overlay: tuple[str, list[Doc]]) -> None:
    """CURVE needs the key pair in every process that opens a tcp:// socket (plans and results on loopback
    too): each container mounts the Secret, non-optional, at PAGODA_CLUSTER_KEY_DIR."""
    name, docs = overlay
    for doc, container in pagoda_containers(docs):
        key_dir = container_env(doc, container, docs).get("PAGODA_CLUSTER_KEY_DIR")
        assert key_dir, (name, container["name"])
        mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
        assert key_dir in mounts and mounts[key_dir]["readOnly"] is True, (name, container["name"])
        volume = {v["name"]: v for v in pod_spec(doc)["volumes"]}[mounts[key_dir]["name"]]
        secret = volume["secret"]
        assert secret["secretName"] == "pagoda-cluster-key" and secret["optional"] is False
        assert [item["path"] for item in secret["items"]] == ["cluster.key_secret"]  # what ClusterKeys.load reads
        assert secret["defaultMode"] & 0o007 == 0, "the key must not be world-readable"
        assert pod_spec(doc)["securityContext"].get("fsGroup") == pod_spec(doc)["securityContext"]["runAsGroup"]


def test_network_policies_admit_only_pagodas_pods_to_the_control_plane(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    policies = by_kind(docs, "NetworkPolicy")
    control = policies["pagoda-control-plane"]["spec"]
    http = policies["pagoda-api-http"]["spec"]
    pagoda_labels = {"app.kubernetes.io/name": "pagoda"}
    assert control["podSelector"]["matchLabels"] == pagoda_labels and control["policyTypes"] == ["Ingress"]
    [rule] = control["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": pagoda_labels}}], "only pagoda's pods"
    control_ports = {p["port"] for p in rule["ports"]}
    for doc, container in pagoda_containers(docs):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert selects(control["podSelector"]["matchLabels"], labels), (name, doc["metadata"]["name"])
        for port in container.get("ports", []):
            if port["name"] == "http":  # the only port clients reach, and only on api pods
                assert selects(http["podSelector"]["matchLabels"], labels) and component(container) == "api"
                assert {p["port"] for r in http["ingress"] for p in r["ports"]} == {port["containerPort"]}
            else:
                assert port["containerPort"] in control_ports, (name, container["name"], port)
    for doc in workloads(docs):  # the HTTP policy opens no other pod
        labels = doc["spec"]["template"]["metadata"]["labels"]
        if selects(http["podSelector"]["matchLabels"], labels):
            assert labels.get("app.kubernetes.io/component") == "api"
