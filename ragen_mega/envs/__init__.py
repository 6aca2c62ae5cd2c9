"""Text environments behind one interface (:class:`TextEnv`) and a registry by name."""
from ragen_mega.envs.base import TextEnv, invalid_action_info
from ragen_mega.envs.registry import env_class, list_envs, make, register_env, register_env_path

__all__ = ["TextEnv", "invalid_action_info", "make", "register_env", "register_env_path",
           "list_envs", "env_class"]
