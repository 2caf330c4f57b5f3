#!/usr/bin/env bash
# Device calls for a whole check, logs under $OUT (or ./device_logs). Two parts, each fits in
# one 10-minute call:
#   bash benchmarks/device_check.sh backward the backward's GPU tests and the layer op's, then bench --backward
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
#   bash benchmarks/device_check.sh x2      the final figures on a 2-GPU machine (nvidia-h200-x2), one
#                                           timing job per GPU: 0 GPU tests picked by TESTS_K, the
#                                           grid with the peers, the layer benchmark; 1 tilegym's op
#                                           next to ours on the source config and the 2.7B layer
#   bash benchmarks/device_check.sh explore 2 GPUs: config variants of the whole op on GPU 0 (CONFIG_VARIANTS,
#                                           variants/config_op.py), stage timings on GPU 1
#   bash benchmarks/device_check.sh host    1 GPU: host time per call, plans on and off (experiment 33),
#                                           the host profile, ours on the anchors, the graph-capture tests
#   bash benchmarks/device_check.sh verify  2 GPUs: every GPU test on GPU 1; on GPU 0 cold first calls
#                                           (FIRST_CALL=0: none), the stages against their loads
#                                           (LOAD_FLOOR=1, variants/load_floor.py), then the whole op at
#                                           config variants (CONFIG_VARIANTS, variants/config_op.py)
#   bash benchmarks/device_check.sh serving 1 GPU, under 4 minutes: bench --serving (the decode and prefill-conv
#                                           ops against mamba_ssm, causal_conv1d and HF's torch path, and a
#                                           2-layer HF Mamba-2 patched vs unpatched); serving.json/.png/.log
#   bash benchmarks/device_check.sh walk    1 GPU, ~9 minutes: the walk's tests, every backward GPU test, bench --backward
#   bash benchmarks/device_check.sh split   1 GPU, ~9 minutes: the layer op's backward tests and mamba_ssm's
#                                           gradients after the dy split, then tilegym's backward next to ours
#   bash benchmarks/device_check.sh nineteenth 1 GPU, ~6 minutes: state71, experiment 73 (prefill launches, host floor), autograd_host
#   bash benchmarks/device_check.sh serving71 1 GPU, ~7 minutes: experiments 71 and 73 in the package: serving GPU tests, bench --serving, the prefill, bench --only
#   bash benchmarks/device_check.sh third19 1 GPU, ~9 minutes: forward70, then the tuner's rounds: tuning GPU tests, the prefill, bench --only
#   VARIANT=msum_tma bash benchmarks/device_check.sh race83 1 GPU, ~8 minutes: experiment 81c/d: a TMA-loaded form (dtg_tma, msum_tma); if its bits hold, GPU tests and bench --only with it
#   bash benchmarks/device_check.sh race82 1 GPU, ~5 minutes: experiment 81b: the TMA form's published states per segment, two rearrangements
#   bash benchmarks/device_check.sh race81 1 GPU, ~4 minutes: experiment 81: the TMA-loaded sums' final state called as the GPU tests call it
#   bash benchmarks/device_check.sh race80 1 GPU, ~8 minutes: where the TMA-loaded sums' final state varies (chained_race.py --diagnose), the chained GPU tests not yet run on the trimmed kernel, chained_loads.py --time
#   bash benchmarks/device_check.sh final79 1 GPU, ~5 minutes: experiment 79c: the trimmed chained path's GPU tests, then the prefill cases with TMA sums loads
#   bash benchmarks/device_check.sh fix79 1 GPU, ~6 minutes: experiment 79b (the chained final state's race): variants stressed, the best applied here, GPU tests, timing
#   bash benchmarks/device_check.sh host79 1 GPU, ~7 minutes: experiment 79 (the chained launch's arguments trimmed): its GPU tests, host and GPU time side by side, bench --only
#   bash benchmarks/device_check.sh chained78 1 GPU, ~8 minutes: experiment 78 (the chained one-launch path in the package): its GPU tests, forward and graph tests, bench --only
#   bash benchmarks/device_check.sh chained77 1 GPU, ~3 minutes: experiment 77 (the prefill in one launch, segments chained through memory) checked and timed
#   bash benchmarks/device_check.sh pdl76 1 GPU, ~8 minutes: experiment 76 in the package: its threshold timed, serving and graph GPU tests, bench --serving
#   bash benchmarks/device_check.sh twentieth2 1 GPU, ~9 minutes: state76 again, then layer74 (experiment 74 on the package)
#   bash benchmarks/device_check.sh twentieth 1 GPU, ~9 minutes: state76, then prefill75 (the next session's first call)
#   bash benchmarks/device_check.sh state76 1 GPU, ~2 minutes: experiment 76 (the decode step with programmatic dependent launch) timed, bits checked
#   bash benchmarks/device_check.sh prefill75 1 GPU, ~7 minutes: experiment 75 (the plain op's short rows in one launch): bit-equality and forward GPU tests, the prefill timed, bench --only
#   bash benchmarks/device_check.sh layer74 1 GPU, ~7 minutes: experiment 74 (whole rows for the layer op's short unpacked rows): its prefill timed, layer and HF GPU tests
#   bash benchmarks/device_check.sh consistent72 1 GPU, ~8 minutes: experiment 72 (the gated dy's low half in the reverse walk) timed, per-head errors, tests
#   bash benchmarks/device_check.sh state71 1 GPU, ~2 minutes: experiment 71 (the decode step without TMA) timed, bits checked
#   bash benchmarks/device_check.sh forward70 1 GPU, ~6 minutes: experiment 70 (the forward on tf32 under "high") timed, its tests and the fp32 forward tests
#   bash benchmarks/device_check.sh eighteenth 1 GPU, ~9 minutes: experiment 66 in the package: backward GPU tests, GPU bad-input sweep, bench --backward
#   bash benchmarks/device_check.sh fp32_66 1 GPU, ~5 minutes: experiment 66 with fp32 inputs, each kernel at occupancy 1 and 2
#   bash benchmarks/device_check.sh split69 1 GPU, ~1 minute: experiment 69 (per-head gradients with and without the dy split)
#   bash benchmarks/device_check.sh state67 1 GPU, ~2 minutes: experiment 67 (the decode step on a persistent grid) timed, bits checked
#   bash benchmarks/device_check.sh occupancy66 1 GPU, ~3 minutes: experiment 66 (chunk_grads at occupancy 2) timed, bits compared
#   bash benchmarks/device_check.sh seventeenth 1 GPU, ~9 minutes: experiments 62-64 in the package: per-head gradient
#                                           errors over 32 seeds before/after, backward GPU tests, bench --backward
#   bash benchmarks/device_check.sh bench_backward 1 GPU, ~4 minutes: bench --backward next to mamba_ssm, nothing else
#   bash benchmarks/device_check.sh last16  1 GPU, ~7 minutes: experiment 61 (the walk now), the test next to mamba_ssm
#   bash benchmarks/device_check.sh final16 1 GPU, ~8 minutes: the walk's tests, the tests next to mamba_ssm, bench --backward
#   bash benchmarks/device_check.sh walk60  1 GPU, ~6 minutes: the walk's variants (experiments 58, 60), the tests next to mamba_ssm
#   bash benchmarks/device_check.sh sixteenth 1 GPU, ~5 minutes: walk_hints, then autograd_host (the next session's first call)
#   bash benchmarks/device_check.sh autograd_host 1 GPU, ~2 minutes: experiment 59 (the autograd step's host time, split up)
#   bash benchmarks/device_check.sh walk_hints 1 GPU, ~3 minutes: experiment 58 (latency hints on the walk's loop loads) timed
#   bash benchmarks/device_check.sh dd_trace 1 GPU, ~8 minutes: experiment 56 (dd per head as a trace) timed, the backward
#                                           GPU tests that reach it, host against GPU time (logs in logs.tgz)
#   bash benchmarks/device_check.sh dd_fused 1 GPU, ~9 minutes: experiment 55 (dd in the columns kernel) timed, every
#                                           backward GPU test, host against GPU time
#   bash benchmarks/device_check.sh fifteenth 1 GPU, ~10 minutes: experiment 54's variant timed; the layer op's fp16 / fp32 backward tests, the mamba_ssm
#                                           comparison and state 512 on the two chunk_grads kernels
#   bash benchmarks/device_check.sh tilegym_vs_ours 1 GPU, ~9 minutes: tilegym's backward next to ours in one process
#   bash benchmarks/device_check.sh final14 1 GPU, ~7 minutes: the two chunk_grads kernels against the joint one, the
#                                           autograd tests (mamba_ssm, compile, layer bf16), host against GPU time
#   bash benchmarks/device_check.sh two_kernels 1 GPU, ~9 minutes: experiment 53, chunk_grads as two kernels timed against the
#                                           joint one, the backward's GPU tests, host against GPU time
#   bash benchmarks/device_check.sh fourteenth 1 GPU, ~8 minutes: experiment 51's eager autograd on the GPU: the
#                                           autograd tests (plain op eager + compiled, layer op bf16 and fp32,
#                                           next to mamba_ssm), then host against GPU time per training step
#   bash benchmarks/device_check.sh final13 1 GPU, ~9 minutes: the autograd+compile and state-512 tests, a cold
#                                           2.7B first call (forward and backward timed apart), then tilegym's
#                                           backward next to ours (BENCH_S seconds)
#   bash benchmarks/device_check.sh thirteenth 1 GPU, ~7 minutes: the backward tests left from the twelfth session,
#                                           then which kernels the 2.7B call compiles after the source config's
#   bash benchmarks/device_check.sh twelfth 1 GPU, ~9 minutes: the next session's first call (experiments 45-47:
#                                           the chunk-state walk, tilegym's backward timed, the first call's
#                                           compiles side by side; then the layer op's fp16 cases)
# e.g. run(command="source .device/setup.sh && bash benchmarks/device_check.sh tests", carry=[".device"])
set -u
out=${OUT:-device_logs}; mkdir -p "$out"

