"""The Serve app builder and the `specflash serve` argument handling (no Ray cluster started)."""
from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from cluster.config import INGRESS_DEPLOYMENT, ClusterConfig
from serving.grpc_service import SERVICER_FUNCTION
from cluster.serve_app import build_app, replace_replica, split_args
from cluster.serve_cli import add_parser, app_args_from


def test_build_app_is_importable_by_path_and_wires_one_ingress():
    from ray._common.utils import import_attr

    assert import_attr("cluster.serve_app:build_app") is build_app
    app = build_app({})
    deployment = app._bound_deployment
    assert deployment.name == INGRESS_DEPLOYMENT
    assert deployment.max_ongoing_requests > ClusterConfig.local_default().serving.max_queue
    (app_args,) = deployment.init_args
    assert (app_args["engine"], app_args["model_name"]) == ("auto", "specflash")
    assert app_args["serving"]["max_queue"] == 256


def test_module_level_app_is_an_application_for_serve_build():
    from ray.serve import Application

    from cluster import serve_app

    assert isinstance(serve_app.app, Application)
    assert serve_app.app._bound_deployment.name == INGRESS_DEPLOYMENT


def test_build_app_takes_the_configs_app_args_plus_builder_keys():
    args = ClusterConfig.local_default().app_args()
    args["serving"]["max_queue"] = 7
    app = build_app({**args, "engine": "local", "model_name": "mine"})
    (app_args,) = app._bound_deployment.init_args
    assert app_args["serving"]["max_queue"] == 7
    assert (app_args["engine"], app_args["model_name"]) == ("local", "mine")


@pytest.mark.parametrize("bad", [{"engine": "warp"}, {"servng": {}}, {"serving": {"port": 0}}])
def test_bad_args_are_rejected_at_build_time(bad):
    with pytest.raises((ValueError, ValidationError)):
        split_args(bad)


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_flags_override_the_config(tmp_path):
    cfg = ClusterConfig.local_default()
    cfg.serving.port = 8100
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    data = app_args_from(parse("--config", str(path), "--target", "/t", "--draft", "/d",
                               "--host", "0.0.0.0", "--grpc-port", "9100", "--engine", "local"))
    assert data["serving"]["port"] == 8100 and data["serving"]["grpc_port"] == 9100
    assert data["serving"]["host"] == "0.0.0.0"
    assert data["models"]["target"] == "/t" and data["models"]["draft"] == "/d"
    assert SERVICER_FUNCTION in data["serving"]["grpc_servicer_functions"]
    assert data["engine"] == "local"
    split_args(data)  # what the builder will accept


def test_prefix_caching_and_chunking_flags_reach_the_app_args():
    data = app_args_from(parse("--prefix-caching", "--prefill-chunk", "256"))
    assert data["kv_cache"] == {"prefix_caching": True, "prefill_chunk": 256, "prefill_step_share": 0.5}
    assert app_args_from(parse())["kv_cache"] == {"prefix_caching": False, "prefill_chunk": 0, "prefill_step_share": 0.5}
    split_args(data)


def test_draft_without_target_is_an_error():
    with pytest.raises(ValueError, match="--draft needs --target"):
        app_args_from(parse("--draft", "/d"))


# ---- configuration a person can use (issue 26, item 7) ---------------------------------------
def test_a_serving_only_config_and_flags_make_a_local_server(tmp_path):
    from cluster.serve_cli import API_KEY_ENV, job_env

    path = tmp_path / "serving.yaml"
    path.write_text("serving:\n  port: 8100\n")
    args = parse("--config", str(path), "--api-key", "sk-local", "--max-queue", "9", "--spec-mode", "off")
    data = app_args_from(args)
    assert data["serving"]["port"] == 8100 and data["serving"]["max_queue"] == 9
    assert (data["serving"]["api_key_env"], data["serving"]["api_key_file"]) == (API_KEY_ENV, None)
    assert data["speculation"]["mode"] == "off"
    assert job_env(args) == {API_KEY_ENV: "sk-local"}       # the replicas read the key from there
    assert data["engine"] == "auto" and data["model_name"] == "specflash"
    split_args(data)
    with pytest.raises(ValueError, match="--api-key is empty"):
        job_env(parse("--api-key", " "))


