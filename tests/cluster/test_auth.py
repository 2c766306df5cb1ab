"""Access control (issue 7): API keys on HTTP and gRPC, never logged; /health and /metrics
configurable; per-key concurrency limits; the KubeRay manifests mount the key from a Secret.

In-process: FastAPI's TestClient and a plain grpc.aio server over the FakeEngine (no Ray)."""
from __future__ import annotations

import asyncio
import importlib.util
import logging
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from cluster import manifests
from serving.access import ApiKeyConfigError, ApiKeys, load_api_keys
from cluster.config import ClusterConfig, ServingConfig
from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from serving.protos import specflash_pb2 as pb
from serving.testing import SAMPLE_TEXT, FakeEngine, tiny_byte_tokenizer

from . import serving_helpers

TOK = tiny_byte_tokenizer()
OUT = TOK.encode(SAMPLE_TEXT * 4)
KEY, OTHER = "sk-right-8f1d2c", "sk-other-77a0b3"
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "cluster.example.yaml"


def make(engine=None, **settings):
    engine = engine or FakeEngine(script=lambda r: OUT, eos_token_id=0)
    server = OpenAIServer(engine, TOK, ServerSettings(**{"max_context": 256, **settings}))
    return engine, server, TestClient(build_fastapi_app(server))


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


COMPLETION = {"prompt": "hi", "max_tokens": 3}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize("headers", [{}, bearer("sk-wrong"), bearer(KEY[:-1]), bearer(KEY + "x"),
                                     {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                                     bearer("")])
def test_missing_or_wrong_key_is_401_on_every_v1_route(headers):
    engine, _, client = make(api_key=KEY)
    for r in (client.post("/v1/completions", json=COMPLETION, headers=headers),
              client.post("/v1/chat/completions", json=CHAT, headers=headers),
              client.get("/v1/models", headers=headers)):
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert KEY not in r.text
    assert engine.requests == []


def test_right_key_is_served_and_the_scheme_is_case_insensitive():
    engine, _, client = make(api_key=KEY)
    assert client.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT,
                       headers={"Authorization": f"bearer  {KEY} "}).status_code == 200
    assert client.get("/v1/models", headers=bearer(KEY)).json()["data"][0]["id"] == "specflash"
    assert len(engine.requests) == 2


def test_several_keys_each_work_and_are_told_apart():
    keys = ApiKeys([KEY, OTHER])
    assert keys.identify(f"Bearer {KEY}") == "key-0" and keys.identify(f"Bearer {OTHER}") == "key-1"
    assert ApiKeys().identify(None) == "anonymous"
    assert KEY not in repr(keys) and OTHER not in repr(keys)


def test_health_and_metrics_are_open_by_default_and_guarded_when_configured():
    _, _, client = make(api_key=KEY)
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    _, _, client = make(api_key=KEY, auth_health=True)
    assert client.get("/health").status_code == 401
    assert client.get("/health", headers=bearer(KEY)).status_code == 200
    assert client.get("/metrics").status_code == 200
    _, _, client = make(api_key=KEY, auth_metrics=True)
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=bearer(KEY)).status_code == 200
    assert client.get("/health").status_code == 200


def test_the_key_never_appears_in_logs_errors_metrics_or_reprs(caplog, capfd):
    caplog.set_level(logging.DEBUG)
    _, server, client = make(api_key=[KEY, OTHER], auth_metrics=True)
    texts = [client.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)).text,
             client.post("/v1/completions", json=COMPLETION, headers=bearer(OTHER + "!")).text,
             client.post("/v1/completions", json={"prompt": 5}, headers=bearer(KEY)).text,
             client.get("/metrics", headers=bearer(KEY)).text,
             repr(server.settings), repr(server.keys), repr(server.__dict__)]
    out, err = capfd.readouterr()
    everything = "\n".join(texts + [caplog.text, out, err])
    assert "specflash_requests_total" in everything  # the metrics really were read
    for secret in (KEY, OTHER):
        assert secret not in everything


