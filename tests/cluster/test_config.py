"""The cluster scaling config: YAML round trip, defaults, and the validators users rely on."""
from __future__ import annotations

import copy
from pathlib import Path

import pydantic
import pytest
import yaml

from cluster.config import ActorPlacement, AppArgs, ClusterConfig, NodeType, ReplicaScaling

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
