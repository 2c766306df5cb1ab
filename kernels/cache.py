"""Where specflash keeps what it builds on first use (the CPU kernels here, the embedded model
pair in `models.embedded`): one directory, chosen by the environment."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$SPECFLASH_CACHE`, else `$XDG_CACHE_HOME/specflash`, else `~/.cache/specflash`."""
    if os.environ.get("SPECFLASH_CACHE"):
        return Path(os.environ["SPECFLASH_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specflash"
