#!/usr/bin/env bash
# GPU tests and benchmarks in one go (meant for one H200). Writes JSON and logs under $OUT and
# prints a short summary table last. Stages are time-boxed so one slow stage cannot eat the rest;
# STAGES selects a subset (default: all), e.g. STAGES="tests acceptance".
# Each stage's status goes into the summary (ok, FAILED (exit N), TIMED OUT after Ns); later stages
# still run, and the script exits 1 at the end if any stage failed.
#   tests       pytest -m gpu (model/engine/spec-decode equality on CUDA, acceptance kernels); TEST_PATHS
#   acceptance  fused acceptance kernels vs seed-style torch, torch amax and the HBM floor
#   spec_round  one speculative round vs k draft steps + one verify (Qwen3-8B / 0.6B shapes), against the
#               floors, each part also timed back to back, and the draft step, verify and plain step split
#               by kernel (SPEC_ROUND_ARGS, default --kernel-profile)
#   throughput  decode tok/s: HF eager, HF static cache, thinkspec plain and speculative (8B shape);
#               THROUGHPUT_ARGS go to bench_throughput.py (e.g. "--skip-hf --batch-sizes 1")
#   projection  the projection of a sweep's cells (PROJECTION_SWEEP, PROJECTION_CELLS) against the engine
#               replaying their acceptance at Qwen3-8B / 0.6B shapes (benchmarks/speculative/validate_projection.py)
#   adaptive    adaptive_k vs plain and fixed k 1..8 at Qwen3-8B / 0.6B shapes, batch 1-128, a good and a bad
#               synthetic draft, with the issue's criteria as ratios (benchmarks/speculative/bench_adaptive.py);
#               ADAPTIVE_ARGS replace its defaults (e.g. "--batch-sizes 1,16 --fixed-ks 2,4,6 --repeats 1");
#               the bundled toy pair with real, relaxed acceptance (adaptive vs the best fixed k):
#               ADAPTIVE_ARGS="--toy --batch-sizes 1,16,64 --repeats 3"
#   overhead    what a speculating engine's plain steps cost on the host-bound toy pair, mode by mode against
#               plain decoding (benchmarks/toy/toy_plain_overhead.py; OVERHEAD_ARGS, e.g. "--batch-sizes 1,16,64
#               --modes plain,adaptive,adaptive-fresh-pass,adaptive-no-bookkeeping")
#   bookkeeping host microseconds of an adaptive engine's bookkeeping per plain decode step (plan + record_plan),
#               plain streaks on and off (benchmarks/engine/bench_plain_bookkeeping.py; BOOKKEEPING_ARGS)
#   long        long contexts: decode tok/s (plain, speculative AL 3) and the speculative round's parts
#               at 8k (batch 1, 16) and 32k (batch 1) prompts; HF skipped
#   graphs      eager vs CUDA graphs, KV pool vs gpu_memory_utilization, batch-1 kernel profile (8B shape)
#   gemv        decode-step projections: cuBLAS vs the Triton GEMV over a launch-shape grid (GEMV_ARGS)
#   argmax      greedy sampling: torch.argmax vs the one-launch Triton argmax at 1-128 rows of Qwen3's
#               vocabulary (benchmarks/kernels/bench_argmax.py; ARGMAX_ARGS)
#   skinny      Qwen3-8B projections at 4..64 rows (SKINNY_ARGS "--model 0.6b": the draft's): cuBLAS vs the
#               skinny Triton GEMM's launch shapes, the per-step totals at rows 16 and 64, and the
#               SKINNY_GEMM_TABLE entries it implies (benchmarks/kernels/bench_skinny_gemm.py; SKINNY_ARGS, e.g.
#               "--rows 16,64 --refine 1")
#   attention   decode (and, with --queries 5, verify) attention: Triton launch shapes x contexts x batches,
#               us per layer (ATTENTION_ARGS, e.g. "--batches 16,64 --queries 1,5 --contexts 256"; with
#               "--layouts nhd,hnd --repeats 3" the KV blocks head-major as well, side by side)
#   tune        launch-shape sweep of the acceptance kernel's stats pass (benchmarks/kernels/tune_acceptance.py)
#   host        how steady one host core is: fixed Python work timed in chunks, unpinned and pinned
#               (benchmarks/engine/host_noise.py; HOST_ARGS, default "--seconds 30")
#   step        one 8B-shaped engine step split into host phases and device busy/idle time, for each
#               "batch[:max_model_len[:mode]]" of STEP_RUNS (default "1 1::sync 16 1:32768"; short
#               max_model_len when empty; mode sync = async_scheduling off, specK = speculative steps
#               drafting K tokens per row with async_scheduling off, e.g. "64::spec3", with the device's
#               time between the step's calls; aheadK = the same with async_scheduling on (the CUDA
#               default), each step running the next one's first draft forward ahead, e.g.
#               "1::spec4 1::ahead4"; switchK = cycles of SWITCH_PLAIN (24) plain
#               steps and one step drafting K, timing the switch out of plain decoding against a
#               steady step, e.g. "16::switch3"); STEP_ARGS go to every run
#               (e.g. "--prompt-len 384" for a longer context)
#   drafts      train toy draft variants (DRAFTS="name:steps[:fork_bias] ...") on the bundled pair's
#               data (the difficulty range, rows of 2,048) and screen them with the simulated
#               measurements of thinkspec.toy.analyze (ANALYZE_N easy problems)
#   toy         toy reasoner quality gates with the engine (TOY_N problems, TOY_DRAFTS)
#   sweep       the toy reasoner sweep of docs/SWEEP.md (SWEEP_DIR, resumable; copied to $OUT/sweep);
#               SWEEP_N, SWEEP_TEMPS, SWEEP_RATIOS, SWEEP_TOPKS, SWEEP_EXTRA, SWEEP_REPEATS, SWEEP_BATCHES,
#               SWEEP_HF, SWEEP_ARGS
#               (SWEEP_LEVEL=hard: the hard level, with its own max_tokens)
#   trees       two source trees side by side, interleaved: plain decode and the speculative round at the
#               Qwen3-8B / 0.6B shapes, batch 1, 16, 64 (benchmarks/engine/compare_trees.py); OLD_TREE is the
#               baseline's root (default .oldtree: e.g. `git archive REV thinkspec | tar -x -C .oldtree`,
#               carried with the call), the working tree is the new one; TREES_ARGS replace the defaults
#   tp          tensor parallelism (needs >= TP_SIZE GPUs, default 2): the TP=2 vs TP=1 bf16 GPU test,
#               then benchmarks/engine/bench_tp.py (all-reduce latency, Llama-3-70B shape step time vs the
#               per-GPU floor, with a Llama-3-8B draft TP / replicated, Qwen3-8B TP vs TP=1) into
#               $OUT/tp.json; TP_ARGS go to bench_tp.py (e.g. "--parts allreduce,plain"; at 8 GPUs
#               TP_SIZE=8 TP_ARGS="--target llama3-405b --batch-sizes 1 ..."); TP_TESTS=0 skips the test
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_check}
STAGES=${STAGES:-"tests acceptance spec_round throughput graphs"}
mkdir -p "$OUT"
summary="$OUT/summary.txt"
: >"$summary"
has() { [[ " $STAGES " == *" $1 "* ]]; }
note() { echo "$*" | tee -a "$summary"; }
# Every stage records its exit status; the script exits non-zero at the end if any stage failed, so a
# failing or timed-out run cannot pass for a good one. `timeout` exits 124 (137 if it had to KILL).
failed=()
# record NAME EXIT LIMIT_S [DETAIL...]: one summary line "NAME: ok | FAILED (exit N) | TIMED OUT after Ns"
record() {
  local name=$1 rc=$2 limit=$3 status
  shift 3
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMED OUT after ${limit}s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  [ "$rc" -eq 0 ] || failed+=("$name")
  note "$name: $status${*:+ $*}"
}

