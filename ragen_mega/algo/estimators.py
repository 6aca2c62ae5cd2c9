"""Advantage estimators over a training batch, by name (``algo.adv_estimator``).

An estimator is one function ``(batch, settings, *, token_values, bootstrap_values) -> batch``
that adds ``advantages`` (and, for a critic's estimator, ``returns``) [B, S] to ``batch`` (the
per-turn batch of ``rollout/batch.py``'s ``build_batch``). The :func:`estimator` decorator
registers it and declares what it needs of the run (:class:`EstimatorSpec`); the config checks
a run against those declarations and names no estimator itself. So a new estimator, built in or
the user's (``algo.adv_estimator: my_pkg.credit:my_advantages`` or ``FILE.py:FUNCTION``), is one
function and nothing else. ``settings`` is the run's ``algo`` section (``gamma``, ``lam``,
``reward_norm``, ``grpo_norm_by_std``, ``whiten_advantages``...): a new estimator's settings are
new fields there. Pure tensor functions; the math is in :mod:`.advantages`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import torch

from ragen_mega.algo.advantages import (bi_level_token_gae, broadcast_to_tokens, episode_scores,
                                        grpo, masked_whiten, normalize_scores, turn_level_gae)
from ragen_mega.algo.gigpo import gigpo
from ragen_mega.user_code import is_code_path, load_object

Estimator = Callable[..., dict]


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """An estimator and what it needs of the run, which the config checks."""
    fn: Estimator
    #: required: it reads the critic's values; forbidden: its own credit replaces the critic's;
    #: optional: a critic may train beside it, unread
    critic: Literal["required", "forbidden", "optional"] = "optional"
    group_relative: bool = False    #: it compares a group's episodes: env.group_size >= 2
    #: it scores streamed steps (``rollout.mode: turns``), whose episodes a step's end cuts
    streams: bool = False
    #: ``algo`` keys (None by default) that only it reads: set under another estimator, an error
    own_settings: tuple[str, ...] = ()
    #: how it assigns credit, in a few words, for the config's messages
    credit: str = ""


ESTIMATORS: dict[str, EstimatorSpec] = {}


def estimator(name: str, **declarations):
    """Register the decorated function as the estimator ``name``, with its
    :class:`EstimatorSpec` declarations (``critic``, ``group_relative``, ``streams``,
    ``own_settings``, ``credit``)."""
    def register(fn: Estimator) -> Estimator:
        ESTIMATORS[name] = EstimatorSpec(fn, **declarations)
        return fn
    return register


def resolve_estimator(name: str) -> EstimatorSpec:
    """The estimator ``name``: a registered one, or the user's function ``MODULE:FUNCTION`` /
    ``FILE.py:FUNCTION``, imported (its module's :func:`estimator` declarations kept; an
    undecorated function gets the defaults) and registered under ``name``. ValueError naming
    what is wrong."""
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    if not is_code_path(name):
        raise ValueError(f"unknown advantage estimator {name!r}; registered: "
                         f"{', '.join(sorted(ESTIMATORS))}, or a function of yours as "
                         f"MODULE:FUNCTION or FILE.py:FUNCTION")
    fn = load_object(name)
    if not callable(fn):
        raise ValueError(f"{name!r} is not a function (an estimator is 'def f(batch, settings, "
                         f"*, token_values=None, bootstrap_values=None)')")
    declared = [spec for spec in ESTIMATORS.values() if spec.fn is fn]
    ESTIMATORS[name] = declared[0] if declared else EstimatorSpec(fn)
    return ESTIMATORS[name]


def compute_advantages(batch: dict[str, torch.Tensor], settings, *,
                       token_values: torch.Tensor | None = None,
                       bootstrap_values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``batch`` with the advantages of the estimator ``settings.adv_estimator``."""
    return resolve_estimator(settings.adv_estimator).fn(
        batch, settings, token_values=token_values, bootstrap_values=bootstrap_values)


def _scores_of(batch: dict[str, torch.Tensor]):
    return episode_scores(batch["episode_id"], batch["group_id"], batch["reward"])


