#!/usr/bin/env bash
# Device calls for a whole check, logs under $OUT (or ./device_logs). Two parts, each fits in
# one 10-minute call:
#   bash benchmarks/device_check.sh tests   every GPU test: the cutile half and the layer half run
#                                           as two processes side by side (compiling is CPU-bound),
#                                           each stopped with SIGINT at its limit so pytest still
#                                           prints its summary
#   bash benchmarks/device_check.sh bench   stage timings of the plain op, then the layer benchmark
#   bash benchmarks/device_check.sh ab      2 or 4 GPUs: every GPU test on GPUs 1-3 (or all on GPU 1);
#                                           on GPU 0, pinned to cores 0-7 so that timing never shares a
#                                           CPU with a compiler (NOTES.md, experiment 17), the stages
#                                           against benchmarks/variants/_baseline (when present), then
#                                           a profile of the layer op's first call
#   bash benchmarks/device_check.sh x4      everything on a 4-GPU machine in one call (kind
#                                           nvidia-h200-x4), one job per GPU so that timings never
#                                           share a GPU: 0 host profile, main command, grid benchmark
#                                           with the peers; 1 and 2 the two test halves; 3 the layer
#                                           benchmark, then tilegym's own op on the source config
#   bash benchmarks/device_check.sh x2      the final figures on a 2-GPU machine (nvidia-h200-x2), one
#                                           timing job per GPU: 0 the grid with the peers; 1 tilegym's
#                                           op next to ours on the 2.7B layer, group scores
#                                           on/off, first calls with empty caches
#   bash benchmarks/device_check.sh profile 2 GPUs: every GPU test on GPU 1; on GPU 0 first calls with
#                                           empty caches (profiled), whole rows against segments, the
#                                           compute_out prefetch variants (NOTES.md, plan)
# e.g. run(command="source .device/setup.sh && bash benchmarks/device_check.sh tests", carry=[".device"])
set -u
out=${OUT:-device_logs}; mkdir -p "$out"
case "${1:-tests}" in
tests)
  limit=${LIMIT_S:-540}
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_cutile.log" 2>&1 &
  first=$!
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_layer_cutile_gpu.py tests/test_layer_gpu.py \
    tests/test_main.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_layer.log" 2>&1
  wait "$first"
  for log in "$out"/gpu_cutile.log "$out"/gpu_layer.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -15
  done
  ;;
bench)
  timeout 200 python3 -m tilegym_mamba2 bench --only --stages --json "$out/stages.json" > "$out/stages.log" 2>&1
  grep whole_call "$out/stages.log" | cut -c1-140
  timeout 330 python3 -m tilegym_mamba2 bench --layer --json "$out/layer.json" > "$out/layer.log" 2>&1
  tail -8 "$out/layer.log"
  ;;
x4)
  limit=${LIMIT_S:-540}
  CUDA_VISIBLE_DEVICES=1 timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile -p no:cacheprovider \
    --tb=short -rfE > "$out/gpu_cutile.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=2 timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_layer_cutile_gpu.py \
    tests/test_layer_gpu.py tests/test_main.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_layer.log" 2>&1 &
  (export CUDA_VISIBLE_DEVICES=3
   timeout 200 python3 -m tilegym_mamba2 bench --layer --json "$out/layer.json" > "$out/layer.log" 2>&1
   timeout $((limit - 210)) python3 -m tilegym_mamba2 bench --only tilegym --tilegym-shapes 1 \
     --json "$out/tilegym.json" > "$out/tilegym.log" 2>&1) &
  export CUDA_VISIBLE_DEVICES=0
  timeout 60 python3 benchmarks/variants/host_profile.py > "$out/host_profile.log" 2>&1
  timeout 60 python3 -m tilegym_mamba2 > "$out/main_run.log" 2>&1
  timeout $((limit - 130)) python3 -m tilegym_mamba2 bench --grid --only mamba_ssm fla --json "$out/grid.json" \
    --png "$out/grid.png" > "$out/grid.log" 2>&1
  wait
  for log in "$out"/gpu_cutile.log "$out"/gpu_layer.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -15
  done
  grep -E "us host|layer op" "$out/host_profile.log"; tail -3 "$out/main_run.log"
  grep -A12 "^| B, T" "$out/grid.log"; tail -6 "$out/layer.log"; tail -4 "$out/tilegym.log"
  ;;
