#!/usr/bin/env bash
# Trains the bundled toy reasoner pair (target, draft, draft-strong) on the difficulty range, measures
# it and packs what the model card needs. Meant for one H200 in about 8 minutes:
#   1. the target trains for T_BUDGET s (after building its tokenizer and data);
#   2. both drafts train side by side while thinkspec.bench.difficulty measures the target's greedy
#      accuracy on the easy level and on every hard candidate (stage grid);
#   3. each draft's strict and relaxed cells run on easy and on the suggested hard level (stage drafts).
# The measurements stop TOTAL_BUDGET s after the start (what still runs then is aborted and marked).
# Every knob below can be overridden from the environment (the CPU smoke test shrinks them);
# TARGET_DIR reuses a trained target instead of training one.
# Results in $OUT, six files: target.tar.part-aa/-ab, drafts.tar, analysis.json, train.log, analysis.log.
set -euo pipefail
export PYTHONUNBUFFERED=1
START=$(date +%s)
PY=${PYTHON:-python3}
OUT=${OUT:-runs/toy}
WORK=${WORK:-/tmp/toy-work}
SEED=${SEED:-0}
TOTAL_BUDGET=${TOTAL_BUDGET:-450}
MIX=${MIX:-range}; SEQ=${SEQ:-2048}; MAX_POS=${MAX_POS:-2048}
T_STEPS=${T_STEPS:-5000}; T_BUDGET=${T_BUDGET:-200}; T_SAMPLES=${T_SAMPLES:-150000}; T_BATCH=${T_BATCH:-64}
TARGET_SIZE=${TARGET_SIZE:-""}  # e.g. "--hidden-size 64 --num-layers 2" for smoke runs
# The bundled drafts, "name:layers:hidden:heads:head_dim:ffn:steps:fork_bias" (assets README: draft is
# the default, fork-biased one; draft-strong the longer-trained uniform one). D_BATCH rows of SEQ tokens
# per step: 40 x 2048 is about the 128 x 640 tokens per step the first drafts were trained with.
DRAFTS=${DRAFTS:-"draft:3:160:5:32:480:250:0.9 draft-strong:3:160:5:32:480:400:0"}
D_SAMPLES=${D_SAMPLES:-40000}; D_BATCH=${D_BATCH:-40}; D_BUDGET=${D_BUDGET:-60}; D_WORKERS=${D_WORKERS:-6}
N_EASY=${N_EASY:-500}; N_HARD=${N_HARD:-200}; N_SPEC_EASY=${N_SPEC_EASY:-300}; N_SPEC_HARD=${N_SPEC_HARD:-200}
GRID_RESERVE=${GRID_RESERVE:-60}  # seconds of TOTAL_BUDGET kept for the drafts stage
ANALYZE_ARGS=${ANALYZE_ARGS:-"--kv-cache-gib 16"}
mkdir -p "$OUT" "$WORK"
log() { echo "[train_toy $(( $(date +%s) - START ))s] $*" | tee -a "$OUT/train.log"; }
left() { local s=$(( START + TOTAL_BUDGET - $(date +%s) - ${1:-0} )); echo $(( s > 1 ? s : 1 )); }
failed=()

if [ -n "${TARGET_DIR:-}" ]; then
  rm -rf "$WORK/target" && cp -r "$TARGET_DIR" "$WORK/target"
else
  rm -rf "$WORK/target"
  $PY -m thinkspec.toy.train --role target --out "$WORK/target" $TARGET_SIZE --steps "$T_STEPS" \
    --time-budget-s "$T_BUDGET" --batch-size "$T_BATCH" --seq-len "$SEQ" --max-positions "$MAX_POS" \
    --mix "$MIX" --samples "$T_SAMPLES" --lr 1e-3 --seed "$SEED" 2>&1 | tee -a "$OUT/train.log"
  tar -C "$WORK" -cf - target | split -b 15M - "$OUT/target.tar.part-"
fi
log "target done"

# Drafts in the background (they need only the target's tokenizer), the greedy grid meanwhile.
pids=(); names=()
for spec in $DRAFTS; do
  IFS=: read -r name layers hidden heads hdim ffn steps bias <<<"$spec"
  rm -rf "${WORK:?}/$name"
  $PY -m thinkspec.toy.train --role draft --tokenizer "$WORK/target" --out "$WORK/$name" \
    --num-layers "$layers" --hidden-size "$hidden" --num-heads "$heads" --head-dim "$hdim" \
    --intermediate-size "$ffn" --steps "$steps" --time-budget-s "$D_BUDGET" --batch-size "$D_BATCH" \
    --seq-len "$SEQ" --max-positions "$MAX_POS" --mix "$MIX" --samples "$D_SAMPLES" --lr 2e-3 \
    --warmup-steps 50 --log-every 100 --seed $((SEED + 1)) --fork-bias "${bias:-0}" \
    --workers "$D_WORKERS" >"$WORK/train_$name.log" 2>&1 &
  pids+=($!); names+=("$name")
done
$PY -m thinkspec.bench.difficulty --target "$WORK/target" --stage grid --json "$OUT/analysis.json" \
  --n-easy "$N_EASY" --n-hard "$N_HARD" --time-budget-s "$(left "$GRID_RESERVE")" $ANALYZE_ARGS 2>&1 \
  | tee -a "$OUT/analysis.log" || failed+=(grid)
log "grid done"
trained=()
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then trained+=("${names[$i]}"); else failed+=("draft ${names[$i]}"); fi
  cat "$WORK/train_${names[$i]}.log" >>"$OUT/train.log"
done
[ ${#trained[@]} -gt 0 ] && tar -C "$WORK" -cf "$OUT/drafts.tar" "${trained[@]}"
log "drafts done: ${trained[*]:-none}"

if [ ${#trained[@]} -gt 0 ]; then
  draft_args=()
  for n in "${trained[@]}"; do draft_args+=(--draft "$WORK/$n"); done
  $PY -m thinkspec.bench.difficulty --target "$WORK/target" "${draft_args[@]}" --stage drafts \
    --json "$OUT/analysis.json" --n-spec-easy "$N_SPEC_EASY" --n-spec-hard "$N_SPEC_HARD" \
    --time-budget-s "$(left)" $ANALYZE_ARGS 2>&1 | tee -a "$OUT/analysis.log" || failed+=(drafts-analysis)
fi

sed -n '/^level | n |/,/^suggested hard level/p' "$OUT/analysis.log"  # the grid again, last in the output
sizes=$(cd "$WORK" && du -cb target/model.safetensors "${trained[@]/%//model.safetensors}" | tail -1 | cut -f1)
log "weights to bundle: $sizes bytes (limit 40 MB)"
if [ ${#failed[@]} -gt 0 ]; then
  log "FAILED: ${failed[*]}"
  exit 1
fi
log "all done"