@estimator("grpo", group_relative=True, credit="each episode's score against its group's")
def grpo_advantages(batch, settings, *, token_values=None, bootstrap_values=None):
    """GRPO: each episode's score (its turns' rewards, normalised within its group by
    ``reward_norm``) against its group's, spread over every response token of the episode."""
    episode_ids, group_ids, scores = _scores_of(batch)
    scores = normalize_scores(scores, group_ids, settings.reward_norm)
    adv = grpo(scores, group_ids, norm_by_std=settings.grpo_norm_by_std)
    per_sample = adv[torch.searchsorted(episode_ids, batch["episode_id"])]
    batch["advantages"] = broadcast_to_tokens(per_sample, batch["loss_mask"])
    return batch


@estimator("gigpo", critic="forbidden", group_relative=True, streams=True,
           own_settings=("gigpo_similarity",),
           credit="its step term replaces the critic's credit")
def gigpo_advantages(batch, settings, *, token_values=None, bootstrap_values=None):
    """GiGPO (:mod:`.gigpo`): GRPO's episode term plus ``gigpo_step_weight`` times a step term
    that compares each turn's discounted return (``gamma``) with those of the turns taken from
    the same anchor state (``batch["state_group"]``, from ``build_batch``) in its group. Each
    group member is scored by ``batch["member"]``: its episode, or in streamed steps its env
    stream. Also adds ``step_advantages`` [B], the step term alone (the step's ``gigpo/*``
    scalars)."""
    adv, _, step_term = gigpo(
        batch["reward"], batch["episode_id"], batch["group_id"], batch["turn"],
        batch["state_group"], step_weight=settings.gigpo_step_weight, gamma=settings.gamma,
        norm_by_std=settings.grpo_norm_by_std, reward_norm=settings.reward_norm,
        members=batch["member"])
    batch["advantages"] = broadcast_to_tokens(adv, batch["loss_mask"])
    batch["step_advantages"] = step_term
    return batch


@estimator("gae", critic="required", streams=True,
           credit="GAE over the critic's values")
def gae_advantages(batch, settings, *, token_values=None, bootstrap_values=None):
    """Turn-level GAE over an episode's turns, then token-level GAE inside each turn (bi-level;
    plain token-level GAE for one-turn episodes), with ``returns`` for the critic.

    ``token_values`` [B, S] is the critic's value of the state each token is written in (column
    t: V(tokens < t), the trainer's layout); a turn's value is the one at its first response
    token. ``gamma``/``lam`` discount across turns; inside a turn tokens are undiscounted
    (Verlog's dual-discount GAE).

    ``bootstrap_values`` [B]: at each cut sample (``batch["cut"]``: its episode goes on past this
    batch) the critic's value of the next state, read in place of a terminal 0 and nowhere else;
    None: every episode ends in the batch (episodes mode).

    ``whiten_advantages``: the advantages are whitened over all of the batch's response tokens
    (:func:`masked_whiten`, as verl does); the returns, the critic's targets, are not.
    """
    mask = batch["loss_mask"]
    if token_values is None or token_values.shape != mask.shape:
        raise ValueError(f"gae needs critic token_values shaped like loss_mask {tuple(mask.shape)}, "
                         f"got {None if token_values is None else tuple(token_values.shape)}")
    rewards = batch["reward"]
    if settings.reward_norm != "identity":  # normalise the episode score, carried by its last turn
        episode_ids, group_ids, scores = _scores_of(batch)
        normed = normalize_scores(scores, group_ids, settings.reward_norm)
        delta = (normed - scores)[torch.searchsorted(episode_ids, batch["episode_id"])]
        rewards = rewards + torch.where(batch["last"], delta, torch.zeros_like(delta))
    first = batch["response_start"]
    turn_values = token_values[torch.arange(mask.shape[0]), first]
    _, turn_returns = turn_level_gae(rewards, turn_values, batch["episode_id"], batch["turn"],
                                     batch["last"], gamma_turn=settings.gamma,
                                     lam_turn=settings.lam, bootstrap_values=bootstrap_values)
    adv, returns = bi_level_token_gae(turn_returns, token_values, mask)
    batch["advantages"] = masked_whiten(adv, mask) if settings.whiten_advantages else adv
    batch["returns"] = returns
    return batch
