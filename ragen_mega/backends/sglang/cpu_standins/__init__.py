"""Import-only stand-ins for ``sgl_kernel`` and ``torchvision``, so SGLang's server runs on CPU.

SGLang 0.5.23 imports both at module level on its CPU path, where it only imports names from
them, and neither installs on a CPU machine. The stand-ins hold exactly the names the server
touches while it starts, loads a Llama/Qwen2 checkpoint, generates and updates weights: the
``*_cpu`` functions in ``sgl_kernel/__init__.py``; torchvision's ``__version__`` (transformers
parses it), ``io.{ImageReadMode, decode_image}``, ``transforms.InterpolationMode``,
``transforms.functional.{InterpolationMode, pil_to_tensor}`` and ``transforms.v2.functional``
(the module only). Functions raise :class:`CpuStandinError` if called; enums are real enums
because SGLang and transformers read their members at import time; any other name raises
``AttributeError``, so SGLang's ``try: from sgl_kernel import X`` fallbacks still work.

Only :func:`ragen_mega.backends.sglang.server.launch_server` uses them, on the server process's
``PYTHONPATH`` and only for a package that is really absent (:func:`server_pythonpath`), so they
never shadow an installed package and no other process sees them. Why each is needed and how the
names were found: docs/cpu_stack.md, "Import-only stand-ins".
"""
from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

STANDIN_ROOT = Path(__file__).resolve().parent
STANDIN_PACKAGES = ("sgl_kernel", "torchvision")


def missing_packages() -> list[str]:
    """The stand-in packages whose real counterpart is not importable in this environment."""
    return [name for name in STANDIN_PACKAGES if importlib.util.find_spec(name) is None]


def server_pythonpath() -> str | None:
    """A ``PYTHONPATH`` entry that provides stand-ins for the missing packages, or ``None``.

    When every stand-in package is missing (the usual CPU machine) this is the stand-in root;
    when only some are missing, a temporary directory that links just those, so an installed
    real package is never shadowed.
    """
    missing = missing_packages()
    if not missing:
        return None
    if len(missing) == len(STANDIN_PACKAGES):
        return str(STANDIN_ROOT)
    partial = Path(tempfile.mkdtemp(prefix="ragen_mega_cpu_standins_"))
    for name in [*missing, "_cpu_standin.py"]:
        os.symlink(STANDIN_ROOT / name, partial / name)
    return str(partial)
