"""Import-only stand-ins for ``sgl_kernel`` and ``torchvision``, so SGLang's server runs on CPU.

Why they exist: SGLang 0.5.23 imports both packages at module level on its CPU path, but neither
can be installed on a CPU machine: PyPI's ``sgl-kernel`` wheels are CUDA builds, and PyPI's
``torchvision`` for torch 2.13 is a CUDA build that fails to load. On the CPU path
(``SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native --sampling-backend
pytorch``) SGLang only *imports* names from them; it never calls one.

What they hold: exactly the names the server touches while it starts, loads a Llama/Qwen2
checkpoint, generates and updates weights on CPU (found by starting the real server with a
tracing import hook). Functions raise :class:`CpuStandinError` if anything ever calls them; enums
(``InterpolationMode``, ``ImageReadMode``) are real enums because SGLang and transformers read
their members at import time. Any *other* name raises ``AttributeError``, so SGLang's own
``try: from sgl_kernel import X / except ImportError`` fallbacks still take effect.

  sgl_kernel:  assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu,
               assign_req_to_token_pool_cpu, build_tree_kernel_efficient_cpu,
               copy_all_layer_kv_cache_cpu, fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu,
               verify_tree_greedy_cpu
  torchvision: __version__ (transformers parses it), io.{ImageReadMode, decode_image},
               transforms.InterpolationMode, transforms.functional.{InterpolationMode,
               pil_to_tensor}, transforms.v2.functional (the module only)

When they are used: only by :func:`ragen_mega.backends.sglang.server.launch_server`, only for
the *server* process (via its ``PYTHONPATH``), and only for a package that is really absent
(:func:`server_pythonpath`). They never shadow an installed package, and no other process of
ragen_mega (trainer, driver, tests) ever sees them. On a GPU cluster both real packages are
installed and the stand-ins are not used at all.
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
