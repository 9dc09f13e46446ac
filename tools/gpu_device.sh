#!/usr/bin/env bash
# On a GPU machine with vLLM 0.32 (CUDA) already installed in the active Python (e.g. the gpu-vllm kit's venv,
# activated): make this checkout the qwen4exp package of that Python without pip (offline), then run one of the GPU
# jobs, logs and results under OUT (default bench_out/gpu).
#
#   bash tools/gpu_device.sh register             # dist-info with pyproject's vllm entry points + .pth
#   bash tools/gpu_device.sh suite [PYTEST ARGS]  # the whole GPU test suite: pytest -m gpu over tests/, in shards
#                                                   # (SUITE_PARTS, default ops,gpu,nvfp4,rest: tests/ops = the
#                                                   # kernel tests, gpu = the plugin's GPU check in tests/gpu,
#                                                   # nvfp4 = tests/gpu/test_vllm_nvfp4_gpu.py, rest = the MTP and
#                                                   # server prefix-cache runs on CUDA and any other gpu test; parts
#                                                   # mtp and serve take the MTP tests and the server/scheduler
#                                                   # tests out of rest into lanes of their own; nvfp4a + nvfp4b
#                                                   # split nvfp4, nvfp4m takes the FN-4 MTP draft out of nvfp4a)
#                                                   # spread over the GPUs (SUITE_GPUS, default all visible; PART:N
#                                                   # puts PART on the N-th; shards on one GPU run one after the
#                                                   # other; SUITE_SHARE=1: all parts at once, sharing the GPUs,
#                                                   # every test engine with a small share of its GPU and a fixed
#                                                   # KV cache; SUITE_THREADS: torch threads a lane), all
#                                                   # within SUITE_TIMEOUT s (default 570);
#                                                   # logs $OUT/suite-PART.log + .xml (+ .failures: each failed
#                                                   # test's report, written as it fails), one summary line at the end.
#                                                   # With PYTEST ARGS: one run of pytest -m gpu ARGS instead
#                                                   # (e.g. tests/test_vllm_mtp.py -k "greedy or share")
#   bash tools/gpu_device.sh check [models]       # tools/vllm_gpu_check.py, ours + upstream (default tiny,coder,fn4)
#   bash tools/gpu_device.sh bench IMPLS [ARGS]   # benchmarks/bench_vllm_gpu.py --profile: IMPLS upstream, ours,
#                                                   # both (= upstream,ours, one per GPU at once: 2 GPUs) or a comma
#                                                   # list naming --variant / --ours-at entries of ARGS (e.g. an A/B
#                                                   # of two commits: `bench prev,ours --ours-at prev=PATH`); each
#                                                   # implementation needs ~4-5 min at full sizes
#   bash tools/gpu_device.sh mtp                  # issue 49's MTP 3 bench (FN-24L-NVFP4; batches 1, 8, 32; profiles),
#                                                   # upstream vs ours, after `bg`'s bench_ops (+ its fastest HC variant)
#   bash tools/gpu_device.sh layer                # benchmarks/bench_layer.py (issue 50's layer harness) in the image's
#                                                   # torch, no vLLM: GDN / QSA layers, batch 1 and 8, 1 and 4 queries;
#                                                   # tables, CSVs and traces in OUT/layer (FLA: fla-core's folder)
#   bash tools/gpu_device.sh agentic [GPUS]       # benchmarks/agentic_gpu.py: qwen4exp-bench (shortened agentic
#                                                   # workload, concurrency 1 and 8) against vLLM servers of upstream
#                                                   # and ours (FN-12L, dummy weights); GPUS default 0,1 = one server
#                                                   # per GPU at once (upstream on 0, ours on 1), one id = one after
#                                                   # the other; table: $OUT/agentic/agentic.csv
#   bash tools/gpu_device.sh bg [GPU]             # detached (setsid, survives the call) in the image's torch (no
#                                                   # vLLM needed, so it runs while later calls stage vLLM), on GPU
#                                                   # (default 1): the kernel tests (pytest -m gpu tests/ops; BG_K:
#                                                   # pytest -k), then benchmarks/bench_ops.py --tune (BG_BENCH=0:
#                                                   # not; BG_ONLY=op,op: those ops without sweeps, BG_OPS_ARGS: more
#                                                   # bench_ops arguments, e.g. --no-ref --decode-breakdown;
#                                                   # BG_LAYER=1: the layer harness first, as `layer`);
#                                                   # results in /tmp/bg, /tmp/bg/done when it ends
#   bash tools/gpu_device.sh bgresult             # what `bg` has written so far, copied to OUT/bg and summarised
#   bash tools/gpu_device.sh bgwait [SECS]        # the same once `bg` has ended (or SECS, default 540, have passed)
#   bash tools/gpu_device.sh modelopt             # ModelOpt's own fake-quant figure beside ours: recipes/quantize_nvfp4.py
#                                                   # --modelopt-eval on the tiny-coder (CUDA), modelopt from the wheels
#                                                   # in MO_WHEELS (default .whl/mo-img, carried), installed --no-deps
#                                                   # into /tmp/mo; $OUT/modelopt.log + quality.json
#   bash tools/gpu_device.sh queue 'CMD' ...      # the commands (e.g. 'SUITE_TIMEOUT=1100 bash tools/gpu_device.sh
#                                                   # suite tests/gpu'), one after the other, detached (setsid: past the
#                                                   # call and its time limit), from a private copy of the tree; the
#                                                   # N-th command's OUT is /tmp/$QUEUE/out/N (QUEUE default queue),
#                                                   # /tmp/$QUEUE/done when all ended
#   bash tools/gpu_device.sh queueresult          # the queue's progress; its results copied to OUT (PACK=1: one .tgz)
#   bash tools/gpu_device.sh queuewait [SECS]     # wait (holding the call, so the machine stays lent) until the queue
#                                                   # ends or SECS (default 540) pass; its log, one line a suite part,
#                                                   # and all it wrote as OUT/results.tgz
#   bash tools/gpu_device.sh tp2 [models]         # tools/vllm_tp_check.py: tensor_parallel_size 2 vs 1, greedy
#                                                   # tokens + teacher-forced top-1 + what is sharded (default coder,fn4;
#                                                   # 2 GPUs); NVLink multicast kept off
#
# Each job is bounded (timeout) and writes to files, never through a pipe that an engine process could hold open.
# PACK=1: afterwards everything under OUT but checkpoints goes into ONE archive, OUT/results.tgz (for runners that
# return only a few files per call).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/bench_out/gpu}
mkdir -p "$OUT"
cd "$ROOT"
# fla-core (flash-linear-attention) for the kernel tests of GDN through fla: `pip install --target .whl/fla --no-deps
# fla-core==0.6.0 einops` carried with the call, or FLA_PATH (a copy outside the tree); without it they skip
FLA=${FLA_PATH:-$ROOT/.whl/fla}