test_summaries() {  # each pytest log's failures and its last line
  for log in "$@"; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|^E  |passed|failed|Interrupt" "$log" | tail -8 | cut -c1-400
  done
}
backward_tests() {  # backward_tests NAME EXPR: tests/test_backward_gpu.py -k EXPR to gpu_backward_NAME.log, under $limit
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_$1.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "$2" -p no:cacheprovider --tb=short -rfE > "$out/gpu_backward_$1.log" 2>&1
}
host_vs_gpu() {  # host_vs_gpu NAME: variants/host_vs_gpu_backward.py to host_vs_gpu_NAME.log, its bench lines
  timeout 80 python3 benchmarks/variants/host_vs_gpu_backward.py > "$out/host_vs_gpu_$1.log" 2>&1
  grep -E " bench |Error" "$out/host_vs_gpu_$1.log" | cut -c1-200
}
four_test_processes() {  # four_test_processes EXPR: the plain op; EXPR (next to mamba_ssm, ...); layer fp32; bf16 + compile
  backward_tests plain "chunk_backward_matches" &
  backward_tests a "$1" &
  backward_tests b "layer_autograd and dtype1" &
  backward_tests c "(layer_autograd and dtype0) or compile"
  wait
  test_summaries "$out"/gpu_backward_plain.log "$out"/gpu_backward_[abc].log
}
apply_once() {  # apply_once PATCH: applies a prepared patch unless the tree has it already
  if git apply --reverse --check "$1" 2>/dev/null || patch -p1 -R --dry-run -s -f < "$1" > /dev/null 2>&1; then
    echo "$1: already applied"; return 0
  fi
  git apply "$1" 2>/dev/null || patch -p1 -s < "$1" || { echo "$1 did not apply"; return 1; }
}
decode_variants() {  # decode_variants NAME SCRIPT SECONDS: a decode-step variant script at batch 1 / 8 / 64 / 256
  (cd benchmarks/variants && timeout "$3" python3 "$2" 1 8 64 256) > "$out/$1.log" 2>&1
  grep -vE "Warn|warn|^ +" "$out/$1.log" | cut -c1-200
}
prefill_and_bench() {  # experiment 73's prefill against the launch floor, then bench --only (its rows)
  timeout 100 python3 benchmarks/variants/prefill_launches.py > "$out/prefill_launches.log" 2>&1
  grep -vE "Warn|warn" "$out/prefill_launches.log" | cut -c1-220
  bench_only
}
bench_only() {  # bench --only on this process's tuning cache: its rows and the tuner's choices
  timeout 130 python3 -m tilegym_mamba2 bench --only --json "$out/bench.json" > "$out/bench.log" 2>&1
  grep -E "^\(|tuning|->" "$out/bench.log" | cut -c1-200
}
chained_tests() {  # chained_tests LIMIT LOG [pytest args]: the chained path's GPU tests to LOG, stopped at LIMIT s
  local limit=$1 log=$2; shift 2
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_chained_prefill_gpu.py -p no:cacheprovider \
    --tb=short -rfE "$@" > "$out/$log" 2>&1
  test_summaries "$out/$log"
}
archive_logs() {  # one file back: the device tool brings back at most 8
  tar -C "$out" -czf /tmp/logs.tgz . && find "$out" -name "*.log" -delete && mv /tmp/logs.tgz "$out/"
}
case "${1:-tests}" in
race83)
  # Experiment 81c/d (~8 minutes): a form of the TMA-loaded chained kernel (VARIANT: dtg_tma, step 1's
  # dt gathered; msum_tma, step 1's decay sums as masked row sums) checked as the GPU tests call it;
  # where no repeat differs, it replaces the package module here, then every chained GPU test and
  # bench --only.
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  variant=${VARIANT:-dtg_tma}
  VARIANTS=$variant TRIALS=${TRIALS:-20} timeout -s INT 200 python3 benchmarks/variants/chained_race.py --diagnose > "$out/chained_race_$variant.log" 2>&1
  echo "exit $?" >> "$out/chained_race_$variant.log"
  grep -vE "Warn|warn" "$out/chained_race_$variant.log" | cut -c1-260 | grep -E "^##|exit|Error|call 0" | tail -30
  if grep -q "repeats differing from the trial's first call 0;" "$out/chained_race_$variant.log"; then
    python3 benchmarks/variants/chained_race.py --write "$variant" 2>&1 | grep -v -i warn
    chained_tests "${LIMIT_S:-200}" gpu_chained.log
    bench_only
  fi
  archive_logs
  ;;
race82)
  # Experiment 81b (~5 minutes): where the TMA form's final state varies along the chain (published
  # states per segment), and two rearrangements (final state stored last; one paired sums load).
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  TRIALS=${TRIALS:-20} timeout -s INT 400 python3 benchmarks/variants/chained_race.py --diagnose > "$out/chained_race82.log" 2>&1
  echo "exit $?" >> "$out/chained_race82.log"
  grep -vE "Warn|warn" "$out/chained_race82.log" | cut -c1-260 | grep -E "^##|exit|Error|call 0" | tail -40
  archive_logs
  ;;
race81)
  # Experiment 81 (~4 minutes): the TMA-loaded sums' final state, called as the GPU tests call it
  # (variants/chained_race.py --diagnose: fresh inputs per trial, poisoned outputs, against ordinary loads).
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  TRIALS=${TRIALS:-24} timeout -s INT 300 python3 benchmarks/variants/chained_race.py --diagnose > "$out/chained_race81.log" 2>&1
  echo "exit $?" >> "$out/chained_race81.log"
  grep -vE "Warn|warn" "$out/chained_race81.log" | cut -c1-300 | tail -60
  archive_logs
  ;;
race80)
  # The next session's first call (~3 minutes): where the TMA-loaded sums' final state varies
  # (variants/chained_race.py --diagnose, outputs poisoned), then the rest of the chained GPU tests.
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  CALLS=${CALLS:-30} timeout -s INT 200 python3 benchmarks/variants/chained_race.py --diagnose > "$out/chained_race80.log" 2>&1
  echo "exit $?" >> "$out/chained_race80.log"
  grep -vE "Warn|warn" "$out/chained_race80.log" | cut -c1-260
  chained_tests "${LIMIT_S:-200}" gpu_chained.log -k "4095 or 1-1-1 or 300 or streams or settled"
  timeout -s INT 150 python3 benchmarks/variants/chained_loads.py --time > "$out/chained_loads80.log" 2>&1
  grep -vE "Warn|warn" "$out/chained_loads80.log" | cut -c1-220
  archive_logs
  ;;
final79)
  # Experiment 79c (~5 minutes): every GPU test of the chained path with its launch trimmed (ordinary sums loads),
  # then the prefill cases again with the sums loaded through TMA but the fence where experiment 78 had it.
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  chained_tests "${LIMIT_S:-150}" gpu_chained.log
  sed -i 's/(1, 1, 1, chunk_size), allow_tma=False).reshape/(1, 1, 1, chunk_size)).reshape/' tilegym_mamba2/cutile/chained_prefill.py
  grep -c "allow_tma=False" tilegym_mamba2/cutile/chained_prefill.py
  chained_tests 90 gpu_chained_tma_loads.log -k "2048 or streams or settled"
  archive_logs
  ;;
