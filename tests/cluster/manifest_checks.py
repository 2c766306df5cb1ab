"""Checks of the rendered deployment files, as the services that read them would check them
(tests/cluster/test_manifests.py): the Kubernetes API server's strict validation of a KubeRay
custom resource against its CRD schema, what the KubeRay operator refuses beyond the schema, and
Ray Serve's config schema with unknown keys refused at any depth."""
from __future__ import annotations

import copy
import json
import re
import typing

import jsonschema
import pydantic
import yaml

from cluster.config import AppArgs

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


# ---- the API server's view of a custom resource -------------------------------------------------
def _strict(schema):
    """Copy of `schema` with additionalProperties: false wherever properties are listed."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) if k in ("items", "additionalProperties", "not") else v for k, v in schema.items()}
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [_strict(s) for s in schema[key]]
    if "properties" in schema:
        out["properties"] = {name: _strict(s) for name, s in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def _drop_nulls(obj):
    if isinstance(obj, dict):
        return {k: _drop_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_nulls(v) for v in obj]
    return obj


def _fill_defaults(schema: dict, obj) -> None:
    """Structural-schema defaulting: a missing property with a default gets it, recursively."""
    if isinstance(obj, dict):
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
        extra = schema.get("additionalProperties")
        for name, value in obj.items():
            sub = props.get(name, extra if isinstance(extra, dict) else None)
            if sub:
                _fill_defaults(sub, value)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            _fill_defaults(schema["items"], item)


_FORMATS = jsonschema.FormatChecker()


@_FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


def api_server_errors(obj: dict, schemas: dict[str, dict]) -> list[str]:
    schema = schemas[obj["kind"]]
    obj = _drop_nulls(copy.deepcopy(obj))
    _fill_defaults(schema, obj)
    validator = jsonschema.Draft7Validator(_strict(schema), format_checker=_FORMATS)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


# ---- what the KubeRay operator checks beyond the schema -----------------------------------------
def _cluster_spec(obj: dict) -> dict:
    return {"RayCluster": lambda s: s, "RayService": lambda s: s["rayClusterConfig"],
            "RayJob": lambda s: s["rayClusterSpec"]}[obj["kind"]](obj["spec"])


def _group_errors(where: str, group: dict) -> list[str]:
    errors = []
    params = group.get("rayStartParams", {})
    errors += [f"{where}: rayStartParams[{k}] is not a string" for k, v in params.items() if not isinstance(v, str)]
    limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    if any(key.endswith("/gpu") for key in limits) and "num-gpus" in params:
        errors.append(f"{where}: num-gpus in rayStartParams beside a GPU limit")
    if "resources" in params and group.get("resources"):
        errors.append(f"{where}: custom resources both in rayStartParams and in the resources field")
    if isinstance(params.get("resources"), str):
        try:
            parsed = _parse_ray_resources(params["resources"])
            assert isinstance(parsed, dict) and all(isinstance(v, (int, float)) for v in parsed.values())
        except (ValueError, AssertionError):
            errors.append(f"{where}: rayStartParams resources is not a JSON object of numbers")
    return errors


def kuberay_rule_errors(obj: dict) -> list[str]:
    name = obj["metadata"]["name"]
    errors = [] if DNS_1035.match(name) and len(name) <= 63 else [f"metadata.name {name!r} is not DNS-1035"]
    spec = _cluster_spec(obj)
    errors += _group_errors("head", spec["headGroupSpec"])
    groups = spec.get("workerGroupSpecs", [])
    if len({g["groupName"] for g in groups}) != len(groups):
        errors.append("worker group names are not unique")
    for g in groups:
        where = f"group {g['groupName']}"
        if not DNS_1035.match(g["groupName"]):
            errors.append(f"{where}: groupName is not DNS-1035")
        lo, n, hi = g.get("minReplicas", 0), g.get("replicas", 0), g.get("maxReplicas", 2**31 - 1)
        if not lo <= n <= hi:
            errors.append(f"{where}: need minReplicas <= replicas <= maxReplicas, got {lo}, {n}, {hi}")
        errors += _group_errors(where, g)
    if obj["kind"] == "RayService":
        if obj["spec"].get("upgradeStrategy", {}).get("type") not in (None, "NewCluster",
                                                                      "NewClusterWithIncrementalUpgrade", "None"):
            errors.append("unknown upgradeStrategy.type")
        if not isinstance(yaml.safe_load(obj["spec"].get("serveConfigV2", "")), dict):
            errors.append("serveConfigV2 is not a YAML mapping")
    if obj["kind"] == "RayJob":
        if obj["spec"].get("submissionMode", "K8sJobMode") not in ("K8sJobMode", "HTTPMode", "InteractiveMode",
                                                                    "SidecarMode"):
            errors.append("unknown submissionMode")
        if obj["spec"].get("shutdownAfterJobFinishes") and "clusterSelector" in obj["spec"]:
            errors.append("shutdownAfterJobFinishes needs a rayClusterSpec, not a clusterSelector")
    return errors


def _parse_ray_resources(text: str) -> dict:
    value = json.loads(text)
    return json.loads(value) if isinstance(value, str) else value  # '"{\"a\": 1}"' or '{"a": 1}'


# ---- Serve config: unknown keys at any depth --------------------------------------------------
def _models_in(annotation) -> list[type[pydantic.BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def unknown_serve_keys(data, model: type[pydantic.BaseModel], path: str = "") -> list[str]:
    """Keys of `data` that no field of `model` (or of the models nested in its fields) knows."""
    errors = []
    fields = {f.alias or n: f for n, f in model.model_fields.items()} | dict(model.model_fields)
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            errors.append(f"{path}{key} (not a field of {model.__name__})")
            continue
        nested = _models_in(field.annotation)
        if not nested:
            continue
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, dict):
                where = f"{path}{key}[{i}]." if isinstance(value, list) else f"{path}{key}."
                errors += unknown_serve_keys(item, nested[0], where)
    return errors


def serve_config_errors(data: dict) -> list[str]:
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(data)
    except pydantic.ValidationError as e:
        return [str(e)]
    errors = unknown_serve_keys(data, ServeDeploySchema)
    for app in data["applications"]:
        try:
            AppArgs.model_validate(app.get("args", {}))
        except pydantic.ValidationError as e:
            errors.append(f"application {app['name']} args: {e}")
    return errors
