#!/usr/bin/env bash
# On a GPU machine with vLLM 0.32 (CUDA) already installed in the active Python (e.g. the gpu-vllm kit's venv:
# `source <venv>/env.sh`): make this checkout the qwen4exp package of that Python without pip (offline), then run
# one of the GPU jobs, logs and results under OUT (default bench_out/gpu).
#
#   bash tools/gpu_device.sh register             # dist-info with the vllm.general_plugins entry point + .pth
#   bash tools/gpu_device.sh tests                # the plugin's teacher-forced GPU test (KERNELS=1: + the GPU
#                                                   # kernel tests, which `bg` runs anyway)
#   bash tools/gpu_device.sh check [models]       # tools/vllm_gpu_check.py, ours + upstream (default tiny,coder,fn4)
#   bash tools/gpu_device.sh window [ARGS]        # 2 GPUs: bench both at once (upstream GPU 0, ours GPU 1)
#                                                   # (WINDOW_TESTS=1: + the GPU kernel tests beside ours); ARGS go
#                                                   # to bench_vllm_gpu.py
#   bash tools/gpu_device.sh bench IMPL           # benchmarks/bench_vllm_gpu.py --profile for upstream or ours: one
#                                                   # implementation per call (each needs ~4-5 min at full sizes);
#                                                   # run both back to back on the same warm machine; IMPL=both on
#                                                   # a two-GPU machine runs them at once, one per GPU
#   bash tools/gpu_device.sh agentic [GPUS]       # benchmarks/agentic_gpu.py: qwen4exp-bench (shortened agentic
#                                                   # workload, concurrency 1 and 8) against vLLM servers of upstream
#                                                   # and ours (FN-12L, dummy weights); GPUS default 0,1 = one server
#                                                   # per GPU at once (upstream on 0, ours on 1), one id = one after
#                                                   # the other; table: $OUT/agentic/agentic.csv
#   bash tools/gpu_device.sh mtp                  # tests/test_vllm_mtp.py on the GPU (CUDA graphs): greedy tokens
#                                                   # with MTP 3 == without == HF; vLLM's acceptance length; the
#                                                   # shared-selection run (MTP_K: pytest -k, e.g. "greedy or share")
#   bash tools/gpu_device.sh extras               # 2 GPUs, one call: `check` of ours on GPU 0 beside upstream's
#                                                   # on GPU 1, then benchmarks/bench_ops.py on GPU 1
#   bash tools/gpu_device.sh bg [GPU]             # detached (setsid, survives the call): the GPU kernel tests, then
#                                                   # (BG_BENCH=0: not; BG_ONLY=op,op: those ops without
#                                                   # sweeps, BG_OPS_ARGS: more bench_ops arguments, e.g.
#                                                   # --no-ref --decode-breakdown; BG_AB=knobs: again with
#                                                   # those; BG_K: pytest -k)
#                                                   # benchmarks/bench_ops.py --tune, on GPU (default 1), with the
#                                                   # image's torch (no vLLM needed), so they run while later calls
#                                                   # stage vLLM; results in /tmp/bg
#   bash tools/gpu_device.sh tune-decode          # vLLM venv: the vLLM top-k test, bench_ops --decode-breakdown,
#                                                   # recipes/pick_knobs.py -> /tmp/knobs.txt (QWEN4EXP_KNOBS value)
#   bash tools/gpu_device.sh bgresult             # what `bg` has written so far, copied to OUT/bg and summarised
#   bash tools/gpu_device.sh tp2 [models]         # tools/vllm_tp_check.py: tensor_parallel_size 2 vs 1, greedy
#                                                   # tokens + teacher-forced top-1 + what is sharded (default coder,fn4;
#                                                   # 2 GPUs: kind nvidia-h200-x2); NVLink multicast kept off
#
# Each job is bounded (timeout) and writes to files, never through a pipe that an engine process could hold open.
# PACK=1: afterwards everything under OUT but checkpoints goes into ONE archive, OUT/results.tgz (the device tool
# returns at most 8 files a call; run 8 lost ours' batch-1 profile to that limit).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/bench_out/gpu}
mkdir -p "$OUT"
cd "$ROOT"