fix79)
  # Experiment 79b (~6 minutes): which TMA store makes the chained final state vary (variants/chained_race.py);
  # the fastest variant without a mismatch replaces the package module here, then its GPU tests and timing.
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  timeout -s INT 200 python3 benchmarks/variants/chained_race.py --apply > "$out/chained_race79.log" 2>&1
  echo "exit $?" >> "$out/chained_race79.log"
  grep -vE "Warn|warn" "$out/chained_race79.log" | cut -c1-220
  chained_tests "${LIMIT_S:-220}" gpu_chained.log
  timeout -s INT 120 python3 benchmarks/variants/chained_host.py "(1,2048,1,32,128,64)" > "$out/chained_host79.log" 2>&1
  grep -vE "Warn|warn" "$out/chained_host79.log" | cut -c1-220
  archive_logs
  ;;
host79)
  # Experiment 79 (~7 minutes): the chained path with 18 launch arguments (was 21): its GPU tests,
  # then its host and GPU time next to the four-launch path and experiment 77's kernel in one
  # process (variants/chained_host.py), then bench --only on a fresh tuning cache.
  limit=${LIMIT_S:-300}
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  chained_tests "$limit" gpu_chained.log
  timeout -s INT 170 python3 benchmarks/variants/chained_host.py > "$out/chained_host79.log" 2>&1
  echo "exit $?" >> "$out/chained_host79.log"
  grep -vE "Warn|warn" "$out/chained_host79.log" | cut -c1-220
  bench_only
  archive_logs
  ;;
chained78)
  # Experiment 78, experiment 77's chain in the package (~8 minutes): the one-launch path's GPU
  # tests, the plain op's forward tests and the graph tests with a fresh tuning cache (short
  # 16-bit rows may now pick it), then bench --only.
  limit=${LIMIT_S:-170}
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  chained_tests "$limit" gpu_chained.log
  timeout -s INT 200 python3 -m pytest -q -m gpu tests/cutile/test_cutile_gpu.py tests/cutile/test_cutile_graph_gpu.py \
    -k "forward_matches_reference or graph" -p no:cacheprovider --tb=short -rfE > "$out/gpu_forward.log" 2>&1
  test_summaries "$out/gpu_forward.log"
  bench_only
  archive_logs
  ;;
chained77)
  # Experiment 77 (~3 minutes): the plain op's short rows in one launch with the segments chained
  # through memory (variants/chained_prefill.py): errors against float64 and the package's, then
  # the prefill's host, bench and GPU times against the package. A hang would show as the timeout.
  # CHAINED_ARGS=--timing skips the checks (a fresh machine compiles them for ~4 minutes).
  (cd benchmarks/variants && timeout -s INT "${LIMIT_S:-240}" python3 chained_prefill.py $CHAINED_ARGS) > "$out/chained77.log" 2>&1
  echo "exit $?" >> "$out/chained77.log"
  grep -vE "Warn|warn" "$out/chained77.log" | cut -c1-220
  ;;
pdl76)
  # The twentieth session's third call (~8 minutes), experiment 76 in the package (the decode step
  # launched as a programmatic dependent for small grids): the threshold against the flag at every
  # size and at none, the serving GPU tests, the peers' tests and the graph-capture tests, then
  # bench --serving.
  limit=${LIMIT_S:-200}
  bash "$0" state76
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_serving_gpu.py tests/test_serving_peers_gpu.py \
    tests/cutile/test_cutile_graph_gpu.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_serving.log" 2>&1
  test_summaries "$out/gpu_serving.log"
  bash "$0" serving
  archive_logs
  ;;
twentieth2)
  # The twentieth session's second call (~9 minutes): experiment 76 again (its launch flag now
  # reaches cuTile's own launch), then experiment 74 on the package (experiment 75 not adopted).
  bash "$0" state76
  bash "$0" layer74
  archive_logs
  ;;
twentieth)
  # The next session's first call (~9 minutes): experiment 76 (timings only, the package), then
  # experiment 75's patch through prefill75 (its tests, the prefill timed, bench --only).
  bash "$0" state76
  bash "$0" prefill75
  archive_logs
  ;;
state76)
  # Experiment 76: selective_state_update with programmatic dependent launch, the package's threshold
  # against the flag at every size and at none, and mamba_ssm; CUDA-graph replay, bits checked
  # (~1 minute; run83-run84 timed the kernel text's two edits with the flag everywhere).
  decode_variants state76 state_update_pdl.py 200
  ;;
prefill75)
  # Experiment 75 (a patch on the nineteenth session's package): the plain op on short rows in one
  # launch (prefill.py), a tuning candidate. Its bit-equality tests against the whole-row path,
  # then the cutile forward and graph tests (fresh tuning cache: short rows may now pick it), then
  # the prefill timed against the package's paths and bench --only (~7 minutes). Experiment 74's
  # patch is written on top of this one.
  limit=${LIMIT_S:-240}
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  apply_once benchmarks/variants/experiment75_one_launch_prefill.patch || exit 1
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_cutile_gpu.py tests/cutile/test_cutile_graph_gpu.py \
    -p no:cacheprovider --tb=short -rfE > "$out/gpu_prefill75.log" 2>&1
  test_summaries "$out/gpu_prefill75.log"
  prefill_and_bench
  ;;
layer74)
  # Experiment 74 (a patch on experiment 75's): whole rows offered to the layer
  # op's short unpacked rows, packed calls tuned under keys of their own. The layer op's prefill
  # tuned against the heuristic's segments (fresh tuning cache), then every layer-op GPU test and
  # the HF model's (~7 minutes).
  limit=${LIMIT_S:-300}
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  apply_once benchmarks/variants/experiment74_layer_whole_rows.patch || exit 1
  timeout 150 python3 benchmarks/variants/prefill_launches.py --layer > "$out/layer_prefill.log" 2>&1
  grep -vE "Warn|warn" "$out/layer_prefill.log" | cut -c1-220
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_layer_cutile_gpu.py -p no:cacheprovider \
    --tb=short -rfE > "$out/gpu_layer74.log" 2>&1 &
  HF_HUB_OFFLINE=1 timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_transformers.py -p no:cacheprovider \
    --tb=short -rfE > "$out/gpu_transformers74.log" 2>&1
  wait
  test_summaries "$out"/gpu_layer74.log "$out"/gpu_transformers74.log
  ;;
third19)
  # The nineteenth session's third call (~9 minutes): experiment 70 (forward70), then the tuner's
  # alternating rounds (experiment 73) on a fresh cache: the tuning GPU tests, the prefill against
  # fewer launches, bench --only.
  bash "$0" forward70
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  timeout -s INT 100 python3 -m pytest -q -m gpu tests/cutile/test_cutile_gpu.py -k "tun" -p no:cacheprovider \
    --tb=short -rfE > "$out/gpu_tuning.log" 2>&1
  test_summaries "$out/gpu_tuning.log"
  prefill_and_bench
  archive_logs
  ;;
serving71)
  # The nineteenth session's second call (~7 minutes), a fresh tuning cache: experiment 71 in the
  # package (the decode step's stores off TMA) through the serving GPU tests, the peers' tests and
  # the graph-capture tests, then bench --serving; experiment 73 in the package (whole rows offered
  # to the tuner on short rows): the prefill against the launch floor again, then bench --only.
  limit=${LIMIT_S:-200}
  export TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d)
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_serving_gpu.py tests/test_serving_peers_gpu.py \
    tests/cutile/test_cutile_graph_gpu.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_serving.log" 2>&1
  test_summaries "$out/gpu_serving.log"
  bash "$0" serving
  prefill_and_bench
  archive_logs
  ;;
nineteenth)
  # The nineteenth session's first call (~6 minutes): experiment 71 (the decode step without TMA),
  # experiment 73 (the prefill's host time against fewer launches, and the launch floor), then
  # experiment 59's split of the autograd step's host time on the current package.
  bash "$0" state71
  timeout 150 python3 benchmarks/variants/prefill_launches.py > "$out/prefill_launches.log" 2>&1
  grep -vE "Warn|warn" "$out/prefill_launches.log" | cut -c1-220
  bash "$0" autograd_host
  ;;
