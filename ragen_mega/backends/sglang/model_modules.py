"""Which of SGLang's model modules a server needs: those that define the checkpoint's
architectures. The launcher names all the others in ``SGLANG_DISABLED_MODEL_ARCHS``
(:func:`unneeded_model_modules`), so SGLang's registry skips them instead of importing all ~260
modules of ``sglang.srt.models`` at start-up (benchmarks/README.md, "CPU engine start-up").
Modules are found by searching their source for ``class <Architecture>(``, without importing
SGLang; when no module defines an architecture (a name SGLang maps elsewhere), nothing is
skipped.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ENV = "SGLANG_DISABLED_MODEL_ARCHS"


def _models_dir() -> Path | None:
    """``sglang/srt/models`` of the installed SGLang (located, not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "srt" / "models"
    return path if path.is_dir() else None


def unneeded_model_modules(model_path: str | Path) -> str | None:
    """``SGLANG_DISABLED_MODEL_ARCHS`` for serving ``model_path``: every module of SGLang's
    model package but those defining an architecture of its ``config.json`` (comma-separated);
    None when that cannot be told (no architectures named, or one no module defines)."""
    try:
        archs = json.loads((Path(model_path) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError):
        return None
    models = _models_dir()
    if not archs or models is None:
        return None
    modules = sorted(models.glob("*.py"))
    needed = set()
    for arch in archs:
        defines = re.compile(rf"^class {re.escape(arch)}\(", re.MULTILINE)
        found = {m.stem for m in modules if defines.search(m.read_text(errors="replace"))}
        if not found:
            return None
        needed |= found
    return ",".join(m.stem for m in modules if m.stem not in needed and m.stem != "__init__")
