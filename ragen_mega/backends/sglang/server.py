"""Launch a real SGLang server (``python -m sglang.launch_server``) as a child process.

Each server has its own session, so :meth:`EngineServer.shutdown` kills the whole group
(SGLang's scheduler and detokenizer would otherwise keep memory and ports) and the starter's
process-group signals do not reach it. Output goes to a log file, after a line naming the
server's pid (a restarted engine appends); a failed or timed-out start raises with the log's
tail. A server dies with the process that started it (``PR_SET_PDEATHSIG``,
``backends/parent_death.py``: so start servers from a long-lived thread; docs/design.md, "A dead
engine, a dead driver").

GPU servers get SGLang's defaults on the GPUs they are given (``gpu_ids``), and
``--enable-deterministic-inference`` for seeded sampling. A machine without CUDA gets
``SGLANG_USE_CPU_ENGINE=1``, :data:`CPU_ARGS`, the ``cpu_standins``, a bounded KV cache and the
:data:`CPU_PLUGINS`, seeded sampling among them (docs/cpu_stack.md, "SGLang on CPU"). Every
server's model registry imports only the modules that define the checkpoint's architectures
(``model_modules.py``).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ragen_mega.backends.parent_death import die_with_parent
from ragen_mega.backends.sglang.cpu_standins import server_pythonpath
from ragen_mega.backends.sglang.engine_key import KEY_ENV
from ragen_mega.backends.sglang.lora_merge import TARGETS_ENV as LORA_TARGETS_ENV
from ragen_mega.backends.sglang.lora_serving import server_args as lora_server_args
from ragen_mega.backends.sglang.model_modules import ENV as DISABLED_MODELS_ENV
from ragen_mega.backends.sglang.model_modules import unneeded_model_modules
from ragen_mega.backends.sglang.plugins import allow_plugins, plugin_pythonpath

logger = logging.getLogger(__name__)

# --sleep-on-idle: without it an idle CPU server's scheduler busy-polls one full core
# (benchmarks/README.md), which on a small machine starves the trainer next to it.
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native",
            "--sampling-backend", "pytorch", "--disable-cuda-graph", "--sleep-on-idle")
CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768
#: the plugins every CPU server loads (docs/cpu_stack.md, "Plugins")
CPU_PLUGINS = ("ragen_mega_warm_receive", "ragen_mega_unpinned_host_buffers",
               "ragen_mega_ep_native_moe", "ragen_mega_forked_start")
LOG_TAIL_CHARS = 4000
# what uvicorn logs when the HTTP port is held by another process; the server then hangs in its
# shutdown instead of exiting, so start-up watches the log for it
PORT_TAKEN = "address already in use"
LAUNCH_ATTEMPTS = 3
SERVER_KEEP_ALIVE_S = 60   # > the client's CLIENT_KEEP_ALIVE_S (client.py)


class EngineStartupError(RuntimeError):
    """The server exited or did not become healthy in time; the message holds its log tail."""


class EnginePortTaken(EngineStartupError):
    """The server could not listen on its port: another process holds it."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process of group ``pgid`` exists (Linux /proc; else kill 0)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<could not read {path}: {e}>"
    return text[-LOG_TAIL_CHARS:]