consistent72)
  # Experiment 72 (a patch on the eighteenth session's package): the reverse walk takes the gated
  # dy's low half as chunk_grads does. The layer op with z timed before and after, the mixer's
  # per-head gradients over seeds 1-16 after (run71 has them with and without the split, on the
  # same inputs as run67's mamba_ssm), the walk's GPU tests (a new one for the low half), the
  # layer op's bf16 backward tests and the comparison with mamba_ssm (~8 minutes).
  limit=${LIMIT_S:-240}
  timeout 150 python3 benchmarks/variants/packed_backward.py --with-z > "$out/mixer_before.log" 2>&1
  host_vs_gpu before72
  apply_once benchmarks/variants/experiment72_walk_dy_low.patch || exit 1
  timeout 150 python3 benchmarks/variants/packed_backward.py --with-z > "$out/mixer_after.log" 2>&1
  host_vs_gpu after72  # the plain op's walks: their instructions but for parameter addresses
  grep -E " bench |Error" "$out"/mixer_before.log "$out"/mixer_after.log | cut -c1-220
  (cd benchmarks/variants && timeout 100 python3 per_head_grad_seeds.py --seeds 16 > "$out/seeds72.log" 2>&1)
  grep -h summary "$out/seeds72.log" | cut -c1-200
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_chunk_states_walk_gpu.py -p no:cacheprovider \
    --tb=short -rfE > "$out/gpu_walk.log" 2>&1 &
  backward_tests a "mamba_ssm" &
  backward_tests c "(layer_autograd and dtype0) or compile"
  wait
  test_summaries "$out"/gpu_walk.log "$out"/gpu_backward_[ac].log
  archive_logs
  ;;
state71)
  # Experiment 71: selective_state_update with its loads / stores kept off TMA (the small vectors,
  # the state, the stores, all) at 16-, 8- and 4-row tiles, against the package and mamba_ssm,
  # CUDA-graph replay, bits checked (~2 minutes).
  decode_variants state71 state_update_loads.py 240
  ;;
forward70)
  # Experiment 70 (a patch on the eighteenth session's package): the forward's mma on tf32
  # operands for fp32 inputs under PyTorch's "high" matmul precision, as the backward's since
  # experiment 65. fp32 at "high" timed next to bf16 (fp32 at "highest" is run75's: the same
  # machine code, cpu_sm90/machine_code_forward70_*.txt), then the new tests and the fp32
  # forward (CASES dtype11, dtype12, dtype18) and layer tests at the default precision (~6 minutes).
  limit=${LIMIT_S:-240}
  apply_once benchmarks/variants/experiment70_forward_tf32.patch || exit 1
  timeout 200 python3 benchmarks/variants/fp32_backward.py --high-only > "$out/fp32_forward70.log" 2>&1
  grep -E "fwd\+bwd|Error" "$out/fp32_forward70.log" | cut -c1-200
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_cutile_gpu.py -p no:cacheprovider \
    -k "dtype11 or dtype12 or dtype18 or matmul_precision" --tb=short -rfE > "$out/gpu_forward70.log" 2>&1 &
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_layer_cutile_gpu.py -p no:cacheprovider \
    -k "fp32 or matmul_precision" --tb=short -rfE > "$out/gpu_layer70.log" 2>&1
  wait
  test_summaries "$out"/gpu_forward70.log "$out"/gpu_layer70.log
  ;;
eighteenth)
  # The eighteenth session's check of experiment 66 in the package (chunk_grads at occupancy 2):
  # the backward's GPU tests in five processes (plain op + state 512, next to mamba_ssm over 4
  # seeds, the layer op in three dtypes with compile) and the GPU bad-input sweep, then bench --backward.
  limit=${LIMIT_S:-240}
  backward_tests plain "chunk_backward_matches or state_512" &
  backward_tests a "mamba_ssm" &
  backward_tests d "layer_autograd and dtype2" &
  backward_tests b "layer_autograd and dtype1" &
  backward_tests c "(layer_autograd and dtype0) or compile" &
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_bad_input_fuzz.py -p no:cacheprovider \
    --tb=short -rfE > "$out/gpu_fuzz.log" 2>&1
  wait
  test_summaries "$out"/gpu_backward_plain.log "$out"/gpu_backward_[abcd].log "$out"/gpu_fuzz.log
  timeout "${BENCH_S:-270}" python3 -m tilegym_mamba2 bench --backward --only mamba_ssm \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  tail -14 "$out/backward.log"
  archive_logs
  ;;
fp32_66)
  # Experiment 66 with fp32 inputs (their chunk states stay fp32, and run50's rows kernel at
  # occupancy 2 was 1.8x slower so): the package (both kernels at 2) against each at 1 (~5 minutes).
  (cd benchmarks/variants && timeout 380 python3 chunk_grads_split.py --float32 split split_occ1 split_rows_occ1 \
    split_columns_occ1 split) > "$out/fp32_66.log" 2>&1
  grep -E " ms |Error" "$out/fp32_66.log" | cut -c1-300
  ;;
split69)
  # Experiment 69 (a diagnostic): the mixer's per-head gradients over seeds 1-16 with the gated dy
  # as two bf16 terms (the package) and rounded once (as mamba_ssm), ~1 minute.
  (cd benchmarks/variants && timeout 100 python3 per_head_grad_seeds.py --seeds 16 > "$out/with_split.log" 2>&1
   timeout 100 python3 per_head_grad_seeds.py --seeds 16 --without-dy-low > "$out/without_split.log" 2>&1)
  grep -H summary "$out"/with_split.log "$out"/without_split.log | cut -c1-200
  ;;
state67)
  # Experiment 67: selective_state_update on a persistent grid (SMs x 8 or 16 blocks walking
  # 4- to 16-row tiles) against the package and mamba_ssm, CUDA-graph replay, bits checked (~2 minutes).
  decode_variants state67 state_update_persistent.py 200
  ;;
occupancy66)
  # Experiment 66: chunk_grads' two kernels at occupancy 2 (they fit two blocks per SM since the
  # chunk states are 16-bit, cpu_sm90/chunk_grads_occupancy66.log), the whole plain-op backward
  # timed per variant with the kernels' own GPU time and the gradients against the package's
  # (the package timed first and last, for drift), ~3 minutes.
  (cd benchmarks/variants && timeout 280 python3 chunk_grads_split.py split split_occ1 split_columns_occ1 \
    split_rows_occ1 split) > "$out/occupancy66.log" 2>&1
  grep -E " ms |Error" "$out/occupancy66.log" | cut -c1-300
  ;;
seventeenth)
  # The seventeenth session's check of experiments 62-64 in the package: the per-head gradients'
  # errors over 32 seeds before (the sixteenth session's package, .device/before17 =
  # `git archive e73a24a tilegym_mamba2 ops_registry.yaml`, with mamba_ssm's) and after, next to
  # the backward's GPU tests in four processes; then bench --backward alone.
  limit=${LIMIT_S:-240}
  (cd benchmarks/variants && PYTHONPATH="$PWD/../../.device/before17:$PYTHONPATH" timeout 150 \
     python3 per_head_grad_seeds.py --peer > "$out/seeds_before.log" 2>&1
   timeout 80 python3 per_head_grad_seeds.py > "$out/seeds_after.log" 2>&1) &
  backward_tests plain "chunk_backward_matches or state_512" &
  backward_tests d "layer_autograd and dtype2" &
  backward_tests b "layer_autograd and dtype1" &
  backward_tests c "(layer_autograd and dtype0) or compile"
  wait
  grep -h summary "$out"/seeds_*.log
  test_summaries "$out"/gpu_backward_plain.log "$out"/gpu_backward_[bcd].log
  timeout "${BENCH_S:-270}" python3 -m tilegym_mamba2 bench --backward --only mamba_ssm \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  tail -14 "$out/backward.log"
  archive_logs
  ;;
bench_backward)
  # bench --backward next to mamba_ssm alone (its first call autotunes for a minute), ~4 minutes.
  timeout "${BENCH_S:-300}" python3 -m tilegym_mamba2 bench --backward --only mamba_ssm \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  tail -14 "$out/backward.log"
  ;;
last16)
  # Experiment 61 (the walk as it is now, two variants, interleaved rounds, bits checked), then the
  # test next to mamba_ssm alone (final16 reached its third case at the limit).
  limit=${LIMIT_S:-330}
  (cd benchmarks/variants && timeout 150 python3 walk_latency.py package following6 half_tiles) \
    > "$out/walk_now.log" 2>&1
  grep -E " ms |Error|DIFFER" "$out/walk_now.log" | cut -c1-300
  backward_tests a "mamba_ssm"
  test_summaries "$out"/gpu_backward_a.log
  ;;
final16)
  # The walk with latency hints (experiment 58) and the mamba_ssm comparison's per-head floor: the
  # walk's GPU tests and the backward tests next to mamba_ssm, then bench --backward with mamba_ssm.
  limit=${LIMIT_S:-240}
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_chunk_states_walk_gpu.py -p no:cacheprovider \
    --tb=short -rfE > "$out/gpu_walk.log" 2>&1 &
  backward_tests a "mamba_ssm or state_512"
  wait
  test_summaries "$out"/gpu_walk.log "$out"/gpu_backward_a.log
  timeout "${BENCH_S:-240}" python3 -m tilegym_mamba2 bench --backward --only mamba_ssm \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  tail -14 "$out/backward.log"
  ;;
