"""The one record that carries a turn from the engine to the trainer, and its batch form.

Each turn of an episode is one :class:`Sample` (docs/design.md, "Long horizons"): the prompt ids
the engine was given, the response ids and log-probs it sampled (token-in/token-out: nothing is
re-tokenized), the turn's reward, and where it belongs (episode, group, turn number).
:func:`collate` builds the trainer's batch from these records, never from text.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]     # one per response token, from the engine
    reward: float                     # this turn: env rewards of its actions + format penalty
    episode_id: int
    group_id: int                     # episodes of one group share the env seed (RAGEN grouping)
    turn: int                         # 1-based
    done: bool                        # the episode ended in this turn (False: not, or truncated)
    last: bool                        # this is the episode's final recorded turn
    env_tag: str
    seed: int
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ``rollout.mode: turns``: the engines' weights it was sampled with (the trainer step that
    #: made them), the env stream that played it, and whether it is the step's last turn of an
    #: episode that goes on (its advantage bootstraps from the next state's value)
    weight_version: int = 0
    stream: int | None = None
    cut: bool = False
    #: the key of the env state this turn acted in (``TextEnv.state_key`` of the observation
    #: it was given): turns of a group with equal keys are GiGPO's anchor states
    state_key: str = ""
    #: the env's observation this turn acted on, as the env wrote it (the trajectory files and
    #: viewer show it; "" for a user agent's calls, whose prompts the agent built)
    observation: str = ""
    #: a mixture of experts' engine: the experts it routed each prompt and response token but
    #: the last to, [prompt + response - 1, layers, top-k] (routing replay, the mismatch metric)
    routed_experts: torch.Tensor | None = None
    #: the weight version that sampled each response token (as the engine reports it; a sync
    #: that lands inside the turn, ``trainer.async_mode: fully``, gives it two); empty: not
    #: reported (a scripted generate function)
    token_versions: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if len(self.rollout_logprobs) != len(self.response_ids):
            raise ValueError(f"Sample: {len(self.response_ids)} response ids but "
                             f"{len(self.rollout_logprobs)} rollout log-probs")
        if self.token_versions and len(self.token_versions) != len(self.response_ids):
            raise ValueError(f"Sample: {len(self.response_ids)} response ids but "
                             f"{len(self.token_versions)} token versions")
        read = len(self.prompt_ids) + len(self.response_ids) - 1
        if self.routed_experts is not None and (self.routed_experts.dim() != 3
                                                or self.routed_experts.shape[0] != read):
            raise ValueError(f"Sample: routed_experts of shape "
                             f"{tuple(self.routed_experts.shape)} for {read} tokens read "
                             f"(prompt + response - 1) x layers x top-k")

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain Python values (``routed_experts`` stays a tensor), so a
        checkpoint holding it loads with ``torch.load(weights_only=True)``; :meth:`from_dict`
        gives an equal Sample back. Anything else in ``info`` (an object, an array) raises
        TypeError naming its key rather than being dropped, which would make a resumed run's
        samples differ from the saved ones."""
        return {"prompt_ids": [int(t) for t in self.prompt_ids],
                "response_ids": [int(t) for t in self.response_ids],
                "rollout_logprobs": [float(x) for x in self.rollout_logprobs],
                "reward": float(self.reward), "episode_id": int(self.episode_id),
                "group_id": int(self.group_id), "turn": int(self.turn), "done": bool(self.done),
                "last": bool(self.last), "env_tag": str(self.env_tag), "seed": int(self.seed),
                "info": _plain(self.info, "info"), "weight_version": int(self.weight_version),
                "stream": None if self.stream is None else int(self.stream),
                "cut": bool(self.cut), "state_key": str(self.state_key),
                "observation": str(self.observation),
                "routed_experts": self.routed_experts,
                "token_versions": [int(v) for v in self.token_versions]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        """The Sample :meth:`to_dict` described. A field the dict lacks (one added to Sample
        after the checkpoint was written) takes its default."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def jsonable(value: Any) -> Any:
    """``value`` as JSON's values (a user env's step info may hold numpy scalars, arrays or
    objects: numbers become floats or ints, sequences lists, anything else its ``str``), so
    it can sit in :attr:`Sample.info` and in a trajectory file."""
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    item = getattr(value, "item", None)   # a numpy or torch scalar
    if callable(item) and getattr(value, "ndim", 1) == 0:
        return jsonable(item())
    tolist = getattr(value, "tolist", None)
    return jsonable(tolist()) if callable(tolist) else str(value)


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON-like Python (None, bool, int, float, str, and lists, tuples and
    str-keyed dicts of them); TypeError naming ``where`` for anything else."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):     # str(): a subclass (numpy's str_) would pickle as itself
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):   # also numpy's float64, a float subclass
        return float(value)
    if isinstance(value, (list, tuple)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"Sample.{where}: key {k!r} is a {type(k).__name__}, not a str")
            out[k] = _plain(v, f"{where}[{k!r}]")
        return out
    raise TypeError(f"Sample.{where} is a {type(value).__module__}.{type(value).__qualname__}: "
                    f"a checkpointed sample holds only plain values (None, bool, int, float, "
                    f"str, and lists, tuples and str-keyed dicts of them)")


def collate(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded training batch of ``prompt + response`` per sample.

    Every field is [B, S] and column t belongs to token t (the trainer's layout: a per-token value
    of token t is computed from the tokens before it; column 0 is never a loss token):
    ``input_ids``, ``attention_mask``, ``loss_mask`` (1 exactly on the model-written tokens),
    ``rollout_logprobs`` (the engine's log-prob of each written token). ``response_start`` [B]
    is each sample's first response column. When every sample carries its engine's routing:
    ``routed_experts`` [B, S, layers, top-k] (int16; -1 where the engine read no token: each
    row's last token and its padding).
    """
    if not samples:
        raise ValueError("collate: no samples")
    seq = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, seq), pad_id, dtype=torch.long)
    attention = torch.zeros(b, seq, dtype=torch.long)
    loss_mask = torch.zeros(b, seq, dtype=torch.float32)
    logprobs = torch.zeros(b, seq, dtype=torch.float32)
    for i, s in enumerate(samples):
        if not s.prompt_ids:
            raise ValueError(f"collate: sample {i} (episode {s.episode_id}, turn {s.turn}) has an "
                             f"empty prompt")
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention[i, :p + r] = 1
        loss_mask[i, p:p + r] = 1.0
        logprobs[i, p:p + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    batch = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask,
             "rollout_logprobs": logprobs,
             "response_start": torch.tensor([len(s.prompt_ids) for s in samples])}
    if all(s.routed_experts is not None for s in samples):
        layers, top_k = samples[0].routed_experts.shape[1:]
        routed = torch.full((b, seq, layers, top_k), -1, dtype=torch.int16)
        for i, s in enumerate(samples):
            routed[i, :len(s.routed_experts)] = s.routed_experts
        batch["routed_experts"] = routed
    return batch
