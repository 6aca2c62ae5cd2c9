"""Episodes played the test's way: all of a list at once, in its order (the rollout manager
plays them in its own way, with faults and replays; these tests want the episodes alone)."""
from __future__ import annotations

import asyncio

from ragen_mega.rollout.episode import run_episode


async def run_episodes(specs, **kwargs):
    """``run_episode`` for every spec concurrently (each advances on its own generation), in
    ``specs`` order."""
    return list(await asyncio.gather(*(run_episode(s, **kwargs) for s in specs)))
