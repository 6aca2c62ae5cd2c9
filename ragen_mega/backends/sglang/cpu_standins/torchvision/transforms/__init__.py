"""CPU import-only stand-in for ``torchvision.transforms`` (see .../sglang/cpu_standins)."""
from _cpu_standin import missing_attribute

from torchvision.transforms.functional import InterpolationMode  # noqa: F401 (SGLang reads it here)

__getattr__ = missing_attribute(__name__)
