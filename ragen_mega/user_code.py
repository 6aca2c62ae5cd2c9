"""The user's code, named from YAML as ``package.module:NAME`` (importable) or
``path/to/file.py:NAME``: agents (``rollout.agent``), envs (``env.name``) and advantage
estimators (``algo.adv_estimator``). One loader, so every key takes the same two spellings and
fails with the same kind of message."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def is_code_path(name: str) -> bool:
    """Whether ``name`` names code (``MODULE:NAME`` or ``FILE.py:NAME``) rather than a registered
    name."""
    return ":" in name


def load_object(path: str) -> Any:
    """The object ``path`` names; ValueError naming what is wrong (the spelling, a missing file,
    an import that raised, a missing attribute). A file is imported once per process, under a
    module name of its own, so the classes in it pickle by reference there."""
    where, _, name = path.rpartition(":")
    if not where or not name:
        raise ValueError(f"{path!r} is not MODULE:NAME or FILE.py:NAME")
    if where.endswith(".py"):
        file = Path(where).resolve()
        if not file.is_file():
            raise ValueError(f"{path!r}: no file {where}")
        # the same name in every process (str's hash is salted per process; a digest is not)
        digest = hashlib.blake2b(str(file).encode(), digest_size=6).hexdigest()
        module_name = f"ragen_mega_user_{file.stem}_{digest}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:  # noqa: BLE001 - the user's file may raise anything
                del sys.modules[module_name]
                raise ValueError(f"{path!r}: importing {where} raised {type(e).__name__}: "
                                 f"{e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001 - the user's module may raise anything
            raise ValueError(f"{path!r}: importing {where} raised {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        raise ValueError(f"{path!r}: {where} has no {name!r}")
    return getattr(module, name)