walk60)
  # Experiments 58 and 60: the walk's variants (latency hints, the next chunk's tiles prefetched,
  # the entry state stored without TMA) timed in interleaved rounds, each checked for the package's
  # bits; then the backward GPU tests run59 did not finish on experiment 57 (next to mamba_ssm,
  # state 512 under the backend switch). (Run60's variants are walk_latency.py at f393bf7.)
  limit=${LIMIT_S:-300}
  (cd benchmarks/variants && timeout 200 python3 walk_latency.py) > "$out/walk_variants.log" 2>&1
  grep -E " ms |Error|DIFFER" "$out/walk_variants.log" | cut -c1-300
  backward_tests a "mamba_ssm or state_512"
  test_summaries "$out"/gpu_backward_a.log
  ;;
sixteenth)
  # The sixteenth session's first call (run58): experiments 58 and 59, timings only. Its second
  # (run59) timed experiment 57's patch before and after and ran the backward GPU tests on it: the
  # mode `glue57` at 28f2e02, the patch being in the package since.
  bash "$0" walk_hints
  bash "$0" autograd_host
  ;;
autograd_host)
  # Experiment 59: where the autograd step's extra host time goes (main vs worker thread, the
  # engine alone, a trivial Function on CUDA tensors), source config.
  timeout 200 python3 benchmarks/variants/autograd_host_cost.py > "$out/autograd_host_cost.log" 2>&1
  grep -E "ms/step|Error" "$out/autograd_host_cost.log" | cut -c1-200
  ;;
walk_hints)
  # Experiment 58: the chunk-state walk's loop loads with latency hints (1, 3, 6, 10) against the
  # package's (none), forwards and in reverse, same process; each must give the package's bits.
  # (Run58's variants are walk_latency.py at 28f2e02.)
  (cd benchmarks/variants && timeout 300 python3 walk_latency.py) > "$out/walk_latency.log" 2>&1
  grep -E " ms |Error|BITS" "$out/walk_latency.log" | cut -c1-300
  ;;
dd_trace)
  # Experiment 56: dd per head as the trace of the columns kernel's x_s . dy_t products (no sum
  # across warps of x * dy): the backward timed (run54: columns 0.376 / 0.893 ms, backward
  # 1.218 / 2.536), the backward GPU tests that reach it in four processes, host and GPU time.
  limit=${LIMIT_S:-250}
  (cd benchmarks/variants && timeout 100 python3 chunk_grads_split.py split) > "$out/split.log" 2>&1
  grep -E " ms |Error" "$out/split.log" | cut -c1-400
  four_test_processes "mamba_ssm"
  host_vs_gpu backward
  archive_logs
  ;;
dd_fused)
  # Experiment 55: dd's sum of dy * x in chunk_grads' columns kernel (no separate reduction),
  # on experiment 54's [s, t] columns kernel: the backward timed (run53: 1.468 / 2.631 ms before),
  # every backward GPU test in five processes side by side, then host and GPU time per step.
  limit=${LIMIT_S:-290}
  (cd benchmarks/variants && timeout 100 python3 chunk_grads_split.py split) > "$out/split.log" 2>&1
  grep -E " ms |Error" "$out/split.log" | cut -c1-400
  backward_tests plain "chunk_backward_matches" &
  backward_tests a "mamba_ssm or state_512" &
  backward_tests b "layer_autograd and dtype1" &
  backward_tests c "(layer_autograd and dtype0) or compile" &
  backward_tests d "layer_autograd and dtype2"
  wait
  test_summaries "$out"/gpu_backward_plain.log "$out"/gpu_backward_[abcd].log
  timeout 90 python3 benchmarks/variants/host_vs_gpu_backward.py > "$out/host_vs_gpu_backward.log" 2>&1
  grep -E " bench |Error" "$out/host_vs_gpu_backward.log" | cut -c1-200
  ;;
fifteenth)
  # The next session's first call: the backward tests not yet run on the two chunk_grads kernels,
  # in three processes side by side (then `tilegym_vs_ours` in a call of its own).
  # First experiment 54's columns kernel on [s, t] tiles against the package's (CPU-compiled only).
  (cd benchmarks/variants && timeout 120 python3 chunk_grads_split.py split columns_st) > "$out/split.log" 2>&1
  grep -E " ms |Error" "$out/split.log" | cut -c1-400
  limit=${LIMIT_S:-300}
  backward_tests a "mamba_ssm or state_512" &
  first=$!
  backward_tests b "layer_autograd and dtype1" &
  second=$!
  backward_tests c "layer_autograd and dtype2"
  wait "$first" "$second"
  test_summaries "$out"/gpu_backward_a.log "$out"/gpu_backward_b.log "$out"/gpu_backward_c.log
  ;;
tilegym_vs_ours)
  # tilegym's backward next to ours in one process (its autotune limited as in run45), under 10 minutes.
  timeout "${BENCH_S:-500}" python3 benchmarks/variants/tilegym_backward.py > "$out/tilegym_backward.log" 2>&1
  grep -E "fwd\+bwd|^\|" "$out/tilegym_backward.log" | cut -c1-200
  ;;
final14)
  # The fourteenth session's last call: the package's two chunk_grads kernels (dl's pairs as row
  # sums less column sums) timed against the joint kernel, the autograd tests next to mamba_ssm
  # and the layer op's bf16 cases (the plain op's passed on this code in run50), host and GPU time.
  limit=${LIMIT_S:-260}
  (cd benchmarks/variants && timeout 110 python3 chunk_grads_split.py joint split) > "$out/split.log" 2>&1
  grep -E " ms |Error" "$out/split.log" | cut -c1-400
  backward_tests a "mamba_ssm or compile" &
  first=$!
  backward_tests b "layer_autograd and dtype0"
  wait "$first"
  test_summaries "$out"/gpu_backward_a.log "$out"/gpu_backward_b.log
  timeout 80 python3 benchmarks/variants/host_vs_gpu_backward.py > "$out/host_vs_gpu_backward.log" 2>&1
  grep -E " bench |Error" "$out/host_vs_gpu_backward.log" | cut -c1-200
  ;;
two_kernels)
  # Experiment 53: chunk_grads as a columns and a rows kernel. Timed against the joint kernel
  # (and a probe without the <dS, S> dot), then the backward's GPU tests in three processes
  # side by side (plain op; next to mamba_ssm and compiled; layer op bf16), then host and GPU
  # time per training step.
  limit=${LIMIT_S:-290}
  (cd benchmarks/variants && timeout 170 python3 chunk_grads_split.py joint split probe_no_through) > "$out/split.log" 2>&1
  grep -E " ms |Error" "$out/split.log" | cut -c1-400
  backward_tests plain "chunk_backward_matches" &
  first=$!
  backward_tests a "mamba_ssm or compile" &
  second=$!
  backward_tests b "layer_autograd and dtype0"
  wait "$first" "$second"
  test_summaries "$out"/gpu_backward_plain.log "$out"/gpu_backward_a.log "$out"/gpu_backward_b.log
  timeout 100 python3 benchmarks/variants/host_vs_gpu_backward.py > "$out/host_vs_gpu_backward.log" 2>&1
  grep -E " bench |Error" "$out/host_vs_gpu_backward.log" | cut -c1-200
  ;;
fourteenth)
  # The next session's first call: experiment 51 (eager autograd through torch.autograd.Function)
  # never ran on a GPU. Its tests in two processes side by side (mamba_ssm's Triton autotune is
  # long), then the host and GPU time of a training step (experiment 50's script), whose
  # autograd rows should drop from 1.86 / 2.51 ms of host time towards the plain ops' 0.92 / 1.43.
  limit=${LIMIT_S:-330}
  backward_tests a "mamba_ssm or compile" &
  first=$!
  backward_tests b "layer_autograd and (dtype0 or dtype1)"
  wait "$first"
  test_summaries "$out"/gpu_backward_a.log "$out"/gpu_backward_b.log
  timeout 150 python3 benchmarks/variants/host_vs_gpu_backward.py > "$out/host_vs_gpu_backward.log" 2>&1
  grep -E " bench |Error" "$out/host_vs_gpu_backward.log" | cut -c1-200
  ;;
final13)
  # The thirteenth session's last call: the two backward tests not yet run on its code, the cold
  # first call of the 2.7B layer on empty caches, then tilegym's backward timed next to ours.
  limit=${LIMIT_S:-180}
  backward_tests c "compile or state_512"
  test_summaries "$out"/gpu_backward_c.log
  CUDA_TILE_CACHE_DIR=$(mktemp -d) TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) timeout 120 \
    python3 benchmarks/variants/first_call.py backward 2>&1 | tail -1 | cut -c1-800 | tee "$out/first_call_backward.log"
  timeout "${BENCH_S:-320}" python3 benchmarks/variants/tilegym_backward.py > "$out/tilegym_backward.log" 2>&1
  grep -E "fwd\+bwd|^\||Error|error" "$out/tilegym_backward.log" | cut -c1-300
  ;;
