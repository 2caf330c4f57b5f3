#!/usr/bin/env bash
# GPU checks, run on the GPU machine from the repository root:
#
#     source .device/setup.sh && bash benchmarks/device_check.sh MODE
#
#   tests     every GPU test (python -m pytest -q -m gpu tests), as two processes side by side
#             (compiling kernels is CPU-bound), split by TESTS_K
#   backward  the backward's GPU tests (-k "backward or chunk_states_walk"), then bench --backward
#   bench     bench --only mamba_ssm fla (the plain op on the anchor shapes), then bench --layer
#   serving   the serving GPU tests (-k "serving or state_update or conv1d"), then bench --serving
#   decode    the decode-graph GPU tests (Mamba2 and the hybrids), then bench --serving
#             --decode-graphs for each model in MODELS (default: mamba2 and every hybrid of
#             bench/decode.py; past ten minutes: give two or three per call)
#   memcheck  compute-sanitizer --tool memcheck on a few small GPU tests (MEMCHECK_K)
#   all       tests, then bench
#
# Every mode but `all` (and `decode` with every model) runs in under ten minutes. Logs, JSON and plots go to ${OUT:-device-out}/;
# each step prints its log's summary, and the script exits non-zero if any step failed.
# Settings (environment): LIMIT_S seconds per pytest run (stopped with SIGINT, so pytest still
# prints its summary), BENCH_S seconds per bench run, PEERS bench --backward's peers (default
# mamba_ssm; tilegym's own op autotunes for minutes per shape), TESTS_K and MEMCHECK_K the -k
# selections (defaults in the script).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
self=benchmarks/device_check.sh
out=${OUT:-device-out}
mkdir -p "$out"
export HF_HUB_OFFLINE=1                               # the GPU machine has no network
export TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors.log"  # the backward tests log each checked gradient
TESTS_K=${TESTS_K:-backward or chunk_states_walk or serving or state_update or conv1d}
MEMCHECK_K=${MEMCHECK_K:-no_initial_state or non_contiguous or state_update_options or conv_initial_and_final or (walk and 200-2-4-16-32)}
status=0

if ! python3 -c "import cuda.tile, tilegym_mamba2" 2>/dev/null; then
  echo "cuda.tile or tilegym_mamba2 does not import: run 'source .device/setup.sh' first" >&2
  exit 2
fi

gpu_tests() {  # gpu_tests NAME LIMIT [pytest args]: GPU tests under tests/ to $out/NAME.log
  local name=$1 limit=$2; shift 2
  timeout -s INT -k 60 "${LIMIT_S:-$limit}" python3 -m pytest -q -m gpu tests -p no:cacheprovider \
    --tb=short -rfE "$@" > "$out/$name.log" 2>&1
}
summary() {  # summary LOG...: each pytest log's failures and its last lines
  for log in "$@"; do
    echo "== $log"
    grep -E "^(FAILED|ERROR)|passed|failed|no tests ran|Interrupt|ERROR SUMMARY" "$log" | tail -15 | cut -c1-300
  done
}
run_tests() {  # run_tests NAME LIMIT [pytest args]: gpu_tests, then its summary
  gpu_tests "$@" || status=1
  summary "$out/$1.log"
}
bench() {  # bench NAME LIMIT [bench args]: python -m tilegym_mamba2 bench to $out/NAME.log, .json
  local name=$1 limit=$2; shift 2
  timeout -k 30 "${BENCH_S:-$limit}" python3 -m tilegym_mamba2 bench "$@" --json "$out/$name.json" \
    > "$out/$name.log" 2>&1 || status=1
  echo "== $out/$name.log"
  grep -vi "warn" "$out/$name.log" | tail -25 | cut -c1-300
}

case "${1:-}" in
tests)
  gpu_tests gpu_tests_a 540 -k "$TESTS_K" &
  first=$!
  gpu_tests gpu_tests_b 540 -k "not ($TESTS_K)" || status=1
  wait "$first" || status=1
  summary "$out/gpu_tests_a.log" "$out/gpu_tests_b.log"
  ;;
backward)
  run_tests gpu_backward 330 -k "backward or chunk_states_walk"
  bench backward 220 --backward --only ${PEERS:-mamba_ssm}
  ;;
bench)
  bench bench 240 --only mamba_ssm fla
  bench layer 300 --layer
  ;;
serving)
  run_tests gpu_serving 300 -k "serving or state_update or conv1d"
  bench serving 240 --serving --png "$out/serving.png"
  ;;
decode)
  run_tests gpu_decode 240 -k "decode_graph or graph_decoding"
  for model in ${MODELS:-mamba2 nemotron_h bamba granitemoehybrid zamba2}; do
    bench "decode_$model" 300 --serving --decode-graphs --model "$model"
  done
  ;;
memcheck)
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -z "$sanitizer" ]; then
    echo "compute-sanitizer is not on PATH (nor under /usr/local/cuda*/bin): memcheck skipped"
    exit 0
  fi
  # Without PyTorch's caching allocator every tensor is its own allocation, so an access past
  # its end is reported rather than landing in a neighbour's pooled memory.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -s INT -k 60 "${LIMIT_S:-540}" "$sanitizer" --tool memcheck \
    --error-exitcode 99 python3 -m pytest -q -m gpu tests -p no:cacheprovider --tb=short -rfE \
    -k "$MEMCHECK_K" > "$out/memcheck.log" 2>&1 || status=1
  summary "$out/memcheck.log"
  grep -m 20 -E "^========= (Invalid|Program hit|Address|Saved host)" "$out/memcheck.log" | cut -c1-300
  ;;
all)
  bash "$self" tests || status=1
  bash "$self" bench || status=1
  ;;
*)
  sed -e 1d -e '/^[^#]/,$d' -e 's/^# \{0,1\}//' "$self"
  exit 2
  ;;
esac
exit "$status"
