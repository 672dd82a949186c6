#!/usr/bin/env bash
# Trains the toy reasoner pair (target + draft variants), measures it, and packs the results.
# Meant for one GPU; every knob below can be overridden from the environment (the CPU smoke
# settings shrink them; TARGET_DIR skips the target). Results land in $OUT: target.tar.part-*,
# drafts.tar, logs, analysis.json.
set -euo pipefail
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-runs/toy}
WORK=${WORK:-/tmp/toy-work}
SEED=${SEED:-0}
T_STEPS=${T_STEPS:-5000}; T_BUDGET=${T_BUDGET:-200}; T_SAMPLES=${T_SAMPLES:-400000}; T_BATCH=${T_BATCH:-128}
D_SAMPLES=${D_SAMPLES:-100000}; D_BATCH=${D_BATCH:-128}; D_BUDGET=${D_BUDGET:-30}
SEQ=${SEQ:-640}; N_EVAL=${N_EVAL:-500}; MAX_NEW=${MAX_NEW:-600}
# Draft variants "name:layers:hidden:heads:head_dim:ffn:steps", all ~1-2M parameters, weaker by design.
DRAFTS=${DRAFTS:-"d3-1200:3:160:5:32:480:1200 d3-400:3:160:5:32:480:400 d3-150:3:160:5:32:480:150 d2-600:2:192:6:32:576:600"}
TARGET_SIZE=${TARGET_SIZE:-""}  # e.g. "--hidden-size 64 --num-layers 2" for smoke runs
mkdir -p "$OUT" "$WORK"

if [ -n "${TARGET_DIR:-}" ]; then
  # Drafts only: reuse a trained target (e.g. thinkspec/assets/toy-reasoner/target).
  rm -rf "$WORK/target" && cp -r "$TARGET_DIR" "$WORK/target"
else
  $PY -m thinkspec.toy.train --role target --out "$WORK/target" $TARGET_SIZE --steps "$T_STEPS" \
    --time-budget-s "$T_BUDGET" --batch-size "$T_BATCH" --seq-len "$SEQ" --samples "$T_SAMPLES" \
    --lr 1e-3 --seed "$SEED" 2>&1 | tee "$OUT/train_target.log"
  tar -C "$WORK" -cf - target | split -b 15M - "$OUT/target.tar.part-"
fi

names=()
for spec in $DRAFTS; do
  IFS=: read -r name layers hidden heads hdim ffn steps <<<"$spec"
  $PY -m thinkspec.toy.train --role draft --tokenizer "$WORK/target" --out "$WORK/$name" \
    --num-layers "$layers" --hidden-size "$hidden" --num-heads "$heads" --head-dim "$hdim" \
    --intermediate-size "$ffn" --steps "$steps" --time-budget-s "$D_BUDGET" --batch-size "$D_BATCH" \
    --seq-len "$SEQ" --samples "$D_SAMPLES" --lr 2e-3 --warmup-steps 50 --log-every 100 \
    --seed $((SEED + 1)) 2>&1 | tee -a "$OUT/train_drafts.log"
  names+=("$name")
done
tar -C "$WORK" -cf "$OUT/drafts.tar" "${names[@]}"

draft_args=()
for n in "${names[@]}"; do draft_args+=(--draft "$WORK/$n"); done
$PY -m thinkspec.toy.analyze --target "$WORK/target" "${draft_args[@]}" --n "$N_EVAL" \
  --max-new-tokens "$MAX_NEW" --relax 0.3,3 --relax 0.3,4 --time-budget-s "${A_BUDGET:-150}" --json "$OUT/analysis.json" 2>&1 \
  | tee "$OUT/analysis.log"
