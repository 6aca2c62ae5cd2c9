"""Sampling seeds that make a step's rollout a function of the step and the weights.

With ``rollout.seeded`` the k-th request of an episode (turn k) carries
``sampling_seed = request_seed(trainer.seed, phase, step, episode_id, k)``, so the episode's
tokens do not depend on what else the engines are running, and a resumed run replays the
uninterrupted one (its data cursor is the step). In ``rollout.mode: turns`` the key is
(trainer.seed, "stream", step, stream, k): the k-th request a stream makes in the step.
"""
from __future__ import annotations

import hashlib
import itertools

from ragen_mega.rollout.episode import GenerateFn


def request_seed(*key) -> int:
    """A 63-bit sampling seed that is a pure function of ``key`` (stable across processes and
    Python versions, unlike ``hash``), spread so that neighbouring keys give unrelated seeds."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seeded_generate(generate: GenerateFn, *key) -> GenerateFn:
    """``generate`` for one episode, its k-th request seeded with ``request_seed(*key, k)``."""
    turns = itertools.count(1)

    async def seeded(prompt_ids, sampling):
        seed = request_seed(*key, next(turns))
        return await generate(prompt_ids, {**sampling, "sampling_seed": seed})
    return seeded
