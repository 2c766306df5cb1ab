"""Shared pieces of the cluster config models: the strict base model, names and resource checks."""
from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
# Name of the Serve ingress deployment the app builds (`cluster.serve_app:build_app`); the Serve
# config's per-deployment settings (autoscaling_config, ray_actor_options) are addressed by it.
# The drafter and verifier are Ray actors of the pipeline, placed and counted from AppArgs.
INGRESS_DEPLOYMENT = "SpecflashIngress"
# Ray's built-in resources are requested through num_cpus / num_gpus, never as custom names.
RAY_BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}
DEFAULT_VERIFIER_POLICY = "cluster.autoscaling:PipelineLoadPolicy"
MAX_DRAFTERS_PER_VERIFIER = 8


class _Model(BaseModel):
    """Base: unknown keys are errors (a typo in YAML must not pass silently)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_custom_resources(resources: dict[str, float]) -> dict[str, float]:
    for name, amount in resources.items():
        if name in RAY_BUILTIN_RESOURCES:
            raise ValueError(f"{name!r} is a Ray built-in resource; use num_cpus / num_gpus / cpus / gpus")
        if amount <= 0:
            raise ValueError(f"custom resource {name!r} must be positive, got {amount}")
    return resources


def _check_dns_1035(name: str) -> str:
    if len(name) > 63 or not DNS_1035.match(name):
        raise ValueError(f"{name!r} is not a DNS-1035 label (lower-case letters, digits, '-', starts with a letter)")
    return name