@dataclass
class EngineServer:
    """Handle of one running SGLang server process group."""

    process: subprocess.Popen
    url: str
    log_file: Path
    command: list[str]
    log_offset: int = 0  # where this server's output starts in ``log_file`` (appended)
    _closed: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _fail(self, why: str, error: type = EngineStartupError) -> EngineStartupError:
        return error(
            f"SGLang server at {self.url} (pid {self.pid}) {why}.\n"
            f"command: {' '.join(self.command)}\nlog {self.log_file}, last lines:\n"
            f"{_log_tail(self.log_file)}")

    def wait_healthy(self, timeout: float = 300.0, poll: float = 0.25) -> "EngineServer":
        """Block until ``/health_generate`` answers 200 (the server generated one token).

        Raises :class:`EngineStartupError` with the log tail if the process exits first or
        ``timeout`` seconds pass, :class:`EnginePortTaken` as soon as its log says that the
        port is held by another process.
        """
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise self._fail(f"exited with code {code} during start-up")
            if self._port_taken():
                raise self._fail(f"could not listen on its port ({PORT_TAKEN})",
                                 EnginePortTaken)
            try:
                with urllib.request.urlopen(f"{self.url}/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or still starting (503)
            if time.monotonic() > deadline:
                raise self._fail(f"was not healthy after {timeout:.0f} s")
            time.sleep(poll)

    def _port_taken(self) -> bool:
        try:
            with open(self.log_file, "rb") as log:
                log.seek(self.log_offset)
                return PORT_TAKEN in log.read().decode(errors="replace").lower()
        except OSError:
            return False

    def shutdown(self) -> None:
        """Stop the whole process group with SIGKILL and reap the launcher.

        A stopped server holds nothing a run needs (its weights come from the trainer, its KV
        cache is scratch), and SGLang's SIGTERM paths are slow: the launcher drains even when
        idle, and a SIGTERM to the group makes it wait for crash diagnostics. SGLang's own
        ``Engine.shutdown`` SIGKILLs its children (``kill_process_tree``) too."""
        if self._closed:
            return
        self._closed = True
        pgid = self.process.pid  # start_new_session=True: the launcher leads its own group
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10.0)
        deadline = time.monotonic() + 10.0  # its other processes: gone once the kernel reaps
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> "EngineServer":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def build_command(model_path: str | Path, *, host: str, port: int, tp: int, device: str,
                  dtype: str | None, mem_fraction: float | None, max_total_tokens: int | None,
                  seeded_sampling: bool = False, memory_saver: bool = False,
                  lora_serving: tuple[int, Sequence[str]] | None = None,
                  extra_args: Sequence[str] = ()) -> list[str]:
    """The ``sglang.launch_server`` command line for these settings (``seeded_sampling``,
    ``memory_saver`` and ``lora_serving``: see :func:`launch_server`)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", host, "--port", str(port), "--tp-size", str(tp)]
    if device == "cpu":
        cmd += CPU_ARGS
        if max_total_tokens is None:
            max_total_tokens = CPU_DEFAULT_MAX_TOTAL_TOKENS
    else:
        if device != "cuda":
            cmd += ["--device", device]
        if seeded_sampling:
            cmd += ["--enable-deterministic-inference"]
        if memory_saver:
            cmd += ["--enable-memory-saver"]
    if dtype:
        cmd += ["--dtype", dtype]
    if mem_fraction is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction)]
    if max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(max_total_tokens)]
    if lora_serving:
        cmd += lora_server_args(*lora_serving, device)
    return cmd + [str(a) for a in extra_args]


def cpu_threads_bind(tp: int, cores: Sequence[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``tp`` CPU ranks: ``cores`` cut into ``tp``
    consecutive groups (``"0-3|4-7"``), or one core each, shared round robin, when there are
    fewer cores than ranks (``"0|1|0"``)."""
    cores = sorted(cores)
    if len(cores) < tp:
        groups = [[cores[r % len(cores)]] for r in range(tp)]
    else:
        per, extra = divmod(len(cores), tp)
        bounds = [r * per + min(r, extra) for r in range(tp + 1)]
        groups = [cores[bounds[r]:bounds[r + 1]] for r in range(tp)]
    return "|".join(map(_core_list, groups))