def test_key_sources_env_and_file(tmp_path):
    assert load_api_keys() == ()
    assert load_api_keys(env="K", environ={"K": f" {KEY}\n"}) == (KEY,)
    f = tmp_path / "api-key"
    f.write_text(f"{KEY}\n\n  {OTHER}  \n")
    assert load_api_keys(file=str(f)) == (KEY, OTHER)
    for kwargs in ({"env": "K", "environ": {}}, {"env": "K", "environ": {"K": " \n"}},
                   {"file": str(tmp_path / "missing")}):
        with pytest.raises(ApiKeyConfigError):
            load_api_keys(**kwargs)
    f.write_text("\n")
    with pytest.raises(ApiKeyConfigError) as info:
        load_api_keys(file=str(f))
    assert "empty" in str(info.value)


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


# ---- per-key concurrency ---------------------------------------------------------------------
def test_one_key_over_its_share_gets_429_while_another_key_is_served():
    engine = FakeEngine(script=lambda r: OUT, delay_s=0.05)
    _, server, client = make(engine, api_key=[KEY, OTHER], max_concurrent_per_key=2, max_queue=8)
    body = {"prompt": "a", "max_tokens": 100, "stream": True, "n": 2}
    with client.stream("POST", "/v1/completions", json=body, headers=bearer(KEY)) as r1:
        assert r1.status_code == 200 and server.outstanding == 2
        r2 = client.post("/v1/completions", json=COMPLETION, headers=bearer(KEY))
        assert r2.status_code == 429 and r2.headers["retry-after"] == "1"
        assert r2.json()["error"]["code"] == "key_concurrency_limit"
        r3 = client.post("/v1/completions", json={**COMPLETION, "n": 2}, headers=bearer(OTHER))
        assert r3.status_code == 200, r3.text
    assert server.outstanding == 0 and dict(server.limiter.held) == {}
    assert client.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)).status_code == 200
    assert 'reason="key_concurrency_limit"' in client.get("/metrics").text


def test_without_keys_the_per_key_limit_does_not_apply():
    engine = FakeEngine(script=lambda r: OUT, delay_s=0.05)
    _, server, client = make(engine, max_concurrent_per_key=1, max_queue=8)
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "a", "max_tokens": 100, "stream": True, "n": 2}) as r1:
        assert r1.status_code == 200
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200


# ---- gRPC ------------------------------------------------------------------------------------
async def with_grpc(fn, engine=None, **settings):
    engine = engine or FakeEngine(script=lambda r: OUT)
    return await serving_helpers.with_grpc(lambda channel, stub, engine, server: fn(stub, engine, server),
                                           engine, TOK, **settings)


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_grpc_missing_wrong_and_right_keys(method):
    req = pb.GenerateRequest(prompt="hi", max_tokens=2)

    async def call(stub, metadata):
        if method == "Generate":
            return [await stub.Generate(req, metadata=metadata)]
        return [m async for m in stub.GenerateStream(req, metadata=metadata)]

    async def go(stub, engine, server):
        errors = []
        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", KEY),)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(stub, metadata)
            errors.append(info.value)
        assert engine.requests == []
        ok = await call(stub, (("authorization", f"Bearer {KEY}"),))
        return errors, ok

    errors, ok = asyncio.run(with_grpc(go, api_key=KEY))
    for e in errors:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.details()
        assert KEY not in e.details()
    assert ok[-1].usage.completion_tokens == 2


def test_grpc_per_key_limit_is_resource_exhausted():
    async def go(stub, engine, server):
        auth = (("authorization", f"Bearer {KEY}"),)
        long = stub.GenerateStream(pb.GenerateRequest(prompt="a", max_tokens=200), metadata=auth)
        await long.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(prompt="b", max_tokens=2), metadata=auth)
        other = await stub.Generate(pb.GenerateRequest(prompt="b", max_tokens=2),
                                    metadata=(("authorization", f"Bearer {OTHER}"),))
        long.cancel()
        return info.value, other

    err, other = asyncio.run(with_grpc(go, FakeEngine(script=lambda r: OUT, delay_s=0.02),
                                       api_key=[KEY, OTHER], max_concurrent_per_key=1))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per key" in err.details()
    assert other.usage.completion_tokens == 2


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
