"""Envs served over HTTP (``ragen-mega env-server``): real servers on loopback, played by the
rollout's own episode code exactly as local envs, bad requests answered without a 5xx, and a
server that dies, hangs or answers garbage costing an episode, not the step."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from conftest import start_env_server as start_server, stop_env_server as stop
from ragen_mega.agent import AgentConfig
from ragen_mega.rollout.types import EpisodeSpec
from ragen_mega.rollout.seeding import EnvPart, mix_specs
from ragen_mega.rollout.faults import (DroppedEpisode, FaultCounters, count_rollout_faults,
                                       episode_or_drop)
from ragen_mega.http_token import ENV_SERVER_TOKEN
from ragen_mega.rollout.remote_env import HttpEnv, RemoteEnvs, check_servers

ANSWERS = [" go </think><answer> Up || Left </answer>", " hmm </think><answer> Down </answer>",
           " so </think><answer> Right || Down </answer>", "no tags at all"]
SOKOBAN = ["--kwarg", "dim_room=(6,6)"]


@pytest.fixture(scope="module")
def servers():
    """Two sokoban servers (6x6) and a frozen lake one, for the whole module."""
    started = [start_server("sokoban", *SOKOBAN), start_server("sokoban", *SOKOBAN),
               start_server("frozen_lake")]
    yield [url for _, url in started]
    for proc, _ in started:
        stop(proc)


def test_remote_episodes_equal_local_ones(servers, tokenizer, scripted, run_episodes_keyed):
    """The same seeds and answers played on the servers (episode i on server i mod 2) and in
    this process: every Sample (prompt and response ids, rewards, done/last, info, state key)
    and every episode metric equal; every session is closed afterwards."""
    agent = AgentConfig(think=True, max_actions_per_turn=2)
    specs = mix_specs([EnvPart("box", "sokoban", {"dim_room": [6, 6]}, 3)], group_size=2,
                      first_seed=3)
    local = asyncio.run(run_episodes_keyed(specs, tokenizer, agent, scripted(tokenizer, ANSWERS),
                                           max_turns=4))
    remote = asyncio.run(asyncio.wait_for(run_episodes_keyed(
        specs, tokenizer, agent, scripted(tokenizer, ANSWERS), max_turns=4,
        open_env=RemoteEnvs(servers[:2], timeout_s=30).open), 120))
    for spec, lo, re in zip(specs, local, remote):
        assert re.samples == lo.samples, spec
        assert re.metrics == lo.metrics, spec
    assert any(e.metrics["num_actions"] > e.metrics["num_turns"] for e in remote)
    assert [requests.get(f"{u}/health").json()["sessions"] for u in servers[:2]] == [0, 0]
    check_servers(servers[:2], "sokoban", {"dim_room": [6, 6]}, timeout_s=10)
    with pytest.raises(ValueError, match=r"\[0\]: .* serves 'sokoban' with kwargs "
                                         r"\{'dim_room': \[6, 6\]\}; the config plays "
                                         r"'sokoban' with \{\}"):
        check_servers(servers[:1], "sokoban", {}, timeout_s=10)
    # the start-up check of a run with env.remote: the servers must serve its env and kwargs
    from ragen_mega.config import load_run_config
    from ragen_mega.config_tree import ConfigError
    from ragen_mega.preflight import preflight

    remote = [f"env.remote=[{servers[0]}, {servers[1]}]", "env.name=sokoban"]
    preflight(load_run_config(None, remote + ["env.kwargs={dim_room: [6, 6]}"]))
    with pytest.raises(ConfigError, match=r"^env.remote\[0\]: .* serves 'sokoban' with kwargs"):
        preflight(load_run_config(None, remote + ["env.kwargs={dim_room: [7, 7]}"]))
    with pytest.raises(ConfigError, match=r"^env.remote\[0\]: http://127.0.0.1:9 does not "
                                          r"answer /health"):
        preflight(load_run_config(None, ["env.remote=[http://127.0.0.1:9]"]))
    # an episode of another env than the server's is an env failure naming both
    wrong = EpisodeSpec("frozen_lake", {}, seed=0, episode_id=0, group_id=0)
    dropped = asyncio.run(episode_or_drop(wrong, run_episodes_keyed(
        [wrong], tokenizer, agent, scripted(tokenizer, ANSWERS),
        open_env=RemoteEnvs(servers[:1], 30).open)))
    assert "serves 'sokoban', the episode plays 'frozen_lake'" in str(dropped)


def post(url, path, body=None, raw=None):
    return requests.post(f"{url}{path}", json=body, data=raw, timeout=10,
                         headers=None if raw is None else {"content-type": "application/json"})


def test_bad_requests_get_4xx_and_the_server_goes_on(servers):
    url = servers[2]  # frozen lake
    kept = post(url, "/sessions", {"seed": 1}).json()  # another session, stepped throughout
    opened = post(url, "/sessions", {"seed": 2})
    assert opened.status_code == 200
    sid = opened.json()["session_id"]
    cases = [("/sessions", {"sed": 2}, None, 422, "seed"),            # a missing field, named
             ("/sessions", {"seed": "2"}, None, 422, "seed"),          # a seed that is no int
             ("/sessions", {"seed": -1}, None, 422, "seed must be a non-negative int"),
             ("/sessions", None, "{not json", 422, "JSON decode error"),
             (f"/sessions/{sid}/step", {}, None, 422, "action"),
             (f"/sessions/{sid}/step", {"action": 3}, None, 422, "action"),
             ("/sessions/nope/step", {"action": "Up"}, None, 404, "no session 'nope'"),
             ("/sessions/nope/reset", {"seed": 1}, None, 404, "no session 'nope'")]
    for path, body, raw, status, needle in cases:
        answer = post(url, path, body, raw)
        assert answer.status_code == status, (path, body, raw, answer.text)
        assert needle in answer.text, (path, answer.text)
        step = post(url, f"/sessions/{kept['session_id']}/step", {"action": "Left"})
        assert step.status_code in (200, 409)  # the other session is served all along
    # not an action: the env's own invalid-action step, as locally
    jump = post(url, f"/sessions/{sid}/step", {"action": "Jump"}).json()
    assert jump["info"]["action_is_valid"] is False and jump["reward"] == 0.0
    # a finished episode refuses steps with 409 until reset
    for _ in range(200):
        out = post(url, f"/sessions/{sid}/step", {"action": "Down"})
        if out.json()["done"]:
            break
    assert post(url, f"/sessions/{sid}/step", {"action": "Down"}).status_code == 409
    assert post(url, f"/sessions/{sid}/reset", {"seed": 2}).json()["observation"] == \
        opened.json()["observation"]
    assert requests.delete(f"{url}/sessions/{sid}").status_code == 200
    assert requests.delete(f"{url}/sessions/{sid}").status_code == 404   # closed: gone
    assert post(url, f"/sessions/{sid}/step", {"action": "Up"}).status_code == 404
    requests.delete(f"{url}/sessions/{kept['session_id']}")


def test_a_token_guards_the_server(monkeypatch):
    """Off loopback the server will not start without a token (exit 2 naming the flag and the
    variable). With one, every request without it is 401, the start-up check says the token
    is missing or another, and the client with it plays."""
    monkeypatch.delenv(ENV_SERVER_TOKEN, raising=False)
    refused = subprocess.run([sys.executable, "-m", "ragen_mega.cli", "env-server",
                              "frozen_lake", "--host", "0.0.0.0"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "--host: 0.0.0.0 is not a loopback address" in refused.stderr
    assert f"set {ENV_SERVER_TOKEN}" in refused.stderr
    token = "env-" + os.urandom(8).hex()
    proc, url = start_server("frozen_lake", environ={ENV_SERVER_TOKEN: token})
    try:
        assert requests.get(f"{url}/health").status_code == 401
        assert post(url, "/sessions", {"seed": 1}).status_code == 401
        with pytest.raises(ValueError, match=f"wants a token, and {ENV_SERVER_TOKEN} is not set"):
            check_servers([url], "frozen_lake", {}, 30)
        monkeypatch.setenv(ENV_SERVER_TOKEN, "not-" + token)
        with pytest.raises(ValueError, match="wants a token, .* holds another"):
            check_servers([url], "frozen_lake", {}, 30)
        monkeypatch.setenv(ENV_SERVER_TOKEN, token)
        check_servers([url], "frozen_lake", {}, 30)

        async def play():
            env = await HttpEnv.open(url, "frozen_lake", 3, 30)
            try:
                await env.reset(3)
                return await env.step("Left")
            finally:
                await env.close()

        obs, reward, done, info = asyncio.run(play())
        assert "action_is_valid" in info and isinstance(obs, str)
    finally:
        stop(proc)


def test_a_dead_hung_or_garbled_server_costs_its_episodes(tokenizer, scripted, run_episodes_keyed):
    """A server SIGKILLed while one of its episodes waits for its second turn, one SIGSTOPped (no
    answer within the time-out) and a fake that answers garbage: their episodes are dropped
    and counted, the others play; a server started again on the same port is used again."""
    from aiohttp import web

    agent = AgentConfig(think=True, max_actions_per_turn=2)
    alive, alive_url = start_server("sokoban", *SOKOBAN)
    doomed, doomed_url = start_server("sokoban", *SOKOBAN)
    try:
        specs = mix_specs([EnvPart("box", "sokoban", {"dim_room": [6, 6]}, 2)], group_size=2,
                          first_seed=0)   # episodes 0, 2 on the live server, 1, 3 on the other
        gen, turns = scripted(tokenizer, ANSWERS), {}

        async def kill_at_turn_2(ids, sampling):  # when episode 1 asks for its second turn
            key = sampling["episode_key"]
            turns[key] = turns.get(key, 0) + 1
            if (key, turns[key]) == (1, 2):
                os.kill(doomed.pid, signal.SIGKILL)
                doomed.wait()
            return await gen(ids, sampling)

        envs = RemoteEnvs([alive_url, doomed_url], timeout_s=5)
        played = asyncio.run(play_or_drop_all(specs, tokenizer, agent, kill_at_turn_2, envs,
                                              run_episodes_keyed))
        assert [isinstance(p, DroppedEpisode) for p in played] == [False, True, False, True]
        counters = FaultCounters(step=1)
        episodes = count_rollout_faults(played, counters, max_failure_rate=0.5)
        assert len(episodes) == 2 and counters.counts["episodes_dropped"] == 2
        assert "(seed 0, episode 1) raised during step: " in played[1].reason  # mid-episode
        with pytest.raises(RuntimeError, match="2 of 4 episodes of step 1 had an env that raised"):
            count_rollout_faults(played, FaultCounters(step=1), max_failure_rate=0.25)

        # the server comes back on its port: the next episodes on it play
        port = int(doomed_url.rsplit(":", 1)[1])
        doomed, back_url = start_server("sokoban", *SOKOBAN, port=port)
        assert back_url == doomed_url
        played = asyncio.run(play_or_drop_all(specs, tokenizer, agent,
                                              scripted(tokenizer, ANSWERS), envs,
                                              run_episodes_keyed))
        assert not any(isinstance(p, DroppedEpisode) for p in played)

        # hung: SIGSTOP, so connections open and nothing answers within the 5 s time-out
        os.kill(doomed.pid, signal.SIGSTOP)
        start = time.monotonic()
        played = asyncio.run(play_or_drop_all(specs, tokenizer, agent,
                                              scripted(tokenizer, ANSWERS), envs,
                                              run_episodes_keyed))
        assert [isinstance(p, DroppedEpisode) for p in played] == [False, True, False, True]
        assert "TimeoutError" in played[1].reason and time.monotonic() - start < 60
        os.kill(doomed.pid, signal.SIGCONT)
    finally:
        stop(alive)
        stop(doomed)

    # garbage: a stand-in server (the real one cannot be made to answer so) whose session
    # answer is not JSON, and one whose step answer lacks the reward
    async def garbled():
        async def not_json(request):
            return web.Response(text="<html>oops</html>")

        app = web.Application()
        app.router.add_post("/sessions", not_json)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        spec = EpisodeSpec("sokoban", {}, seed=0, episode_id=0, group_id=0)
        try:
            return await episode_or_drop(spec, run_episodes_keyed(
                [spec], tokenizer, agent, scripted(tokenizer, ANSWERS),
                open_env=RemoteEnvs([url], 5).open))
        finally:
            await runner.cleanup()

    dropped = asyncio.run(garbled())
    assert isinstance(dropped, DroppedEpisode)
    assert "not a JSON object: '<html>oops</html>'" in dropped.reason


async def play_or_drop_all(specs, tokenizer, agent, gen, envs, run_episodes_keyed):
    async def one(spec):
        async def play():
            [episode] = await run_episodes_keyed([spec], tokenizer, agent, gen, max_turns=3,
                                                 open_env=envs.open)
            return episode
        return await episode_or_drop(spec, play())
    return await asyncio.gather(*(one(s) for s in specs))