def _core_list(cores: list[int]) -> str:
    """``"3"``, ``"0-7"`` for a run of cores, else ``"0,2,4"``."""
    if len(cores) == 1:
        return str(cores[0])
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def build_env(base: Mapping[str, str], *, device: str, tp: int = 1,
              cpu_threads: int | None = None, seeded_sampling: bool = False,
              gpu_ids: Sequence[str | int] | None = None,
              api_key: str | None = None,
              lora_targets: Sequence[str] = ()) -> dict[str, str]:
    """The server's environment: a copy of ``base`` plus ``CUDA_VISIBLE_DEVICES`` for
    ``gpu_ids``, the engine key for the ``engine_key.py`` plugin, the adapted modules for the
    ``lora_merge.py`` plugin, and on CPU the engine switch, thread count, stand-in/plugin paths
    and, for ``tp > 1``, each rank's cores (see :func:`launch_server`)."""
    child_env = dict(base)
    child_env.pop(KEY_ENV, None)  # a key is this server's own, never inherited
    child_env.pop(LORA_TARGETS_ENV, None)
    # longer than the client's keep-alive (client.CLIENT_KEEP_ALIVE_S), which says why
    child_env.setdefault("SGLANG_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEP_ALIVE_S))
    plugins: tuple[str, ...] = ()
    paths = []
    if gpu_ids is not None:
        child_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpu_ids)
    if device == "cpu":
        child_env["SGLANG_USE_CPU_ENGINE"] = "1"
        if tp > 1 and not child_env.get("SGLANG_CPU_OMP_THREADS_BIND"):
            # without it SGLang allows one CPU rank per NUMA node only
            child_env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(
                tp, sorted(os.sched_getaffinity(0)))
        if cpu_threads is not None:
            child_env["OMP_NUM_THREADS"] = str(cpu_threads)
        plugins = CPU_PLUGINS + (("ragen_mega_seeded_sampling",) if seeded_sampling else ())
        paths.append(server_pythonpath())
    if api_key:
        child_env[KEY_ENV] = api_key
        plugins += ("ragen_mega_engine_key",)
    if lora_targets:
        child_env[LORA_TARGETS_ENV] = ",".join(lora_targets)
        plugins += ("ragen_mega_lora_merge",)
    if plugins:
        allowed = allow_plugins(child_env.get("SGLANG_PLUGINS"), plugins)
        if allowed:
            child_env["SGLANG_PLUGINS"] = allowed
        paths.append(plugin_pythonpath(plugins))
    path = [p for p in (*paths, child_env.get("PYTHONPATH")) if p]
    if path:
        child_env["PYTHONPATH"] = os.pathsep.join(path)
    return child_env


