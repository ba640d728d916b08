#!/usr/bin/env bash
# The main job: a 2-process ZeRO-2 fine-tune of a GPT-2 style model on the bundled corpus, through
# `hfzero run` and an unmodified Hugging Face Trainer script, recording a memory profile; then a
# summary of the profile and the dashboard on it (http://127.0.0.1:8501, Ctrl-C to stop).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/main}
rm -rf "$OUT"
hfzero run --nproc_per_node 2 examples/train_clm.py --config_name tiny --do_train --do_eval \
  --output_dir "$OUT/clm" --max_steps 200 --per_device_train_batch_size 8 --learning_rate 2e-3 \
  --warmup_steps 20 --logging_steps 20 --save_steps 100 --report_to none \
  --zero_stage 2 --zero_profile_dir "$OUT/profile"
hfzero profile summary "$OUT/profile"
if [ "${HFZERO_NO_DASHBOARD:-0}" != "1" ]; then
  hfzero dashboard "$OUT/profile" --port "${PORT:-8501}"
fi
