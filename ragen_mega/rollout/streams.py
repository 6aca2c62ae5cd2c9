"""Env streams: episodes that run across training steps (``rollout.mode: turns``).

Each env stream plays exactly ``rollout.turns_per_step`` turns a step, and its episode goes on in
the next step where this one cut it (Verlog's fixed-turn batches). A finished episode is followed
at once by the stream's next one, so no stream waits for the slowest episode and every step
trains the same number of turn samples (docs/design.md, "Long horizons").

Streams keep RAGEN's seed groups: stream ``s`` is the ``s``-th episode of
:func:`~ragen_mega.rollout.seeding.train_step_specs`, and its ``j``-th episode plays what
episodes mode plays at step ``j + 1``, so a group's streams play the same seed sequence and
episode ``j`` of group ``g`` has a seed that is a function of ``(g, j)`` alone. Episode ids are
``j * num_streams + s``, unique over the run.

Exact resume: :meth:`EnvStreams.state_dict` holds, per stream, its episode index and its current
episode's responses; :meth:`EnvStreams.load_state_dict` replays them through
:func:`~ragen_mega.rollout.episode.take_turn` on a freshly reset env (envs are deterministic given
seed and actions), so the resumed stream is where the saved one was.

Faults (``rollout/faults.py``) cost an episode, never the window's size: an env that raises drops
its episode's samples of this window (earlier windows' are trained already) and the stream goes
on with its next episode. A prompt too long for the engine ends the episode before that turn,
truncated (its last sample in the window becomes ``last``; with none in this window, the previous
window's cut bootstrapped it and only the fault is counted). Either way the stream plays on until
it has ``turns_per_step`` samples. A window an engine restart interrupted is replayed from where
it started (:meth:`EnvStreams.restore`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import contextlib
from typing import Any, Callable, Sequence

from ragen_mega.agent import AgentConfig
from ragen_mega.rollout.types import (DroppedEpisode, EnvFailed, EpisodeSpec, GenerateFn,
                                      Generation, OpenEnvFn, PromptTooLong)
from ragen_mega.rollout.seeding import EnvPart, train_step_specs
from ragen_mega.rollout.episode import Episode, EpisodeState, open_episode, take_turn
from ragen_mega.rollout.sample import Sample


@dataclasses.dataclass
class Window:
    """What one step's streams played."""
    samples: list[Sample]       # num_streams x turns_per_step, stream by stream, turn order
    finished: list[Episode]     # episodes that ended in this window: this window's samples of
                                # each, and the metrics of the whole episode
    #: episode id of each cut episode -> the prompt its next turn will get (the state the critic
    #: values for the cut bootstrap; valued, never trained on)
    next_prompts: dict[int, list[int]]
    #: episodes that gave this window nothing: their env raised (their samples of this window
    #: left out), or their first prompt was too long for the engine
    dropped: list[DroppedEpisode] = dataclasses.field(default_factory=list)
    #: (episode, turns played) of each episode ended because its next prompt was too long
    too_long: list[tuple[EpisodeSpec, int]] = dataclasses.field(default_factory=list)

    @classmethod
    def merged(cls, parts: Sequence[Window]) -> Window:
        """One window of the streams' parts (:meth:`EnvStreams.play_stream`), in their order."""
        window = cls([], [], {})
        for part in parts:
            window.samples += part.samples
            window.finished += part.finished
            window.next_prompts.update(part.next_prompts)
            window.dropped += part.dropped
            window.too_long += part.too_long
        return window


class _Stream:
    """One stream: the episode it is playing and the responses that episode has had so far."""

    def __init__(self, index: int):
        self.index = index
        self.episode = 0                    # j: the stream's current (or next) episode
        self.state: EpisodeState | None = None
        self.responses: list[tuple[list[int], str]] = []   # (output ids, finish reason) per turn

    def next_episode(self) -> None:
        self.episode += 1
        self.state, self.responses = None, []

    def saved(self) -> tuple[int, list]:
        """Where the stream is: its episode index and its current episode's responses."""
        return self.episode, list(self.responses)

    def load(self, episode: int, responses: Sequence) -> None:
        """Continue from :meth:`saved`'s place; the episode is replayed (reset, then its
        recorded turns) when the stream next plays."""
        self.episode, self.state = episode, None
        self.responses = [(list(ids), reason) for ids, reason in responses]


