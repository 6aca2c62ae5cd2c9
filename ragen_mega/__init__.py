"""ragen_mega: StarPO / StarPO-S multi-turn agent RL on Megatron-core, SGLang and Ray."""

#: the package's version, the one place it is written (pyproject.toml reads it from here)
__version__ = "0.1.0"
