"""deploy/k8s: every manifest validates offline against the Kubernetes schemas and agrees with the app and the image."""

from __future__ import annotations

import copy
import os
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml
from deploy_servers import drain_timeout_s
from servers import free_port

from service.api import __main__ as entry_point
from service.api.app import create_app
from service.levers import LEVERS, EngineProfile, parse_profile
from service.settings import Settings, unknown_env_vars

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
# The oldest still-common release and the newest the validator ships: the manifests use only stable APIs.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
APP_LABELS = {"app.kubernetes.io/name": "cosyvoice-lite", "app.kubernetes.io/component": "api"}

Manifest = dict[str, Any]


def load_manifests() -> list[tuple[str, Manifest]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]
    return docs


MANIFESTS = load_manifests()


def one(kind: str, name: str) -> Manifest:
    found = [doc for _, doc in MANIFESTS if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def api_container() -> Manifest:
    return one("Deployment", "cosyvoice-lite")["spec"]["template"]["spec"]["containers"][0]


def settings_env() -> dict[str, str]:
    return dict(one("ConfigMap", "cosyvoice-lite-settings")["data"])


def cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def dockerfile_value(pattern: str) -> str:
    match = re.search(pattern, (REPO / "docker" / "Dockerfile").read_text(encoding="utf-8"), re.M)
    assert match, f"docker/Dockerfile has no match for {pattern}"
    return match.group(1)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("file", "doc"), MANIFESTS, ids=[f"{f}:{d['kind']}" for f, d in MANIFESTS])
def test_manifest_is_valid_against_the_kubernetes_schema(file: str, doc: Manifest, version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError with the failing path


def test_the_validator_rejects_a_broken_manifest() -> None:
    broken = copy.deepcopy(one("Deployment", "cosyvoice-lite"))
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limit"] = {"cpu": "2"}  # typo: limits
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_every_required_kind_is_there() -> None:
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in MANIFESTS}
    for required in [
        ("Deployment", "cosyvoice-lite"),
        ("Service", "cosyvoice-lite"),
        ("HorizontalPodAutoscaler", "cosyvoice-lite"),
        ("ConfigMap", "cosyvoice-lite-settings"),
        ("Deployment", "cosyvoice-redis"),
        ("Service", "cosyvoice-redis"),
    ]:
        assert required in kinds


def test_configmap_holds_only_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    env = settings_env()
    assert unknown_env_vars(env) == [], "a ConfigMap key is not a TTS_* setting"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings(_env_file=None)  # type: ignore[call-arg]  # raises on any out-of-bounds value
    limits = api_container()["resources"]["limits"]
    assert settings.intra_op_threads <= cpu_cores(limits["cpu"]), "one session's threads fit the pod's CPUs"
    assert settings.engine_profile.max_batch > 0, "concurrent requests share one batched LLM thread"
    assert str(settings.model_dir) == dockerfile_value(r"TTS_MODEL_DIR=(\S+)"), "the image serves the bundle from there"


CONCURRENCY_KEYS = ("concurrent_requests", "max_batch", "acoustic_slots", "intra_op_threads", "queue_max")


def test_concurrency_settings_are_the_service_defaults() -> None:
    """What the ConfigMap ships is what Settings, the Dockerfile (which sets none of them) and the README say."""
    env = settings_env()
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    shipped = Settings(_env_file=None, **{k[4:].lower(): v for k, v in env.items() if k[4:].lower() in CONCURRENCY_KEYS})  # type: ignore[call-arg]
    profile = parse_profile(env.get("TTS_ENGINE_PROFILE", ""))
    assert isinstance(profile, dict) and set(profile) <= set(LEVERS)
    levers = EngineProfile(**profile)
    for name in CONCURRENCY_KEYS:
        got = getattr(shipped, name) if name in Settings.model_fields else getattr(levers, name)
        want = Settings.model_fields[name].default if name in Settings.model_fields else EngineProfile.model_fields[name].default
        assert got == want, f"{name} differs from its default"
        assert f"TTS_{name.upper()}" not in dockerfile, f"the Dockerfile overrides {name}"
    assert "TTS_WORKERS" not in env and "TTS_ENGINE_PROFILE" not in dockerfile