# bench NAME SCRIPT LIMIT [DEFAULT_ARGS [bars]]: the stage NAME, i.e. benchmarks/SCRIPT --out $OUT/NAME.json
# with ${NAME_ARGS:-DEFAULT_ARGS}, time-boxed by ${NAME_TIMEOUT:-LIMIT}, its output shown and kept in
# $OUT/NAME.log ("bars": tqdm's progress lines left out), its status recorded
bench() {
  local name=$1 script=$2 upper=${1^^} bars=${5:-}
  local limit_var=${upper}_TIMEOUT args_var=${upper}_ARGS
  local limit=${!limit_var:-$3} args=${!args_var:-${4:-}}
  timeout "$limit" $PY "benchmarks/$script" --out "$OUT/$name.json" $args 2>&1 \
    | if [ "$bars" = bars ]; then grep -v 'it/s]'; else cat; fi | tee "$OUT/$name.log"
  record "$name" "${PIPESTATUS[0]}" "$limit"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$summary"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || record nvidia-smi "$rc" 0

if has tests; then
  timeout "${TESTS_TIMEOUT:-360}" $PY -m pytest -q -m gpu -p no:cacheprovider ${TEST_PATHS:-tests} 2>&1 | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
  record tests "$rc" "${TESTS_TIMEOUT:-360}" "$(grep -E '(passed|failed|error|no tests ran)' "$OUT/gpu_tests.log" | tail -1)"
fi


has spec_round && bench spec_round speculative/bench_spec_round.py 200 --kernel-profile
has trees && bench trees engine/compare_trees.py 540 "--old ${OLD_TREE:-.oldtree} --new . --repeats 3"
has throughput && bench throughput engine/bench_throughput.py 420

if has projection; then
  timeout "${PROJECTION_TIMEOUT:-300}" $PY benchmarks/speculative/validate_projection.py \
    --sweep "${PROJECTION_SWEEP:-docs/sweep-toy-h200/sweep.json}" --cells "${PROJECTION_CELLS:-T=0 strict,T=0 r=0.3 k=8}" \
    --out "$OUT/projection.json" ${PROJECTION_ARGS:-} 2>&1 | tee "$OUT/projection.log"
  record projection "${PIPESTATUS[0]}" "${PROJECTION_TIMEOUT:-300}"
fi

has adaptive && bench adaptive speculative/bench_adaptive.py 480 "--repeats 2" bars
has overhead && bench overhead toy/toy_plain_overhead.py 400 "" bars
has bookkeeping && bench bookkeeping engine/bench_plain_bookkeeping.py 200 "" bars

if has long; then
  for spec in 8192:1,16 32768:1; do
    IFS=: read -r len batches <<<"$spec"
    timeout "${LONG_TIMEOUT:-200}" $PY benchmarks/engine/bench_throughput.py --skip-hf --prompt-len "$len" \
      --batch-sizes "$batches" --acceptance-lengths 3 --out "$OUT/long_throughput_$len.json" 2>&1 \
      | grep -v 'it/s' | tee -a "$OUT/long.log" | tail -n 8
    record "long throughput prompt $len" "${PIPESTATUS[0]}" "${LONG_TIMEOUT:-200}"
    timeout "${LONG_TIMEOUT:-200}" $PY benchmarks/speculative/bench_spec_round.py --prompt-len "$len" --batch-sizes "$batches" \
      --out "$OUT/long_spec_round_$len.json" 2>&1 | tee -a "$OUT/long.log" | tail -n 4
    record "long spec_round prompt $len" "${PIPESTATUS[0]}" "${LONG_TIMEOUT:-200}"
  done
fi

if has graphs; then
  timeout "${GRAPHS_TIMEOUT:-240}" $PY benchmarks/engine/bench_graphs.py --out "$OUT/graphs.json" >"$OUT/graphs.log" 2>&1
  rc=$?
  record graphs "$rc" "${GRAPHS_TIMEOUT:-240}" "$(tail -n 1 "$OUT/graphs.log")"
fi

has gemv && bench gemv kernels/bench_gemv.py 240
has argmax && bench argmax kernels/bench_argmax.py 120

if has skinny; then
  timeout "${SKINNY_TIMEOUT:-300}" $PY benchmarks/kernels/bench_skinny_gemm.py --out "$OUT/skinny.json" ${SKINNY_ARGS:-} 2>&1 \
    | tee "$OUT/skinny.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && $PY benchmarks/kernels/bench_skinny_gemm.py --table-from "$OUT/skinny.json" 2>&1 | tee -a "$OUT/skinny.log"
  record skinny "$rc" "${SKINNY_TIMEOUT:-300}"
fi

has attention && bench attention kernels/bench_attention.py 240

if has tune; then
  timeout "${TUNE_TIMEOUT:-240}" $PY benchmarks/kernels/tune_acceptance.py --out "$OUT/tune.json" ${TUNE_ARGS:-} 2>&1 \
    | tee "$OUT/tune.log" | tail -n 12
  record tune "${PIPESTATUS[0]}" "${TUNE_TIMEOUT:-240}"
fi

# After tune (when both run): the benchmark uses the shape the tune found best.
if has acceptance; then
  cfg=()
  [ -f "$OUT/tune.json" ] && cfg=(--stats-config "$($PY -c 'import json,sys; b=json.load(open(sys.argv[1]))["best"]
print(",".join(str(b[k]) for k in ("tile","vec","warps","maxnreg")))' "$OUT/tune.json")")
  timeout "${ACCEPTANCE_TIMEOUT:-240}" $PY benchmarks/kernels/bench_acceptance.py --out "$OUT/acceptance.json" "${cfg[@]}" \
    2>&1 | tee "$OUT/acceptance.log"
  record acceptance "${PIPESTATUS[0]}" "${ACCEPTANCE_TIMEOUT:-240}" "${cfg[*]}"
fi

if has step; then
  steps=()
  for spec in ${STEP_RUNS:-1 1::sync 16 1:32768}; do
    IFS=: read -r bs len mode <<<"$spec"
    args=()
    [ -n "$len" ] && args+=("\"max_model_len\": $len")
    [ "$mode" = sync ] && args+=("\"async_scheduling\": false")
    spec=()
    if [[ "$mode" == spec* || "$mode" == ahead* ]]; then  # speculative steps; ahead: forward 1 runs ahead
      spec=(--spec "${mode##*[a-z]}" --device-phases)
      args+=("\"async_scheduling\": $([[ "$mode" == ahead* ]] && echo true || echo false)")
    fi
    [[ "$mode" == switch* ]] && spec=(--spec "${mode#switch}" --switch "${SWITCH_PLAIN:-24}" --steps 10 --warmup 2)
    name="step_${#steps[@]}_${bs}_${len:-short}${mode:+_$mode}"  # a run listed twice keeps both files
    timeout "${STEP_TIMEOUT:-150}" $PY benchmarks/engine/profile_step.py --batch "$bs" "${spec[@]}" ${STEP_ARGS:-} \
      --engine-args "{$(IFS=,; echo "${args[*]}")}" --out "$OUT/$name.json" 2>&1 | tee -a "$OUT/step.log" | tail -n 21
    record "step batch $bs max_model_len ${len:-short} ${mode:-async}" "${PIPESTATUS[0]}" "${STEP_TIMEOUT:-150}"
    steps+=("$OUT/$name.json")
  done
  # One file back instead of one per run (at most 8 files come back).
  $PY -c 'import json,sys; json.dump([json.load(open(f)) for f in sys.argv[2:]], open(sys.argv[1], "w"), indent=1)' \
    "$OUT/step.json" "${steps[@]}" 2>/dev/null && rm -f "${steps[@]}"
fi

has host && bench host engine/host_noise.py 150 "--seconds 30"

if has drafts; then
  work=/tmp/toy-drafts
  mkdir -p "$work"
  names=()
  for spec in ${DRAFTS:-"d3-250:250"}; do
    IFS=: read -r name steps bias <<<"$spec"
    timeout 120 $PY -m thinkspec.toy.train --role draft --tokenizer thinkspec/assets/toy-reasoner/target \
      --out "$work/$name" --num-layers 3 --hidden-size 160 --num-heads 5 --head-dim 32 \
      --intermediate-size 480 --steps "$steps" --batch-size 40 --seq-len 2048 --max-positions 2048 \
      --mix range --samples 40000 --lr 2e-3 --warmup-steps 50 --log-every 100 --seed 1 \
      --fork-bias "${bias:-0}" >>"$OUT/drafts.log" 2>&1
    rc=$?
    record "draft $name" "$rc" 120
    [ "$rc" -eq 0 ] && names+=("$name")
    # Later stages see the new drafts next to the bundled ones.
    [ -d "$work/$name" ] && cp -r "$work/$name" "thinkspec/assets/toy-reasoner/$name"
  done
  [ ${#names[@]} -gt 0 ] && tar -C "$work" -cf "$OUT/drafts.tar" "${names[@]}"
  note "drafts: trained ${names[*]:-none}"
  if [ ${#names[@]} -gt 0 ]; then
    args=()
    for name in draft "${names[@]}"; do args+=(--draft "thinkspec/assets/toy-reasoner/$name"); done
    timeout "${ANALYZE_TIMEOUT:-300}" $PY -m thinkspec.toy.analyze --target thinkspec/assets/toy-reasoner/target \
      "${args[@]}" --n "${ANALYZE_N:-300}" --relax 0.1,8 --relax 0.3,3 --json "$OUT/analyze.json" \
      >>"$OUT/drafts.log" 2>&1
    rc=$?
    record analyze "$rc" "${ANALYZE_TIMEOUT:-300}"
    tail -n $(( ${#names[@]} + 3 )) "$OUT/drafts.log" | tee -a "$summary"
  fi
fi

if has toy; then
  timeout "${TOY_TIMEOUT:-240}" $PY benchmarks/toy/toy_quality.py --num-problems "${TOY_N:-500}" \
    --drafts "${TOY_DRAFTS:-draft}" --relax "${TOY_RELAX:-0.3:3,0.1:8}" --device cuda \
    --max-num-seqs 256 --out "$OUT/toy_quality.json" 2>&1 | grep -v 'it/s]' | tee "$OUT/toy_quality.log"
  record toy "${PIPESTATUS[0]}" "${TOY_TIMEOUT:-240}"
fi

if has sweep; then
  dir=${SWEEP_DIR:-docs/sweep-toy-h200}
  timeout "${SWEEP_TIMEOUT:-400}" $PY -m thinkspec.entrypoints.cli sweep toy-reasoner --device cuda \
    --num-prompts "${SWEEP_N:-500}" --level "${SWEEP_LEVEL:-easy}" --max-num-seqs 512 --max-num-batched-tokens 8192 \
    --gpu-memory-utilization 0.5 --temperatures "${SWEEP_TEMPS:-0,0.6}" --relax-ratios "${SWEEP_RATIOS:-0.1,0.3,0.6}" \
    --relax-top-ks "${SWEEP_TOPKS:-3,8}" --extra-settings "${SWEEP_EXTRA:-0.3:8:0.2}" --repeats "${SWEEP_REPEATS:-3}" \
    --batch-sizes "${SWEEP_BATCHES:-all}" --accuracy-budget 0.01 --hf-baseline-prompts "${SWEEP_HF:-10}" \
    --output-dir "$dir" --resume ${SWEEP_ARGS:-} 2>&1 | grep -v 'it/s]' >"$OUT/sweep.log"
  record sweep "${PIPESTATUS[0]}" "${SWEEP_TIMEOUT:-400}"
  mkdir -p "$OUT/sweep" && cp "$dir"/* "$OUT/sweep/" 2>/dev/null
fi

if has tp; then
  if [ "${TP_TESTS:-1}" != 0 ]; then
    timeout "${TP_TESTS_TIMEOUT:-300}" $PY -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=120 tests/test_tensor_parallel_gpu.py \
      2>&1 | tee "$OUT/tp_tests.log"
    rc=${PIPESTATUS[0]}
    record tp_tests "$rc" "${TP_TESTS_TIMEOUT:-300}" \
      "$(grep -E '(passed|failed|error|no tests ran)' "$OUT/tp_tests.log" | tail -1)"
  fi
  timeout "${TP_TIMEOUT:-1500}" $PY benchmarks/engine/bench_tp.py --tp "${TP_SIZE:-2}" --out "$OUT/tp.json" ${TP_ARGS:-} \
    2>&1 | tee "$OUT/tp.log"
  record tp "${PIPESTATUS[0]}" "${TP_TIMEOUT:-1500}"
fi

if [ ${#failed[@]} -gt 0 ]; then
  note "FAILED: ${#failed[@]} stage(s): $(IFS=,; echo "${failed[*]}")"
else
  note "all stages ok"
fi

# At most 8 files come back: logs travel as one archive.
logs=("$OUT"/*.log)
if [ -e "${logs[0]}" ]; then
  tar -C "$OUT" -cf "$OUT/logs.tar" $(cd "$OUT" && ls *.log) && keep_logs=("${logs[@]}")
fi

echo
echo "==== summary ===="
cat "$summary"
for f in host spec_round projection adaptive throughput gemv argmax skinny attention acceptance step toy_quality sweep tp; do
  [ -f "$OUT/$f.log" ] && { echo "--- $f"; tail -n 16 "$OUT/$f.log"; }
done
[ -n "${keep_logs:-}" ] && rm -f "${keep_logs[@]}"
[ ${#failed[@]} -eq 0 ]