thirteenth)
  # The next session's first call, one GPU, ~7 minutes: the backward GPU tests that never ran on
  # the twelfth session's final code (two processes side by side: compiling is CPU-bound), then
  # which kernels the 2.7B call compiles after the source config's (experiment 47's result).
  # Then, alone in a second call: BENCH_S=300 python3 benchmarks/variants/tilegym_backward.py.
  limit=${LIMIT_S:-300}
  backward_tests a "mamba_ssm or compile or state_512 or (layer_autograd and dtype1 and (seq_idx or cu_seqlens or per_sequence))" &
  first=$!
  backward_tests b "layer_autograd and dtype2"
  wait "$first"
  test_summaries "$out"/gpu_backward_a.log "$out"/gpu_backward_b.log
  CUDA_TILE_CACHE_DIR=$(mktemp -d) TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) timeout 90 \
    python3 benchmarks/variants/first_call.py second_shape 2>&1 | tail -2 | cut -c1-800 | tee "$out/first_call_second_shape.log"
  ;;
split)
  # The gated dy as two terms in chunk_grads (experiment 48): the layer op's backward tests (two
  # processes side by side: compiling is CPU-bound) and mamba_ssm's gradients next to ours, then
  # tilegym's backward timed next to ours (experiment 45's script, now with the walk).
  limit=${LIMIT_S:-270}
  backward_tests a "mamba_ssm or compile or 512 or (layer_autograd and dtype0)" &
  first=$!
  backward_tests b "layer_autograd and (dtype1 or dtype2)"
  wait "$first"
  test_summaries "$out"/gpu_backward_a.log "$out"/gpu_backward_b.log
  timeout "${BENCH_S:-240}" python3 benchmarks/variants/tilegym_backward.py > "$out/tilegym_backward.log" 2>&1
  grep -E "fwd\+bwd|^\||Error|error" "$out/tilegym_backward.log" | cut -c1-300
  ;;
walk)
  # The chunk-state walk in the package (experiment 46's kernel in both of the backward's scans):
  # its own tests and every backward GPU test, then bench --backward against mamba_ssm.
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors.log" timeout -s INT "${LIMIT_S:-330}" python3 -m pytest -q -m gpu \
    tests/cutile/test_chunk_states_walk_gpu.py tests/test_backward_gpu.py -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_backward.log" 2>&1
  test_summaries "$out/gpu_backward.log"
  timeout "${BENCH_S:-200}" python3 -m tilegym_mamba2 bench --backward --only ${PEERS:-mamba_ssm} \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  tail -12 "$out/backward.log"
  ;;
twelfth)
  # For the next session's first call, one GPU, ~9 minutes: the walk's three loop orders checked
  # against the state pass and timed (experiment 46), then tilegym's backward with its search
  # filtered to run36's winners next to ours (experiment 45), the 2.7B backward's first call with
  # and without compiling its kernels side by side (experiment 47), then the layer op's fp16 cases
  # (never run on a GPU; ~70 s each, so the limit cuts them: the rest in a later call, with the
  # fp32 seq_idx, cu_seqlens and per_sequence_init cases run36 did not reach).
  timeout "${SWEEP_S:-150}" python3 benchmarks/variants/chunk_states_walk.py > "$out/chunk_states_walk.log" 2>&1
  cat "$out/chunk_states_walk.log"
  timeout "${BENCH_S:-240}" python3 benchmarks/variants/tilegym_backward.py > "$out/tilegym_backward.log" 2>&1
  grep -E "fwd\+bwd|^\||Error|error" "$out/tilegym_backward.log" | cut -c1-300
  for how in "" --parallel; do  # experiment 47: the 2.7B fwd+bwd's first call on empty caches
    CUDA_TILE_CACHE_DIR=$(mktemp -d) TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) timeout 60 \
      python3 benchmarks/variants/first_call.py backward $how 2>&1 | tail -3 | cut -c1-600
  done | tee "$out/first_call_backward.log"
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_layer.log" timeout -s INT "${LIMIT_S:-80}" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "layer_autograd and dtype2" \
    -p no:cacheprovider --tb=short -rfE > "$out/gpu_layer.log" 2>&1
  test_summaries "$out/gpu_layer.log"
  ;;
eleventh)
  # Eleventh session, one GPU, ~7 minutes: causal_conv1d_update's channel tile and occupancy swept
  # alone (bits checked against main's), bench --backward on ours alone for the runtime heads per
  # block (speed as run34's, the 2.7B first call without a second chunk_grads compile), then the
  # plain op's backward tests next to the conv update's GPU tests.
  timeout "${SWEEP_S:-100}" python3 benchmarks/variants/conv_update_tiles.py 1 64 256 > "$out/conv_update_tiles.log" 2>&1
  cat "$out/conv_update_tiles.log"
  timeout "${BENCH_S:-140}" python3 -m tilegym_mamba2 bench --backward --only \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  grep -E "fwd\+bwd|^\|" "$out/backward.log"
  limit=${LIMIT_S:-170}
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_plain.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "chunk_backward or compile" -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_plain.log" 2>&1 &
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_serving_gpu.py tests/test_serving_peers_gpu.py \
    -k "conv_update" -p no:cacheprovider --tb=short -rfE > "$out/gpu_conv_update.log" 2>&1 &
  wait
  test_summaries "$out"/gpu_*.log
  ;;
next-serving)
  # One GPU, ~2 minutes: the state update's sweep again at the batches where it trails mamba_ssm
  # in CUDA graphs (batch 1: 7.74 against 7.10 us in run38; its plans are now forgotten between
  # variants). The conv update's sweep that this mode also ran is done (run37, experiment 43).
  timeout "${SWEEP_S:-110}" python3 benchmarks/variants/state_update_tiles.py 1 8 > "$out/state_update_tiles.log" 2>&1
  grep -E "^##|mamba_ssm|as on main" "$out/state_update_tiles.log"
  ;;next)
  # For the next session's first call, one GPU, ~9 minutes: what the tenth could not run on its
  # final code. The layer op's fp32 and fp16 cases (dtype1, dtype2) and the comparison with
  # mamba_ssm's gradients side by side, then tilegym's own forward+backward next to ours on the
  # source config (its autotune takes minutes: the 1.5x-tilegym target has never been measured).
  limit=${LIMIT_S:-290}
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_layer.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "layer_autograd and (dtype1 or dtype2)" -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_layer.log" 2>&1 &
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_peer.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "mamba_ssm" -p no:cacheprovider --tb=short -rfE > "$out/gpu_peer.log" 2>&1 &
  wait
  test_summaries "$out"/gpu_*.log
  cat "$out"/grad_errors_peer.log 2>/dev/null
  timeout "${BENCH_S:-250}" python3 -m tilegym_mamba2 bench --backward --only tilegym \
    --json "$out/backward_tilegym.json" > "$out/backward_tilegym.log" 2>&1
  grep -E "fwd\+bwd|^\|" "$out/backward_tilegym.log"
  ;;