def test_redis_url_points_at_the_redis_service() -> None:
    url = urlparse(settings_env()["TTS_REDIS_URL"])
    redis_service = one("Service", "cosyvoice-redis")
    assert url.hostname == redis_service["metadata"]["name"]
    assert url.port in {p["port"] for p in redis_service["spec"]["ports"]}
    redis_pod = one("Deployment", "cosyvoice-redis")["spec"]["template"]["metadata"]["labels"]
    assert redis_service["spec"]["selector"].items() <= redis_pod.items()


def redis_options(container: Manifest) -> dict[str, str]:
    """`--name value` pairs of a redis-server command line."""
    args = [str(a) for a in container.get("args", [])]
    return {args[i][2:]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}


def test_redis_keeps_saved_voices_and_the_lexicon_across_restarts() -> None:
    """Saved voices and lexicon entries live in Redis with no TTL: a Redis without persistence (3 voices became 0 after
    a restart) or one that may evict any key (allkeys-*) loses them. Persistence must be on a volume that outlives the
    pod, and only keys with a TTL (caches, counters) may be evicted."""
    deployment = one("Deployment", "cosyvoice-redis")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    options = redis_options(container)
    assert options.get("appendonly") == "yes" or options.get("save", "") != "", "no persistence: a restart loses voices"
    assert options.get("maxmemory-policy", "noeviction") in ("noeviction", "volatile-lru", "volatile-lfu", "volatile-ttl")
    data_dir = options.get("dir", "/data")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == data_dir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "persistentVolumeClaim" in volume, f"{data_dir} must be a PersistentVolumeClaim, not {sorted(volume)}"
    claim = one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["resources"]["requests"]["storage"]
    if "ReadWriteOnce" in claim["spec"]["accessModes"]:
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert not container["securityContext"].get("readOnlyRootFilesystem") or not mount.get("readOnly")
    assert pod["securityContext"].get("fsGroup") == pod["securityContext"]["runAsGroup"], "Redis may write its volume"


