#!/usr/bin/env bash
# Runs the test suite on CPU: creates/updates .venv (scripts/setup_env.sh), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/test_sokoban.py -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RAGEN_MEGA_VENV:-$root/.venv}"  # as scripts/setup_env.sh
"$root/scripts/setup_env.sh"
cd "$root"
# a crash in native code prints every thread's stack (tests/conftest.py: pytest_unconfigure)
export PYTHONFAULTHANDLER=1
exec "$venv/bin/python" -m pytest "$@"
