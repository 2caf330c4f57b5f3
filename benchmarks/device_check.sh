#!/usr/bin/env bash
# Device calls for a whole check, logs under $OUT (or ./device_logs). Two parts, each fits in
# one 10-minute call:
#   bash benchmarks/device_check.sh tests   every GPU test: the cutile half and the layer half run
#                                           as two processes side by side (compiling is CPU-bound),
#                                           each stopped with SIGINT at its limit so pytest still
#                                           prints its summary
#   bash benchmarks/device_check.sh bench   stage timings of the plain op, then the layer benchmark
#   bash benchmarks/device_check.sh x4      everything on a 4-GPU machine in one call (kind
#                                           nvidia-h200-x4), one job per GPU so that timings never
#                                           share a GPU: 0 host profile, main command, grid benchmark
#                                           with the peers; 1 and 2 the two test halves; 3 the layer
#                                           benchmark, then tilegym's own op on the source config
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
*) echo "usage: $0 tests|bench|x4" >&2; exit 2 ;;
esac
