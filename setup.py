"""ragen_mega: StarPO / StarPO-S multi-turn agent RL on Megatron-core + SGLang + Ray."""
from setuptools import find_packages, setup

setup(
    name="ragen_mega",
    version="0.1.0",
    description="Multi-turn agent RL (StarPO/StarPO-S) on Megatron-core, SGLang and Ray",
    python_requires=">=3.11",
    packages=find_packages(include=["ragen_mega", "ragen_mega.*"]),
    package_data={"ragen_mega": ["py.typed", "view_page.html"]},
    install_requires=["numpy", "pyyaml"],
    extras_require={
        # The CPU stack is installed by scripts/setup_env.sh (it needs --no-deps steps).
        # GPU clusters: pip install -r requirements/gpu.txt, then this package.
    },
    entry_points={"console_scripts": ["ragen-mega=ragen_mega.cli:main"]},
)
