"""CPU import-only stand-in for ``torchvision.transforms.v2`` (see .../sglang/cpu_standins)."""
from _cpu_standin import missing_attribute

__getattr__ = missing_attribute(__name__)
