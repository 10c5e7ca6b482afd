"""The deployment files agree with the server and with each other: manifests are valid, the router
and the gateway reach the pods on the port the image serves, probes and grace periods fit the
drain, and the dashboard and alerts query only metrics the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import option_value as flag  # --name value or --name=value; the last one wins
from scheduler.messages import TierCounts, WorkerStats
from server.metrics import Metrics

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="in the test extra: pip install -e '.[test]'"
)
promql_parser = pytest.importorskip(
    "promql_parser", reason="in the test extra: pip install -e '.[test]'"
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
SCHEMAS = Path(__file__).parent / "schemas"
# The oldest and the newest Kubernetes that kubernetes-validate ships schemas for and that we claim
# to support.
KUBERNETES_VERSIONS = ("1.34.0", "1.37.0")
SHUTDOWN_TIMEOUT_DEFAULT = 30.0  # ppd serve --shutdown-timeout


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifests() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(KUBERNETES.rglob("*.yaml")) for doc in documents(path)]


def find(folder: str, kind: str, name: str | None = None) -> dict:
    found = [
        doc
        for path, doc in manifests()
        if path.parent.name == folder
        and doc["kind"] == kind
        and (name is None or doc["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (
        f"expected one {kind} {name or ''} in deploy/kubernetes/{folder}, found {len(found)}"
    )
    return found[0]


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def dockerfile(name: str) -> dict[str, list[str]]:
    """Each instruction of a Dockerfile (continuations joined, comments dropped) -> its arguments,
    in order."""
    instructions: dict[str, list[str]] = {}
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.setdefault(keyword.upper(), []).append(rest.strip())
    return instructions


def exec_form(value: str) -> list[str]:
    return json.loads(value)


def image_port(name: str) -> int:
    return int(flag(exec_form(dockerfile(name)["ENTRYPOINT"][-1]), "--port"))


# --- manifests: schemas ---------------------------------------------------------------------------


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields the CRD's structural schema does not declare: kubectl's strict field validation
    rejects them."""
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}")
            else:
                found += unknown_fields(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def test_every_manifest_is_valid_for_its_kind() -> None:
    """Core kinds against Kubernetes' own schemas (strict: no unknown fields); the InferencePool
    against its CRD's schema; Gateway API kinds, whose schemas we do not hold, only by the
    references checked below."""
    pool_schema = json.loads(
        (SCHEMAS / "inferencepool-inference.networking.k8s.io-v1.json").read_text()
    )
    seen = set()
    for path, doc in manifests():
        kind, where = (
            doc["kind"],
            f"{path.relative_to(ROOT)}: {doc['kind']} {doc['metadata']['name']}",
        )
        seen.add(kind)
        if doc["apiVersion"] == "inference.networking.k8s.io/v1" and kind == "InferencePool":
            jsonschema.validate(doc, pool_schema, cls=jsonschema.Draft4Validator)
            assert unknown_fields(doc, pool_schema) == [], where
            # The CRD's CEL rule: a Service endpoint picker needs its port.
            ref = doc["spec"]["endpointPickerRef"]
            assert ref.get("kind", "Service") != "Service" or "port" in ref, where
        elif doc["apiVersion"] == "gateway.networking.k8s.io/v1" and kind in (
            "Gateway",
            "HTTPRoute",
        ):
            continue
        else:
            for version in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
    assert {"Deployment", "Service", "InferencePool", "HTTPRoute", "Gateway"} <= seen


def test_the_inferencepool_schema_rejects_what_the_crd_rejects() -> None:
    pool_schema = json.loads(
        (SCHEMAS / "inferencepool-inference.networking.k8s.io-v1.json").read_text()
    )
    pool = find("llm-d", "InferencePool")
    broken = json.loads(json.dumps(pool))
    broken["spec"]["targetPorts"] = [{"number": port} for port in range(8000, 8009)]  # at most 8
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, pool_schema, cls=jsonschema.Draft4Validator)
    broken = json.loads(json.dumps(pool))
    broken["spec"]["endpointPickerRef"]["portNumber"] = 9002  # the pre-v1 field
    assert unknown_fields(broken, pool_schema) == [".spec.endpointPickerRef.portNumber"]


# --- manifests: the pieces reach each other -------------------------------------------------------