ab)
  limit=${LIMIT_S:-480}
  gpu_test() {  # GPU, cores, seconds, log, test paths...
    local gpu=$1 cores=$2 secs=$3 log=$4; shift 4
    CUDA_VISIBLE_DEVICES=$gpu taskset -c "$cores" timeout -s INT "$secs" python3 -m pytest -q -m gpu "$@" \
      -p no:cacheprovider --tb=short -rfE > "$out/$log" 2>&1
  }
  # 4 GPUs: one test job per GPU 1-3; 2 GPUs: all three on GPU 1 (compiling is CPU-bound). Cores
  # 0-7 stay with the timing jobs on GPU 0, the rest are split between the three test jobs.
  if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then gpus=(1 2 3); else gpus=(1 1 1); fi
  share=$((($(nproc) - 8) / 3))
  cores() { echo "$((8 + $1 * share))-$((7 + ($1 + 1) * share))"; }
  gpu_test "${gpus[0]}" "$(cores 0)" "$limit" gpu_cutile.log tests/cutile &
  gpu_test "${gpus[1]}" "$(cores 1)" "$limit" gpu_layer_cutile.log tests/test_layer_cutile_gpu.py &
  gpu_test "${gpus[2]}" "$(cores 2)" "$limit" gpu_layer.log tests/test_layer_gpu.py tests/test_main.py &
  export CUDA_VISIBLE_DEVICES=0
  if [ -d benchmarks/variants/_baseline ]; then
    taskset -c 0-7 timeout $((limit - 100)) python3 benchmarks/variants/ab_stages.py > "$out/ab_stages.log" 2>&1
  fi
  TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) taskset -c 0-7 timeout 90 python3 benchmarks/variants/first_call.py \
    layer --profile > "$out/first_call.log" 2>&1
  wait
  for log in "$out"/gpu_*.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -15
  done
  grep -h -E "^\(|^  " "$out/ab_stages.log" 2>/dev/null; grep -E "call" "$out/first_call.log" | head -3
  ;;
x2)
  # GPU 0, cores 0-7: the grid with the peers. GPU 1, cores 8-31:
  # tilegym's op next to ours on the 2.7B layer (its autotune alone takes ~250 s), group scores
  # on/off on the whole op, then first calls in fresh processes with empty caches.
  limit=${LIMIT_S:-540}
  (export CUDA_VISIBLE_DEVICES=1
   taskset -c 8-31 timeout 320 python3 -c "from tilegym_mamba2 import bench; \
bench.run(shapes=[bench.ANCHOR_SHAPES[1]], only=['tilegym'], out_json='$out/tilegym.json')" > "$out/tilegym.log" 2>&1
   taskset -c 8-15 timeout 90 python3 benchmarks/variants/group_scores_op.py > "$out/group_scores_op.log" 2>&1
   kernels=$(mktemp -d)
   for mode in plain layer unseen; do  # unseen reuses plain's compiled kernels, as a user's new shape does
     [ "$mode" = layer ] && dir=$(mktemp -d) || dir=$kernels
     CUDA_TILE_CACHE_DIR=$dir TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) taskset -c 8-15 timeout 35 \
       python3 benchmarks/variants/first_call.py $mode 2>&1 | grep -v -i warn
   done > "$out/first_call.log") &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-7 timeout $((limit - 20)) python3 -m tilegym_mamba2 bench --grid --only mamba_ssm fla \
    --json "$out/grid.json" --png "$out/grid.png" > "$out/grid.log" 2>&1
  wait
  grep -A12 "^| B, T" "$out/grid.log"; tail -4 "$out/tilegym.log"
  cat "$out/group_scores_op.log" "$out/first_call.log" | grep -E "chosen|call"
  ;;
profile)
  # GPU 1: every GPU test, three processes on cores 8-31. GPU 0, cores 0-7: first calls in fresh
  # processes (empty caches; unseen reuses plain's compiled kernels), whole rows against segments,
  # then compute_out_prefetch.py.
  limit=${LIMIT_S:-540}
  gpu_test() {  # cores, log, test paths...
    local cores=$1 log=$2; shift 2
    CUDA_VISIBLE_DEVICES=1 taskset -c "$cores" timeout -s INT "$limit" python3 -m pytest -q -m gpu "$@" \
      -p no:cacheprovider --tb=short -rfE > "$out/$log" 2>&1
  }
  gpu_test 8-15 gpu_cutile.log tests/cutile &
  gpu_test 16-23 gpu_layer_cutile.log tests/test_layer_cutile_gpu.py &
  gpu_test 24-31 gpu_layer.log tests/test_layer_gpu.py tests/test_main.py &
  export CUDA_VISIBLE_DEVICES=0
  kernels=$(mktemp -d)
  for run in "plain" "unseen --profile" "layer --profile"; do
    [ "${run%% *}" = layer ] && dir=$(mktemp -d) || dir=$kernels
    CUDA_TILE_CACHE_DIR=$dir TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) taskset -c 0-7 timeout 80 \
      python3 benchmarks/variants/first_call.py $run > "$out/first_${run%% *}.log" 2>&1
  done
  taskset -c 0-7 timeout 150 python3 benchmarks/variants/whole_rows.py > "$out/whole_rows.log" 2>&1
  taskset -c 0-7 timeout 150 python3 benchmarks/variants/compute_out_prefetch.py > "$out/prefetch.log" 2>&1
  wait
  for log in "$out"/gpu_*.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -15
  done
  grep -h "call" "$out"/first_*.log | grep -v -i warn | head -3
  grep -v -i warn "$out/whole_rows.log" "$out/prefetch.log"
  ;;
*) echo "usage: $0 tests|bench|x4|ab|x2|profile" >&2; exit 2 ;;
esac
