"""Access control as the cluster configures and deploys it (issue 7): the serving config's key
settings and their checks, and the KubeRay manifests mounting the key from a Secret (the HTTP
and gRPC checks themselves are in tests/serving/test_auth.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cluster import manifests
from cluster.config import ClusterConfig, ServingConfig
from serving.access import ApiKeys
from serving.openai_api import ServerSettings
from tests.serving.test_auth import KEY

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "cluster.example.yaml"


def test_settings_from_the_serving_config_read_the_file(tmp_path):
    f = tmp_path / "secret" / "api-key"
    f.parent.mkdir()
    f.write_text(KEY)
    serving = ServingConfig(api_key_file=str(f), auth_health=True, max_concurrent_per_key=3,
                            max_request_bytes=2048, drain_timeout_s=5)
    s = ServerSettings.from_config(serving, "m", 128)
    assert ApiKeys.of(s.api_key).identify(f"Bearer {KEY}") == "key-0"
    assert (s.auth_health, s.auth_metrics, s.max_concurrent_per_key, s.max_request_bytes,
            s.drain_timeout_s) == (True, False, 3, 2048, 5)
    assert KEY not in repr(s) and KEY not in repr(serving)
    assert ServerSettings.from_config(ServingConfig(), "m", 128).api_key is None


@pytest.mark.parametrize("fields,message", [
    ({"api_key_env": "K", "api_key_file": "/run/key/k"}, "not both"),
    ({"api_key_file": "key.txt"}, "absolute path"),
    ({"api_key_file": "/key"}, "folder of its own"),
    ({"auth_health": True}, "need an API key"),
    ({"max_concurrent_per_key": 0}, "greater than or equal to 1"),
])
def test_bad_serving_auth_configs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ServingConfig(**fields)


# ---- KubeRay: the key comes from a Kubernetes Secret -------------------------------------------
def _manifest_checks():
    """The CRD-schema and operator-rule checks of test_manifests.py."""
    path = Path(__file__).with_name("test_manifests.py")
    spec = importlib.util.spec_from_file_location("_manifest_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pods(obj: dict) -> list[dict]:
    spec = obj["spec"]
    cluster = {"RayService": lambda: spec["rayClusterConfig"], "RayCluster": lambda: spec,
               "RayJob": lambda: spec["rayClusterSpec"]}[obj["kind"]]()
    groups = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    return [g["template"]["spec"] for g in groups]


@pytest.mark.parametrize("source", ["file", "env"])
def test_manifests_mount_the_key_from_a_secret_and_pass_the_crds(source):
    checks = _manifest_checks()
    base = ClusterConfig.from_yaml(EXAMPLE)
    serving = {"api_key_file": "/var/run/secrets/specflash/api-key"} if source == "file" \
        else {"api_key_env": "SPECFLASH_API_KEY"}
    cfg = base.model_copy(update={"serving": base.serving.model_copy(update=serving)})
    secret = f"{cfg.name}-api-key"
    schemas = checks.crd_schemas.__wrapped__()
    for obj in (manifests.ray_service(cfg), manifests.ray_cluster(cfg), manifests.ray_job(cfg)):
        assert checks.api_server_errors(obj, schemas) == [], obj["kind"]
        assert checks.kuberay_rule_errors(obj) == [], obj["kind"]
        for pod in _pods(obj):
            (container,) = pod["containers"]
            if source == "file":
                (volume,) = [v for v in pod["volumes"] if v["name"] == "api-key"]
                assert volume["secret"]["secretName"] == secret
                assert volume["secret"]["items"] == [{"key": "api-key", "path": "api-key"}]
                (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-key"]
                assert mount == {"name": "api-key", "mountPath": "/var/run/secrets/specflash",
                                 "readOnly": True}
            else:
                (env,) = [e for e in container["env"] if e["name"] == "SPECFLASH_API_KEY"]
                assert env["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "api-key"}
                assert "value" not in env
    args = manifests.serve_config(cfg)["applications"][0]["args"]["serving"]
    assert args["api_key_file" if source == "file" else "api_key_env"] == \
        next(iter(serving.values()))
