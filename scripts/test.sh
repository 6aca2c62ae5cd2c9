#!/usr/bin/env bash
# Runs the test suite on CPU: creates/updates .venv (scripts/setup_env.sh), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/test_sokoban.py -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
