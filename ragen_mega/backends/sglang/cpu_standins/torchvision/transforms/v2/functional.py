"""CPU import-only stand-in for ``torchvision.transforms.v2.functional`` (imported, never used)."""
from _cpu_standin import missing_attribute

__getattr__ = missing_attribute(__name__)
