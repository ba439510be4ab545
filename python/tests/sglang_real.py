"""SGLang's real HiCache storage module, loaded for the tests when the ``sglang`` package is installed.

CI installs it with ``pip install --no-deps sglang==<version>`` (about 40 MB; see docs/engines.md): the
storage interface needs none of SGLang's dependencies, but ``sglang/__init__.py`` imports most of them
(transformers, orjson, ...). So when the normal import fails, the top-level package is entered as a
bare package (its ``__init__`` not run) and the real, unmodified ``hicache_storage.py`` and
``storage/backend_factory.py`` are imported from the installed files. The module imports torch only
for annotations and for its built-in file backend's bodies: without torch installed, a stand-in
module named ``torch`` is present while it loads and removed afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Optional, Tuple

HICACHE = "sglang.srt.mem_cache.hicache_storage"
FACTORY = "sglang.srt.mem_cache.storage.backend_factory"


def load() -> Tuple[Optional[types.ModuleType], Optional[types.ModuleType], str]:
    """(hicache_storage, backend_factory, how) or (None, None, why not)."""
    if HICACHE in sys.modules and FACTORY in sys.modules:
        return sys.modules[HICACHE], sys.modules[FACTORY], "already loaded"
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None, None, "sglang is not installed (pip install --no-deps sglang==0.5.23)"
    try:
        return importlib.import_module(HICACHE), importlib.import_module(FACTORY), "import"
    except ImportError:
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]
    bare = types.ModuleType("sglang")
    bare.__path__ = list(spec.submodule_search_locations)
    sys.modules["sglang"] = bare
    stand_in = None
    if importlib.util.find_spec("torch") is None:
        stand_in = types.ModuleType("torch")
        stand_in.Tensor = type("Tensor", (), {})
        sys.modules["torch"] = stand_in
    try:
        hicache = importlib.import_module(HICACHE)
        factory = importlib.import_module(FACTORY)
    finally:
        if stand_in is not None and sys.modules.get("torch") is stand_in:
            del sys.modules["torch"]
    how = "installed files (sglang/__init__ not run" + (", torch stand-in)" if stand_in else ")")
    return hicache, factory, how


def version() -> Optional[str]:
    try:
        from importlib.metadata import version as v

        return v("sglang")
    except Exception:
        return None


if __name__ == "__main__":
    h, f, how = load()
    print(version(), how, h and os.path.dirname(h.__file__))
