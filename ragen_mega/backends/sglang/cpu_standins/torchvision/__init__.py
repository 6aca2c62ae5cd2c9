"""CPU import-only stand-in for ``torchvision`` (see ragen_mega/backends/sglang/cpu_standins).

``__version__`` is read by transformers, which treats torchvision as present once it is
importable; a local version label makes the stand-in recognisable in any version report.
"""
from _cpu_standin import missing_attribute

__version__ = "0.0.0+ragen.cpu.standin"
__getattr__ = missing_attribute(__name__)
