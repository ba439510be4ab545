"""The part of an engine's extra-config dict that is kvtier's, shared by the engine seams.

SGLang (``--hicache-storage-backend-extra-config``) and vLLM (``kv_connector_extra_config``) hand
kvtier one flat dict that also carries the engine's own keys. kvtier reads its storage knobs from the
``storage.disk.*``, ``storage.redis.*`` and ``storage.tenant.*`` keys (docs/configuration.md) and an
optional ``namespace``; every other key must be one the seam or the engine knows, or it is reported
back so the seam can log it.
"""

from __future__ import annotations

from typing import Any, Collection, Dict, List, Mapping, Tuple

from .errors import InvalidArgumentError

KNOB_PREFIXES = ("storage.disk.", "storage.redis.", "storage.tenant.")


def knob_text(seam: str, key: str, value: Any) -> str:
    """A knob value as the config table parses it (booleans as true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise InvalidArgumentError(f"{seam}: extra_config['{key}'] = {value!r} is not a string, number or boolean")


def split_extra_config(seam: str, extra: Mapping[str, Any],
                       known_keys: Collection[str]) -> Tuple[str, Dict[str, str], List[str]]:
    """``extra`` as (namespace addition, kvtier knobs, sorted unknown keys).

    Raises ``InvalidArgumentError`` naming the key for a namespace that is not a string, a ``storage.*``
    key that is not one of kvtier's knob families, or a knob value of another type.
    """
    ns = extra.get("namespace", "")
    if not isinstance(ns, str):
        raise InvalidArgumentError(f"{seam}: extra_config['namespace'] = {ns!r} is not a string")
    knobs: Dict[str, str] = {}
    unknown = []
    for key, value in extra.items():
        if key.startswith("storage."):
            if not key.startswith(KNOB_PREFIXES):
                raise InvalidArgumentError(
                    f"{seam}: extra_config key '{key}' is not a storage.disk.*, storage.redis.* or "
                    "storage.tenant.* knob")
            knobs[key] = knob_text(seam, key, value)
        elif key != "namespace" and key not in known_keys:
            unknown.append(key)
    return ns, knobs, sorted(unknown)
