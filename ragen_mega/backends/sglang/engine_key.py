"""An SGLang server plugin: the run's engine key, kept off the command line and out of the log.

SGLang's ``--api-key`` makes every endpoint but ``/health*`` answer 401 without
``Authorization: Bearer KEY``. On the command line the key would be readable by every user of
the node (``/proc/PID/cmdline``) and SGLang logs its whole ``server_args``, so the launcher
passes it in the server's environment (:data:`KEY_ENV`, readable by its owner only); this plugin,
run in each server process before it parses its arguments, adds ``--api-key`` and blanks the key
in every log record (docs/cluster.md, "Shared clusters").
"""
from __future__ import annotations

import logging
import os
import sys

KEY_ENV = "RAGEN_MEGA_ENGINE_KEY"
REDACTED = "<engine key>"


def engine_key_plugin() -> None:
    """SGLang general plugin: ``--api-key`` from :data:`KEY_ENV` for the launcher, and a log
    record factory that redacts the key (kept when SGLang reconfigures its handlers)."""
    key = os.environ.get(KEY_ENV)
    if not key:
        return
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    given = any(a == "--api-key" or a.startswith("--api-key=") for a in sys.argv)
    if getattr(spec, "name", None) == "sglang.launch_server" and not given:
        sys.argv.append(f"--api-key={key}")  # one word: a key may begin with "-"
    make_record = logging.getLogRecordFactory()

    def redacting_record(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        message = record.getMessage()
        if key in message:
            record.msg, record.args = message.replace(key, REDACTED), ()
        return record

    logging.setLogRecordFactory(redacting_record)
