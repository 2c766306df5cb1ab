"""One local multi-node Ray cluster for the tests that need Ray (the fixtures `ray_cluster` and
`make_engine` in tests/conftest.py).

`ray.cluster_utils.Cluster` starts, on this machine, two Ray nodes, each with its own raylet
and object store: the head offers the custom resource `specflash_verifier`, the worker
`specflash_drafter`, so drafter and verifier actors pinned by those resources run on
different nodes and their trees cross object stores. The cluster is started once per session
(it costs ~20-40 s here) and shut down at the end, raylets included.
"""
from __future__ import annotations

DRAFTER_RESOURCE = "specflash_drafter"
VERIFIER_RESOURCE = "specflash_verifier"


def start_cluster(attempts: int = 3):
    """Two raylets: the head hosts verifiers, the worker hosts drafters (a third node would only
    add start-up time). Retried whole: on an overloaded machine a raylet can miss Ray's fixed
    30 s start-up window, and a half-started cluster is shut down before the next try."""
    from ray.cluster_utils import Cluster

    store = 96 * 2**20
    for attempt in range(attempts):
        cluster = Cluster()
        try:
            cluster.add_node(num_cpus=4, resources={VERIFIER_RESOURCE: 4}, object_store_memory=store,
                             include_dashboard=False)
            drafter_node = cluster.add_node(num_cpus=4, resources={DRAFTER_RESOURCE: 4},
                                            object_store_memory=store)
            cluster.wait_for_nodes()
            return cluster, drafter_node
        except Exception:
            cluster.shutdown()
            if attempt + 1 == attempts:
                raise


def pipeline_args(drafters: int = 1, strategy: str = "NONE", **speculation):
    """AppArgs pinning drafters and verifiers to their nodes (by resource or placement group)."""
    from cluster.config import ActorPlacement, AppArgs, DrafterScaling, PlacementConfig
    from speculation.settings import SpeculationSettings

    placement = PlacementConfig(
        drafter=ActorPlacement(num_cpus=1, resources={DRAFTER_RESOURCE: 1}),
        verifier=ActorPlacement(num_cpus=1, resources={VERIFIER_RESOURCE: 1}),
        strategy=strategy)
    return AppArgs(placement=placement, drafters_per_verifier=drafters,
                   drafter_scaling=DrafterScaling(max_per_verifier=drafters),
                   speculation=SpeculationSettings(**speculation))
