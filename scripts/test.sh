#!/usr/bin/env bash
# Runs the test suite on CPU: creates/updates .venv (scripts/setup_env.sh), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/test_sokoban.py -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RAGEN_MEGA_VENV:-$root/.venv}"  # as scripts/setup_env.sh
"$root/scripts/setup_env.sh"
# the trajectory viewer's browser test (tests/test_learn.py) drives Debian's headless Chromium
if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium chromium-driver >/dev/null
  else
    echo "scripts/test.sh: the viewer's browser test needs Chromium and its driver:" \
      "sudo apt-get install chromium chromium-driver" >&2
    exit 1
  fi
fi
cd "$root"
# a crash in native code prints every thread's stack (tests/conftest.py: pytest_unconfigure)
export PYTHONFAULTHANDLER=1
# Two test files at a time (pytest-xdist; a file's tests stay on one worker, with its module
# fixtures): the whole-loop tests wait on start-ups (Ray, engines, trainer ranks) about a third
# of their time, which a second file fills; the suite 1.29x faster (benchmarks/README.md, "The
# test suite's wall time").
# RAGEN_MEGA_TEST_WORKERS=0 runs them one at a time, in this process; `-n N` here overrides too.
exec "$venv/bin/python" -m pytest -n "${RAGEN_MEGA_TEST_WORKERS:-2}" --dist loadfile "$@"
