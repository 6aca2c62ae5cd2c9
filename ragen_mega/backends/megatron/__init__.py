"""Megatron-core trainer: process groups, model, forward/train steps, checkpoints, conversion."""
