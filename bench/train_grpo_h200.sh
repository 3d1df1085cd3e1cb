#!/usr/bin/env bash
# Issue 15's bar on one H200: scripts/train_grpo.py with a qwen3-0.6b-shaped random-init model, 16 completions of
# 4096 tokens per step (2 prompts x n=8), 5 steps, the engine co-located with the trainer (it sleeps while the
# trainer trains: train.sleep_level=1), rollout/* metrics and the bf16 logprob gap in an offline W&B run.
# Writes $OUT/grpo_h200/{step_times.json (generation / weight push / training s per step), metrics.jsonl,
# train_grpo.log, wandb/}. The reward (digit_fraction) is ~0 for a random model: a throughput bar, not learning.
#
# Needs the job wheels plus trl and accelerate (the GPU machine has none of them), built here beforehand:
#   bash ../shared/device/wheels.sh job
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
#     trl==1.16.0 accelerate==1.15.0 psutil
# then on the device (carry .whl):  bash bench/train_grpo_h200.sh
set -euo pipefail
: "${OUT:?set OUT}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1
python3 - <<'PY'
import shutil

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from rollout.assets import TOKENIZER_FILES, assets_dir

torch.manual_seed(0)  # Qwen3-0.6B's shape (scripts/bench.py PRESETS), the shipped tokenizer's special ids
cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_theta=1e6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained("/tmp/qwen3-0.6b-random")
for name in TOKENIZER_FILES:
    shutil.copyfile(assets_dir() / name, f"/tmp/qwen3-0.6b-random/{name}")
PY
python3 -m scripts.train_grpo hydra.run.dir="$OUT/grpo_h200" \
  model=qwen3-0.6b model.path=/tmp/qwen3-0.6b-random engine=h200 engine.max_model_len=8192 engine.max_num_seqs=16 \
  engine.gpu_memory_utilization=0.5 sampling.max_tokens=4096 sampling.ignore_eos=true sampling.n=8 \
  data.num_prompts=2 train.steps=5 train.sleep_level=1 train.learning_rate=1e-6 train.torch_threads=null \
  +train.grpo.gradient_accumulation_steps=4 logger.wandb.mode=offline
python3 - "$OUT/grpo_h200" <<'PY'
import json
import sys

out = sys.argv[1]
print(json.dumps(json.load(open(f"{out}/step_times.json"))["summary"]))
for line in open(f"{out}/metrics.jsonl"):
    row = json.loads(line)
    print({k: round(v, 5) for k, v in row.items() if k.startswith(("rollout/", "sampling/")) or k == "step"})
PY
