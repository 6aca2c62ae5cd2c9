"""The package as pip builds it from pyproject.toml: a wheel of the source tree holds every module
of ``ragen_mega``, its data files (the viewer's page, the ``py.typed`` marker), the licence and
the ``ragen-mega`` command, under the version ``ragen_mega.__version__`` states (the one place
it is written)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import ragen_mega

ROOT = Path(__file__).parents[1]


def test_the_wheel_holds_the_modules_data_licence_and_command(tmp_path):
    src = tmp_path / "src"   # a copy, so setuptools' build/ never lands in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "ragen_mega", src / "ragen_mega",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(src)], check=True)
    wheel, = (tmp_path / "dist").glob("ragen_mega-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(z.read(info).decode())
        entry_points = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    sources = {p.relative_to(src).as_posix() for p in (src / "ragen_mega").rglob("*")
               if p.is_file()}
    assert sources - names == set(), "files of ragen_mega/ missing from the wheel"
    assert {"ragen_mega/py.typed", "ragen_mega/view_page.html"} <= names
    assert metadata["Version"] == ragen_mega.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "ragen-mega = ragen_mega.cli:main" in entry_points
