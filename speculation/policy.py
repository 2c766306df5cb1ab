"""Decisions both sides of the pipeline make alike, each from its own view (DESIGN.md §3).

The drafter and the verifier never ask each other how deep a bridge chain is or whether they
run in lockstep: each decides with the functions here from what it knows (the settings, the
budget of the last step signal, where the other side runs). Where the two views differ for a
step, the cost is speed, never exactness: outcomes and bridges follow each tree's own header.
Whether a restart tree follows a contradicted outcome, and how deep, the verifier decides
(`restart_tree_depth`) and its step signal says (`Signal.restart`): a mismatch there would
leave the verifier waiting for a tree the drafter never drafts.
"""
from __future__ import annotations

from speculation.settings import MAX_BRIDGE_DEPTH, EngineSettings


def bridge_chain_depth(settings: EngineSettings, params, budget: int, proposer: str = "model") -> int:
    """Draft tokens a bridge step of this sequence verifies: the setting, for greedy requests
    drafted by the draft model (`proposer`), within the sequence's budget (the verifier's last
    signal; 0 = decode alone)."""
    if settings.bridge_depth <= 0 or proposer != "model" or not params.greedy:
        return 0
    return max(0, min(settings.bridge_depth, budget, MAX_BRIDGE_DEPTH))


# a lone overlapped stream's restart chain (`restart_depth` -1): the draft is right about half as
# often just after a miss as elsewhere, and each level more is one more draft forward the verifier
# waits for: past ~3 tokens a level's expected gain is below its wait (bench/README.md, one core each)
LONE_RESTART_DEPTH = 3


def restart_tree_depth(settings: EngineSettings, budget: int, lone_overlapped: bool) -> int:
    """The verifier's choice of the restart tree that follows a contradicted outcome, told to
    the drafter with the step's signal (`Signal.restart`): the setting within the sequence's
    budget (its next tree's depth); with the setting -1, a chain of `LONE_RESTART_DEPTH` for a
    lone stream overlapped with its drafter (`lone_overlapped`: the verifier waits for a short chain
    instead of decoding one token alone, the drafter having nothing else to draft) and a
    bridge for streams that share one; 0 = the verifier bridges (so does a budget of 0)."""
    depth = LONE_RESTART_DEPTH if settings.restart_depth < 0 and lone_overlapped else settings.restart_depth
    return max(0, min(depth, budget))


def next_tree_shape(settings: EngineSettings, params, budget: tuple[int, int], contradicted: bool,
                    proposer: str = "model", restart: int = 0) -> tuple[int, int, int]:
    """The drafter's next tree for a sequence: (depth, width, bridge), `bridge` the tokens the
    verifier's bridge step is assumed to commit before it (0: none; `drafter.draft_side`).
    After a contradicted outcome: the restart chain the verifier asked for (`restart`, from
    the step's signal: `restart_tree_depth`), else the restart tree after a bridge of one
    token or a bridge chain's r plus one (drafter/streams.py)."""
    k, width = budget
    if not contradicted:
        return k, width, 0
    if restart:
        return restart, 1, 0
    return k, width, 1 + bridge_chain_depth(settings, params, k, proposer)


def threads_of(num_cpus: float) -> int:
    """Torch threads for an actor that reserved `num_cpus` CPUs: one per CPU, at least one."""
    return max(1, int(num_cpus))


def plain_step_threads(setting: int, own: int, device: str, node: str, drafters: list[dict]) -> int:
    """Threads for a verifier step taken while no drafter has work (every sequence decodes alone).

    On a CPU node the drafter's cores then idle: a plain step may use them, so that an
    asynchronous pipeline with speculation switched off decodes as fast as the target
    alone on the same cores instead of on the verifier's share of them. `drafters`: the
    live drafters, each {"node": node id, "cpus": CPUs it reserved}; only those on the
    verifier's own `node` lend their cores. GPU verifiers keep `own`.
    """
    if device != "cpu" or setting == 0:
        return own
    if setting > 0:
        return setting
    return own + sum(threads_of(d.get("cpus", 0)) for d in drafters if node and d.get("node") == node)


def shares_gpu(node: str, gpus: list[str] | None, other_node: str, other_gpus: list[str] | None) -> bool:
    """Whether two actors run on one GPU: the same node and a GPU id in common, or both on a GPU
    with none named (each then uses the node's first visible device). Two processes on one GPU
    have their kernels time-sliced, so overlapping their forwards gains nothing."""
    if gpus is None or other_gpus is None or not node or node != other_node:
        return False
    return bool(set(gpus) & set(other_gpus)) or (not gpus and not other_gpus)


def in_lockstep(settings: EngineSettings, streams: int, on_cpu: bool,
                drafter_node: str, drafter_cpus: float, drafter_gpus: list[str] | None,
                verifier_node: str, verifier_cpus: float, verifier_gpus: list[str] | None) -> bool:
    """Whether a drafter runs in lockstep with its verifier (one tree in flight, nothing
    assumed past it): always with `ring_slots` 1; with `lockstep_shared_gpu` while the two
    share a GPU (`shares_gpu`); with `lockstep_alone` while the drafter, on the verifier's node
    and with at least its CPUs, serves one stream (`streams`) and the deciding side runs on a
    CPU (`on_cpu`: the verifier then verifies on the drafter's cores too)."""
    if settings.ring_slots == 1:
        return True
    if settings.lockstep_shared_gpu and shares_gpu(drafter_node, drafter_gpus, verifier_node, verifier_gpus):
        return True
    return (settings.lockstep_alone and on_cpu and streams == 1 and bool(drafter_node)
            and drafter_node == verifier_node and drafter_cpus >= verifier_cpus > 0)
