"""Config errors a person can act on: one plain sentence per wrong field, not pydantic's raw list.

`explain(error, model, source)` turns a pydantic `ValidationError` raised while validating `model`
into a `ConfigError` whose message names each field by its dotted path (`serving.port`), says what is
wrong in words, and, for a missing field, what the field is (its `Field(description=...)`); an unknown
key gets the closest real one ("did you mean `port`?").
"""
from __future__ import annotations

import difflib
import types
import typing

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A config that does not validate. `problems`: one sentence per wrong field."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source, self.problems = source, problems
        super().__init__(f"{source} is not a valid config: {' '.join(problems)}")  # one line, as CLIs print it


def explain(error: ValidationError, model: type[BaseModel], source: str) -> ConfigError:
    """The `ConfigError` saying, once per field, what `error` found wrong in data for `model`."""
    problems: dict[str, str] = {}
    for e in error.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(part) for part in loc)
        problems.setdefault(path, _sentence(e, loc, path, model))  # a union reports one field twice
    return ConfigError(source, list(problems.values()))


def _sentence(e: dict, loc: tuple, path: str, model: type[BaseModel]) -> str:
    kind, msg = e["type"], e["msg"]
    where = f"`{path}`" if path else "the config"
    if kind == "missing":
        description = _field(model, loc).description if _field(model, loc) is not None else None
        return f"{where} is missing" + (f": {description.rstrip('.')}." if description else ".")
    if kind == "extra_forbidden":
        return _unknown_key(model, loc)
    if kind in ("value_error", "assertion_error"):
        msg = msg.split(", ", 1)[1] if msg.startswith(("Value error, ", "Assertion failed, ")) else msg
        return f"{where}: {msg}."
    if msg.startswith("Input should be "):  # pydantic's type and range checks
        return f"{where} should be {msg[len('Input should be '):].split(', unable to')[0]}, got {e.get('input')!r}."
    return f"{where}: {msg}, got {e.get('input')!r}."


def _unknown_key(model: type[BaseModel], loc: tuple) -> str:
    parent = _model_at(model, loc[:-1])
    key = str(loc[-1])
    where = f"of `{'.'.join(map(str, loc[:-1]))}`" if loc[:-1] else "at the top level"
    known = list(parent.model_fields) if parent is not None else []
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean `{close[0]}`?" if close else f"; the settings there are {', '.join(known)}."
    return f"`{key}` is not a setting {where}{hint}"


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class describing the mapping at `loc` (None past a dict or list)."""
    current: type[BaseModel] | None = model
    for part in loc:
        info = current.model_fields.get(part) if current is not None and isinstance(part, str) else None
        current = _model_in(info.annotation) if info is not None else None
    return current


def _field(model: type[BaseModel], loc: tuple):
    parent = _model_at(model, loc[:-1]) if loc else None
    return parent.model_fields.get(loc[-1]) if parent is not None and isinstance(loc[-1], str) else None


def _model_in(annotation) -> type[BaseModel] | None:
    """The BaseModel class inside an annotation such as `ModelVolume | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if (found := _model_in(arg)) is not None:
                return found
    return None