def launch_server(model_path: str | Path, *, port: int | None = None, host: str = "127.0.0.1",
                  tp: int = 1, device: str = "auto", dtype: str | None = None,
                  mem_fraction: float | None = None, max_total_tokens: int | None = None,
                  extra_args: Sequence[str] = (), log_file: str | Path | None = None,
                  startup_timeout: float = 300.0, wait: bool = True,
                  env: dict[str, str] | None = None,
                  cpu_threads: int | None = None,
                  seeded_sampling: bool = False, memory_saver: bool = False,
                  gpu_ids: Sequence[str | int] | None = None,
                  api_key: str | None = None,
                  lora_targets: Sequence[str] = (),
                  lora_serving: tuple[int, Sequence[str]] | None = None) -> EngineServer:
    """Start an SGLang server for the HF checkpoint at ``model_path``; return its handle.

    ``port=None`` picks a free port; ``device="auto"`` is ``cuda`` when CUDA is available, else
    ``cpu`` (module docstring). ``dtype``, ``mem_fraction`` (``--mem-fraction-static``) and
    ``max_total_tokens`` pass through when given (on CPU the token budget defaults to
    :data:`CPU_DEFAULT_MAX_TOTAL_TOKENS`). ``extra_args`` are appended verbatim; ``env`` replaces
    the inherited environment; ``log_file`` defaults to
    ``$TMPDIR/ragen_mega_sglang/server-<host>-<port>-<pid>.log``. ``cpu_threads`` (CPU only) sets
    the server's ``OMP_NUM_THREADS``: torch's default (one thread per core) collapses under
    oversubscription on a machine shared with busy processes (benchmarks/README.md, SGLang).
    ``seeded_sampling=True``: the server honours ``sampling_params["sampling_seed"]``.
    ``memory_saver=True`` (colocated engines): ``release_memory_occupation`` really frees the GPU
    memory for the trainer (``--enable-memory-saver``); on CPU it adds nothing (SGLang runs the
    release/resume protocol without it, and the CPU install leaves ``torch_memory_saver`` out).
    ``gpu_ids`` (exactly ``tp``): the server's ``CUDA_VISIBLE_DEVICES``, the devices Ray reserved
    for this engine (``ray/devices.py``). ``api_key``: every request but ``/health*`` must carry
    it (as an :class:`~ragen_mega.backends.sglang.client.AsyncEngineClient` of the same key
    does); it reaches the server through its environment, never its command line or log
    (``engine_key.py``). ``lora_targets`` (a LoRA run's adapted HF modules): the server keeps
    their base weights and merges the adapters each sync sends (``lora_merge.py``).
    ``lora_serving`` (rank, target modules): the server serves LoRA adapters by name
    (``lora_serving.py``).
    With ``wait=True`` (default) this returns once the server is healthy, or stops the process
    group and raises :class:`EngineStartupError` with the log tail. A port that :func:`free_port`
    picked can be taken before the server binds it (it listens only after loading the model):
    then the launch is retried on a new port, :data:`LAUNCH_ATTEMPTS` times in all; a ``port``
    given by the caller is not replaced.
    """
    model_path = Path(model_path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"launch_server: model_path {model_path} has no config.json")
    if tp < 1:
        raise ValueError(f"launch_server: tp must be >= 1, got {tp}")
    device = _default_device() if device == "auto" else device
    if gpu_ids is not None and len(gpu_ids) != tp:
        raise ValueError(f"launch_server: gpu_ids {list(gpu_ids)} must name exactly tp={tp} GPUs")
    child_env = build_env(os.environ if env is None else env, device=device, tp=tp,
                          cpu_threads=cpu_threads, seeded_sampling=seeded_sampling,
                          gpu_ids=gpu_ids, api_key=api_key, lora_targets=lora_targets)
    if DISABLED_MODELS_ENV not in child_env and (skip := unneeded_model_modules(model_path)):
        child_env[DISABLED_MODELS_ENV] = skip   # model_modules.py
    attempts_left = LAUNCH_ATTEMPTS if port is None and wait else 1
    while True:
        chosen = port or free_port(host)
        cmd = build_command(model_path, host=host, port=chosen, tp=tp, device=device,
                            dtype=dtype, mem_fraction=mem_fraction,
                            max_total_tokens=max_total_tokens, seeded_sampling=seeded_sampling,
                            memory_saver=memory_saver, lora_serving=lora_serving,
                            extra_args=extra_args)
        server = _spawn(cmd, host, chosen, child_env, log_file)
        if not wait:
            return server
        attempts_left -= 1
        try:
            return server.wait_healthy(startup_timeout)
        except EnginePortTaken:
            server.shutdown()
            if not attempts_left:
                raise
            logger.warning("SGLang server: %s was taken before the server listened (log %s); "
                           "launching again on another port", server.url, server.log_file)
        except BaseException:
            server.shutdown()
            raise


def _spawn(cmd: list[str], host: str, port: int, child_env: dict[str, str],
           log_file: str | Path | None) -> EngineServer:
    """Start ``cmd`` (a server on ``host:port``) in its own session, its output appended to
    ``log_file``."""
    if log_file is None:
        log_dir = Path(tempfile.gettempdir()) / "ragen_mega_sglang"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_file = log_dir / f"server-{host}-{port}-{os.getpid()}.log"
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        offset = log.tell()
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=functools.partial(die_with_parent, os.getpid()))
        # O_APPEND: this line and the server's output never overwrite each other. The leading
        # newline: a previous server's output may end mid-line (nanobind's leak report)
        log.write(f"\n[ragen-mega] SGLang server pid {process.pid}: {' '.join(cmd)}\n".encode())
    server = EngineServer(process=process, url=f"http://{host}:{port}", log_file=log_file,
                          command=cmd, log_offset=offset)
    atexit.register(server.shutdown)  # never leave a server behind when the caller crashes
    return server