register() {
  local sp
  sp=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$sp/qwen4exp-0.1.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: qwen4exp\nVersion: 0.1.0\n' > "$sp/qwen4exp-0.1.0.dist-info/METADATA"
  # every entry point of pyproject.toml (vllm.general_plugins, vllm.stat_logger_plugins)
  python - "$ROOT/pyproject.toml" > "$sp/qwen4exp-0.1.0.dist-info/entry_points.txt" <<'PY'
import sys, tomllib
for group, eps in tomllib.load(open(sys.argv[1], "rb"))["project"]["entry-points"].items():
    print(f"[{group}]", *(f"{k} = {v}" for k, v in eps.items()), "", sep="\n")
PY
  echo "$ROOT" > "$sp/qwen4exp-dev.pth"
  python -c "import qwen4exp, vllm, torch; print('qwen4exp from', qwen4exp.__file__, '| vllm', vllm.__version__, '| torch', torch.__version__)"
  # vLLM's model-class inspections (target and draft, upstream's and ours: ~26 s each, one after another in each
  # engine's first start) all at once, once a machine
  if [ ! -f /tmp/modelinfo.log ]; then
    timeout 180 python "$ROOT/tools/warm_modelinfo.py" > /tmp/modelinfo.log 2>&1
    grep -E "cached|inspected|failed|skipped" /tmp/modelinfo.log | cut -c1-200
  fi
}

pack() {  # DIR ARCHIVE [TAR ARGS]: DIR's files as one .tgz, without checkpoints and caches
  tar czf "$2" -C "$1" --exclude='*.safetensors' --exclude='*.bin' --exclude='*/cache/*' "${@:3}" . 2>/dev/null
}

