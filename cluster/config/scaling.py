"""How many verifiers and drafters run: Serve replica autoscaling, drafters per verifier, Ray's node autoscaler."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from cluster.config.base import DEFAULT_VERIFIER_POLICY, MAX_DRAFTERS_PER_VERIFIER, _Model


class ReplicaScaling(_Model):
    """Verifier replicas: each replica of the Serve ingress deployment hosts one verifier pipeline, so
    this is the deployment's `autoscaling_config` (cluster.autoscaling.PipelineLoadPolicy by default)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas the Serve autoscaler keeps.")
    max_replicas: int = Field(1, ge=1, description="Most replicas the Serve autoscaler starts.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time; None = min_replicas.")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Ongoing requests per replica the autoscaler aims for."
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="Load must stay high this long before scaling up.")
    downscale_delay_s: float = Field(600.0, ge=0, description="Load must stay low this long before scaling down.")
    policy: str | None = Field(
        DEFAULT_VERIFIER_POLICY,
        description="Serve autoscaling policy as `module:function` or `module:Class`. The default scales on "
        "ongoing requests and on the verifiers' busy fraction, which each replica reports through "
        "`record_autoscaling_stats`; None = Serve's built-in policy, on ongoing requests only.",
    )
    policy_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of `policy`.")

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaScaling:
        initial = self.min_replicas if self.initial_replicas is None else self.initial_replicas
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"need min_replicas <= initial_replicas <= max_replicas, got "
                f"{self.min_replicas} <= {initial} <= {self.max_replicas}"
            )
        if self.policy_kwargs and self.policy is None:
            raise ValueError("policy_kwargs given without a policy")
        if self.policy is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.policy):
            raise ValueError(f"policy must be an import path `module:function`, got {self.policy!r}")
        return self

    def autoscaling_config(self) -> dict[str, Any]:
        """Serve's `autoscaling_config` for this deployment."""
        cfg: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "initial_replicas": self.min_replicas if self.initial_replicas is None else self.initial_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        }
        if self.policy is not None:
            cfg["policy"] = {"policy_function": self.policy, "policy_kwargs": dict(self.policy_kwargs)}
        return cfg


class DrafterScaling(_Model):
    """Drafters per verifier, adjusted inside each replica by `cluster.autoscaling.DrafterAutoscaler`
    from that verifier's own signals; `drafters_per_verifier` is the starting count."""

    min_per_verifier: int = Field(1, ge=1, le=MAX_DRAFTERS_PER_VERIFIER, description="Fewest drafters feeding one verifier.")
    max_per_verifier: int = Field(1, ge=1, le=MAX_DRAFTERS_PER_VERIFIER, description="Most drafters feeding one verifier.")
    starved_idle_fraction: float = Field(
        0.2, gt=0, lt=1, description="Add a drafter while the verifier spends more than this fraction of its "
        "time waiting for trees with requests pending (drafting is the bottleneck).")
    full_ring_occupancy: float = Field(
        0.9, gt=0, le=1, description="Remove a drafter while the rings stay fuller than this on average and the "
        "verifier is not starved (drafters wait on backpressure: one fewer keeps up).")
    period_s: float = Field(10.0, gt=0, description="How often each replica reads its verifier's signals.")
    upscale_delay_s: float = Field(30.0, ge=0, description="A starved verifier must stay starved this long.")
    downscale_delay_s: float = Field(300.0, ge=0, description="Full rings must stay full this long.")

    @model_validator(mode="after")
    def _ordered(self) -> DrafterScaling:
        if self.min_per_verifier > self.max_per_verifier:
            raise ValueError(f"need min_per_verifier <= max_per_verifier, got "
                             f"{self.min_per_verifier} > {self.max_per_verifier}")
        return self

    @property
    def enabled(self) -> bool:
        return self.max_per_verifier > self.min_per_verifier


class AutoscalerOptions(_Model):
    idle_timeout_s: int = Field(60, ge=0, description="A worker node idle this long is removed.")
    upscaling_mode: Literal["Default", "Aggressive", "Conservative"] = Field(
        "Default", description="KubeRay upscalingMode: Conservative adds nodes gradually, Aggressive at once."
    )
    version: Literal["v1", "v2"] = Field("v2", description="Ray autoscaler version KubeRay runs.")
