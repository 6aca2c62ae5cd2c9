"""Megatron-core trainer: process groups, model build, forward/train steps, checkpoints, conversion."""