suite_part() {  # PART GPU SECONDS PYTEST-ARGS...: one shard of the GPU suite (GPU '': all visible), rc in its log
  local part=$1 gpu=$2 secs=$3 vars=()
  shift 3
  [ -n "$gpu" ] && vars+=(CUDA_VISIBLE_DEVICES="$gpu")
  # fla only for the kernel tests: the engine tests' HF references run as they always have
  [ "$part" = ops ] && vars+=(PYTHONPATH="$FLA${PYTHONPATH:+:$PYTHONPATH}")
  # -v, unbuffered: one line per finished test as it finishes, so a run cut off by the lease still says what passed;
  # failures' reports go to suite-PART.failures at once (tests/conftest.py); at the limit pytest gets SIGINT first,
  # so it still prints its summary
  env "${vars[@]}" PYTHONUNBUFFERED=1 QWEN4EXP_FAILURE_LOG="$OUT/suite-$part.failures" \
    timeout -s INT -k 30 "$secs" python -m pytest -v -rs --durations=15 -p no:cacheprovider \
    -m gpu --junitxml "$OUT/suite-$part.xml" "$@" > "$OUT/suite-$part.log" 2>&1
  echo "rc=$?" >> "$OUT/suite-$part.log"
}

suite() {
  register > "$OUT/suite-register.log" 2>&1 || { echo "register failed:"; tail -5 "$OUT/suite-register.log"; return 1; }
  local deadline=$(( $(date +%s) + ${SUITE_TIMEOUT:-570} )) parts gpus lanes=() i g p
  if [ $# -gt 0 ]; then
    suite_part args "" "${SUITE_TIMEOUT:-570}" "$@"
    parts=(args)
  else
    IFS=, read -ra parts <<< "${SUITE_PARTS:-ops,gpu,nvfp4,rest}"
    IFS=, read -ra gpus <<< "${SUITE_GPUS:-$(python -c "import torch; print(','.join(map(str, range(max(1, torch.cuda.device_count())))))")}"
    # part i on GPU i mod #GPUs (PART:N: on the N-th of them); parts of one GPU one after the other, or with
    # SUITE_SHARE=1 all at once (each test engine then takes a small share of the GPU: tools/vllm_offline.py)
    local lane_gpu=() rest_ignore=() nvfp4a_k="fn_shaped"
    listed() { [[ ",${parts[*]}," =~ [,\ ]$1[,:\ ] ]]; }  # PART (or PART:N) is one of the parts
    listed nvfp4m && nvfp4a_k="fn_shaped and not mtp_draft"
    listed mtp && rest_ignore+=(--ignore=tests/test_vllm_mtp.py)
    listed serve && rest_ignore+=(--ignore=tests/test_vllm_server_prefix_cache.py --ignore=tests/test_vllm_scheduler.py)
    # sharing: each engine run of the NVFP4 check gets more than its 200 s alone (run 20: its HF reference took 169 s)
    [ "${SUITE_SHARE:-0}" = 1 ] && export QWEN4EXP_TEST_GPU_SHARE=1 QWEN4EXP_CHECK_TIMEOUT=${QWEN4EXP_CHECK_TIMEOUT:-400}
    for i in "${!parts[@]}"; do
      p=${parts[i]%%:*}
      g=$([ "$p" != "${parts[i]}" ] && echo "${parts[i]#*:}" || echo $(( i % ${#gpus[@]} )))
      l=$([ "${SUITE_SHARE:-0}" = 1 ] && echo "$i" || echo "$g")
      lanes[l]+="$p "
      lane_gpu[l]=${gpus[g]}
      parts[i]=$p
    done
    # SUITE_THREADS: torch threads a lane (default: torch's, one a core: a lane left alone at the end, e.g. nvfp4a's
    # CPU reference, then gets every core)
    [ -n "${SUITE_THREADS:-}" ] && export OMP_NUM_THREADS=$SUITE_THREADS
    for l in "${!lanes[@]}"; do
      ( for p in ${lanes[l]}; do
          left=$(( deadline - $(date +%s) ))
          [ $left -gt 10 ] || { echo "rc=124 (no time left)" > "$OUT/suite-$p.log"; continue; }
          case $p in
            ops)  suite_part ops "${lane_gpu[l]}" $left tests/ops ;;
            gpu)  suite_part gpu "${lane_gpu[l]}" $left tests/gpu --ignore=tests/gpu/test_vllm_nvfp4_gpu.py ;;
            nvfp4) suite_part nvfp4 "${lane_gpu[l]}" $left tests/gpu/test_vllm_nvfp4_gpu.py ;;
            # nvfp4 in two lanes (SUITE_SHARE=1 on one GPU: ~half its wall time): the FN-4 model's two tests (one
            # build and HF reference), then the tiny-coder and the anchor config
            nvfp4a) suite_part nvfp4a "${lane_gpu[l]}" $left tests/gpu/test_vllm_nvfp4_gpu.py -k "$nvfp4a_k" ;;
            # (nvfp4m: the FN-4 MTP draft test in a lane of its own, out of nvfp4a, the longest lane with it)
            nvfp4m) suite_part nvfp4m "${lane_gpu[l]}" $left tests/gpu/test_vllm_nvfp4_gpu.py -k "mtp_draft" ;;
            nvfp4b) suite_part nvfp4b "${lane_gpu[l]}" $left tests/gpu/test_vllm_nvfp4_gpu.py -k "not fn_shaped" ;;
            # the CPU-and-CUDA engine tests in up to three lanes: mtp and serve take their files out of rest
            mtp)  suite_part mtp "${lane_gpu[l]}" $left tests/test_vllm_mtp.py ;;
            serve) suite_part serve "${lane_gpu[l]}" $left tests/test_vllm_server_prefix_cache.py \
                     tests/test_vllm_scheduler.py ;;
            rest) suite_part rest "${lane_gpu[l]}" $left tests --ignore=tests/ops --ignore=tests/gpu \
                    "${rest_ignore[@]}" ;;
            *)    echo "rc=2 (unknown part $p: want ops, gpu, nvfp4 (or nvfp4a, nvfp4b, nvfp4m), mtp, serve or rest)" \
                    > "$OUT/suite-$p.log" ;;
          esac
        done ) &
    done
    wait
  fi
  for p in "${parts[@]}"; do echo "== $p"; grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/suite-$p.log" | head -20; tail -2 "$OUT/suite-$p.log"; done
  python - "$OUT" "${parts[@]}" <<'EOF'
