"""The ``filter`` and ``algo`` sections of the run config: which groups a step trains on, and
the advantage estimator with its settings. What an estimator needs (a critic, groups, streams)
is declared on its registry entry (``algo/estimators.py``); the run's tree
(``ragen_mega/config.py``) checks those needs against the other sections."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from ragen_mega.algo.estimators import ESTIMATORS, resolve_estimator
from ragen_mega.algo.filter import GROUP_METRICS, STRATEGIES
from ragen_mega.config_tree import ConfigError, bounded, setting
from ragen_mega.user_code import is_code_path


def builtin_estimators():
    """(name, spec) of the registered estimators named by a word, not a user's code path."""
    return [(n, e) for n, e in sorted(ESTIMATORS.items()) if not is_code_path(n)]


@dataclasses.dataclass
class FilterConfig:
    """Which rollout groups the step trains on (``algo/filter.py`` says each option and where
    it differs from RAGEN's code). The defaults are StarPO-S: the top ``ratio`` of groups by
    in-group reward std; ``ratio: 1.0`` is plain StarPO."""
    strategy: str = setting("top_k", choices=lambda: list(STRATEGIES), help=(
        "top_k: the top `ratio` of groups; top_p: the fewest top groups holding `top_p` of the "
        "score mass (RAGEN-2); min_p: every group scoring >= `min_p` x the best"))
    ratio: float = bounded(0.25, gt=0, le=1, help=(
        "strategy top_k: the share of groups kept (1.0: every group, plain StarPO)"))
    top_p: Optional[float] = bounded(None, gt=0, le=1, help=(
        "strategy top_p only: the share of the score mass kept; unset: RAGEN-2's 0.9"))
    top_p_mode: Literal["linear", "softmax"] = setting("linear", help=(
        "strategy top_p: the mass of the scores, or of their softmax"))
    selection_eps: float = bounded(0.01, ge=0, help=(
        "strategy top_p, top_p_mode linear: the threshold's slack (RAGEN's)"))
    min_p: Optional[float] = bounded(None, gt=0, le=1, help=(
        "strategy min_p only: keep groups scoring at least this times the best; unset: 0.9"))
    metric: str = setting("reward_std", choices=lambda: list(GROUP_METRICS), help=(
        "the group score: reward_std (StarPO-S), reward_variance, reward (mean), entropy (mean "
        "token NLL of the sampled answers), length (mean response tokens)"))
    mode: Optional[Literal["std", "std_rev", "largest", "smallest"]] = setting(None, help=(
        "largest or smallest scores first; std / std_rev are StarPO-S's names for largest / "
        "smallest reward std. Unset: std for reward_std, else largest"))
    include_zero: bool = setting(True, help=(
        "groups scoring 0 may be kept; false: never (RAGEN-2 recommends false)"))
    loss_scaling: Literal["none", "linear", "sqrt"] = setting("none", help=(
        "scale the kept samples' advantages by the kept share of groups (linear) or its root"))
    soft_reweight: bool = setting(False, help=(
        "weigh each kept group's advantages by its reward std over the largest kept one "
        "(RAGEN-2's soft reweighting; critic-free estimators only)"))

    def validate(self):
        for key, registry in (("strategy", STRATEGIES), ("metric", GROUP_METRICS)):
            value = getattr(self, key)
            if value not in registry:
                raise ConfigError(f"{key}: must be one of {sorted(registry)}, got {value!r}")
        for key in ("top_p", "min_p"):  # unset: algo/filter.py's defaults, which follow the
            value = getattr(self, key)     # strategy and the metric
            if value is not None and self.strategy != key:
                raise ConfigError(f"{key}: read only by filter.strategy={key}, and the strategy "
                                  f"is {self.strategy!r}; unset it or set filter.strategy={key}")
        if self.mode in ("std", "std_rev") and self.metric != "reward_std":
            order = "largest" if self.mode == "std" else "smallest"
            raise ConfigError(f"mode: {self.mode!r} means {order} reward std; with "
                              f"filter.metric={self.metric} say largest or smallest")


@dataclasses.dataclass
class AlgoConfig:
    adv_estimator: str = setting(
        "gae", choices=lambda: [name for name, _ in builtin_estimators()],
        also="a function of yours as MODULE:FUNCTION or FILE.py:FUNCTION", help=(
            "how each turn's advantage is computed. gae: a critic, GAE over turns then over the "
            "tokens of each turn (bi-level; RAGEN StarPO-S, Verlog for long horizons); grpo: "
            "critic-free, episode score vs. its group; gigpo: critic-free, grpo plus a step term "
            "comparing the turns taken from the same state within a group (verl-agent's GiGPO)"))
    gamma: float = bounded(1.0, ge=0, le=1, help=(
        "the discount across turns (RAGEN uses 1.0; gigpo: its step returns' discount, 0.95 in "
        "verl-agent)"))
    lam: float = bounded(1.0, ge=0, le=1, help="GAE lambda across turns")
    grpo_norm_by_std: bool = setting(True, help=(
        "grpo, gigpo: group-relative advantages divided by the group's std (false: Dr. GRPO)"))
    whiten_advantages: bool = setting(True, help=(
        "gae: whiten the advantages over the batch's response tokens (zero mean, unit variance), "
        "as verl's GAE (and so RAGEN's and Verlog's) always does. An untrained critic biases "
        "every advantage one way (all samples pushed up or all down, the answer format with "
        "them); centring leaves the ranking the returns make. false: raw returns minus values."))
    reward_norm: Literal["identity", "mean", "mean_std", "asym_clip"] = setting("identity", help=(
        "RAGEN's episode-score normalisation within a group (same seed) before advantages"))
    use_rollout_logprobs: bool = setting(False, help=(
        "take the engine's sampled log-probs as the PPO `old` log-probs instead of recomputing "
        "them with the actor (slime's --use-rollout-logprobs): saves a forward pass. Checked "
        "equal to the trainer's in fp32 at temperature 1 only, hence allowed only there (in bf16 "
        "they differ: 0.044 mean |diff| a token on SmolLM2)."))
    gigpo_step_weight: float = bounded(1.0, ge=0, lt=float("inf"), help=(
        "gigpo: the step term's weight omega in A = A_episode + omega * A_step (verl-agent's "
        "step_advantage_w, 1.0)"))
    gigpo_similarity: Optional[float] = bounded(
        None, gt=0, lt=1, note="leave it unset for exact matching", help=(
            "gigpo: null matches anchor states exactly (equal `TextEnv.state_key`); a ratio in "
            "(0, 1) also groups near-identical ones (difflib ratio; verl-agent's "
            "similarity_thresh, 0.9)"))
    kl_in_reward: float = bounded(0.0, ge=0, lt=float("inf"), note="0: off", help=(
        "KL in the reward (verl's use_kl_in_reward, Verlog's long-horizon option): each turn's "
        "reward less this times its tokens' summed KL (actor.kl_kind) between the rollout policy "
        "and the initial one (the actor keeps a reference model). 0 = off: StarPO-S is KL-free"))

    def validate(self):
        try:
            spec = resolve_estimator(self.adv_estimator)
        except ValueError as e:
            raise ConfigError(f"adv_estimator: {e}") from e
        for name, other in ESTIMATORS.items():
            for key in (k for k in other.own_settings if other is not spec):
                if getattr(self, key) is not None:
                    raise ConfigError(f"{key}: read by adv_estimator={name} only, got "
                                      f"adv_estimator={self.adv_estimator!r}; leave it unset")
