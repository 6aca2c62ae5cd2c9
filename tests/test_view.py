"""``ragen-mega view``'s API over hand-written trajectory files: steps, groups, episodes and the
echo-trap marks against hand-counted numbers; missing, corrupt and too-new files and bad or
traversing parameters answered with a 4xx naming the problem, never a 500. The page itself is
driven in a headless browser on a real run's files in tests/test_learn.py."""
from __future__ import annotations

import gzip
import json

import pytest
from fastapi.testclient import TestClient

from ragen_mega import trajectories
from ragen_mega.view import main, make_app


def record(step, episode, group, seed, responses, rewards, kept=True, score=0.5, kind="train",
           copies=()):
    turns = [{"turn": i + 1, "observation": f"board {seed}.{i}\n_G_\nP__", "prompt_tokens": 40,
              "response": text, "response_tokens": 3, "finish_reason": "stop",
              "format_ok": True, "example_copy": i in copies,
              "actions": [{"action": text.strip(), "reward": r, "done": False, "info": {}}],
              "reward": r, "done": i == len(responses) - 1, "advantage": 0.25,
              "step_advantage": None} for i, (text, r) in enumerate(zip(responses, rewards))]
    return {"schema": 1, "kind": kind, "step": step, "tag": "lake", "seed": seed,
            "group": group, "episode": episode, "weight_version": step - 1,
            "return": sum(rewards), "success": sum(rewards) > 0, "kept": kept,
            "group_score": score, "turns": turns}


@pytest.fixture()
def run_dir(tmp_path):
    """Steps 1 and 2 (group 0 kept, group 1 filtered), the evaluation at step 2, metrics."""
    step1 = [record(1, 0, 0, 7, [" Up", " Left"], [0.0, 1.0]),
             record(1, 1, 0, 7, [" Up"], [0.0]),
             record(1, 2, 1, 8, [" Down"], [0.0], kept=False, score=0.0),
             record(1, 3, 1, 8, [" Down"], [0.0], kept=False, score=0.0)]
    step2 = [record(2, 0, 0, 9, [" Up", " Right"], [0.0, 0.0], copies=(0,)),
             record(2, 1, 0, 9, [" Left"], [1.0]),
             record(2, 2, 1, 7, [" Right"], [1.0])]
    for step, records in ((1, step1), (2, step2)):
        trajectories.write_records(trajectories.step_file(tmp_path, step), records)
    trajectories.write_records(trajectories.step_file(tmp_path, 2, "eval"),
                               [record(2, 0, 0, 10**6, [" Up"], [1.0], kept=None, score=None,
                                       kind="eval")])
    lines = [{"step": 1, "rollout/success": 0.25, "rollout/reward_mean": 0.25,
              "filter/kept_groups": 1.0},
             {"step": 2, "rollout/success": 0.5, "rollout/reward_mean": 0.5,
              "filter/kept_groups": 2.0, "val/success": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines)
                                            + '{"step": 3, "rollout/succ')  # cut short
    return tmp_path


