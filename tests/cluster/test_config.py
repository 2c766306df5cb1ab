"""The cluster scaling config: YAML round trip, defaults, and the validators users rely on."""
from __future__ import annotations

import copy
from pathlib import Path

import pydantic
import pytest
import yaml

from cluster.config import ActorPlacement, AppArgs, ClusterConfig, ConfigError, NodeType, ReplicaScaling

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "manifests" / "cluster.example.yaml"


@pytest.fixture
def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def _set(data: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(data)
    *path, last = dotted.split(".")
    cur = data
    for key in path:
        cur = cur.setdefault(key, {})
    cur[last] = value
    return data


def test_example_loads_and_round_trips(tmp_path):
    cfg = ClusterConfig.from_yaml(EXAMPLE)
    assert cfg.placement.drafter.resources == {"specflash_drafter": 1}
    assert cfg.verifier_nodes.gpus == 1
    out = tmp_path / "c.yaml"
    text = cfg.to_yaml(out)
    assert out.read_text() == text
    assert ClusterConfig.from_yaml(out) == cfg


def test_local_default_is_one_machine_without_custom_resources(tmp_path):
    cfg = ClusterConfig.local_default()
    assert cfg.placement.drafter.resources == {} and cfg.placement.verifier.resources == {}
    assert cfg.placement.drafter.num_gpus == 0 and cfg.placement.verifier.num_gpus == 0
    assert cfg.models.target is None and cfg.models.draft is None
    # no worker nodes: both actors are hosted by the (only) machine
    assert cfg.host_of("drafter") is cfg.head and cfg.host_of("verifier") is cfg.head
    cfg.to_yaml(tmp_path / "local.yaml")
    assert ClusterConfig.from_yaml(tmp_path / "local.yaml") == cfg


def test_ray_options_and_bundles():
    actor = ActorPlacement(num_cpus=2, num_gpus=0.5, resources={"specflash_drafter": 1})
    assert actor.ray_options() == {"num_cpus": 2, "num_gpus": 0.5, "resources": {"specflash_drafter": 1}}
    cfg = ClusterConfig.from_yaml(EXAMPLE)
    bundles = cfg.placement.bundles(drafters_per_verifier=2)
    assert bundles[0] == {"CPU": 8, "GPU": 1, "specflash_verifier": 1}
    assert bundles[1:] == [{"CPU": 4, "GPU": 1, "specflash_drafter": 1}] * 2


def test_autoscaling_config_is_what_serve_accepts():
    from ray.serve.config import AutoscalingConfig

    policy = "ray.serve.autoscaling_policy:default_autoscaling_policy"

    scaling = ReplicaScaling(min_replicas=1, max_replicas=4, target_ongoing_requests=16, policy=policy)
    cfg = AutoscalingConfig(**scaling.autoscaling_config())
    assert (cfg.min_replicas, cfg.initial_replicas, cfg.max_replicas) == (1, 1, 4)
    assert cfg.policy.policy_function == policy


@pytest.mark.parametrize(
    "dotted, value, message",
    [
        ("serving.prot", 8000, "Extra inputs are not permitted"),
        ("placement.drafter.num_gpus", 2, "does not fit on node type 'drafter'"),
        ("placement.drafter.num_gpus", 1.5, "whole number"),
        ("placement.verifier.resources", {"specflash_drafter": 1}, "does not fit on node type 'verifier'"),
        ("placement.verifier.resources", {"GPU": 1}, "built-in resource"),
        ("verifier_nodes.gpus", 0, "GPU=1"),
        ("head.resources", {"specflash_verifier": 1}, "head must run no model"),
        ("verifier_scaling.max_replicas", 5, "verifiers exceed what 4 'verifier' nodes hold"),
        ("verifier_scaling.initial_replicas", 9, "min_replicas <= initial_replicas <= max_replicas"),
        ("verifier_scaling.min_replicas", 0, "nothing serves without a verifier"),
        ("drafters_per_verifier", 2, "outside drafter_scaling"),
        ("drafter_scaling.min_per_verifier", 2, "min_per_verifier <= max_per_verifier"),
        ("drafter_scaling.max_per_verifier", 2, "drafter_scaling.max_per_verifier=8 drafters exceed"),
        ("ingress_scaling", {"min_replicas": 1}, "verifier_scaling is the Serve deployment"),
        ("verifier_nodes.name", "Verifier_GPU", "DNS-1035"),
        ("drafter_nodes.name", "verifier", "distinct names"),
        ("drafter_nodes.memory", "32 GB", "Kubernetes quantity"),
        ("drafter_nodes.replicas", 7, "min_workers <= replicas <= max_workers"),
        ("speculation.spec_len", 0, "greater than or equal to 1"),
        ("speculation.mode", "chain", "tree_width 1"),
        ("models.target", None, "needs its target"),
        ("serving.grpc_port", 8000, "different ports"),
        ("verifier_scaling.policy", "not an import path", "module:function"),
        ("verifier_scaling.policy", None, "policy_kwargs given without a policy"),
        ("engine", "sync", "engine must be"),
        ("models.draft", "/elsewhere/draft", "not under model_volume.mount_path"),
        ("model_volume.mount_path", "models", "must be absolute"),
    ],
)
def test_inconsistent_configs_are_rejected(example, dotted, value, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        ClusterConfig.model_validate(_set(example, dotted, value))


def test_target_without_draft_needs_ngram_or_off(example):
    data = _set(example, "models.draft", None)
    with pytest.raises(pydantic.ValidationError, match="ngram"):
        ClusterConfig.model_validate(data)
    assert ClusterConfig.model_validate(_set(data, "speculation.proposer", "ngram")).models.draft is None


def test_more_drafters_per_verifier_when_replicas_follow(example):
    data = _set(example, "drafters_per_verifier", 2)
    data = _set(data, "drafter_scaling.min_per_verifier", 2)
    data = _set(data, "drafter_scaling.max_per_verifier", 2)
    data = _set(data, "drafter_nodes.max_workers", 8)
    cfg = ClusterConfig.model_validate(data)
    assert cfg.drafters_per_verifier == 2


def test_actors_per_node_counts_the_scarcest_resource():
    node = NodeType(name="v", cpus=16, memory="64Gi", gpus=4, resources={"specflash_verifier": 2})
    assert node.actors_per_node(ActorPlacement(num_cpus=4, num_gpus=1, resources={"specflash_verifier": 1})) == 2
    assert node.actors_per_node(ActorPlacement(num_cpus=6, num_gpus=0.5)) == 2
    assert node.actors_per_node(ActorPlacement(num_cpus=1, num_gpus=0, resources={"other": 1})) == 0


def test_from_yaml_rejects_a_non_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        ClusterConfig.from_yaml(path)


def test_app_args_are_the_serve_app_part_of_the_config():
    cfg = ClusterConfig.from_yaml(EXAMPLE)
    args = AppArgs.model_validate(cfg.app_args())
    assert args.placement == cfg.placement and args.models == cfg.models
    assert "head" not in cfg.app_args() and "image" not in cfg.app_args()
    assert AppArgs.model_validate({}) == AppArgs()  # `serve run cluster.serve_app:build_app` with no args
    with pytest.raises(pydantic.ValidationError, match="nothing serves without a verifier"):
        AppArgs.model_validate({"verifier_scaling": {"min_replicas": 0}})


# ---- a config a person can use (issue 26, item 7) ---------------------------------------------
def test_a_partial_config_is_layered_over_the_local_defaults(tmp_path):
    path = tmp_path / "serving.yaml"
    path.write_text("serving:\n  api_key_env: MY_KEY\n  port: 8100\n")
    cfg = ClusterConfig.from_yaml(path, layered=True)
    local = ClusterConfig.local_default()
    assert (cfg.serving.api_key_env, cfg.serving.port) == ("MY_KEY", 8100)
    assert cfg.serving.max_queue == local.serving.max_queue          # the block's own defaults
    assert cfg.model_copy(update={"serving": local.serving}) == local  # everything else is local
    (tmp_path / "empty.yaml").write_text("")
    assert ClusterConfig.from_yaml(tmp_path / "empty.yaml", layered=True) == local
    # the cluster manifests still need a complete config: each missing field said once, in words
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml(path)
    problems = info.value.problems
    assert problems[0] == "`image` is missing: Container image with specflash installed (same Ray version)."
    assert [p.split("`")[1] for p in problems] == ["image", "ray_version", "head", "drafter_nodes", "verifier_nodes"]
    assert "\n" not in str(info.value)


def test_a_block_given_is_taken_whole(tmp_path):
    path = tmp_path / "head.yaml"
    path.write_text("head: {name: big}\n")
    with pytest.raises(ConfigError, match=r"`head.cpus` is missing: CPUs of one node"):
        ClusterConfig.from_yaml(path, layered=True)


@pytest.mark.parametrize("yaml_text, sentence", [
    ("serving: {prot: 8001}", "`prot` is not a setting of `serving`; did you mean `port`?"),
    ("servng: {port: 8001}", "`servng` is not a setting at the top level; did you mean `serving`?"),
    ("serving: {port: abc}", "`serving.port` should be a valid integer, got 'abc'."),
    ("serving: {port: 0}", "`serving.port` should be greater than or equal to 1, got 0."),
    ("models: {dtype: fp8}", "`models.dtype` should be 'float32', 'bfloat16' or 'float16', got 'fp8'."),
    ("serving: {port: 9000}", "`serving`: HTTP and gRPC need different ports, both are 9000."),
    ("verifier_scaling: {min_replicas: 0}", "the config: verifier_scaling.min_replicas must be >= 1"),
])
def test_config_errors_are_one_plain_sentence_per_field(tmp_path, yaml_text, sentence):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text + "\n")
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml(path, layered=True)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(sentence), info.value.problems
    assert str(info.value).startswith(f"{path} is not a valid config: ")


def test_the_local_head_is_this_machine(monkeypatch, tmp_path):
    import cluster.config.app as app

    monkeypatch.setattr(app, "_local_gpus", lambda: 0)
    monkeypatch.setattr(app.os, "cpu_count", lambda: 6)
    assert ClusterConfig.local_default().head.cpus == 6
    path = tmp_path / "gpu.yaml"
    path.write_text("placement:\n  verifier: {num_gpus: 1}\n")
    with pytest.raises(ConfigError, match=r"a verifier actor does not fit on node type 'local': needs GPU=1 \(offers 0\)"):
        ClusterConfig.from_yaml(path, layered=True)
    monkeypatch.setattr(app, "_local_gpus", lambda: 1)
    assert ClusterConfig.from_yaml(path, layered=True).placement.verifier.num_gpus == 1


def test_unplaceable_names_the_actor_and_what_the_nodes_offer():
    cfg = ClusterConfig.from_yaml(EXAMPLE)
    cpu_node = {"CPU": 2.0, "memory": 1e9, "node:10.0.0.1": 1.0, "object_store_memory": 1e8}
    problems = cfg.placement.unplaceable([cpu_node])
    assert problems == [
        "placement.verifier asks for CPU=8, GPU=1, specflash_verifier=1, which no node of this Ray cluster "
        "offers (CPU=2)",
        "placement.drafter asks for CPU=4, GPU=1, specflash_drafter=1, which no node of this Ray cluster "
        "offers (CPU=2)",
    ]
    assert cfg.placement.unplaceable([cpu_node], pipeline=False) == []  # only the ingress: CPU=1
    gpu_nodes = [{"CPU": 8, "GPU": 1, "specflash_verifier": 1}, {"CPU": 8, "GPU": 1, "specflash_drafter": 1}]
    assert cfg.placement.unplaceable(gpu_nodes) == []
    assert cfg.placement.unplaceable([]) and "no alive node" in cfg.placement.unplaceable([])[0]
