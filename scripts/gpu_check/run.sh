#!/bin/bash
# The GPU check of tinker_exp, one command from the repo's root on a machine with one GPU (80 GiB: stage a's 1.5B
# shape peaked at 70.3 GiB on an H200):
#   bash scripts/gpu_check/run.sh                                         # no network: installs from the bundle
#   GPU_SITE=none PYTHON=.venv/bin/python bash scripts/gpu_check/run.sh   # a venv with tinker_exp and a CUDA torch
# It installs what the machine lacks from the bundle (.gpu_bundle, built by scripts/gpu_check/build_bundle.sh: cp312
# wheels + a pruned Ray) into a folder of its own, then runs the stages in order, each under its own timeout, in its
# own process session (what a stage leaves running, Ray's daemons and workers included, is killed after it), within
# one deadline (GPU_BUDGET_S, default 400 s after start). Every stage starts cold (TINKER_EXP_POOL=none: a warm
# pool that is up serves none of them; stage e starts its own in its folder). Writes under $OUT (default: out/ in
# its work folder, a fresh temp dir unless GPU_WORK names one): figures.json (every stage's figures), run.log (all
# output), gpu.csv (nvidia-smi every 2 s) and logs.tar.gz (each stage's log, each run dir's logs).
#
# Stages (GPU):
#   a  benchmarks/gpu.py: Qwen2.5-1.5B's shape, 16 x 2048 = 32,768 tokens a step, the default throughput knobs:
#      start-up split, step split, tokens/s, MFU, peak memory, ratio to the bare verl loop               (140 s)
#   s  benchmarks/slots.py: 16 LoRA slots of rank 16 on one 1.5B-shape group against one slot, each slot 2 x 1024
#      tokens a step (16 of them: a's 32,768): a round packed and time-shared, tokens/s, MFU on the 4 x N basis,
#      memory a slot, peak memory                                                                       (150 s)
#   b  the same batch with the knobs as before them (by sequences, 2 a micro batch; no fused lm head; foreach
#      AdamW), tinker_exp's loop only                                                                       (80 s)
#   c  `python -m tinker_exp lora=r8 trainer.steps=10 backend.num_workers=1`: a CLI run's cold start, the tiny
#      model's fixed cost a step, and its end (evaluation, checkpoint, adapter export, report, shutdown)   (80 s)
#   e  benchmarks/pool.py start: the tiny model's cold run and a run on a warm pool, process start to step 1 (140 s)
#   f  a's batch and knobs but backend.liger=false, tinker_exp's loop only: Liger's kernels (on in a when
#      liger_kernel imports: the bundle has it) measured off; figures not measured on a GPU yet            (80 s)
#   g  a's batch with LoRA rank 16 (alpha 32), tinker_exp's loop only: tokens/s, MFU on the 4 x N basis  (80 s)
#   h  the same with LoRA rank 64 (alpha 128)                                                          (80 s)
#   d  a's batch and knobs but padding-free on (with sdpa the default pads), tinker_exp's loop only: what sdpa
#      makes of a packed row                                                        (70 s, or what is left: >= 45 s)
# Every stage needs about 770 s: GPU_BUDGET_S=850 (the default 400 s skips the last ones, saying so).
# Switches: GPU_STAGES="a b" (a subset); GPU_EMU=1 (no GPU: backend=cpu, tiny settings, longer timeouts: how this
# script is tested on CPU); GPU_BUNDLE (default .gpu_bundle); GPU_SITE=none (use the Python environment as it is:
# PYTHON's, which needs tinker_exp's dependencies and, on a GPU, a CUDA build of torch), or a folder to install the
# bundle into (default: site/ in the work folder); GPU_WORK (the work folder: logs, runs, cache, Ray's files);
# GPU_PEAK_TFLOPS (the GPU's dense bf16 peak, for one benchmarks/gpu.py does not know by name).
set -u
START=$(date +%s)
ROOT=$(pwd)
HERE="$ROOT/scripts/gpu_check"
BUNDLE=${GPU_BUNDLE:-$ROOT/.gpu_bundle}
EMU=${GPU_EMU:-0}
STAGES=" ${GPU_STAGES:-a s b c e f g h d} "
# Never a fixed shared folder it deletes: a fresh one of its own (or GPU_WORK, made if need be), and in it a fresh
# logs folder
WORK=${GPU_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/tinker-gpu-check.XXXXXX")}
mkdir -p "$WORK"
OUT=${OUT:-$WORK/out}
SITE=${GPU_SITE:-$WORK/site}
LOGS=$(mktemp -d "$WORK/logs.XXXXXX")
PY=${PYTHON:-python3}
mkdir -p "$OUT"
FIG="$OUT/figures.json"
export GPU_CSV="$OUT/gpu.csv"
rm -f "$FIG"
exec > >(tee -a "$OUT/run.log") 2>&1
if [ "$EMU" = 1 ]; then BUDGET=${GPU_BUDGET_S:-1500}; else BUDGET=${GPU_BUDGET_S:-400}; fi
left() { echo $(( START + BUDGET - $(date +%s) )); }
say() { echo "=== [$(( $(date +%s) - START )) s] $*"; }

# --- install -------------------------------------------------------------------------------------------------
if [ "$SITE" != none ]; then
  say "install: $(ls "$BUNDLE"/whl/*.whl 2>/dev/null | wc -l) wheels + ray.tar.xz from $BUNDLE into $SITE; stages:$STAGES"
  mkdir -p "$SITE"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/whl/*.whl
  PIP_RC=$?
  tar -xJf "$BUNDLE/ray.tar.xz" -C "$SITE"
  TAR_RC=$?
  chmod -R a+x "$SITE/ray/core/src/ray" "$SITE/ray/core/libjemalloc.so" 2>/dev/null  # Ray's daemons (the tar may keep no x bits)
  export PYTHONPATH="$SITE:$ROOT"
  say "install done: pip rc $PIP_RC, tar rc $TAR_RC"
else
  PIP_RC=0; TAR_RC=0
  export PYTHONPATH="$ROOT"
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 TINKER_EXP_POOL=none
export TINKER_EXP_POOL_DIR="$WORK/pool"  # stage e's pool: never this user's own
PEAK=(); [ -n "${GPU_PEAK_TFLOPS:-}" ] && PEAK=(--peak-tflops "$GPU_PEAK_TFLOPS")
export TINKER_EXP_CACHE=${TINKER_EXP_CACHE:-$WORK/cache}
if [ "$EMU" = 1 ]; then
  export RAY_TMPDIR=${RAY_TMPDIR:-$WORK/ray}  # never the /tmp/ray of other clusters on a shared machine
  mkdir -p "$RAY_TMPDIR"
  unset RAY_ADDRESS
fi
NSMI_PID=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw,clocks.sm --format=csv,nounits -l 2 > "$GPU_CSV" 2>/dev/null &
  NSMI_PID=$!
fi
$PY - > "$LOGS/env.log" 2>&1 <<PYEOF
import importlib.metadata as md, json, os, sys, time
t = time.monotonic()
info = {"python": sys.version.split()[0], "pip_rc": $PIP_RC, "tar_rc": $TAR_RC, "cpus": os.cpu_count(), "emu": "$EMU" == "1"}
for name in ("torch", "verl", "ray", "transformers", "tokenizers", "tensordict", "flash-attn", "flash_attn", "liger-kernel", "triton", "numpy"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = None
import torch
info["torch_cuda"] = torch.version.cuda
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), capability=list(torch.cuda.get_device_capability(0)))
import ray, verl  # noqa: F401  (the imports themselves, from the site dir)
info["import_s"] = round(time.monotonic() - t, 1)
print("ENV " + json.dumps(info))
PYEOF
cat "$LOGS/env.log"
$PY "$HERE/record.py" "$FIG" env env 0 "$(( $(date +%s) - START ))" "$LOGS/env.log"

# --- stages --------------------------------------------------------------------------------------------------
SUMMARY=()
# stage LETTER NAME KIND TIMEOUT_S MIN_S RUN_DIR -- COMMAND...
stage() {
  local letter=$1 name=$2 kind=$3 nominal=$4 minimum=$5 run_dir=$6; shift 7
  case "$STAGES" in *" $letter "*) ;; *) return ;; esac
  local t=$nominal avail=$(( $(left) - 8 ))
  (( avail < t )) && t=$avail
  if (( t < minimum )); then
    say "stage $name: skipped ($avail s left before the deadline, needs $minimum)"
    $PY "$HERE/record.py" "$FIG" "$name" skipped skipped 0 -
    SUMMARY+=("$name=skip"); return
  fi
  [ -n "$run_dir" ] && rm -rf "$run_dir"
  local log="$LOGS/$name.log" sidfile="$LOGS/$name.sid"
  say "stage $name (timeout $t s): $*"
  local s0=$(date +%s.%N)
  (setsid bash -c 'echo $$ > "$0"; shift; exec timeout -k 5 "$@"' "$sidfile" _ "$t" "$@" 2>&1) | tee "$log"
  local rc=${PIPESTATUS[0]}
  local s1=$(date +%s.%N)
  local sid=$(cat "$sidfile" 2>/dev/null)
  if [ -n "$sid" ]; then  # what the stage left running (Ray's daemons, workers): its session's processes
    local pids=$($PY -c "
import os, sys
sid = int(sys.argv[1])
for n in os.listdir('/proc'):
    if n.isdigit() and int(n) != os.getpid():
        try:
            print(n) if os.getsid(int(n)) == sid else None
        except OSError:
            pass" "$sid" 2>/dev/null)
    if [ -n "$pids" ]; then echo "stage $name left $(echo $pids | wc -w) process(es): killing"; kill -9 $pids 2>/dev/null; sleep 1; fi
  fi
  local secs=$($PY -c "print(round($s1 - $s0, 1))")
  say "stage $name: rc $rc, $secs s"
  $PY "$HERE/record.py" "$FIG" "$name" "$kind" "$rc" "$secs" "$log" $run_dir $s1
  SUMMARY+=("$name=$rc(${secs%.*}s)")
}

R="$WORK/runs"
mkdir -p "$R"
OLD=(--set backend.micro_batch_tokens=0 --set backend.micro_batch_size=2 --set backend.fused_lm_head=false
     --set backend.optimizer_kernel=foreach --set backend.padding_free=true)  # as every run was before the knobs
if [ "$EMU" = 1 ]; then
  CPU=(backend=cpu backend.num_workers=1 logger=none)
  stage a a_bench bench 400 60 "" -- $PY benchmarks/gpu.py --tiny --device cpu --steps 5 --json "$LOGS/a_bench.log.json"
  stage s s_slots slots 400 60 "" -- $PY benchmarks/slots.py --slots 1,2 --rounds 2 --warmup 1 --no-gain backend.num_workers=1 lora.rank=16 lora.alpha=32 --json "$LOGS/s_slots.log.json"
  stage b b_bench_before bench 300 60 "" -- $PY benchmarks/gpu.py --tiny --device cpu --no-bare --steps 3 --warmup 1 "${OLD[@]}" --json "$LOGS/b_bench_before.log.json"
  stage c c_lora_end run 300 60 "$R/c_lora" -- $PY -m tinker_exp lora=r8 "${CPU[@]}" trainer.steps=4 trainer.eval_every=2 checkpoint.every_steps=2 hydra.run.dir="$R/c_lora"
  stage e e_pool_start text 400 60 "" -- env TINKER_EXP_POOL=auto $PY benchmarks/pool.py start --pairs 1 --no-bare --set backend=cpu --set backend.num_workers=1 --set logger=none
  stage f f_bench_no_liger bench 300 60 "" -- $PY benchmarks/gpu.py --tiny --device cpu --no-bare --steps 3 --warmup 1 --set backend.liger=false --json "$LOGS/f_bench_no_liger.log.json"
  stage g g_bench_lora16 bench 300 60 "" -- $PY benchmarks/gpu.py --tiny --device cpu --no-bare --steps 3 --warmup 1 --set lora=r8 --set lora.rank=16 --set lora.alpha=32 --json "$LOGS/g_bench_lora16.log.json"
  stage h h_bench_lora64 bench 300 60 "" -- $PY benchmarks/gpu.py --tiny --device cpu --no-bare --steps 3 --warmup 1 --set lora=r8 --set lora.rank=64 --set lora.alpha=128 --json "$LOGS/h_bench_lora64.log.json"
  stage d d_bench_packed bench 300 60 "" -- $PY benchmarks/gpu.py --tiny --device cpu --no-bare --steps 3 --warmup 1 --set backend.padding_free=true --json "$LOGS/d_bench_packed.log.json"
else
  stage a a_bench bench 140 80 "" -- $PY benchmarks/gpu.py --steps 5 "${PEAK[@]}" --json "$LOGS/a_bench.log.json"
  stage s s_slots slots 150 90 "" -- $PY benchmarks/slots.py --shape 1.5b --device cuda --slots 1,16 --rows 2 --seq 1024 --rounds 3 --warmup 1 --no-gain lora.rank=16 lora.alpha=32 "${PEAK[@]}" --json "$LOGS/s_slots.log.json"
  stage b b_bench_before bench 80 45 "" -- $PY benchmarks/gpu.py --no-bare --steps 3 --warmup 1 "${OLD[@]}" "${PEAK[@]}" --json "$LOGS/b_bench_before.log.json"
  stage c c_lora_end run 80 40 "$R/c_lora" -- $PY -m tinker_exp lora=r8 trainer.steps=10 backend.num_workers=1 logger=none hydra.run.dir="$R/c_lora"
  stage e e_pool_start text 140 90 "" -- env TINKER_EXP_POOL=auto $PY benchmarks/pool.py start --pairs 1 --no-bare --set backend.num_workers=1 --set logger=none
  stage f f_bench_no_liger bench 80 45 "" -- $PY benchmarks/gpu.py --no-bare --steps 3 --warmup 1 --set backend.liger=false "${PEAK[@]}" --json "$LOGS/f_bench_no_liger.log.json"
  stage g g_bench_lora16 bench 80 50 "" -- $PY benchmarks/gpu.py --no-bare --steps 4 --warmup 1 --set lora=r8 --set lora.rank=16 --set lora.alpha=32 "${PEAK[@]}" --json "$LOGS/g_bench_lora16.log.json"
  stage h h_bench_lora64 bench 80 50 "" -- $PY benchmarks/gpu.py --no-bare --steps 4 --warmup 1 --set lora=r8 --set lora.rank=64 --set lora.alpha=128 "${PEAK[@]}" --json "$LOGS/h_bench_lora64.log.json"
  stage d d_bench_packed bench 70 45 "" -- $PY benchmarks/gpu.py --no-bare --steps 3 --warmup 1 --set backend.padding_free=true "${PEAK[@]}" --json "$LOGS/d_bench_packed.log.json"
fi

# --- what comes back -----------------------------------------------------------------------------------------
[ -n "$NSMI_PID" ] && kill "$NSMI_PID" 2>/dev/null
$PY "$HERE/record.py" "$FIG" summary summary 0 "$(( $(date +%s) - START ))" -
tar -czf "$OUT/logs.tar.gz" --exclude='checkpoints' --exclude='adapter' --exclude='*.png' --exclude='wandb' \
  --exclude='*.safetensors' -C "$LOGS" . -C "$R" . 2>/dev/null
say "SUMMARY: ${SUMMARY[*]}; total $(( $(date +%s) - START )) s; figures in $FIG"
grep -h -A10 "^GPU benchmark: " "$LOGS"/{a_bench,b_bench_before,f_bench_no_liger,g_bench_lora16,h_bench_lora64,d_bench_packed}.log 2>/dev/null
sleep 1  # let tee write the last lines