def test_steps_groups_episodes_and_echo_marks(run_dir):
    client = TestClient(make_app(run_dir))
    assert "<title>ragen-mega view</title>" in client.get("/").text
    run = client.get("/api/run").json()
    assert [s["step"] for s in run["steps"]] == [1, 2]  # the cut line is skipped
    assert run["steps"][1] == {"step": 2, "success": 0.5, "reward": 0.5, "kept_groups": 2.0,
                               "val_success": 1.0, "train": True, "eval": True}

    step1 = client.get("/api/train/steps/1").json()
    g0, g1 = step1["groups"]
    assert (g0["seed"], g0["kept"], g0["returns"]) == (7, True, [1.0, 0.0])
    assert g0["std"] == pytest.approx(2 ** -0.5)
    assert (g1["kept"], g1["score"], g1["std"]) == (False, 0.0, 0.0)
    assert [e["episode"] for e in g0["episodes"]] == [0, 1] and g0["episodes"][0]["turns"] == 2
    # turn 1 of episodes 0 and 1 both " Up", of 2 and 3 both " Down": 4 of 5 turns repeat
    assert step1["echo"] == {"turns": 5, "repeated_in_group": 0.8, "example_copy": 0.0,
                             "in_previous_step": None}
    step2 = client.get("/api/train/steps/2").json()
    # step 2's responses " Up", " Right", " Left", " Right": " Up" and " Left" were in step 1
    assert step2["echo"] == {"turns": 4, "repeated_in_group": 0.0, "example_copy": 0.25,
                             "in_previous_step": 0.5}

    episode = client.get("/api/train/steps/1/episodes/0").json()
    assert [t["response"] for t in episode["turns"]] == [" Up", " Left"]
    assert [t["repeats_in_group"] for t in episode["turns"]] == [1, 0]
    assert episode["turns"][0]["observation"] == "board 7.0\n_G_\nP__"
    assert client.get("/api/eval/steps/2/episodes/0").json()["kind"] == "eval"

    compare = client.get("/api/train/seeds/7", params={"steps": [1, 2]}).json()
    assert compare["episodes"]["1"]["episode"] == 0 and compare["episodes"]["2"]["episode"] == 2


def test_bad_requests_and_bad_files_are_4xx_with_the_reason(run_dir):
    client = TestClient(make_app(run_dir), raise_server_exceptions=False)
    missing = client.get("/api/train/steps/5")
    assert missing.status_code == 404
    assert "no train trajectories for step 5" in missing.json()["detail"]
    assert client.get("/api/train/steps/1/episodes/9").status_code == 404
    assert client.get("/api/train/seeds/99", params={"steps": [1]}).status_code == 404
    for bad in ("/api/train/steps/-1", "/api/test/steps/1", "/api/train/steps/x",
                "/api/train/steps/..%2F..%2Fetc", "/api/train/steps/1/episodes/..%2F0",
                "/api/../../etc/passwd", "/api/train/seeds/7?steps=-1",
                "/api/train/seeds/7"):
        answer = client.get(bad)
        assert 400 <= answer.status_code < 500, (bad, answer.status_code)

    garbled = trajectories.step_file(run_dir, 3)
    garbled.write_bytes(b"not gzip at all")
    answer = client.get("/api/train/steps/3")
    assert answer.status_code == 422
    assert "step_3.jsonl.gz: cannot be read" in answer.json()["detail"]
    newer = trajectories.step_file(run_dir, 4)
    with gzip.open(newer, "wt") as f:
        f.write(json.dumps({"schema": trajectories.SCHEMA + 1}) + "\n")
    answer = client.get("/api/train/steps/4")
    assert answer.status_code == 422 and "upgrade ragen-mega" in answer.json()["detail"]


def test_view_refuses_a_directory_that_is_no_run(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "holds no trajectories/ and no metrics.jsonl" in capsys.readouterr().err


def test_off_loopback_the_viewer_needs_a_token(run_dir, monkeypatch, capsys):
    """As the env server and the gateway: ``--host 0.0.0.0`` without RAGEN_MEGA_VIEW_TOKEN is
    refused before serving; with a token, a request without it is 401, a browser opens
    ``/?token=`` once and its cookie carries the token to the page's fetches."""
    monkeypatch.delenv("RAGEN_MEGA_VIEW_TOKEN", raising=False)
    assert main([str(run_dir), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--host: 0.0.0.0 is not a loopback address" in err and "RAGEN_MEGA_VIEW_TOKEN" in err

    browser = TestClient(make_app(run_dir, token="s3cret"))
    assert browser.get("/api/run").status_code == 401
    assert browser.get("/?token=wrong").status_code == 401
    assert browser.get("/api/run").status_code == 401
    assert browser.get("/?token=s3cret").status_code == 200          # sets the cookie
    assert browser.get("/api/run").status_code == 200        # the page's fetch
    other = TestClient(make_app(run_dir, token="s3cret"))
    assert other.get("/api/run",
                     headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert other.get("/api/run",
                     headers={"Authorization": "Bearer s3cre"}).status_code == 401
