"""Where actors run: their Ray resources, the placement group, and the node types that host them."""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cluster.config.base import K8S_QUANTITY, _check_custom_resources, _check_dns_1035, _Model


class ActorPlacement(_Model):
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs the actor reserves.")
    num_gpus: float = Field(
        0.0, ge=0, description="Ray GPUs the actor reserves; a fraction shares a GPU, above 1 must be whole."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources the actor asks for, e.g. {specflash_drafter: 1}; "
        "only nodes offering them can host it.",
    )

    @field_validator("num_gpus")
    @classmethod
    def _whole_gpus_above_one(cls, v: float) -> float:
        if v > 1 and v != int(v):
            raise ValueError(f"num_gpus above 1 must be a whole number, got {v}")
        return v

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_custom_resources(v)

    def ray_options(self) -> dict[str, Any]:
        """Keyword arguments for `ActorClass.options(...)` / Serve `ray_actor_options`."""
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts

    def bundle(self) -> dict[str, float]:
        """This actor's placement-group bundle (Ray resource names)."""
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in bundle.items() if v > 0}


class PlacementConfig(_Model):
    drafter: ActorPlacement = Field(default_factory=ActorPlacement, description="Resources of one drafter actor.")
    verifier: ActorPlacement = Field(default_factory=ActorPlacement, description="Resources of one verifier actor.")
    ingress: ActorPlacement = Field(
        default_factory=lambda: ActorPlacement(num_cpus=0.0),
        description="Resources of one Serve ingress replica (HTTP/gRPC front, runs no model).",
    )
    strategy: Literal["NONE", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "NONE",
        description="Placement group over one verifier and its drafters; NONE = no placement group, "
        "the resources above decide; STRICT_SPREAD = each on a different node.",
    )

    def bundles(self, drafters_per_verifier: int) -> list[dict[str, float]]:
        """Placement-group bundles of one pipeline: the verifier first, then its drafters."""
        return [self.verifier.bundle()] + [self.drafter.bundle() for _ in range(drafters_per_verifier)]

    def unplaceable(self, nodes: list[dict[str, float]], pipeline: bool = True) -> list[str]:
        """One sentence per actor that no node of a running Ray cluster can host; [] when all fit.

        `nodes`: each alive node's total resources (`ray.nodes()[i]["Resources"]`); `pipeline`:
        the drafter and verifier actors are started too (False: only the ingress, engine local/fake).
        Ray would keep such an actor pending forever; `specflash serve` stops with these instead."""
        sides = ("ingress", "verifier", "drafter") if pipeline else ("ingress",)
        problems = []
        for side in sides:
            wanted = getattr(self, side).bundle()
            if any(all(node.get(k, 0.0) >= v for k, v in wanted.items()) for node in nodes):
                continue
            offered = "; ".join(_readable(node) for node in nodes) or "no alive node"
            problems.append(f"placement.{side} asks for {_readable(wanted)}, which no node of this Ray "
                            f"cluster offers ({offered})")
        return problems


class Toleration(_Model):
    key: str | None = Field(None, description="Taint key; None with operator Exists tolerates every taint.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Kubernetes toleration operator.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect; None = every effect."
    )


class NodeType(_Model):
    name: str = Field(description="Node type / KubeRay group name (DNS-1035 label).")
    cpus: int = Field(gt=0, description="CPUs of one node (pod request and limit; Ray's num-cpus on workers).")
    memory: str = Field(description="Memory of one node as a Kubernetes quantity, e.g. 32Gi.")
    gpus: int = Field(0, ge=0, description="GPUs of one node (a `gpu_resource` limit on Kubernetes).")
    gpu_resource: str = Field("nvidia.com/gpu", description="Kubernetes extended resource name of the GPUs.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources the node offers (rayStartParams `resources`)."
    )
    min_workers: int = Field(0, ge=0, description="Fewest nodes of this type (KubeRay minReplicas).")
    max_workers: int = Field(1, ge=0, description="Most nodes of this type (KubeRay maxReplicas).")
    replicas: int | None = Field(None, ge=0, description="Nodes at creation; None = min_workers.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Kubernetes nodeSelector of the pods.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Kubernetes tolerations of the pods.")
    image: str | None = Field(None, description="Container image override; None = the cluster image.")
    instance_type: str | None = Field(None, description="VM instance type for the `ray up` launcher config.")

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_custom_resources(v)

    @field_validator("name")
    @classmethod
    def _dns_1035(cls, v: str) -> str:
        return _check_dns_1035(v)

    @field_validator("memory")
    @classmethod
    def _quantity(cls, v: str) -> str:
        if not K8S_QUANTITY.match(v):
            raise ValueError(f"memory {v!r} is not a Kubernetes quantity such as 32Gi or 64G")
        return v

    @model_validator(mode="after")
    def _replicas_in_range(self) -> NodeType:
        if not self.min_workers <= self.initial_workers <= self.max_workers:
            raise ValueError(
                f"node type {self.name}: need min_workers <= replicas <= max_workers, got "
                f"{self.min_workers} <= {self.initial_workers} <= {self.max_workers}"
            )
        return self

    @property
    def initial_workers(self) -> int:
        return self.min_workers if self.replicas is None else self.replicas

    def actors_per_node(self, actor: ActorPlacement) -> int:
        """How many such actors one node of this type can hold (0 = none fits)."""
        offered = {"CPU": self.cpus, "GPU": float(self.gpus), **self.resources}
        wanted = {"CPU": actor.num_cpus, "GPU": actor.num_gpus, **actor.resources}
        fits = [math.floor(offered.get(k, 0.0) / v + 1e-9) for k, v in wanted.items() if v > 0]
        return min(fits) if fits else 1 << 30

    def missing_for(self, actor: ActorPlacement) -> list[str]:
        """The resources this node type lacks to host one such actor, as readable strings."""
        offered = {"CPU": self.cpus, "GPU": float(self.gpus), **self.resources}
        wanted = {"CPU": actor.num_cpus, "GPU": actor.num_gpus, **actor.resources}
        return [f"{k}={v:g} (offers {offered.get(k, 0):g})" for k, v in wanted.items() if offered.get(k, 0.0) < v]


def _readable(resources: dict[str, float]) -> str:
    """`CPU=4, GPU=1, specflash_drafter=1`: the resources an actor can ask for (no node:, memory)."""
    shown = {k: v for k, v in resources.items() if ":" not in k and k not in ("memory", "object_store_memory")}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(shown.items(), key=lambda kv: (kv[0] not in ("CPU", "GPU"), kv[0])))
