"""CPU import-only stand-in for ``torchvision.transforms.functional`` (see .../cpu_standins)."""
import enum

from _cpu_standin import missing_attribute, standin_function


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


pil_to_tensor = standin_function("torchvision.transforms.functional.pil_to_tensor")
__getattr__ = missing_attribute(__name__)
