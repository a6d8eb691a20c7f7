"""One getter for nested configs: a value by its dotted path in mappings (dicts, OmegaConf containers, NeMo-RL's
typed dicts) or attribute objects (pydantic models)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_SCALARS = (str, bytes, int, float, bool, list, tuple)


def lookup(cfg: Any, path: str | tuple[str, ...], default: Any = None) -> Any:
    """The value at ``path`` (``"a.b.c"`` or ``("a", "b", "c")``) in ``cfg``. ``default`` where a key is missing
    or a section on the way is None or not a section; a None found at the end is returned as None."""
    cur = cfg
    for part in path.split(".") if isinstance(path, str) else path:
        if isinstance(cur, Mapping):
            if part not in cur:
                return default
            cur = cur[part]
        elif cur is not None and not isinstance(cur, _SCALARS) and hasattr(cur, part):
            cur = getattr(cur, part)
        else:
            return default
    return cur
