"""An SGLang server plugin for CPU servers: the scheduler and detokenizer processes are forked
from the server's main process instead of spawned.

Why: SGLang's launcher sets the ``spawn`` start method (``entrypoints/engine.py``,
``_set_envs_and_config``) because a CUDA context cannot cross a fork, so each child imports
sglang, torch and transformers again beside the main process. A forked child inherits the
imported modules and the plugins already applied (``load_plugins`` is guarded by a flag it
inherits too), which saves a third of a CPU server's start-up (benchmarks/README.md, "CPU engine
start-up").

Why a fork is safe here: a CPU server has no CUDA, the main process has computed nothing with
torch when it forks (no OpenMP thread pool is inherited half-alive), and none of our plugins
starts a thread. GPU servers never load this plugin (``server.build_env`` adds it on CPU only).
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
