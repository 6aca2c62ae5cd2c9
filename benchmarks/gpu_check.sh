#!/usr/bin/env bash
# The GPU-only checks in one short run (meant for a briefly lent single-GPU machine):
#   1. tests/test_gpu.py: the Megatron trainer on CUDA/NCCL in fp32 and bf16 against the
#      transformers + AdamW reference, the local spec's SDPA attention against the unfused one
#      (and on its flash kernel), the colocated sync payload through CUDA IPC, and a tiny
#      Qwen2-MoE's actor step at EP 1, with one linear per expert and with grouped-GEMM experts
#      (TransformerEngine's TEGroupedMLP: skipped, saying so, where TE is not installed; EP 2
#      over NCCL needs a second GPU: skipped, saying so);
#   2. bench_logprobs.py at 16k tokens of Qwen's 151 936-row vocabulary (9.3 GiB a full fp32
#      tensor): time and peak CUDA memory of the log-prob/entropy function against plain autograd;
#   3. bench_train_step.py on the Qwen2.5-1.5B / 0.5B shapes (random weights), bf16: tokens/s,
#      MFU and peak memory of Megatron with SDPA attention, Megatron with the unfused attention,
#      and transformers, in one run per shape. Expected to take ~5 min on an H200; the limits
#      below add up to 10.
# Usage, from the repository root: benchmarks/gpu_check.sh OUT_DIR
# Needs torch with CUDA, transformers, pytest(-timeout) and megatron-core importable, and the
# SmolLM2 tokenizer under $RAGEN_MEGA_CACHE/models/SmolLM2-135M-Instruct (the tiny test models
# use its vocabulary; no weights needed): scripts/prepare_gpu_carry.sh packs both for a machine
# without a package index, and its header has the commands to run there. Each part has its own
# time limit so one hang cannot eat the others' time.
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', m.__version__)"
} 2>&1 | tee "$out/gpu.txt"

timeout 180 python3 -m pytest -p no:cacheprovider -q -rA -s tests/test_gpu.py 2>&1 \
  | grep -v "Warning\|warnings.warn" | tee "$out/test_gpu.log"

timeout 120 python3 benchmarks/bench_logprobs.py --tokens 16384 --vocab 151936 --repeats 3 2>&1 \
  | grep -E "^tokens=|^one|^\||ratio" | tee "$out/bench_logprobs.md"

n=0
bench() {  # LIMIT_S ARGS...: one benchmark; the table and ratio lines are what matter
  local limit=$1; shift
  echo "## $*" | tee -a "$out/bench_train_step.md"
  local log="$out/bench_$(( ++n )).log"
  timeout "$limit" python3 benchmarks/bench_train_step.py "$@" > "$log" 2>&1
  grep -E "^model=|^\||ratio" "$log" | tee -a "$out/bench_train_step.md" || tail -5 "$log"
}
bench 200 --model qwen2.5-1.5b --batch 16 --seq 1024 --micro-batch 4 --steps 3 --bf16 --attention sdpa,unfused
bench 100 --model qwen2.5-0.5b --batch 16 --seq 1024 --micro-batch 4 --steps 3 --bf16 --attention sdpa,unfused
