"""Access control for the HTTP and gRPC fronts: API keys and per-key concurrency (issue 7).

`load_api_keys` reads the keys from an environment variable or a secret file
(one key per line, so a Kubernetes Secret can hold several and be rotated by
adding the new key before removing the old). `ApiKeys.identify` checks an
`Authorization: Bearer <key>` value against every key with
`hmac.compare_digest`, never stopping at the first match, so the time it takes
says nothing about which key, or how much of one, was right. A key is never
logged, never part of an error message and never in a repr: callers only ever
see its position, `key-<i>`, which is what the per-key limits and the logs use.

`KeyLimiter` caps the generations one key may have admitted at once, so one
client cannot take the whole queue; over the cap it answers 429 with
Retry-After. With no key configured every request is anonymous and only the
server-wide queue bound applies (docs/serving.md, "Access control").
"""
from __future__ import annotations

import hmac
import os
from collections import Counter
from pathlib import Path
from typing import Iterable

from serving.openai_models import APIError

ANONYMOUS = "anonymous"


class ApiKeyConfigError(RuntimeError):
    """The configured key source is missing or empty (the message never holds a key)."""


def load_api_keys(env: str | None = None, file: str | None = None,
                  environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The keys from `env` (an environment variable's name) or `file` (a path); () if neither.

    Lines are keys; blank lines and surrounding whitespace are ignored."""
    if env is None and file is None:
        return ()
    environ = os.environ if environ is None else environ
    if env is not None:
        text, where = environ.get(env, ""), f"environment variable {env!r}"
    else:
        try:
            text, where = Path(file).read_text(encoding="utf-8"), f"file {file!r}"
        except (OSError, UnicodeDecodeError) as e:
            raise ApiKeyConfigError(f"cannot read the API key file {file!r}: "
                                    f"{type(e).__name__}") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not keys:
        raise ApiKeyConfigError(f"the API key {where} is unset or empty")
    return keys


class ApiKeys:
    """The accepted keys; `identify` maps a credential to `key-<i>` or raises 401."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [k.encode() for k in keys]

    @classmethod
    def of(cls, setting: str | Iterable[str] | None) -> ApiKeys:
        """From `ServerSettings.api_key`: None, one key, or several."""
        if setting is None:
            return cls()
        return cls([setting] if isinstance(setting, str) else setting)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __repr__(self) -> str:  # never the keys themselves
        return f"ApiKeys({len(self._keys)} key{'s' * (len(self._keys) != 1)})"

    def identify(self, authorization: str | None) -> str:
        """`key-<i>` of the key `authorization` carries, or ANONYMOUS when no key is configured."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, given = (authorization or "").strip().partition(" ")
        token = given.strip().encode() if scheme.lower() == "bearer" else b""
        match = -1
        for i, key in enumerate(self._keys):  # every key compared, whatever matched
            if hmac.compare_digest(token, key) and match < 0:
                match = i
        if match < 0:
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")  # OpenAI's type and code for it
        return f"key-{match}"


class KeyLimiter:
    """Generations admitted per client; `acquire` raises 429 over `limit` (None = no limit)."""

    def __init__(self, limit: int | None, retry_after_s: int) -> None:
        self.limit, self.retry_after_s = limit, retry_after_s
        self.held: Counter[str] = Counter()

    def acquire(self, client: str, n: int) -> None:
        if self.limit is not None and client != ANONYMOUS and self.held[client] + n > self.limit:
            raise APIError(429, f"Too many concurrent generations for this API key "
                           f"({self.held[client]} running, the limit per key is {self.limit}); "
                           "retry later", type="rate_limit_error", code="key_concurrency_limit",
                           headers={"Retry-After": str(self.retry_after_s)})
        self.held[client] += n

    def release(self, client: str, n: int) -> None:
        self.held[client] -= n
        if self.held[client] <= 0:
            del self.held[client]
