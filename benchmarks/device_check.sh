#!/usr/bin/env bash
# One device call that runs every GPU test, the stage timings and the layer benchmark, logs under $OUT (or ./device_logs).
# Compilation is CPU-bound, so the two halves of the GPU tests run as two processes side by side;
# each is stopped with SIGINT at its time limit so pytest still prints its summary.
#   run(command="source .device/setup.sh && bash benchmarks/device_check.sh", carry=[".device"])
set -u
out=${OUT:-device_logs}; mkdir -p "$out"
limit=${LIMIT_S:-420}
timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile -p no:cacheprovider --tb=short -rfE \
  > "$out/gpu_cutile.log" 2>&1 &
first=$!
timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_layer_cutile_gpu.py tests/test_layer_gpu.py \
  -p no:cacheprovider --tb=short -rfE > "$out/gpu_layer.log" 2>&1
wait "$first"
for log in "$out"/gpu_cutile.log "$out"/gpu_layer.log; do
  echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -15
done
timeout 120 python3 -m tilegym_mamba2 bench --only --stages --json "$out/stages.json" > "$out/stages.log" 2>&1
grep whole_call "$out/stages.log" | cut -c1-140
timeout 200 python3 -m tilegym_mamba2 bench --layer --json "$out/layer.json" > "$out/layer.log" 2>&1
tail -8 "$out/layer.log"
