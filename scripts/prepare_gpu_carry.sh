#!/usr/bin/env bash
# Prepare what benchmarks/gpu_check.sh needs on a bare GPU machine that has torch, transformers
# and pytest but cannot reach a package index (a briefly lent single-GPU box):
#   .whl/        megatron-core as a CPython 3.12 manylinux wheel (pure Python plus one helper)
#   .gpu_carry/  models/SmolLM2-135M-Instruct: the tokenizer files only (the tiny test models
#                use its vocabulary; no weights), and src/: a snapshot of HEAD to run from
# Both are git-ignored. Then, on the GPU machine, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export RAGEN_MEGA_CACHE=$PWD/.gpu_carry; cd .gpu_carry/src
#   PYTHONPATH=/tmp/site:$PWD bash benchmarks/gpu_check.sh OUT_DIR
# Needs the CPU environment (scripts/setup_env.sh) for pip and the prepared SmolLM2.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py=.venv/bin/python
rm -rf .whl .gpu_carry
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
  "megatron-core==$("$py" -c 'import megatron.core as m; print(m.__version__)')"
tok=.gpu_carry/models/SmolLM2-135M-Instruct
mkdir -p "$tok" .gpu_carry/src
smollm2=$("$py" -c 'from ragen_mega.models.prepare import prepare_smollm2; print(prepare_smollm2())')
for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
  cp "$smollm2/$f" "$tok/"
done
git archive HEAD | tar -x -C .gpu_carry/src
du -sh .whl .gpu_carry