register() {
  local sp
  sp=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$sp/qwen4exp-0.1.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: qwen4exp\nVersion: 0.1.0\n' > "$sp/qwen4exp-0.1.0.dist-info/METADATA"
  printf '[vllm.general_plugins]\nqwen4exp = qwen4exp.vllm:register\n' > "$sp/qwen4exp-0.1.0.dist-info/entry_points.txt"
  echo "$ROOT" > "$sp/qwen4exp-dev.pth"
  python -c "import qwen4exp, vllm, torch; print('qwen4exp from', qwen4exp.__file__, '| vllm', vllm.__version__, '| torch', torch.__version__)"
}

case "${1:-}" in
  register) register ;;
  tests)  # the plugin's GPU check (3 variants, ~7 min alone; > 8.5 min beside `bg`, run 12: start it after `bg` is done)
    register
    files=(tests/test_vllm_gpu.py)
    [ "${KERNELS:-0}" = 1 ] && files=(tests/test_gpu_kernels.py "${files[@]}")
    if [ -n "${KERNELS_K:-}" ]; then  # kernel tests that need the vLLM venv (e.g. vllm_topk), before the check
      timeout 150 python -m pytest -q -rs -p no:cacheprovider tests/test_gpu_kernels.py -k "$KERNELS_K" \
        > "$OUT/kernels-venv.log" 2>&1
      echo "kernel tests in the vLLM venv: rc=$?"; tail -3 "$OUT/kernels-venv.log"
    fi
    timeout 580 python -m pytest -q -rs -p no:cacheprovider "${files[@]}" > "$OUT/tests.log" 2>&1
    echo "rc=$?"; tail -15 "$OUT/tests.log" ;;
  check)
    register
    QWEN4EXP_CHECK_TIMEOUT=${QWEN4EXP_CHECK_TIMEOUT:-240} timeout 560 python tools/vllm_gpu_check.py --out "$OUT/check" \
      --models "${2:-tiny,coder,fn4}" --impls ours,upstream > "$OUT/check.log" 2>&1
    echo "rc=$?"; tail -12 "$OUT/check.log" ;;
  bench)
    register
    impl=${2:?bench needs upstream, ours or both}
    extra=()
    if [ "$impl" = both ]; then impl=upstream,ours; extra=(--gpus 0,1); fi  # two GPUs: side by side, same clock
    extra+=("${@:3}")  # further arguments go to bench_vllm_gpu.py (e.g. --bs32-ctx 8000)
    timeout 585 python benchmarks/bench_vllm_gpu.py --out "$OUT/bench-${impl/,/-}" --impls "$impl" --profile \
      --timeout 575 "${extra[@]}" > "$OUT/bench-${impl/,/-}.log" 2>&1
    echo "rc=$?"; tail -12 "$OUT/bench-${impl/,/-}.log" ;;
  window)  # two GPUs, one call: upstream vs ours side by side (GPU 0 / GPU 1), the GPU kernel tests beside ours
    register
    if [ "${WINDOW_TESTS:-0}" = 1 ]; then  # the kernel tests beside ours (they share its GPU during its start-up)
      ( CUDA_VISIBLE_DEVICES=1 timeout 200 python -m pytest -q -rs -p no:cacheprovider tests/test_gpu_kernels.py \
          > "$OUT/kernels.log" 2>&1; echo "rc=$?" >> "$OUT/kernels.log" ) &
    fi
    timeout 585 python benchmarks/bench_vllm_gpu.py --out "$OUT/bench" --impls upstream,ours --gpus 0,1 --profile \
      --timeout 575 "${@:2}" > "$OUT/bench.log" 2>&1
    echo "rc=$?"; wait; [ -f "$OUT/kernels.log" ] && tail -3 "$OUT/kernels.log"; tail -12 "$OUT/bench.log" ;;
  agentic)
    register
    timeout 585 python benchmarks/agentic_gpu.py --out "$OUT/agentic" --gpus "${2:-0,1}" --timeout 570 "${@:3}" \
      > "$OUT/agentic.log" 2>&1
    echo "rc=$?"; tail -25 "$OUT/agentic.log" ;;
  mtp)
    register
    timeout 560 python -m pytest -q -rs -s -p no:cacheprovider tests/test_vllm_mtp.py ${MTP_K:+-k "$MTP_K"} \
      > "$OUT/mtp.log" 2>&1
    echo "rc=$?"; grep -E "acceptance|passed|failed" "$OUT/mtp.log" | tail -5 ;;
  extras)  # big work files (the fn4 checkpoint) stay in /tmp; results and logs under OUT
    register
    for impl in ours upstream; do
      ( export CUDA_VISIBLE_DEVICES=$([ $impl = ours ] && echo 0 || echo 1)
        QWEN4EXP_CHECK_TIMEOUT=${QWEN4EXP_CHECK_TIMEOUT:-200} timeout 400 python tools/vllm_gpu_check.py \
          --out /tmp/check-$impl --models tiny,coder,fn4 --impls $impl > "$OUT/check-$impl.log" 2>&1
        echo "rc=$?" >> "$OUT/check-$impl.log"; cp /tmp/check-$impl/results.csv "$OUT/check-$impl.csv"
        if [ $impl = upstream ]; then
          timeout 150 python benchmarks/bench_ops.py --csv "$OUT/bench_ops.csv" --no-compile ${BENCH_OPS_ARGS:-} \
            > "$OUT/bench_ops.log" 2>&1
          echo "rc=$?" >> "$OUT/bench_ops.log"
        fi ) &
    done
    wait
    for f in check-ours check-upstream bench_ops; do echo "== $f"; tail -12 "$OUT/$f.log"; done ;;
  tune-decode)  # in the vLLM venv: the vLLM top-k kernel test, then bench_ops' QSA decode breakdown (+ the PLE mix
    # table), then recipes/pick_knobs.py -> OUT/knobs.txt and /tmp/knobs.txt: the QWEN4EXP_KNOBS value for the
    # engine runs later in the lease (the machine is released 30 s after a call: no time to choose by hand)
    register >/dev/null
    timeout 150 python -m pytest -q -rs -p no:cacheprovider tests/test_gpu_kernels.py -k vllm_topk \
      > "$OUT/kernels-venv.log" 2>&1
    rc=$?; echo "vllm_topk test: rc=$rc"; tail -3 "$OUT/kernels-venv.log"
    ok=""; [ $rc = 0 ] && grep -q "1 passed" "$OUT/kernels-venv.log" && ok=--vllm-topk-ok
    stages="$OUT/ops_stages.csv"
    if [ -n "${TUNE_STAGES:-}" ]; then  # a breakdown already timed (e.g. by `bg` with BG_OPS_ARGS=--decode-breakdown
      for i in $(seq 60); do [ -f "$TUNE_STAGES" ] && break; sleep 5; done  # while vLLM was staged): wait for it
      stages=$TUNE_STAGES; cp "$stages" "$OUT/" 2>/dev/null
    else
      timeout "${TUNE_TIMEOUT:-330}" python benchmarks/bench_ops.py --only "${TUNE_ONLY:-ple_mix}" --no-compile --no-ref \
        --decode-breakdown --csv "$OUT/ops.csv" > "$OUT/ops.log" 2>&1
      echo "bench_ops: rc=$?"
    fi
    python recipes/pick_knobs.py "$stages" $ok > /tmp/knobs.txt 2> "$OUT/knobs-why.txt"
    cp /tmp/knobs.txt "$OUT/knobs.txt"; cat "$OUT/knobs-why.txt"; echo "knobs: $(cat /tmp/knobs.txt)" ;;
  bg)
    mkdir -p /tmp/bg
    # .whl/fla (flash-linear-attention, `pip install --target .whl/fla --no-deps fla-core==0.6.0 einops`, carried
    # with the call, or FLA_PATH: a copy outside the tree that later calls do not remove) for the GDN-through-fla
    # tests; without it they skip
    PYTHONPATH=$ROOT:$ROOT/tests:${FLA_PATH:-$ROOT/.whl/fla} CUDA_VISIBLE_DEVICES=${2:-1} setsid nohup bash -c '
      timeout 400 python -m pytest -q -rs -p no:cacheprovider tests/test_gpu_kernels.py ${BG_K:+-k "$BG_K"} \
        > /tmp/bg/kernels.log 2>&1
      echo "rc=$?" >> /tmp/bg/kernels.log
      [ "${BG_BENCH:-1}" = 1 ] || exit 0
      if [ -n "${BG_ONLY:-}" ]; then  # a few ops, no sweeps; BG_AB: once more with those knobs (an A/B)
        timeout ${BG_TIMEOUT:-300} python benchmarks/bench_ops.py --csv /tmp/bg/bench_ops.csv --no-compile --only "$BG_ONLY" \
          ${BG_OPS_ARGS:-} > /tmp/bg/bench_ops.log 2>&1
        echo "rc=$?" >> /tmp/bg/bench_ops.log
        [ -n "${BG_AB:-}" ] && QWEN4EXP_KNOBS=$BG_AB timeout 150 python benchmarks/bench_ops.py \
          --csv /tmp/bg/bench_ops_ab.csv --no-compile --only "$BG_ONLY" > /tmp/bg/bench_ops_ab.log 2>&1
        exit 0
      fi
      timeout 420 python benchmarks/bench_ops.py --csv /tmp/bg/bench_ops.csv --no-compile --tune \
        > /tmp/bg/bench_ops.log 2>&1
      echo "rc=$?" >> /tmp/bg/bench_ops.log' > /tmp/bg/bg.log 2>&1 < /dev/null &
    echo "bg started (pid $!) as $(id -un) on GPU ${2:-1}" ;;
  bgresult)
    mkdir -p "$OUT/bg"; cp -r /tmp/bg/. "$OUT/bg/" 2>/dev/null
    for f in kernels bench_ops bench_ops_ab; do echo "== $f"; tail -25 "/tmp/bg/$f.log" 2>/dev/null; done ;;
  tp2)
    register
    # greedy only: no FlashInfer sampler (run 6: the TP=2 engine was up after ~130 s, then stalled in FlashInfer's
    # first-use JIT build of its sampling module until the 200 s limit)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0 \
      VLLM_USE_FLASHINFER_SAMPLER=0 QWEN4EXP_CHECK_TIMEOUT=${QWEN4EXP_CHECK_TIMEOUT:-300} timeout 590 python tools/vllm_tp_check.py \
      --out "$OUT/tp2" --models "${2:-coder,fn4}" --tp 2 > "$OUT/tp2.log" 2>&1
    echo "rc=$?"; tail -30 "$OUT/tp2.log" ;;
  *) sed -n '2,/^set /{/^#/p}' "$0"; exit 2 ;;
esac

if [ "${PACK:-0}" = 1 ]; then
  tmp=$(mktemp /tmp/pack.XXXX.tgz)
  tar czf "$tmp" -C "$OUT" --exclude='*.safetensors' --exclude='*.bin' --exclude='*/cache/*' . 2>/dev/null
  find "$OUT" -mindepth 1 -delete && mv "$tmp" "$OUT/results.tgz" && echo "packed: $OUT/results.tgz ($(du -h "$OUT/results.tgz" | cut -f1))"
fi