tenth-verify)
  # Tenth session, one GPU, ~9 minutes: every backward GPU test on the final chunk_grads, three
  # processes side by side (run32's 1-token seed replayed, the plain op, compile and state 512;
  # the layer options; next to mamba_ssm's gradients), then bench --backward against mamba_ssm.
  limit=${LIMIT_S:-270}
  (TILEGYM_MAMBA2_SEED=3352746843 TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_replay.log" timeout 100 python3 -m pytest \
    -q -m gpu tests/test_backward_gpu.py -k "chunk_backward and 1-1-1-4-128-64" -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_replay.log" 2>&1
   TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_plain.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "chunk_backward or compile or 512" -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_plain.log" 2>&1) &
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_layer.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "layer_autograd" -p no:cacheprovider --tb=short -rfE > "$out/gpu_layer.log" 2>&1 &
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_peer.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "mamba_ssm" -p no:cacheprovider --tb=short -rfE > "$out/gpu_peer.log" 2>&1 &
  wait
  test_summaries "$out"/gpu_*.log
  cat "$out"/grad_errors_replay.log "$out"/grad_errors_peer.log 2>/dev/null | cut -c1-220
  timeout "${BENCH_S:-230}" python3 -m tilegym_mamba2 bench --backward --only mamba_ssm \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  grep -E "fwd\+bwd|^\|" "$out/backward.log"
  ;;
tenth)
  # Tenth session, one GPU, ~8 minutes: chunk_grads' head blocks (experiment 41) swept alone on
  # the GPU, then three test processes side by side: run32's 1-token seed replayed and every
  # backward GPU test; the combined call's and the HF patch's GPU tests; the forward's graph tests.
  timeout "${SWEEP_S:-150}" python3 benchmarks/variants/chunk_grads_blocks.py > "$out/chunk_grads_blocks.log" 2>&1
  cat "$out/chunk_grads_blocks.log"
  limit=${LIMIT_S:-330}
  (TILEGYM_MAMBA2_SEED=3352746843 TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_replay.log" timeout 100 python3 -m pytest \
    -q -m gpu tests/test_backward_gpu.py -k "chunk_backward and 1-1-1-4-128-64" -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_replay.log" 2>&1
   TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_backward.log" 2>&1) &
  HF_HUB_OFFLINE=1 timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_split_conv1d_scan.py \
    tests/test_transformers.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_serving.log" 2>&1 &
  wait
  for log in "$out"/gpu_*.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|^E  |passed|failed|Interrupt" "$log" | tail -10
  done
  cat "$out"/grad_errors_replay.log "$out"/grad_errors.log 2>/dev/null | grep -v "^layer" | cut -c1-220
  ;;
next-tests)
  # For the next session's first call, one GPU, ~8 minutes: what this session could not run on
  # a GPU. Three test processes side by side: every backward GPU test (the 1-token case of run31
  # replayed with its seed first); the serving ops (tiles at occupancy 8, launch plans), the
  # combined training call and the HF patch (inference and a training step); the forward's.
  limit=${LIMIT_S:-420}
  TILEGYM_MAMBA2_SEED=3352746843 timeout 120 python3 -m pytest -q -m gpu tests/test_backward_gpu.py \
    -k "chunk_backward and 1-1-1-4-128-64" -p no:cacheprovider --tb=short -rfE > "$out/gpu_replay.log" 2>&1 &
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_backward.log" 2>&1 &
  HF_HUB_OFFLINE=1 timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_serving_gpu.py \
    tests/test_serving_peers_gpu.py tests/test_split_conv1d_scan.py tests/test_transformers.py -p no:cacheprovider \
    --tb=short -rfE > "$out/gpu_serving.log" 2>&1 &
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_cutile_gpu.py tests/cutile/test_cutile_graph_gpu.py \
    tests/test_layer_cutile_gpu.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_forward.log" 2>&1
  wait
  for log in "$out"/gpu_*.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -10
  done
  ;;
next-bench)
  # The next session's second call, one GPU, ~8 minutes: bench --serving (the state update's new
  # tiles and plans, HF decode), then bench --backward with mamba_ssm on both shapes.
  HF_HUB_OFFLINE=1 timeout "${SERVING_S:-200}" python3 -m tilegym_mamba2 bench --serving \
    --json "$out/serving.json" --png "$out/serving.png" > "$out/serving.log" 2>&1
  tail -28 "$out/serving.log"
  timeout "${BENCH_S:-250}" python3 -m tilegym_mamba2 bench --backward --only mamba_ssm \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  grep -E "fwd\+bwd|^\|" "$out/backward.log"
  ;;
fused3)
  # Ninth session's last call, one GPU, ~5 minutes: three backward test processes side by side
  # (plain op; the layer options that exercise chunk_grads' skip modes and seq_idx; compile and
  # state 512), then bench --backward against mamba_ssm alone on the GPU.
  limit=${LIMIT_S:-160}
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_plain.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "chunk_backward" -p no:cacheprovider --tb=short -rfE > "$out/gpu_plain.log" 2>&1 &
  one=$!
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_backward_gpu.py -k "compile or 512" \
    -p no:cacheprovider --tb=short -rfE > "$out/gpu_compile.log" 2>&1 &
  two=$!
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_layer.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "layer_autograd and dtype0 and (mixer or channel or seq_idx)" \
    -p no:cacheprovider --tb=short -rfE > "$out/gpu_layer.log" 2>&1
  wait "$one" "$two"
  for log in "$out"/gpu_plain.log "$out"/gpu_compile.log "$out"/gpu_layer.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -8
  done
  cat "$out"/grad_errors_*.log | cut -c1-200
  timeout "${BENCH_S:-125}" python3 -m tilegym_mamba2 bench --backward --only mamba_ssm \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  grep -E "fwd\+bwd|^\|" "$out/backward.log"
  ;;
fused2)
  # Ninth session, one GPU: every backward GPU test in three processes side by side (plain op;
  # layer options; next to mamba_ssm), then alone on the GPU bench --backward and a profile.
  limit=${LIMIT_S:-280}
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_plain.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "chunk_backward or compile or 512" -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_plain.log" 2>&1 &
  one=$!
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_peer.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "mamba_ssm" -p no:cacheprovider --tb=short -rfE > "$out/gpu_peer.log" 2>&1 &
  two=$!
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_layer.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "layer_autograd" -p no:cacheprovider --tb=short -rfE > "$out/gpu_layer.log" 2>&1
  wait "$one" "$two"
  for log in "$out"/gpu_plain.log "$out"/gpu_peer.log "$out"/gpu_layer.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|^E  |passed|failed|Interrupt" "$log" | tail -12
  done
  cat "$out/grad_errors_peer.log"
  timeout "${BENCH_S:-130}" python3 -m tilegym_mamba2 bench --backward --only mamba_ssm \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  grep -E "fwd\+bwd|^\|" "$out/backward.log"
  timeout "${PROFILE_S:-50}" python3 benchmarks/variants/backward_profile.py 2,8192,1,80,128,64 \
    > "$out/backward_profile.log" 2>&1
  grep -E "kernel|aten::" "$out/backward_profile.log" | head -16 | cut -c1-60,120-150
  ;;
fused)
  # Ninth session, one GPU: the backward on chunk_grads (experiment 38). Two backward test
  # processes side by side (plain-op cases; layer cases with the mamba_ssm comparison), then
  # alone on the GPU bench --backward against mamba_ssm and a profile of one 2.7B backward.
  limit=${LIMIT_S:-300}
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_plain.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "chunk_backward or compile or 512" -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_plain.log" 2>&1 &
  one=$!
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_layer.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "layer" -p no:cacheprovider --tb=short -rfE > "$out/gpu_layer.log" 2>&1
  wait "$one"
  for log in "$out"/gpu_plain.log "$out"/gpu_layer.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -12
  done
  timeout "${BENCH_S:-150}" python3 -m tilegym_mamba2 bench --backward --only mamba_ssm \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  grep -E "fwd\+bwd|^\|" "$out/backward.log"
  timeout "${PROFILE_S:-60}" python3 benchmarks/variants/backward_profile.py 2,8192,1,80,128,64 \
    > "$out/backward_profile.log" 2>&1
  head -22 "$out/backward_profile.log" | cut -c1-150
  ;;
ninth)
  # Ninth session's first call, one GPU: the state update's tile sweep alone on the GPU (experiment
  # 37), then two backward test processes side by side: the packed-sequence cases, and the
  # comparison with mamba_ssm's gradients next to the torch.compile test.
  timeout "${SWEEP_S:-170}" python3 benchmarks/variants/state_update_tiles.py 1 8 64 256 > "$out/state_update_tiles.log" 2>&1
  cat "$out/state_update_tiles.log"
  limit=${LIMIT_S:-380}
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "cu_seqlens or per_sequence" -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_packed.log" 2>&1 &
  one=$!
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors_peer.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "mamba_ssm or compile" -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_peer.log" 2>&1
  wait "$one"
  for log in "$out"/gpu_packed.log "$out"/gpu_peer.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -12
  done
  ;;
final)
  # Eighth session's last call, one GPU: host time on an idle machine first, then the GPU tests
  # not yet passed (BACKWARD_K picks the backward's) next to the HF patch's, then bench --serving,
  # bench --backward and a profile of one backward.
  timeout 55 python3 benchmarks/variants/host_time.py planned > "$out/host_time.log" 2>&1
  grep -v -i warn "$out/host_time.log" | grep "host" | cut -c1-160
  limit=${LIMIT_S:-200}
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -k "${BACKWARD_K:-}" -p no:cacheprovider --tb=short -rfE > "$out/gpu_backward.log" 2>&1 &
  one=$!
  HF_HUB_OFFLINE=1 timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_transformers.py \
    -p no:cacheprovider --tb=short -rfE > "$out/gpu_hf.log" 2>&1
  wait "$one"
  for log in "$out"/gpu_backward.log "$out"/gpu_hf.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -12
  done
  HF_HUB_OFFLINE=1 timeout "${SERVING_S:-180}" python3 -m tilegym_mamba2 bench --serving --json "$out/serving.json" \
    --png "$out/serving.png" > "$out/serving.log" 2>&1
  tail -28 "$out/serving.log"
  timeout "${BENCH_S:-130}" python3 -m tilegym_mamba2 bench --backward --only mamba_ssm \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  grep -E "fwd\+bwd|^\|" "$out/backward.log"
  ;;