class EnvStreams:
    """The run's env streams; :meth:`play_window` plays one step's window."""

    def __init__(self, parts: Sequence[EnvPart], *, group_size: int, seed: int,
                 turns_per_step: int, tokenizer, agent: AgentConfig, max_turns: int,
                 env_steps_in_thread: bool = False, open_env: OpenEnvFn | None = None):
        self.parts, self.group_size, self.seed = list(parts), group_size, seed
        self.turns_per_step = turns_per_step
        self.tokenizer, self.agent = tokenizer, agent
        self.open_kwargs = dict(tokenizer=tokenizer, agent=agent, max_turns=max_turns,
                                env_steps_in_thread=env_steps_in_thread, open_env=open_env)
        self.streams = [_Stream(i) for i in range(len(self.spec_row(0)))]

    def spec_row(self, j: int) -> list[EpisodeSpec]:
        """Episode ``j`` of every stream (the episodes of step ``j + 1`` in episodes mode)."""
        return train_step_specs(self.parts, group_size=self.group_size, seed=self.seed, step=j + 1)

    def spec(self, stream: int, j: int) -> EpisodeSpec:
        return dataclasses.replace(self.spec_row(j)[stream],
                                   episode_id=j * len(self.streams) + stream)

    async def play_window(self, generate_for: Callable[[int], GenerateFn],
                          sampling: dict[str, Any], weight_version: int) -> Window:
        """Every stream plays ``turns_per_step`` turns concurrently (:meth:`play_stream`) with
        ``generate_for(s)``; ``weight_version`` (the engines' weights) is recorded in each sample.
        If any stream raises, the others are cancelled (their envs stay open: :meth:`restore`)."""
        try:
            async with asyncio.TaskGroup() as tasks:
                played = [tasks.create_task(self.play_stream(s, generate_for(s.index), sampling))
                          for s in self.streams]
        except BaseExceptionGroup as group:  # the first stream's error, as the caller knows it
            raise group.exceptions[0] from None
        window = Window.merged([task.result() for task in played])
        for sample in window.samples:
            sample.weight_version = weight_version
        return window

    async def play_stream(self, stream: _Stream, generate: GenerateFn, sampling: dict[str, Any]
                          ) -> Window:
        """Stream ``stream``'s ``turns_per_step`` turns of one window, as a window of their own
        (:meth:`Window.merged` joins them). More than ``turns_per_step`` episodes dropped in the
        window raise RuntimeError naming the first."""
        window = Window([], [], {})
        samples, finished, dropped = window.samples, window.finished, window.dropped
        episode_start = 0   # where the current episode's samples begin in ``samples``
        while len(samples) < self.turns_per_step:
            spec = self.spec(stream.index, stream.episode)
            try:
                if stream.state is None:
                    episode_start = len(samples)
                    stream.state = await self._open(stream)
                try:
                    sample = await take_turn(stream.state, tokenizer=self.tokenizer,
                                             agent=self.agent, generate=generate,
                                             sampling=sampling)
                except PromptTooLong:  # truncated before this turn, like a turn limit
                    stream.state.too_long = True
                    window.too_long.append((spec, stream.state.turn))
                    if len(samples) > episode_start:
                        samples[-1].last = True
                    elif stream.state.turn == 0:  # not a single turn: nothing to train on
                        dropped.append(DroppedEpisode(
                            spec, "prompt_too_long", f"env {spec.env_name!r} (seed {spec.seed}, "
                            f"episode {spec.episode_id}): its first prompt is longer than the "
                            f"engine's context"))
                else:
                    sample.stream = stream.index
                    samples.append(sample)
                    stream.responses.append((sample.response_ids, sample.info["finish_reason"]))
                if stream.state.over:
                    await stream.state.env.close()
                    if len(samples) > episode_start:
                        finished.append(Episode(samples[episode_start:], stream.state.metrics()))
                    stream.next_episode()
            except EnvFailed as e:
                del samples[episode_start:]
                if stream.state is not None:
                    with contextlib.suppress(Exception):  # the env already failed once
                        await stream.state.env.close()
                dropped.append(DroppedEpisode(spec, "env_failed", str(e)))
                stream.next_episode()
            if len(dropped) > self.turns_per_step:
                raise RuntimeError(f"rollout: env stream {stream.index}: {len(dropped)} episodes "
                                   f"in one window gave no sample; the first: "
                                   f"{dropped[0].reason}")
        if stream.state is not None:   # the episode goes on: its last turn here is a cut
            samples[-1].cut = True
            window.next_prompts[samples[-1].episode_id] = stream.state.next_prompt_ids(self.agent)
        return window

    async def restore(self, state: dict[str, list]) -> None:
        """Close the envs of an abandoned window (an engine restart cut it short) and put the
        streams back where :meth:`state_dict` left them, so the window can be played again."""
        self._check_size(state)
        for stream, j, responses in zip(self.streams, state["episodes"], state["responses"]):
            await self.restore_stream(stream, (j, responses))

    @staticmethod
    async def restore_stream(stream: _Stream, saved: tuple[int, Sequence]) -> None:
        """:meth:`restore` for one stream, to ``saved`` (its :meth:`_Stream.saved`)."""
        if stream.state is not None:
            with contextlib.suppress(Exception):
                await stream.state.env.close()
        stream.load(*saved)

    async def _open(self, stream: _Stream) -> EpisodeState:
        """The stream's current episode, reset, with the turns it already played replayed."""
        state = await open_episode(self.spec(stream.index, stream.episode), **self.open_kwargs)
        for ids, finish_reason in stream.responses:
            async def recorded(_prompt, _sampling, ids=ids, finish_reason=finish_reason):
                return Generation(list(ids), [0.0] * len(ids), finish_reason)
            await take_turn(state, tokenizer=self.tokenizer, agent=self.agent,
                            generate=recorded, sampling={})
        return state

    def state_dict(self) -> dict[str, list]:
        """Where every stream is: its episode index and its current episode's responses."""
        return self.joined_state([s.saved() for s in self.streams])

    @staticmethod
    def joined_state(saved: Sequence[tuple[int, list]]) -> dict[str, list]:
        """:meth:`state_dict`'s form of every stream's :meth:`_Stream.saved`, in stream order."""
        return {"episodes": [j for j, _ in saved], "responses": [r for _, r in saved]}

    def load_state_dict(self, state: dict[str, list]) -> None:
        """Continue from :meth:`state_dict`'s streams; each one's episode is replayed (reset,
        then its recorded turns) when the stream next plays."""
        self._check_size(state)
        for stream, j, responses in zip(self.streams, state["episodes"], state["responses"]):
            stream.load(j, responses)

    def _check_size(self, state: dict[str, list]) -> None:
        if len(state["episodes"]) != len(self.streams):
            raise ValueError(f"the checkpoint holds {len(state['episodes'])} env streams, this "
                             f"run has {len(self.streams)} (env.env_groups x env.group_size "
                             f"changed?); a streamed run resumes only with its own streams")
