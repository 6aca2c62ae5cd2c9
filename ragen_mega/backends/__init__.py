"""Engines the stack drives: Megatron-core (training) and SGLang (rollout). Neither imports ray/."""