@pytest.mark.parametrize("folder", ["llm-d", "vllm-router"])
def test_node_pods_serve_on_the_image_port_with_every_gpu(folder: str) -> None:
    deployment = find(folder, "Deployment", "ppd-serve")
    node = container(deployment)
    ports = {port["name"]: port["containerPort"] for port in node["ports"]}
    assert ports["http"] == image_port("Dockerfile.cuda")
    assert node["resources"]["limits"]["nvidia.com/gpu"] == "8"
    mounts = {mount["mountPath"]: mount["name"] for mount in node["volumeMounts"]}
    volumes = {
        volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("folder", ["llm-d", "vllm-router"])
def test_probes_follow_health_and_the_grace_period_covers_the_drain(folder: str) -> None:
    deployment = find(folder, "Deployment", "ppd-serve")
    node = container(deployment)
    port_names = {port["name"]: port["containerPort"] for port in node["ports"]}
    for probe in ("startupProbe", "readinessProbe"):
        assert node[probe]["httpGet"]["path"] == "/health", probe
        assert port_names[node[probe]["httpGet"]["port"]] == image_port("Dockerfile.cuda"), probe
    # Liveness must not follow /health: it is 503 while one unit restarts, and the other units live
    # on.
    assert node["livenessProbe"]["httpGet"]["path"] == "/metrics"
    shutdown_timeout = float(flag(node["args"], "--shutdown-timeout") or SHUTDOWN_TIMEOUT_DEFAULT)
    pre_stop = node["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(pre_stop[1]) + shutdown_timeout


def test_gateway_route_pool_and_epp_point_at_each_other() -> None:
    pool, route, gateway = (
        find("llm-d", "InferencePool"),
        find("llm-d", "HTTPRoute"),
        find("llm-d", "Gateway"),
    )
    pods = find("llm-d", "Deployment", "ppd-serve")["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pods.items()
    assert [port["number"] for port in pool["spec"]["targetPorts"]] == [
        image_port("Dockerfile.cuda")
    ]
    [parent] = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["name"]) == ("Gateway", gateway["metadata"]["name"])
    [backend] = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    ref = pool["spec"]["endpointPickerRef"]
    service = find("llm-d", "Service", ref["name"])
    assert ref["port"]["number"] in [port["port"] for port in service["spec"]["ports"]]
    epp = find("llm-d", "Deployment", ref["name"])
    assert (
        service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    )
    assert flag(container(epp)["args"], "--pool-name") == pool["metadata"]["name"]


def test_the_epp_reads_metrics_the_server_exports() -> None:
    config_map = find("llm-d", "ConfigMap", "ppd-serve-epp")
    args = container(find("llm-d", "Deployment", "ppd-serve-epp"))["args"]
    config = yaml.safe_load(config_map["data"][Path(flag(args, "--config-file")).name])
    [extractor] = [
        plugin for plugin in config["plugins"] if plugin["type"] == "core-metrics-extractor"
    ]
    engine_name = extractor["parameters"]["defaultEngine"]
    [engine] = [e for e in extractor["parameters"]["engineConfigs"] if e["name"] == engine_name]
    pods = find("llm-d", "Deployment", "ppd-serve")["spec"]["template"]["metadata"]["labels"]
    assert pods["llm-d.ai/engine-type"] == engine_name
    specs = {key: value for key, value in engine.items() if key.endswith("Spec")}
    assert set(specs) == {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"}
    assert set(specs.values()) <= exported_samples()


def test_the_router_discovers_the_node_pods() -> None:
    router_container = container(find("vllm-router", "Deployment", "vllm-router"))
    router = router_container["args"]
    pods = find("vllm-router", "Deployment", "ppd-serve")["spec"]["template"]["metadata"]["labels"]
    key, value = router[router.index("--selector") + 1].split("=", 1)
    assert pods[key] == value
    assert int(flag(router, "--service-discovery-port")) == image_port("Dockerfile.cuda")
    assert flag(router, "--health-check-endpoint") == "/health"
    service = find("vllm-router", "Service", "vllm-router")
    targets = {port["targetPort"] for port in service["spec"]["ports"]}
    container_ports = {port["name"]: port["containerPort"] for port in router_container["ports"]}
    assert container_ports["http"] == int(flag(router, "--port")) and "http" in targets


# --- images ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_run_ppd_serve_and_check_health_on_its_port(name: str) -> None:
    instructions = dockerfile(name)
    entrypoint = exec_form(instructions["ENTRYPOINT"][-1])
    assert entrypoint[:2] == ["ppd", "serve"]
    assert flag(entrypoint, "--host") == "0.0.0.0"  # reachable from outside the container
    port = image_port(name)
    assert instructions["EXPOSE"] == [str(port)]
    [healthcheck] = instructions["HEALTHCHECK"]
    assert f"http://127.0.0.1:{port}/health" in healthcheck
    assert not instructions["USER"][-1].startswith(("0", "root"))
    assert "--model" in exec_form(instructions["CMD"][-1])


def test_the_cpu_image_serves_the_demo_by_default() -> None:
    assert flag(exec_form(dockerfile("Dockerfile.cpu")["CMD"][-1]), "--model") == "demo"


# --- dashboard and alerts -------------------------------------------------------------------------


def exported_samples() -> set[str]:
    """Every sample name (with its _total, _bucket, _sum, _count) that a server with every metric
    observed renders."""
    metrics = Metrics("demo")
    metrics.worker_stats(
        0,
        None,
        WorkerStats(
            num_running=2,
            num_waiting=1,
            kv_usage=0.5,
            prefix_queries=64,
            prefix_hits=32,
            num_preemptions=1,
            prefill_queue_tokens=100,
            decode_step_ms=20.0,
            decode_share=1,
            prefill_share=1,
            share_switches=1,
            steps=10,
            step_seconds=0.2,
            loop_seconds=0.01,
            kv_retained_blocks=3,
            tier=TierCounts(100, 10, 4096, 16, stored=12, loaded=5, dropped=2, tokens_per_s=1e5),
        ),
    )
    metrics.prefill_speed_measured(0, 1000.0)
    metrics.rejected("overloaded")
    metrics.route_decision("decode", "table")
    metrics.prefill_routed("decode")
    metrics.first_token(0.1)
    metrics.inter_token(0.04, 2)
    metrics.request_finished(1.0, 10, 5, "stop")
    families = text_string_to_metric_families(metrics.render().decode())
    return {sample.name for family in families for sample in family.samples}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's variables replaced by values, so it
    parses)."""
    expr = (
        expr.replace("$__rate_interval", "5m")
        .replace("$model_name", ".*")
        .replace("$instance", ".*")
    )
    names: set[str] = set()
    promql_parser.walk(
        promql_parser.parse(expr),
        lambda node: (
            names.add(node.name) if isinstance(node, promql_parser.VectorSelector) else None
        ),
    )
    return names


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "ppd-serve.json").read_text())


def dashboard_exprs() -> list[str]:
    return [
        target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])
    ]


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = exported_samples()
    for expr in dashboard_exprs():
        assert metric_names(expr) and metric_names(expr) <= exported, expr
        assert 'model_name=~"$model_name"' in expr and 'instance=~"$instance"' in expr, expr
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            metric = re.match(r"label_values\(([\w:]+)", variable["query"]["query"]).group(1)
            assert metric in exported, variable["name"]


def test_dashboard_shows_every_exported_metric() -> None:
    used = set().union(*(metric_names(expr) for expr in dashboard_exprs()))
    bases = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    missing = {
        name
        for name in exported_samples()
        if re.sub(r"_(bucket|sum|count)$", "", name) not in bases
    }
    assert missing == set()


def test_dashboard_has_its_variables_and_schema() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource"
        and variables["datasource"]["query"] == "prometheus"
    )
    assert {"model_name", "instance"} <= set(variables)
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def alert_rules() -> list[dict]:
    return [
        rule
        for group in documents(DEPLOY / "prometheus" / "alerts.yaml")[0]["groups"]
        for rule in group["rules"]
    ]


def test_alerts_query_exported_metrics_and_the_readme_quotes_them() -> None:
    exported = exported_samples() | {"up"}  # up: Prometheus's own per-target series
    readme_lines = {
        " ".join(line.split()) for line in (DEPLOY / "README.md").read_text().splitlines()
    }
    for rule in alert_rules():
        assert metric_names(rule["expr"]) <= exported, rule["alert"]
        assert " ".join(rule["expr"].split()) in readme_lines, (
            f"{rule['alert']}: deploy/README.md does not quote it"
        )


def test_an_installed_package_has_every_module_and_the_cpu_kernels_sources() -> None:
    """The images `pip install /src` (not editable): a subpackage missing from pyproject's list, or
    a kernel source missing from its package data, is missing from the image. Both were, until
    engine.attention's kernels."""
    import fnmatch
    import tomllib

    from engine.attention import cpu_kernel

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    found = {
        str(init.parent.relative_to(ROOT)).replace("/", ".")
        for top in {p.split(".")[0] for p in listed}
        for init in (ROOT / top).rglob("__init__.py")
        if "results" not in init.parts
    }
    assert listed == found
    data = setup["package-data"]["engine.attention"]
    for source in (*cpu_kernel.SOURCES, *cpu_kernel.HEADERS):
        assert any(fnmatch.fnmatch(source.name, pattern) for pattern in data), source.name