import re, sys
out, parts = sys.argv[1], sys.argv[2:]
total, rcs = {}, []
for p in parts:
    text = open(f"{out}/suite-{p}.log", errors="replace").read()
    rc = re.findall(r"^rc=(\d+)", text, re.M)
    rc = rc[-1] if rc else "?"
    rcs.append(f"{p} rc={rc}" + {"5": " (no tests selected)", "124": " (timed out)", "137": " (timed out, killed)"}.get(rc, ""))
    last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)\b", ln)]
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", last[-1] if last else ""):
        what = "errors" if what.startswith("error") else what
        total[what] = total.get(what, 0) + int(n)
ok = all(r.endswith("rc=0") for r in rcs) and not total.get("failed") and not total.get("errors")
print(f"suite {'PASS' if ok else 'FAIL'}: " + (", ".join(f"{n} {w}" for w, n in total.items()) or "no results")
      + f" ({'; '.join(rcs)})")
sys.exit(0 if ok else 1)
EOF
}

case "${1:-}" in
  register) register ;;
  suite) suite "${@:2}" ;;
  check)
    register
    QWEN4EXP_CHECK_TIMEOUT=${QWEN4EXP_CHECK_TIMEOUT:-240} timeout 560 python tools/vllm_gpu_check.py --out "$OUT/check" \
      --models "${2:-tiny,coder,fn4}" --impls ours,upstream > "$OUT/check.log" 2>&1
    echo "rc=$?"; tail -12 "$OUT/check.log" ;;
  bench)
    register
    impl=${2:?bench needs upstream, ours, both or a comma list of implementations}
    extra=()
    if [ "$impl" = both ]; then impl=upstream,ours; extra=(--gpus 0,1); fi  # two GPUs: side by side, same clock
    extra+=("${@:3}")  # further arguments go to bench_vllm_gpu.py (e.g. --bs32-ctx 8000, --ours-at prev=PATH)
    name=bench-${impl//,/-}
    timeout 585 python benchmarks/bench_vllm_gpu.py --out "$OUT/$name" --impls "$impl" --profile \
      --timeout 575 "${extra[@]}" > "$OUT/$name.log" 2>&1
    echo "rc=$?"; tail -12 "$OUT/$name.log" ;;
  mtp)
    # issue 49's same-call MTP 3 figures (FN-24L-NVFP4, batch 1 at 50k, batches 8 and 32 at 30k, profiles, the warm
    # prefill), upstream against ours; first waits (up to 10 min) for a `bg` job to end, copies its
    # results to OUT/bg and lets tools/pick_hc_variant.py name the fastest QWEN4EXP_HC_DECODE at 4 tokens: where
    # that is not the default it runs as a third implementation, `hc`. MTP_ARGS: more bench_vllm_gpu.py arguments;
    # MTP_VARIANTS: more implementations (below)
    register
    for _ in $(seq 200); do [ -d /tmp/bg ] || break; [ -f /tmp/bg/done ] && break; sleep 3; done
    impls=upstream,ours; extra=()
    if [ -f /tmp/bg/bench_ops.csv ]; then
      mkdir -p "$OUT/bg" && cp /tmp/bg/*.log /tmp/bg/*.csv "$OUT/bg/" 2>/dev/null
      var=$(python tools/pick_hc_variant.py /tmp/bg/bench_ops.csv 2>"$OUT/pick.log") || var=fused
      echo "picked $var" >> "$OUT/pick.log"
      if [ "$var" != fused ]; then impls=upstream,ours,hc; extra=(--variant "hc=QWEN4EXP_HC_DECODE=$var"); fi
    fi
    # MTP_VARIANTS="NAME=SWITCH=VALUE ...": more implementations of ours, each one switch (e.g.
    # tsel=QWEN4EXP_QSA_PREFILL_SELECT=triton, fp8head=QWEN4EXP_MTP_DRAFT_HEAD=fp8)
    for v in ${MTP_VARIANTS:-}; do impls+=",${v%%=*}"; extra+=(--variant "$v"); done
    python benchmarks/bench_vllm_gpu.py --preset fn-nvfp4 --layers 24 --impls "$impls" "${extra[@]}" --mtp 3 \
      --bs8-ctx 30000 --bs32-ctx 30000 --bs32-tokens 1200 --mp --profile --warm-prefill --out "$OUT" ${MTP_ARGS:-} \
      > "$OUT/mtp.log" 2>&1
    echo "rc=$?"; tail -14 "$OUT/mtp.log" ;;
  layer)
    # benchmarks/bench_layer.py in the image's own torch and Triton (no vLLM, no register): GDN and QSA layers at the
    # real widths, batch 1 and 8, then 1 + 3 queries a request (MTP verification); fla from FLA. LAYER_ARGS: more
    # arguments for both runs (e.g. --set QWEN4EXP_HC_DECODE=fused-ticket, --e2e gdn=US,qsa=US)
    mkdir -p "$OUT/layer"
    for q in 1 4; do
      PYTHONPATH=$ROOT:$FLA${PYTHONPATH:+:$PYTHONPATH} timeout ${LAYER_TIMEOUT:-280} python benchmarks/bench_layer.py \
        --batch 1,8 --queries $q --csv "$OUT/layer/layer-q$q.csv" --profile "$OUT/layer" ${LAYER_ARGS:-} \
        > "$OUT/layer/layer-q$q.log" 2>&1
      echo "q=$q rc=$?"; grep -v '^   ' "$OUT/layer/layer-q$q.log" | tail -8
    done ;;
  agentic)
    register
    timeout 585 python benchmarks/agentic_gpu.py --out "$OUT/agentic" --gpus "${2:-0,1}" --timeout 570 "${@:3}" \
      > "$OUT/agentic.log" 2>&1
    echo "rc=$?"; tail -25 "$OUT/agentic.log" ;;
  bg)
    # from a private copy of the tree: each later call re-syncs the working tree, and a file replaced while pytest
    # imports it (collection, or an op's lazily loaded kernels) fails that import
    mkdir -p /tmp/bg && rm -rf /tmp/bg/tree && mkdir -p /tmp/bg/tree
    cp -r "$ROOT/qwen4exp" "$ROOT/tests" "$ROOT/benchmarks" "$ROOT/tools" "$ROOT/pyproject.toml" /tmp/bg/tree/
    cd /tmp/bg/tree
    rm -f /tmp/bg/done
    PYTHONPATH=/tmp/bg/tree:/tmp/bg/tree/tests:$FLA CUDA_VISIBLE_DEVICES=${2:-1} setsid nohup bash -c '
      trap "touch /tmp/bg/done" EXIT  # (what `mtp` waits for)
      # the layer harness first (benchmarks/bench_layer.py, as `layer` does): its timings want the GPU to itself,
      # which it has while later calls stage vLLM
      if [ "${BG_LAYER:-0}" = 1 ]; then
        mkdir -p /tmp/bg/layer
        for q in 1 4; do
          timeout ${LAYER_TIMEOUT:-280} python benchmarks/bench_layer.py --batch 1,8 --queries $q \
            --csv /tmp/bg/layer/layer-q$q.csv --profile /tmp/bg/layer ${LAYER_ARGS:-} > /tmp/bg/layer/layer-q$q.log 2>&1
          echo "rc=$?" >> /tmp/bg/layer/layer-q$q.log
        done
      fi
      timeout 400 python -m pytest -q -rs -p no:cacheprovider -m gpu tests/ops ${BG_K:+-k "$BG_K"} \
        > /tmp/bg/kernels.log 2>&1
      echo "rc=$?" >> /tmp/bg/kernels.log
      [ "${BG_BENCH:-1}" = 1 ] || exit 0
      if [ -n "${BG_ONLY:-}" ]; then  # a few ops, no sweeps
        timeout ${BG_TIMEOUT:-300} python benchmarks/bench_ops.py --csv /tmp/bg/bench_ops.csv --no-compile --only "$BG_ONLY" \
          ${BG_OPS_ARGS:-} > /tmp/bg/bench_ops.log 2>&1
        echo "rc=$?" >> /tmp/bg/bench_ops.log
        exit 0
      fi
      timeout 420 python benchmarks/bench_ops.py --csv /tmp/bg/bench_ops.csv --no-compile --tune \
        > /tmp/bg/bench_ops.log 2>&1
      echo "rc=$?" >> /tmp/bg/bench_ops.log' > /tmp/bg/bg.log 2>&1 < /dev/null &
    echo "bg started (pid $!) as $(id -un) on GPU ${2:-1}" ;;
  modelopt)
    mkdir -p /tmp/mo
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mo \
      "${MO_WHEELS:-$ROOT/.whl/mo-img}"/*.whl > "$OUT/modelopt-install.log" 2>&1 \
      || { echo "modelopt install failed:"; tail -5 "$OUT/modelopt-install.log"; exit 1; }
    rm -rf /tmp/mo-tc
    PYTHONPATH=$ROOT:/tmp/mo${PYTHONPATH:+:$PYTHONPATH} timeout "${MO_TIMEOUT:-500}" python recipes/quantize_nvfp4.py \
      --model qwen4exp/assets/tiny-coder --out /tmp/mo-tc --modelopt-eval > "$OUT/modelopt.log" 2>&1
    echo "rc=$?" | tee -a "$OUT/modelopt.log"; cp /tmp/mo-tc/quality.json "$OUT/" 2>/dev/null; tail -20 "$OUT/modelopt.log" ;;
  queue)
    q=/tmp/${QUEUE:-queue}
    rm -rf "$q" && mkdir -p "$q/tree" "$q/out"
    # (a private copy: later calls re-sync the working tree under a running job)
    for f in qwen4exp tests benchmarks tools recipes pyproject.toml .whl .ab; do
      [ -e "$ROOT/$f" ] && cp -r "$ROOT/$f" "$q/tree/"
    done
    cd "$q/tree"
    # the venv's qwen4exp becomes this copy: a registration of the synced tree, or of a carried folder that a later
    # call removes, can lose the package under a running job
    ROOT="$q/tree" register > "$q/register.log" 2>&1 || { cat "$q/register.log"; exit 1; }
    setsid nohup bash -c '
      q=$1; shift; i=0
      for cmd in "$@"; do
        i=$((i + 1)); mkdir -p "$q/out/$i"
        echo "[$(date +%T)] $i start: $cmd" >> "$q/queue.log"
        ( export OUT="$q/out/$i"; eval "$cmd" ) > "$q/out/$i/stdout.log" 2>&1
        rc=$?
        echo "[$(date +%T)] $i end rc=$rc: $(tail -1 "$q/out/$i/stdout.log")" >> "$q/queue.log"
      done
      touch "$q/done"' _ "$q" "${@:2}" > "$q/nohup.log" 2>&1 < /dev/null &
    echo "queue $q started (pid $!): $(( $# - 1 )) command(s)" ;;
  queueresult)
    q=/tmp/${QUEUE:-queue}
    cat "$q/queue.log" 2>/dev/null; [ -f "$q/done" ] && echo "(all ended)"
    mkdir -p "$OUT/${QUEUE:-queue}"
    (cd "$q/out" 2>/dev/null && find . -type f ! -name '*.safetensors' ! -name '*.pt' -size -20M \
      -exec cp --parents {} "$OUT/${QUEUE:-queue}/" \;) ;;
  queuewait)
    # hold the call (the machine goes back ~30 s after the last call ends) until the queue ends or SECS pass, then
    # its log, a line a suite log, and everything it wrote as ONE archive (a call returns at most 8 files)
    q=/tmp/${QUEUE:-queue}
    end=$(( $(date +%s) + ${2:-540} ))
    while [ ! -f "$q/done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    cat "$q/queue.log" 2>/dev/null; [ -f "$q/done" ] && echo "(all ended)"
    for f in "$q"/out/*/suite-*.log; do
      [ -f "$f" ] && echo "${f#$q/out/}: $(grep -c ' PASSED' "$f") passed, $(grep -cE ' (FAILED|ERROR)' "$f") failed; $(tail -1 "$f" | cut -c1-120)"
    done
    for f in "$q"/out/*/suite-*.failures; do  # (the first lines of why each failed test failed)
      [ -f "$f" ] && { echo "== ${f#$q/out/}"; head -c 4000 "$f"; }
    done
    pack "$q/out" "$OUT/results.tgz" --exclude='*.pt'; echo "archive: $(du -h "$OUT/results.tgz" | cut -f1)" ;;
  bgresult|bgwait)
    # bgwait [SECS]: first hold the call until `bg` ends (or SECS pass, default 540: the machine goes back ~30 s after
    # the last call ends); then both copy what `bg` wrote (not its private copy of the tree) to OUT/bg
    if [ "$1" = bgwait ]; then
      end=$(( $(date +%s) + ${2:-540} ))
      while [ ! -f /tmp/bg/done ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
      [ -f /tmp/bg/done ] && echo "(bg ended)" || echo "(bg still running)"
    fi
    mkdir -p "$OUT/bg"
    (cd /tmp/bg 2>/dev/null && find . -path ./tree -prune -o -type f -size -20M -exec cp --parents {} "$OUT/bg/" \;)
    for f in kernels bench_ops layer/layer-q1 layer/layer-q4; do echo "== $f"; tail -25 "/tmp/bg/$f.log" 2>/dev/null; done ;;
  tp2)
    register
    # greedy only: no FlashInfer sampler (its first-use JIT build of the sampling module can hold a fresh machine's
    # TP=2 start-up for minutes)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0 \
      VLLM_USE_FLASHINFER_SAMPLER=0 QWEN4EXP_CHECK_TIMEOUT=${QWEN4EXP_CHECK_TIMEOUT:-300} timeout 590 python tools/vllm_tp_check.py \
      --out "$OUT/tp2" --models "${2:-coder,fn4}" --tp 2 > "$OUT/tp2.log" 2>&1
    echo "rc=$?"; tail -30 "$OUT/tp2.log" ;;
  *) sed -n '2,/^set /{/^#/p}' "$0"; exit 2 ;;
esac
status=$?  # (the job's: suite's PASS / FAIL; the other jobs print their rc)

if [ "${PACK:-0}" = 1 ]; then
  tmp=$(mktemp /tmp/pack.XXXX.tgz)
  pack "$OUT" "$tmp"
  find "$OUT" -mindepth 1 -delete && mv "$tmp" "$OUT/results.tgz" && echo "packed: $OUT/results.tgz ($(du -h "$OUT/results.tgz" | cut -f1))"
fi
exit $status
