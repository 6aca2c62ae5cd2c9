"""CPU import-only stand-in for ``torchvision.io`` (see ragen_mega/backends/sglang/cpu_standins)."""
import enum

from _cpu_standin import missing_attribute, standin_function


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


decode_image = standin_function("torchvision.io.decode_image")
__getattr__ = missing_attribute(__name__)
