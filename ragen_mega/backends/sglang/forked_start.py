"""An SGLang server plugin for CPU servers: the scheduler and detokenizer processes are forked
from the server's main process instead of spawned, so they inherit its imports (sglang, torch,
transformers) and the plugins already applied (``load_plugins`` is guarded by a flag they inherit
too). SGLang spawns because a CUDA context cannot cross a fork; a CPU server has none, computes
nothing with torch before the fork, and no plugin of ours starts a thread. GPU servers never load
it (``server.build_env`` adds it on CPU only). Why a fork is safe, and the saving:
docs/cpu_stack.md, "Plugins"; benchmarks/README.md, "CPU engine start-up".
"""
from __future__ import annotations

import multiprocessing


def forked_start_plugin() -> None:
    """SGLang general plugin: the launcher's start-method setting ends with ``fork``.

    Plugins load before ``_set_envs_and_config`` runs (``sglang/launch_server.py``), which would
    overwrite a method set here; wrapping it makes ``fork`` the last word."""
    from sglang.srt.entrypoints import engine

    spawning = engine._set_envs_and_config

    def set_envs_and_config(server_args):
        spawning(server_args)
        multiprocessing.set_start_method("fork", force=True)

    engine._set_envs_and_config = set_envs_and_config