eighth)
  # Eighth session, one GPU: three test processes side by side (compiling is CPU-bound): the
  # backward's, the serving ops' and HF patch's, and the repeated-call / graph / layer-op ones;
  # then, alone on the GPU, bench --backward and the host time per call.
  limit=${LIMIT_S:-300}
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_backward.log" 2>&1 &
  one=$!
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_serving_gpu.py tests/test_serving_peers_gpu.py \
    tests/test_transformers.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_serving.log" 2>&1 &
  two=$!
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/cutile/test_cutile_graph_gpu.py tests/test_layer_cutile_gpu.py \
    -p no:cacheprovider --tb=short -rfE > "$out/gpu_forward.log" 2>&1
  wait "$one" "$two"
  for log in "$out"/gpu_backward.log "$out"/gpu_serving.log "$out"/gpu_forward.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -12
  done
  timeout "${BENCH_S:-150}" python3 -m tilegym_mamba2 bench --backward --only ${PEERS:-mamba_ssm} \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  grep -E "fwd\+bwd|^\|" "$out/backward.log"
  timeout "${HOST_S:-60}" python3 benchmarks/variants/host_time.py planned > "$out/host_time.log" 2>&1
  grep -v -i warn "$out/host_time.log" | cut -c1-160 | tail -12
  ;;
serving)
  # Issue 14's speed figures, one GPU, one process (each part fails alone; the JSON is written
  # after every row, so a run cut short keeps what it measured). No network: no hub downloads.
  export HF_HUB_OFFLINE=1
  timeout 240 python3 -m tilegym_mamba2 bench --serving --json $out/serving.json --png $out/serving.png > $out/serving.log 2>&1; tail -30 $out/serving.log
  ;;
backward)
  # The backward's GPU tests (gradient errors logged one line each) next to the layer op's forward
  # tests, then bench --backward (PEERS: which peers, default mamba_ssm; tilegym autotunes minutes).
  limit=${LIMIT_S:-330}
  TILEGYM_MAMBA2_GRAD_LOG="$out/grad_errors.log" timeout -s INT "$limit" python3 -m pytest -q -m gpu \
    tests/test_backward_gpu.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_backward.log" 2>&1 &
  first=$!
  timeout -s INT "$limit" python3 -m pytest -q -m gpu tests/test_layer_cutile_gpu.py -p no:cacheprovider \
    --tb=short -rfE > "$out/gpu_layer.log" 2>&1
  wait "$first"
  for log in "$out"/gpu_backward.log "$out"/gpu_layer.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -15
  done
  timeout "${BENCH_S:-200}" python3 -m tilegym_mamba2 bench --backward --only ${PEERS:-mamba_ssm} \
    --json "$out/backward.json" > "$out/backward.log" 2>&1
  tail -12 "$out/backward.log"
  ;;
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
x2)
  # The final figures, one timing job per GPU. GPU 1, cores 8-31: tilegym's op next to ours on
  # the source config and the 2.7B layer (its autotune alone takes ~250 s per shape). GPU 0,
  # cores 0-7: the GPU tests named by TESTS_K (pytest -k; none when empty), then the grid with the
  # peers, then the layer benchmark in what is left of LIMIT_S.
  limit=${LIMIT_S:-570}
  CUDA_VISIBLE_DEVICES=1 taskset -c 8-31 timeout "$limit" python3 -c "from tilegym_mamba2 import bench; \
bench.run(shapes=bench.ANCHOR_SHAPES[:2], only=['tilegym'], tilegym_shapes=2, out_json='$out/tilegym.json')" \
    > "$out/tilegym.log" 2>&1 &
  export CUDA_VISIBLE_DEVICES=0
  if [ -n "${TESTS_K:-}" ]; then
    taskset -c 0-7 timeout -s INT 120 python3 -m pytest -q -m gpu -k "$TESTS_K" tests/cutile \
      tests/test_layer_cutile_gpu.py -p no:cacheprovider --tb=short -rfE > "$out/gpu_tests.log" 2>&1
  fi
  taskset -c 0-7 timeout 360 python3 -m tilegym_mamba2 bench --grid --only mamba_ssm fla \
    --json "$out/grid.json" --png "$out/grid.png" > "$out/grid.log" 2>&1
  taskset -c 0-7 timeout $((limit - SECONDS)) python3 -m tilegym_mamba2 bench --layer --json "$out/layer.json" \
    > "$out/layer.log" 2>&1
  wait
  grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$out/gpu_tests.log" 2>/dev/null
  grep -A12 "^| B, T" "$out/grid.log"; tail -8 "$out/layer.log"; tail -6 "$out/tilegym.log"
  ;;
explore)
  # 2 GPUs, nothing else running. GPU 0, cores 0-7: the whole op at config variants
  # (CONFIG_VARIANTS, variants/config_op.py). GPU 1, cores 8-15: stage timings of the plain op.
  CUDA_VISIBLE_DEVICES=1 taskset -c 8-15 timeout 200 python3 -m tilegym_mamba2 bench --only --stages \
    --json "$out/stages.json" > "$out/stages.log" 2>&1 &
  (cd benchmarks/variants && CUDA_VISIBLE_DEVICES=0 TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) taskset -c 0-7 \
     timeout 240 python3 config_op.py ${CONFIG_VARIANTS:-}) > "$out/config_op.log" 2>&1
  wait
  grep whole_call "$out/stages.log" | cut -c1-150
  grep -E "^\(|^  " "$out/config_op.log" | cut -c1-120
  ;;
verify)
  # 2 GPUs. GPU 1: every GPU test, three processes on cores 8-31. GPU 0, cores 0-7, so that
  # timing never shares a CPU with a compiler (NOTES.md, experiment 17): cold first calls in fresh
  # processes (unseen reuses plain's compiled kernels, as a user's new shape does), then the whole
  # op at config variants in alternating rounds (variants/config_op.py).
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
  [ "${FIRST_CALL:-1}" = 1 ] && for mode in plain unseen layer; do
    [ "$mode" = layer ] && dir=$(mktemp -d) || dir=$kernels
    CUDA_TILE_CACHE_DIR=$dir TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) taskset -c 0-7 timeout 80 \
      python3 benchmarks/variants/first_call.py $mode 2>&1 | grep -v -i warn
  done > "$out/first_call.log"
  [ "${LOAD_FLOOR:-0}" = 1 ] && (cd benchmarks/variants && TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) \
    taskset -c 0-7 timeout 150 python3 load_floor.py) > "$out/load_floor.log" 2>&1
  (cd benchmarks/variants && TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) taskset -c 0-7 timeout "${CONFIG_S:-240}" \
     python3 config_op.py ${CONFIG_VARIANTS:-}) > "$out/config_op.log" 2>&1
  wait
  for log in "$out"/gpu_*.log; do
    echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$log" | tail -15
  done
  grep "call" "$out/first_call.log" 2>/dev/null
  grep -E "^\(|^  |read" "$out/load_floor.log" 2>/dev/null | cut -c1-150
  grep -E "^\(|^  " "$out/config_op.log" | cut -c1-120
  ;;
host)
  # Experiment 33, one GPU, one job at a time (timing never next to a compiler): host time per call
  # with plans on and off in one process (variants/host_time.py), the host profile, ours alone on
  # the anchor shapes (the prefill and 2 x 1024 are host-bound), then the GPU tests of repeated
  # calls and graph capture, then the other cuTile tests in what is left of LIMIT_S.
  limit=${LIMIT_S:-560}
  timeout 150 python3 benchmarks/variants/host_time.py planned > "$out/host_time.log" 2>&1
  timeout 60 python3 benchmarks/variants/host_profile.py > "$out/host_profile.log" 2>&1
  timeout 120 python3 -m tilegym_mamba2 bench --only --json "$out/bench.json" > "$out/bench.log" 2>&1
  timeout -s INT $((limit - SECONDS)) python3 -m pytest -q -m gpu tests/cutile/test_cutile_graph_gpu.py \
    tests/cutile/test_cutile_gpu.py tests/test_layer_cutile_gpu.py -p no:cacheprovider --tb=short -rfE \
    > "$out/gpu_tests.log" 2>&1
  grep -v -i warn "$out/host_time.log" | cut -c1-200; grep -E "us host|layer op" "$out/host_profile.log"
  grep -A8 "^| B, T" "$out/bench.log"
  grep -E "^(FAILED|ERROR)|passed|failed|Interrupt" "$out/gpu_tests.log" | tail -15
  ;;
*) echo "usage: $0 tests|bench|serving|backward|eighth|x4|x2|explore|verify|host" >&2; exit 2 ;;
esac
