"""Shared by the stand-in packages: see the ``cpu_standins`` package docstring for why."""
from __future__ import annotations


class CpuStandinError(RuntimeError):
    """Something called a stand-in: this code path needs the real (CUDA) package."""


def standin_function(qualname: str):
    """A function named ``qualname`` that raises :class:`CpuStandinError` when called."""
    package = qualname.split(".")[0]

    def standin(*args, **kwargs):
        raise CpuStandinError(
            f"{qualname} was called, but it is a CPU import-only stand-in "
            f"(ragen_mega/backends/sglang/cpu_standins): the real {package!r} package is not "
            f"installed. SGLang's CPU path (--device cpu --attention-backend torch_native "
            f"--sampling-backend pytorch) never calls it; install the real {package!r} or do not "
            f"enable the feature that needs it.")

    standin.__name__ = standin.__qualname__ = qualname.rsplit(".", 1)[-1]
    standin.__module__ = qualname.rsplit(".", 1)[0]
    return standin


def missing_attribute(module: str):
    """A module ``__getattr__``: any name not provided raises AttributeError (so SGLang's
    ``except ImportError`` fallbacks apply) with a message that names the stand-in."""

    def __getattr__(name: str):
        raise AttributeError(
            f"{module}.{name} is not provided by the CPU import-only stand-in for {module!r} "
            f"(ragen_mega/backends/sglang/cpu_standins)")

    return __getattr__
