"""Make our SGLang plugins visible to the server processes we launch, and to no other process.

SGLang runs each general plugin in every server process before it serves
(``sglang.srt.plugins.load_plugins``), so :func:`plugin_pythonpath` declares just the requested
ones in a throw-away ``.dist-info`` for the server's ``PYTHONPATH`` (docs/cpu_stack.md,
"Plugins"). A user's ``SGLANG_PLUGINS`` is a whitelist of entry-point names; :func:`allow_plugins`
adds ours to it.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

DIST_NAME = "ragen_mega_sglang_plugins"

# entry-point name -> "module:function"
PLUGINS = {
    "ragen_mega_seeded_sampling":
        "ragen_mega.backends.sglang.seeded_sampling:seeded_sampling_plugin",
    "ragen_mega_warm_receive": "ragen_mega.backends.sglang.warm_receive:warm_receive_plugin",
    "ragen_mega_unpinned_host_buffers":
        "ragen_mega.backends.sglang.host_buffers:unpinned_host_buffers_plugin",
    "ragen_mega_ep_native_moe": "ragen_mega.backends.sglang.ep_native_moe:ep_native_moe_plugin",
    "ragen_mega_engine_key": "ragen_mega.backends.sglang.engine_key:engine_key_plugin",
    "ragen_mega_lora_merge": "ragen_mega.backends.sglang.lora_merge:lora_merge_plugin",
    "ragen_mega_forked_start": "ragen_mega.backends.sglang.forked_start:forked_start_plugin",
}


@functools.cache
def plugin_pythonpath(names: tuple[str, ...]) -> str:
    """A directory holding a ``.dist-info`` whose entry points are the plugins ``names`` (keys
    of :data:`PLUGINS`); removed when this process exits (servers read it at start-up only)."""
    unknown = sorted(set(names) - set(PLUGINS))
    if unknown:
        raise KeyError(f"unknown SGLang plugin(s) {unknown}; known: {sorted(PLUGINS)}")
    root = Path(tempfile.mkdtemp(prefix="ragen_mega_sglang_plugins_"))
    atexit.register(shutil.rmtree, root, True)
    info = root / f"{DIST_NAME}-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: 0\n")
    lines = "".join(f"{name} = {PLUGINS[name]}\n" for name in names)
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{lines}")
    return str(root)


def allow_plugins(whitelist: str | None, names: tuple[str, ...]) -> str | None:
    """``SGLANG_PLUGINS`` with ``names`` added when the user set a whitelist, else None."""
    if not whitelist:
        return None
    return ",".join([whitelist, *names])