def test_flags_left_out_keep_the_configs_values():
    from tests.cluster.test_config import EXAMPLE

    data = app_args_from(parse("--config", str(EXAMPLE)))
    assert data["engine"] == "pipeline" and data["speculation"]["tree_width"] == 2


def test_a_bad_flag_is_explained_by_the_field_it_sets():
    from cluster.config import ConfigError

    with pytest.raises(ConfigError) as info:
        app_args_from(parse("--port", "0", "--spec-len", "99"))
    assert info.value.source == "the command-line flags"
    assert [p.split("`")[1] for p in info.value.problems] == ["speculation.spec_len", "serving.port"]


def test_an_unplaceable_config_fails_fast_on_a_local_ray_and_warns_on_a_cluster(capsys, tmp_path):
    from cluster.config import AppArgs
    from cluster.serve_cli import check_placeable
    from tests.cluster.test_config import EXAMPLE

    args = AppArgs.model_validate(app_args_from(parse("--config", str(EXAMPLE))))
    laptop = [{"CPU": 2.0, "memory": 8e9}]
    with pytest.raises(RuntimeError) as info:
        check_placeable(args, laptop, joined=False)
    message = str(info.value)
    assert "placement.verifier asks for CPU=8, GPU=1, specflash_verifier=1" in message
    assert "This local Ray cannot grow" in message and "not a checkpoint directory" in message
    check_placeable(args, laptop, joined=True)
    assert "waiting for Ray's autoscaler" in capsys.readouterr().err
    local = AppArgs.model_validate(app_args_from(parse("--engine", "fake")))
    check_placeable(local, laptop, joined=False)


def test_the_health_check_waits_for_a_restarting_verifier_then_asks_serve_to_replace():
    """A verifier Ray is restarting (its node lost: it may move) keeps the replica for the grace;
    past it, or when a pipeline is unhealthy for another reason, Serve is told to replace it."""
    up = {"ok": True, "down_for_s": 0.0}
    down = {"ok": False, "down_for_s": 40.0, "error": "verifier: lost node n1 at T; ..."}
    broken = {"ok": False, "down_for_s": 0.0, "error": "step failed"}

    def engine(*pipelines):
        return {"ok": all(p["ok"] for p in pipelines), "verifier": "verifier: lost node n1 at T; ...",
                "down_for_s": max(p["down_for_s"] for p in pipelines), "pipelines": list(pipelines)}

    assert replace_replica(engine(up, up)) is None
    assert replace_replica(engine(up, down), grace_s=60) is None
    assert "not come back in 40 s: verifier: lost node n1" in replace_replica(engine(up, down), grace_s=30)
    assert replace_replica(engine(broken, up)).startswith("engine unhealthy")
    assert replace_replica(engine(broken, down), grace_s=60).startswith("engine unhealthy")
    assert replace_replica({"ok": False}).startswith("engine unhealthy"), "an engine without verifiers"


def test_session_affinity_picks_serves_consistent_hash_router():
    from cluster.config.front import SESSION_ROUTER

    assert app_args_from(parse("--session-affinity"))["serving"]["session_affinity"] is True
    default = build_app({})._bound_deployment._deployment_config.request_router_config
    assert default.request_router_class != SESSION_ROUTER
    sticky = build_app({"serving": {"session_affinity": True}})._bound_deployment
    assert sticky._deployment_config.request_router_config.request_router_class == SESSION_ROUTER


def test_stream_interval_flag_reaches_the_engines_settings():
    from cluster.config import AppArgs
    from cluster.pipeline import settings_from_config

    args = app_args_from(parse("--stream-interval", "8"))
    assert args["serving"]["stream_interval"] == 8
    assert settings_from_config(AppArgs.model_validate(args)).stream_interval == 8
    assert settings_from_config(AppArgs.model_validate({})).stream_interval == 1
    with pytest.raises(Exception, match="stream_interval"):
        app_args_from(parse("--stream-interval", "0"))