def test_deployment_probes_ports_and_resources() -> None:
    deployment = one("Deployment", "cosyvoice-lite")
    pod = deployment["spec"]["template"]
    container = api_container()
    port = next(p for p in container["ports"] if p["name"] == "http")
    assert port["containerPort"] == int(settings_env()["TTS_PORT"]) == int(dockerfile_value(r"^EXPOSE (\d+)"))
    grpc_port = next(p for p in container["ports"] if p["name"] == "grpc")
    assert grpc_port["containerPort"] == int(settings_env()["TTS_GRPC_PORT"]) == int(dockerfile_value(r"^EXPOSE \d+ (\d+)"))
    assert int(settings_env()["TTS_GRPC_PORT"]) == Settings.model_fields["grpc_port"].default
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][kind].keys()
    assert deployment["spec"]["selector"]["matchLabels"] == APP_LABELS and pod["metadata"]["labels"].items() >= APP_LABELS.items()
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_pods_run_as_the_image_user_and_have_time_to_drain() -> None:
    pod = one("Deployment", "cosyvoice-lite")["spec"]["template"]["spec"]
    uid, gid = dockerfile_value(r"^USER (\d+):(\d+)"), dockerfile_value(r"^USER \d+:(\d+)")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == uid and str(pod["securityContext"]["runAsGroup"]) == gid
    pre_stop_s = int(api_container()["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert "TTS_DRAIN_TIMEOUT_S" in settings_env(), "the drain the grace period is sized for is set, not implied"
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_timeout_s(settings_env())


def test_the_entry_point_drains_for_tts_drain_timeout_s(
    monkeypatch: pytest.MonkeyPatch, tiny_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    served: dict[str, Any] = {}
    monkeypatch.setattr(entry_point, "serve", lambda app, *_: served.update(app=app) or True)
    for key in [k for k in os.environ if k.startswith("TTS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TTS_MODEL_DIR", str(tiny_bundle))
    monkeypatch.setenv("TTS_PORT", str(free_port()))  # the entry point checks that its ports are free
    monkeypatch.setenv("TTS_GRPC_PORT", "0")
    monkeypatch.setenv("TTS_DRAIN_TIMEOUT_S", "17")
    entry_point.main()
    assert served["app"].state.tts.drain.timeout_s == 17  # the deadline every transport drains by (service.api.drain)
    monkeypatch.setenv("TTS_DRAIN_TIMEOUT_S", "0")
    with pytest.raises(SystemExit) as exited:
        entry_point.main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: TTS_DRAIN_TIMEOUT_S: Input should be greater than or equal to 1"
    ]


def test_the_entry_point_refuses_a_port_in_use(
    monkeypatch: pytest.MonkeyPatch, tiny_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(entry_point, "serve", lambda *_: pytest.fail("served on a busy port"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("TTS_MODEL_DIR", str(tiny_bundle))
        monkeypatch.setenv("TTS_HOST", "127.0.0.1")
        monkeypatch.setenv("TTS_PORT", str(free_port()))
        monkeypatch.setenv("TTS_GRPC_PORT", str(busy.getsockname()[1]))
        with pytest.raises(SystemExit) as exited:
            entry_point.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: TTS_GRPC_PORT: cannot listen on 127.0.0.1:") and err.count("\n") == 1, err
    assert "`make run GRPC_PORT=50001`" in err and "0 turns gRPC off" in err, "say how to choose another port"


def test_service_and_hpa_target_the_deployment() -> None:
    service = one("Service", "cosyvoice-lite")
    assert service["spec"]["selector"] == APP_LABELS
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "grpc"}
    hpa = one("HorizontalPodAutoscaler", "cosyvoice-lite")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cosyvoice-lite"}
    assert 2 <= hpa["minReplicas"] < hpa["maxReplicas"]
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"], "CPU utilization needs the cpu request above"


def app_paths(tiny_bundle: Path) -> set[str]:
    """Every documented path of the app plus the web page and its static files (the model is not loaded)."""
    app = create_app(Settings(model_dir=tiny_bundle, _env_file=None))  # type: ignore[call-arg]
    return set(app.openapi()["paths"]) | {"/", "/static/index.html", "/docs", "/openapi.json"}


INGRESSES = ("cosyvoice-lite", "cosyvoice-lite-uploads")


def ingress_routes(path: str) -> bool:
    rules = [r for name in INGRESSES for r in one("Ingress", name)["spec"]["rules"]]
    for entry in (p for rule in rules for p in rule["http"]["paths"]):
        prefix = entry["path"].rstrip("/")
        if path == entry["path"] or (entry["pathType"] == "Prefix" and path.startswith(prefix + "/")):
            return True
    return False


def test_ingress_routes_every_public_path_but_not_metrics(tiny_bundle: Path) -> None:
    paths = app_paths(tiny_bundle)
    assert "/metrics" in paths and not ingress_routes("/metrics")
    public = paths - {"/metrics"}
    assert {p for p in public if not ingress_routes(p.replace("{", "x").replace("}", ""))} == set()


def test_ingress_matches_the_nginx_rules() -> None:
    notes = one("Ingress", "cosyvoice-lite")["metadata"]["annotations"]
    conf = (REPO / "nginx" / "nginx.conf").read_text(encoding="utf-8")
    prefix = "nginx.ingress.kubernetes.io/"
    assert notes[prefix + "proxy-buffering"] == "off"
    assert int(notes[prefix + "proxy-read-timeout"]) >= 120
    body_size = re.search(r"client_max_body_size (\S+);", conf)
    assert body_size and notes[prefix + "proxy-body-size"] == body_size.group(1)
    assert int(settings_env()["TTS_MAX_BODY_BYTES"]) == 64 * 1024 == int(body_size.group(1).rstrip("k")) * 1024
    uploads = one("Ingress", "cosyvoice-lite-uploads")["metadata"]["annotations"]
    upload_size = re.search(r"location ~ \^/\(([^)]*)\)\$ \{\s*client_max_body_size (\S+);", conf)
    assert upload_size and uploads[prefix + "proxy-body-size"] == upload_size.group(2) == "10m"
    assert Settings.model_fields["max_upload_bytes"].default == 10 * 1024 * 1024
    upload_rules = one("Ingress", "cosyvoice-lite-uploads")["spec"]["rules"]
    upload_paths = {p["path"].lstrip("/") for r in upload_rules for p in r["http"]["paths"]}
    assert upload_paths == set(upload_size.group(1).split("|")), "nginx and the ingress raise the limit on the same paths"
