"""Advantages, losses and the StarPO-S filter: pure tensor functions, no I/O, no distributed
state (the trainer reduces metrics and normalizers across ranks itself)."""
from ragen_mega.algo.advantages import (GroupStats, bi_level_token_gae, broadcast_to_tokens, gae,
                                        group_stats, grpo, masked_whiten, normalize_scores,
                                        turn_level_gae)
from ragen_mega.algo.filter import GroupSelection, select_groups
from ragen_mega.algo.losses import (AGG_MODES, aggregate, kl_penalty, loss_normalizer,
                                    masked_mean, policy_loss, truncated_is_weights,
                                    value_loss)

__all__ = [
    "AGG_MODES", "GroupSelection", "GroupStats", "aggregate", "bi_level_token_gae",
    "broadcast_to_tokens", "gae", "group_stats", "grpo", "kl_penalty", "loss_normalizer",
    "masked_mean", "masked_whiten", "normalize_scores", "policy_loss", "select_groups",
    "truncated_is_weights", "turn_level_gae", "value_loss",
]
