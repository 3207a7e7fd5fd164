#!/usr/bin/env bash
# verify's GPU proofs (--e2e and --model at TP=1/2, the poisoned adapter) and
# nan-probe's proof and serving cost on a 2-GPU H200 host, as
# a few device calls run back to back (the host is given back 30 s after a call;
# /opt and /tmp go with it). The plan, with each call's carry list, command and
# time, is at the end of docs/evidence.md.
#
#   bash scripts/proofs/gpu_session.sh STEP
#
#   b1       unpack .devbundle/b1, install .whl into /tmp/pk, start building the
#            models in the background (setsid: it outlives the call)
#   b3       unpack .devbundle/b3 (vLLM's _moe_C, from ../shared/device/make-bundles.sh)
#   b2       unpack .devbundle/b2, keep an unpatched hard-linked copy of vLLM in
#            /opt/pristine, apply the default set to /opt/site, check _moe_C
#            loads, start the proofs in the background, wait, pack
#   collect  wait for the proofs and the benchmark, pack
#   more     a second plan on the host an earlier plan's b1 and b2 left warm (vLLM
#            unpacked and patched; give it its own GS_DIR): unpack .devbundle/b3 if
#            carried, build this plan's models and start its proofs (both detached),
#            wait, pack; then `collect` with the same GS_DIR
#   dry      (CPU, here) the plan's commands without GPU work: argument parsing,
#            packing; DRY=1 in the environment makes every step print, not run
#
# GS_PLAN=v2 (one GPU, about 1,200 s; calls b1, b3, b2, collect): Model Runner V2 on
# vLLM 0.26.0 (VLLM_USE_V2_MODEL_RUNNER=1 for every run): the nan-probe proof under V2
# (GS_V2_PROOFS, default torch-cudagraph: under CUDA graphs, the quarantine record and
# the report naming the poisoned tensor and layer; the log's header must say "v2";
# triton-eager adds the NaN named by layer and projection), then `verify --e2e` (the
# torch path's answers against the reference, base rows, under V2), then the serving
# benchmark of the default set against unpatched under V2 (LoRA decode batch 1 and 64,
# LoRA prefill; interleaved rounds) until GS_BENCH_END, one after another on GPU 0.
# GS_PLAN=probe (nan-probe only, about 1,100 s; calls b1, b2, collect; no b3): the
# nan-probe proof on GPU 1, then the serving benchmark's rounds on GPU 0 (its
# engines start at once, its rounds wait for the proof), until GS_BENCH_END.
# GS_PROBE_GPU=0 puts the proof on GPU 0 too, for a one-GPU host: the benchmark
# then starts after the proof (two engines profiling memory at once on one GPU
# count each other's allocations: docs/evidence.md).
# GS_PLAN=probe GS_V2=1: the same under Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1 for
# every engine; the proof runs GS_V2_PROOFS, default torch-cudagraph, with --runner v2).
# GS_BENCH_WORKLOADS="W ..." (probe and v2 plans): the benchmark's workloads, fewer for
# more rounds of each in a short sitting (e.g. decode_b1_lora decode_b64_lora prefill_lora).
# GS_FIRST="COMMAND" (any plan): run first in the proofs step, alone on the GPU, its
# output in first.log, inside GS_BENCH_END (e.g. another proof of the same sitting).
# GS_PLAN=rule (one GPU; calls b1, b3, b2, collect): verify's rule on the 35B-A3B-wide
# MoE, the healthy adapter with its engine-side controls and vLLM with an injected bug
# (rule_runs below); with GS_SEEDS="2 3 ..." the healthy adapter at each seed instead,
# and with GS_RULE_DENSE=1 then the dense 27B-wide cut (rule_seeds).
# GS_PLAN=tail (what is left when a sitting loses its host, about 500 s): model-tp2
# and poison side by side, no benchmark; calls b1 then b2 (GS_WAIT bounds it).
# GS_PLAN=short (a second sitting with about 600 s of device time): no stand-in
# build, and the proofs are e2e-tp1 and model-tp1 side by side on GPU 1 while
# the benchmark has GPU 0 to itself, its rounds from the start (no wait for the
# proofs), until GS_BENCH_END.
# GS_PLAN=serving (one H200, about 1,300-1,600 s; calls b1, b3, b2, collect): the
# serving benchmark alone, unpatched against the default set, on the adapter sets
# of GS_SETS (default "m8=moe35b:8x16 d16=dense27b:16x64"; NAME=MODEL:COUNTxRANK,
# optionally :CONFIG,CONFIG for bench_serving's --configs (default "default"); MODEL
# may be MODEL@LAYERS for a deeper cut, e.g. dense27b@32; a later set of a model
# and depth links the first one's weights; the sets named in GS_LINKED build with
# --linked-adapters: one adapter's weights on /dev/shm under every name). Every
# set's engines start together; then, one set at a time, the others idle: decode
# batch 1 and 4 rounds (legs of GS_LEG_S seconds, 2 by default), then batch 64 and
# prefill rounds (GS_B64=0 leaves them out), for the sets named in GS_MEASURE
# (default all; - for none), and last the workloads of GS_PROFILE (default
# "decode_b1 decode_b4") once under the torch profiler (`bench_serving.py profile`,
# GS_PROFILE_S seconds a set, 150 by default) on the sets of GS_PROFILE_SETS
# (default all; - for none), within GS_BENCH_END (1,300 s for this plan) of the
# start. GS_B64_S (0: an equal share of the time) keeps that many seconds a set for
# batch 64 and prefill. GS_W14 and GS_W64 name other workloads for the two kinds of
# rounds (a short sitting that measures only the cells still open: GS_W14=decode_b1
# GS_W64=prefill). GS_POISON=1 runs, before the engines start, verify with a
# poisoned adapter on the default set's torch path (poison-torch: it must FAIL on
# `poisoned` only, the quarantine line naming it in its engines' logs; about 300 s
# of GS_BENCH_END). GS_KERNELS=1 runs verify's GPU kernel checks (no --e2e, no
# --model) on the default set first, alone (kernels.txt); GS_HOST_BENCH=1 then the
# LoRA op's host time a call (lora-host-R-N.json: round R, this tree's module as N=0,
# then those of GS_HOST_BEFORE, earlier commits' module files; GS_HOST_ROUNDS rounds).
# GS_KV_GIB (4) is each engine's KV cache: less of it fits more engines on the GPU.
# GS_PIN=1 gives each engine CPUs of its own (bench_serving's BENCH_CPUS; b1 writes
# the host's CPU topology into cpus.txt).
# Meanwhile clocks.log (the GPU's clocks, power and throttle reasons) and cpu.log
# (the guest's /proc/stat) are written once a second, mem.log (/proc/meminfo) every 5 s.
#
# Each step writes one archive, $OUT/gs-STEP.tar.gz (results under /tmp/gs,
# weights and caches left out), and prints a summary. Wait limits are in
# seconds since the step began (SECONDS), so a call ends inside its 600 s.
#
# The proofs (step `proofs`, started by b2), in three lanes:
#   lane 1: e2e-tp2 (both GPUs), then model-tp2 (both GPUs)
#   lane 2: e2e-tp1 (GPU 1), then poison (GPU 1), then probe (GPU 1)
#   lane 3: model-tp1 (GPU 0), then the nan-probe benchmark (GPU 0): its
#           engines start, its rounds wait for lanes 1 and 2 (proofs.done)
# e2e-*:     verify --e2e (dense and MoE) at TP=1 / TP=2
# model-*:   verify --model on the Qwen3.5-27B-wide cut (4 layers) with two
#            rank-128 adapters (scripts/proofs/verify_model_gpu.py --preset wide27b)
# poison:    verify --model on the 8-layer stand-in with `full` and `poisoned`
#            (inf in one lora_B), PATCHKIT_LORA_BACKEND=triton: must FAIL
#            naming `poisoned`
# probe:     scripts/proofs/nan_probe_gpu.py --proofs triton-cudagraph --no-bench on
#            /opt/probe (default set + nan-probe): the report names layer 1
#            mlp.down_proj under CUDA graphs, healthy phase 0 records (the probe
#            proof again, with the probe's Triton row kernel)
# bench:     scripts/bench_probe_gpu.py (the probe's kernels in a CUDA graph), then
#            scripts/bench_serving.py, default against default+nan-probe
#            (PATCHKIT_PROBE_LOG set), CUDA graphs, interleaved rounds
set -u
STEP=${1:?usage: gpu_session.sh b1|b3|b2|collect|proofs|build|dry}
G=${GS_DIR:-/tmp/gs}
REPO=$(pwd)
OUT=${OUT:-$G/out}
SEED=${GS_SEED:-11}
RUN_LIMIT=${GS_RUN_LIMIT:-1500}     # one verify run, at most
BENCH_END=${GS_BENCH_END:-1100}     # the benchmark ends this long after the proofs start
[ "${GS_PLAN:-}" = serving ] && BENCH_END=${GS_BENCH_END:-1300}
# GS_PLAN=v2: every engine of the sitting on Model Runner V2 (0.19.0-0.33.0 read it)
[ "${GS_PLAN:-}" = v2 ] && export VLLM_USE_V2_MODEL_RUNNER=1
# GS_V2=1 with GS_PLAN=probe: the probe plan on Model Runner V2 (the proof's engines
# and both benchmark engines, default and default+nan-probe); GS_V2_PROOFS picks the proofs
[ "${GS_V2:-0}" = 1 ] && export VLLM_USE_V2_MODEL_RUNNER=1
SETS=${GS_SETS:-m8=moe35b:8x16 d16=dense27b:16x64}
export PYTHONUNBUFFERED=1
# The host keeps NVLink multicast off (KINDS.md); every child inherits these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$G" "$OUT"

say() { echo "[gs $(date +%H:%M:%S) +${SECONDS}s] $*"; }
do_() { if [ -n "${DRY:-}" ]; then echo "DRY: $*"; else "$@"; fi; }
site_path() { export PYTHONPATH=/opt/site:/opt/site/deps:$REPO/.devtools:$REPO:/tmp/pk; }
# The background steps run from a copy of the repository under $G, so the next
# call's copy of the working tree never changes a file under a running process.
# b1 takes one for the build and b2 a new one for the proofs ($G/repo-STEP): a fix
# made here between a sitting's calls reaches the proofs.
snapshot() {
  [ -d "$G/repo-$1/patchkit" ] && return
  mkdir -p "$G/repo-$1"
  cp -a patchkit scripts patches pyproject.toml .devtools "$G/repo-$1/"
}

# pack NAME: the small files under $G (no weights, compile caches, vLLM trees)
pack() {
  local tarball=$OUT/gs-$1.tar.gz limit=${2:-3M}
  (cd "$G" && find . -type f -size -"$limit" ! -name '*.safetensors' ! -name '*.pt' \
    ! -path './out/*' ! -path './repo-*' ! -path '*/vllm-cache*' ! -path './bench/cache/*' \
    ! -path './bench/sites/*' ! -path '*/torch_compile_cache/*' ! -path './bench-*/sites/*' \
    ! -path './bench-*/cache/*' ! -path './bench-*/profiles/*' -print0 |
    tar czf "$tarball" --null -T -)
  if [ "$(stat -c %s "$tarball")" -gt 15000000 ]; then
    [ "$limit" = 300k ] || { pack "$1" 300k; return; }
  fi
  say "packed $(stat -c %s "$tarball") bytes into $tarball"
}

# summary: each run's verdict and time, the checks that failed (for output_tail)
summary() {
  for f in "$G"/*.txt; do
    [ -e "$f" ] || continue
    case $(basename "$f") in
      e2e-* | model-* | poison* | probe.txt | kernels.txt)
        echo "== $(basename "$f" .txt): $(grep -E '^(verify|probe) (PASSED|FAILED)' "$f" | tail -1)" \
          "| $(tail -1 "$f")"
        grep -q '^exit ' "$f" || echo "   running: $(tail -1 "${f%.txt}.err" 2>/dev/null | cut -c1-150)"
        grep -E 'FAIL {2,}' "$f" | cut -c1-160 | head -8
        case $(basename "$f") in poison.txt | poison-torch.txt)
          echo "   failed rows naming poisoned: $(grep -E 'FAIL {2,}' "$f" | grep -c poisoned)," \
            "naming full: $(grep -E 'FAIL {2,}' "$f" | grep -c ' full ')" ;;
        esac
        # verify serves an adapter NAME as patchkit-NAME; its engines log under --keep/model
        [ "$(basename "$f")" = poison-torch.txt ] &&
          echo "   quarantine lines naming poisoned in its engines' logs:" \
            "$(cat "$G"/poison-torch/model/vllm-*.log 2>/dev/null |
              grep -c "patchkit LoRA torch path: adapter 'patchkit-poisoned'")"
        ;;
    esac
  done
  for f in "$G"/rule-s*.txt; do # GS_SEEDS: each seed's verdict, or where it is
    [ -e "$f" ] && { echo "== $(basename "$f" .txt)"; tail -n 12 "$f"; }
  done
  if [ -f "$G/rule.txt" ]; then # GS_PLAN=rule: each run's verdict, or where it is
    echo "== rule: $(tail -n 2 "$G/inject.txt" 2>/dev/null | tr '\n' ' ')"
    tail -n 24 "$G/rule.txt"
    for e in "$G"/rule/*.err; do
      [ -e "$e" ] && echo "   $(basename "$e"): $(tail -n 1 "$e" | cut -c1-150)"
    done
  fi
  [ -f "$G/probe/summary.json" ] && python3 -c "import json,sys; \
s = json.load(open(sys.argv[1]))['proofs']; print({k: v.get('checks', v) for k, v in s.items()})" \
    "$G/probe/summary.json" 2>&1 | cut -c1-600
  [ -f "$G/probe-kernels.txt" ] && grep -v '^check ' "$G/probe-kernels.txt" | tail -8
  for f in "$G"/lora-host-*.txt; do # GS_HOST_BENCH: microseconds a call, per route
    [ -e "$f" ] && { echo "== $(basename "$f" .txt)"; grep -o '"route.*' "$f" | tr -d '"{}' | head -14; }
  done
  [ -f "$G/bench/serving.md" ] && head -12 "$G/bench/serving.md"
  for f in "$G"/serving-*.md; do [ -e "$f" ] && { echo "== $(basename "$f")"; grep '^|' "$f" | head -14; }; done
  [ -f "$G/bench.log" ] && tail -3 "$G/bench.log"
  tail -2 "$G/smi.log" 2>/dev/null
}

# wait_for FILE UNTIL: until FILE exists or SECONDS reaches UNTIL
wait_for() {
  while [ ! -e "$1" ] && [ "$SECONDS" -lt "$2" ]; do sleep 5; done
  [ -e "$1" ]
}

# one NAME: one verify run, its report in $G/NAME.txt, its --keep folder $G/NAME
one() {
  local name=$1 start=$SECONDS
  local w=$G/wide u=$G/user
  local args=(--seed "$SEED" --keep "$G/$name")
  local env=()
  case $name in
    e2e-tp1) env=(CUDA_VISIBLE_DEVICES=1) args+=(--e2e --tensor-parallel-size 1) ;;
    e2e-v2) env=(CUDA_VISIBLE_DEVICES=0) args+=(--e2e --tensor-parallel-size 1) ;;
    e2e-tp2) args+=(--e2e --tensor-parallel-size 2) ;;
    model-tp1 | model-tp2)
      [ "$name" = model-tp1 ] && env=(CUDA_VISIBLE_DEVICES="${GS_MODEL_GPU:-0}")
      args+=(--model "$w/model" --lora "full=$w/full" --lora "attn-mlp=$w/attn-mlp"
        --tensor-parallel-size "${name#model-tp}")
      ;;
    poison | poison-torch)
      env=(CUDA_VISIBLE_DEVICES=1 PATCHKIT_LORA_BACKEND=triton)
      # poison-torch: the default set's own LoRA path, the quarantine, on one GPU
      [ "$name" = poison-torch ] && env=(CUDA_VISIBLE_DEVICES=0)
      args+=(--model "$u/model" --lora "full=$u/full" --lora "poisoned=$u/poisoned")
      ;;
    kernels) env=(CUDA_VISIBLE_DEVICES=0) ;; # verify's GPU kernel checks alone (no --e2e, --model)
    probe) # not a verify run: the nan-probe proof on its own tree
      say "start probe: nan_probe_gpu.py on /opt/probe"
      local probe_args=(--budget 300 --proofs triton-cudagraph --no-bench) limit=330
      [ "${GS_PLAN:-}" = v2 ] || [ "${GS_V2:-0}" = 1 ] && probe_args=(--budget 300 --proofs "${GS_V2_PROOFS:-torch-cudagraph}" \
        --serial --no-bench --runner v2) limit=330
      do_ env CUDA_VISIBLE_DEVICES="${GS_PROBE_GPU:-1}" PYTHONPATH="/opt/probe:/opt/site/deps:$REPO/.devtools:$REPO:/tmp/pk" \
        timeout "$limit" python3 scripts/proofs/nan_probe_gpu.py "$G/probe" "${probe_args[@]}" \
        >"$G/probe.txt" 2>"$G/probe.err"
      local rc=$?
      echo "probe $([ $rc = 0 ] && echo PASSED || echo FAILED) (nan_probe_gpu.py checks)" >>"$G/probe.txt"
      echo "exit $rc after $((SECONDS - start)) s" >>"$G/probe.txt"
      say "end probe: exit $rc after $((SECONDS - start)) s"
      return
      ;;
    *) echo "unknown run $name" >&2; return 2 ;;
  esac
  say "start $name: ${env[*]} patchkit verify ${args[*]}"
  do_ env "${env[@]}" timeout "$RUN_LIMIT" python3 -m patchkit verify "${args[@]}" \
    >"$G/$name.txt" 2>"$G/$name.err"
  local rc=$?
  echo "exit $rc after $((SECONDS - start)) s" >>"$G/$name.txt"
  say "end $name: exit $rc after $((SECONDS - start)) s"
  # a --model run's served.json (4 MB on the wide MoE) is over what pack keeps: its xz
  [ -f "$G/$name/model/served.json" ] && xz -9 -k "$G/$name/model/served.json"
  return 0
}

lane() { for run in "$@"; do one "$run"; done; }

# GS_PLAN=rule: verify's rule on the 35B-A3B-wide MoE (scripts/proofs/verify_moe_proof.sh):
# the healthy adapter with its engine-side controls, and the same on a hard-linked copy
# of the site with scripts/proofs/inject_engine_bug.py's bug (/opt/bugged), side by side
# on GPU 0; GS_RULE_RUNS picks the runs, GS_SEED the prompts' seed (VMP_ONE_AT_A_TIME and
# VMP_BUG_REFERENCE pass through to verify_moe_proof.sh: one run at a time on an H100)
rule_runs() {
  if [ -n "${GS_SEEDS:-}" ]; then
    rule_seeds
    return
  fi
  do_ rm -rf /opt/bugged
  do_ mkdir -p /opt/bugged
  do_ cp -al /opt/site/vllm /opt/site/vllm-*.dist-info /opt/bugged/
  do_ python3 scripts/proofs/inject_engine_bug.py /opt/bugged >"$G/inject.txt" 2>&1
  say "rule: ${GS_RULE_RUNS:-healthy engine-bug}, seed $SEED"
  do_ env CUDA_VISIBLE_DEVICES=0 VMP_RUNS="${GS_RULE_RUNS:-healthy engine-bug}" \
    VMP_BUGGED_SITE=/opt/bugged VMP_SEED="$SEED" timeout "$RUN_LIMIT" \
    bash scripts/proofs/verify_moe_proof.sh "$G/rule" "${GS_RULE_LIMIT:-900}" >"$G/rule.txt" 2>&1
  say "rule: exit $?"
}

# GS_SEEDS="2 3 4 5" (GS_PLAN=rule): the healthy adapter of the 35B-A3B-wide cut at each
# seed, one run after another on GPU 0, each in $G/rule-sN (rule-sN.txt: its summary),
# --max-model-len GS_RULE_LEN (4112: a 4096-token prompt; 16400 for 16384 tokens);
# then, with GS_RULE_DENSE=1, the dense 27B-wide cut with its two adapters and their
# controls (the run model-tp1, $G/wide built by the build step)
rule_seeds() {
  for seed in $GS_SEEDS; do
    do_ mkdir -p "$G/rule-s$seed"
    do_ ln -sfn "$G/rule/user" "$G/rule-s$seed/user"
    say "rule: healthy, seed $seed"
    do_ env CUDA_VISIBLE_DEVICES=0 VMP_RUNS=healthy VMP_SEED="$seed" VMP_ONE_AT_A_TIME=1 \
      timeout "$RUN_LIMIT" bash scripts/proofs/verify_moe_proof.sh "$G/rule-s$seed" \
      "${GS_RULE_LIMIT:-900}" "${GS_RULE_LEN:-4112}" >"$G/rule-s$seed.txt" 2>&1
    say "rule: seed $seed exit $?"
  done
  [ "${GS_RULE_DENSE:-0}" = 1 ] && GS_MODEL_GPU=0 one model-tp1
}

# GS_HOST_ROUNDS (1) rounds, each module once a round, in reverse order every other
# round (ABBA): the host's speed drifts between runs by up to a quarter
# (2026-12-02k), so modules are compared round by round, not by one run each
host_bench() {
  local module n round modules=("" ${GS_HOST_BEFORE:-}) order
  for round in $(seq 1 "${GS_HOST_ROUNDS:-1}"); do
    order=$(seq 0 $((${#modules[@]} - 1)))
    [ $((round % 2)) = 0 ] && order=$(seq $((${#modules[@]} - 1)) -1 0)
    for n in $order; do
      module=${modules[$n]}
      say "host bench round $round: ${module:-(this tree)}"
      do_ env CUDA_VISIBLE_DEVICES=0 timeout 120 python3 scripts/bench_lora_host.py --device cuda \
        ${module:+--module "$module"} --json "$G/lora-host-$round-$n.json" \
        >"$G/lora-host-$round-$n.txt" 2>&1
    done
  done
}

# detach COPY STEP: run STEP from a snapshot $G/repo-COPY in a session of its own
# that outlives the call, its output in $G/STEP.log. The subshell's own descriptors
# go to /dev/null too: the backgrounded `cd && setsid` list forks a shell that waits
# for STEP, and that shell held the call's stdout, so a call whose output went
# through a pipe (`b2 | tail`) lasted as long as the step (2026-12-02: b2 ran to its
# 600 s limit, not GS_WAIT's 480)
detach() {
  snapshot "$1"
  (cd "$G/repo-$1" && setsid nohup bash scripts/proofs/gpu_session.sh "$2" >"$G/$2.log" 2>&1 </dev/null &) \
    >/dev/null 2>&1 </dev/null
}

bench() {
  local left=$((BENCH_END - SECONDS))
  say "bench: engines start now, rounds after proofs.done, $left s in all"
  [ "$left" -gt 300 ] || { say "bench: too little time left ($left s), not started"; return; }
  # the probe's kernels alone, replayed in a CUDA graph (about 20 s): what a step's
  # probed points cost on the device, apart from the serving benchmark's whole
  do_ env CUDA_VISIBLE_DEVICES=0 timeout 120 python3 scripts/bench_probe_gpu.py \
    >"$G/probe-kernels.txt" 2>&1
  local after=(--after "$G/proofs.done")
  [ "${GS_PLAN:-}" = short ] && after=()
  # The parent imports the unpatched tree (for its version); each engine its own site.
  # GS_PLAN=v2: the default set against unpatched, LoRA only, under Model Runner V2
  local compare=(--base default --configs default+nan-probe)
  [ "${GS_PLAN:-}" = v2 ] && compare=(--base unpatched --configs default
    --workloads decode_b1_lora decode_b64_lora prefill_lora)
  do_ env PYTHONPATH="/opt/pristine:/opt/site/deps:$REPO/.devtools:$REPO:/tmp/pk" \
    CUDA_VISIBLE_DEVICES=0 timeout $((left + 60)) \
    python3 scripts/bench_serving.py run "$G/bench" --site /opt/pristine "${compare[@]}" \
    --rounds 40 --deadline "$left" "${after[@]}" ${GS_BENCH_WORKLOADS:+--workloads $GS_BENCH_WORKLOADS} \
    --json "$G/bench/serving.json" --markdown "$G/bench/serving.md" >"$G/bench.log" 2>&1
  say "bench: exit $?"
}

# build_sets: each set of GS_SETS built on /dev/shm (the MoE's weights are 13.6 GB), the
# first set of a model writing the weights and the others linking them; each set's
# work folder $G/bench-NAME (beside /opt, for the hard-linked trees) links its files
build_sets() {
  local set name model count rank layers from
  local -A first=() # the first set of each model and depth: the others link its weights
  for set in $SETS; do
    name=${set%%=*} model=${set#*=} count=${model#*:} model=${model%%:*}
    count=${count%%:*} rank=${count#*x} count=${count%x*} layers=8 from=()
    case $model in *@*) layers=${model#*@} model=${model%@*} ;; esac
    [ -n "${first[$model@$layers]:-}" ] && from=(--model-from "${first[$model@$layers]}")
    local linked=()
    [[ " ${GS_LINKED:-} " == *" $name "* ]] && linked=(--linked-adapters)
    do_ python3 scripts/bench_serving.py build "/dev/shm/gs-bench/$name" --model "$model" \
      --adapters "$count" --rank "$rank" --layers "$layers" "${from[@]}" "${linked[@]}" \
      >"$G/build-$name.txt" 2>&1
    echo "exit $?" >>"$G/build-$name.txt"
    first[$model@$layers]=${first[$model@$layers]:-/dev/shm/gs-bench/$name}
    mkdir -p "$G/bench-$name"
    for entry in /dev/shm/gs-bench/"$name"/*; do [ -e "$entry" ] && ln -sfn "$entry" "$G/bench-$name/"; done
  done
}

# build_user: the 8-layer stand-in verify's poison runs serve, with its poisoned adapter
build_user() {
  do_ python3 scripts/proofs/verify_model_gpu.py "$G/user" --poison full >"$G/build-user.txt" 2>&1
  echo "exit $?" >>"$G/build-user.txt"
}

# set_configs SET: the configurations a GS_SETS entry names beside unpatched (default)
set_configs() {
  local configs=${1#*=}
  configs=${configs#*:}
  case $configs in *:*) echo "${configs#*:}" ;; *) echo default ;; esac
}

# set_engines SET: how many engines a GS_SETS entry starts (its configurations and unpatched)
set_engines() {
  local configs
  configs=$(set_configs "$1")
  echo $((2 + $(tr -cd , <<<"$configs" | wc -c)))
}

# serving: the GS_PLAN=serving benchmark (see the header), unpatched /opt/pristine
# against the default set
serving() {
  local set name configs left sets=() starts=() leg=${GS_LEG_S:-2}
  local measure=() profiled=() profile_s=${GS_PROFILE_S:-150} b64=${GS_B64:-1}
  for set in $SETS; do sets+=("${set%%=*}"); done
  read -r -a measure <<<"${GS_MEASURE:-${sets[*]}}"
  [ "${measure[*]}" = - ] && measure=() # GS_MEASURE=-: no rounds, the profile alone
  read -r -a profiled <<<"${GS_PROFILE_SETS:-${sets[*]}}"
  [ "${profiled[*]}" = - ] && profiled=() # GS_PROFILE_SETS=-: no profile
  read -r -a profile_kinds <<<"${GS_PROFILE:-decode_b1 decode_b4}"
  # GS_POISON=1: first, alone on the GPU, verify with a poisoned adapter on the default
  # set's own LoRA path (must FAIL naming poisoned only; the quarantine line in its logs)
  [ "${GS_POISON:-0}" = 1 ] && RUN_LIMIT=${GS_POISON_LIMIT:-420} one poison-torch # 254-283 s so far
  # GS_KERNELS=1: verify's kernel checks on the default set (29 s on 2026-12-01h), alone
  [ "${GS_KERNELS:-0}" = 1 ] && RUN_LIMIT=180 one kernels
  # GS_HOST_BENCH=1: the LoRA op's host time a call (scripts/bench_lora_host.py), the
  # working tree's module and each module file of GS_HOST_BEFORE (an earlier commit's),
  # GS_HOST_ROUNDS rounds
  [ "${GS_HOST_BENCH:-0}" = 1 ] && host_bench
  clock_log &
  local clocks=$!
  local bs=(env PYTHONPATH="/opt/pristine:/opt/site/deps:$REPO/.devtools:$REPO:/tmp/pk"
    BENCH_GPU_MEMORY=0.10 BENCH_KV_GIB="${GS_KV_GIB:-4}" python3 scripts/bench_serving.py)
  say "serving: starting the engines of ${sets[*]}"
  local engines=0 each=0 first=0 pin=()
  for set in $SETS; do engines=$((engines + $(set_engines "$set"))); done
  [ "${GS_PIN:-0}" = 1 ] && each=$(($(nproc) / engines))
  for set in $SETS; do
    name=${set%%=*} configs=$(set_configs "$set")
    if [ "$each" -gt 0 ]; then # GS_PIN=1: each engine CPUs of its own (cpu_shares)
      local count=$(($(set_engines "$set") * each))
      pin=(BENCH_CPUS="$first-$((first + count - 1))")
      first=$((first + count))
    fi
    do_ env "${pin[@]}" "${bs[@]}" run "$G/bench-$name" --site /opt/pristine --configs ${configs//,/ } \
      --workloads decode_b1 decode_b4 --rounds 0 --keep --leg-seconds "$leg" \
      --deadline $((BENCH_END - SECONDS)) >"$G/serving-start-$name.log" 2>&1 &
    starts+=($!)
  done
  wait "${starts[@]}" # not a bare wait: the proofs step's GPU monitor runs until all.done
  say "serving: engines up"
  # GS_B64_S (0: an equal share) keeps that many seconds a set for batch 64 and
  # prefill, whose rounds vary less than batch 1 and 4 and need fewer of them
  local profiles=$((profile_s * ${#profiled[@]})) shares=$((${#measure[@]} * (1 + b64)))
  local kept=$((b64 * ${GS_B64_S:-0} * ${#measure[@]}))
  [ "$kept" -gt 0 ] && shares=${#measure[@]}
  # GS_RELOAD_S (60; 0: none) a set for reload_lora, after batch 64 and prefill
  local reload_s=${GS_RELOAD_S:-60}
  local reloads=$((reload_s * ${#measure[@]}))
  # more's --rounds is the last round's number, counted from the run's first round
  # across every step, not this step's count: the deadlines alone end the rounds
  # (2026-12-03c's prefill stopped at round 99, 270 s before its deadline)
  local last_round=9999
  for name in "${measure[@]}"; do # batch 1 and 4: their share of what is left
    left=$(((BENCH_END - SECONDS - profiles - reloads - kept) / shares))
    do_ "${bs[@]}" more "$G/bench-$name" --rounds "$last_round" --deadline "$left" --keep \
      --workloads ${GS_W14:-decode_b1 decode_b4} \
      --markdown "$G/serving-b14-$name.md" >"$G/serving-b14-$name.log" 2>&1
    say "serving: $name batch 1 and 4 done"
    shares=$((shares - 1))
  done
  [ "$kept" -gt 0 ] && shares=${#measure[@]}
  for name in "${measure[@]}"; do # batch 64 and prefill with what is left
    [ "$b64" = 1 ] || break
    left=$(((BENCH_END - SECONDS - profiles - reloads) / shares))
    do_ "${bs[@]}" more "$G/bench-$name" --rounds "$last_round" --deadline "$left" --keep \
      --workloads ${GS_W64:-decode_b64 prefill} --json "$G/serving-$name.json" \
      --markdown "$G/serving-$name.md" >"$G/serving-$name.log" 2>&1
    say "serving: $name batch 64 and prefill done"
    shares=$((shares - 1))
  done
  for name in "${measure[@]}"; do # the adapters' reload, last of the rounds: new, and
    [ "$reload_s" -gt 0 ] || break # what it runs cannot cost the rounds above
    do_ "${bs[@]}" more "$G/bench-$name" --rounds "$last_round" --deadline "$reload_s" --keep \
      --workloads reload --markdown "$G/serving-reload-$name.md" \
      >"$G/serving-reload-$name.log" 2>&1
    say "serving: $name reload done"
  done
  # Last: once vLLM's profiler has run, every later step of that engine annotates
  # itself for it (gpu_worker.annotate_profile), which the rounds must not carry.
  for name in "${profiled[@]}"; do
    do_ "${bs[@]}" profile "$G/bench-$name" --workloads "${profile_kinds[@]}" \
      --deadline $((profile_s - 10)) --markdown "$G/serving-profile-$name.md" \
      >"$G/serving-profile-$name.log" 2>&1
    say "serving: $name profiled; its engines stopped"
  done
  for name in "${sets[@]}"; do # the sets not profiled: their engines stop too
    [[ " ${profiled[*]} " == *" $name "* ]] && continue
    do_ "${bs[@]}" stop "$G/bench-$name" >"$G/serving-stop-$name.log" 2>&1
    say "serving: $name engines stopped"
  done
  kill "$clocks" 2>/dev/null
}

# clock_log: the GPU's clocks, power and throttle reasons once a second
# ($G/clocks.log, one nvidia-smi that stays up: a process a second would be host
# noise of its own) and the guest's CPU counters (cpu.log), so that a slow leg
# (its "wall" in results.json) can be told apart as the GPU's clocks or the host's CPU
clock_log() {
  local fields=timestamp,clocks.sm,clocks.mem,power.draw,pstate,temperature.gpu,utilization.gpu
  local reasons=clocks_event_reasons.active
  nvidia-smi --query-gpu=$reasons --format=csv,noheader >/dev/null 2>&1 ||
    reasons=clocks_throttle_reasons.active
  [ -n "${DRY:-}" ] && { echo "DRY: clock_log $fields,$reasons"; return; }
  echo "# $fields,$reasons" >"$G/clocks.log"
  nvidia-smi --query-gpu=$fields,$reasons --format=csv,noheader -lms 1000 >>"$G/clocks.log" 2>&1 &
  local smi=$!
  trap 'kill $smi 2>/dev/null; exit 0' TERM
  echo "# epoch; /proc/stat cpu: user nice system idle iowait irq softirq steal" >"$G/cpu.log"
  echo "# epoch; /proc/meminfo kB (KiB: 1024 bytes): MemAvailable Shmem AnonPages Unevictable" >"$G/mem.log"
  local tick=0
  while true; do
    read -r line </proc/stat
    echo "$EPOCHREALTIME; $line" >>"$G/cpu.log"
    ((tick++ % 5)) || mem_line >>"$G/mem.log"
    sleep 1
  done
}

# mem_line: the host's memory every 5 s (mem.log), with bash builtins only (no process
# a sample): what the models on /dev/shm and each engine's pinned adapter copies leave
# free, which bounds how deep a sitting's cuts and how many its engines can be
mem_line() {
  local key value rest available shmem anon unevictable
  while read -r key value rest; do
    case $key in
      MemAvailable:) available=$value ;;
      Shmem:) shmem=$value ;;
      AnonPages:) anon=$value ;;
      Unevictable:) unevictable=$value ;;
    esac
  done </proc/meminfo
  echo "$EPOCHREALTIME; $available $shmem $anon $unevictable"
}

case $STEP in
  b1)
    do_ bash .devtools/unpack.sh .devbundle/b1
    do_ python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/pk .whl/*.whl
    nvidia-smi >"$G/nvidia-smi.txt" 2>&1
    # which vCPUs share a core: what GS_PIN's CPU runs are to be read against
    (lscpu; lscpu -e; grep . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list) \
      >"$G/cpus.txt" 2>&1
    # the room the builds and engines have: /dev/shm holds the models and adapters
    (free -g; df -h /dev/shm /tmp /opt) >"$G/room.txt" 2>&1
    cat "$G/room.txt"
    say "building the models in the background (build.log)"
    detach b1 build
    sleep "${GS_SLEEP:-20}"
    tail -5 "$G/build.log"
    pack b1
    ;;
  build) # background, from b1: transformers + PEFT on the GPU, no vLLM
    if [ "${GS_PLAN:-}" = rule ]; then # the 35B-A3B-wide stand-in alone, where the runs read it
      mkdir -p "$G/rule"
      do_ python3 scripts/proofs/verify_model_gpu.py "$G/rule/user" --preset wide35b --poison a0 \
        >"$G/rule/build.txt" 2>&1
      echo "exit $?" >>"$G/rule/build.txt"
      if [ "${GS_RULE_DENSE:-0}" = 1 ]; then # and the dense 27B-wide cut (rule_seeds)
        do_ python3 scripts/proofs/verify_model_gpu.py "$G/wide" --preset wide27b >"$G/build-wide.txt" 2>&1
        echo "exit $?" >>"$G/build-wide.txt"
      fi
      touch "$G/build.done"
      exit 0
    fi
    if [ "${GS_PLAN:-}" = serving ]; then
      if [ "${GS_POISON:-0}" = 1 ]; then # the stand-in and its poisoned adapter
        build_user &
      fi
      build_sets
      wait
      touch "$G/build.done"
      exit 0
    fi
    if [ "${GS_PLAN:-}" != probe ] && [ "${GS_PLAN:-}" != v2 ]; then
      (do_ python3 scripts/proofs/verify_model_gpu.py "$G/wide" --preset wide27b >"$G/build-wide.txt" 2>&1
        echo "exit $?" >>"$G/build-wide.txt") &
    fi
    if [ "${GS_PLAN:-}" != short ] && [ "${GS_PLAN:-}" != probe ] && [ "${GS_PLAN:-}" != v2 ]; then
      build_user &
    fi
    if [ "${GS_PLAN:-}" != tail ]; then
      (do_ python3 scripts/bench_serving.py build "$G/bench" >"$G/build-bench.txt" 2>&1
        echo "exit $?" >>"$G/build-bench.txt") &
    fi
    wait
    tail -n 3 "$G"/build-*.txt
    touch "$G/build.done"
    ;;
  b3)
    do_ bash .devtools/unpack.sh .devbundle/b3
    ls -l /opt/site/vllm/_moe_C* >"$G/moe-file.txt" 2>&1
    cat "$G/moe-file.txt"
    tail -n 3 "$G"/build-*.txt 2>/dev/null
    pack b3
    ;;
  b2)
    do_ bash .devtools/unpack.sh .devbundle/b2
    site_path
    if [ ! -d /opt/pristine/vllm ]; then # before patching: patchkit writes new files
      mkdir -p /opt/pristine
      do_ cp -al /opt/site/vllm /opt/site/vllm-*.dist-info /opt/pristine/
      mkdir -p /opt/probe # the probe proof's tree: default set + nan-probe
      do_ cp -al /opt/site/vllm /opt/site/vllm-*.dist-info /opt/probe/
    fi
    do_ python3 -m patchkit apply --target /opt/site >"$G/apply.txt" 2>&1
    cat "$G/apply.txt"
    (do_ python3 -m patchkit apply --target /opt/probe &&
      do_ python3 -m patchkit apply --only nan-probe --target /opt/probe) >"$G/apply-probe.txt" 2>&1
    tail -3 "$G/apply-probe.txt"
    do_ timeout 240 python3 -c "import torch, vllm._moe_C_stable_libtorch as m; \
print(m.__file__, torch.ops._moe_C.topk_softmax)" >"$G/moe-import.txt" 2>&1
    tail -2 "$G/moe-import.txt"
    wait_for "$G/build.done" 240 || say "models not built yet (build.log); proofs wait for them"
    detach b2 proofs
    wait_for "$G/all.done" "${GS_WAIT:-480}"
    summary
    pack b2
    ;;
  proofs) # background, from b2
    site_path
    wait_for "$G/build.done" 600 || say "build not done after 600 s; starting anyway"
    (while [ ! -e "$G/all.done" ]; do
      nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader |
        tr '\n' ' ' | sed "s/^/$(date +%T) /" >>"$G/smi.log"
      echo >>"$G/smi.log"
      sleep 30
    done) &
    SECONDS=0
    # GS_FIRST: a command run first, alone on the GPU, before the plan's runs (its
    # output in first.log; GS_BENCH_END counts its time): another proof of the sitting
    if [ -n "${GS_FIRST:-}" ]; then
      say "first: $GS_FIRST"
      do_ bash -c "$GS_FIRST" >"$G/first.log" 2>&1
      say "first: exit $? after $SECONDS s"
    fi
    if [ "${GS_PLAN:-}" = serving ]; then
      serving
      touch "$G/proofs.done" "$G/all.done"
      say "all done"
      exit 0
    fi
    if [ "${GS_PLAN:-}" = v2 ]; then
      # one GPU, one engine at a time (memory profiles count each other's allocations)
      (GS_PROBE_GPU=0 one probe; one e2e-v2; touch "$G/proofs.done"; bench) &
      p1=$!
      p2=$!
      p3=
    elif [ "${GS_PLAN:-}" = probe ] && [ "${GS_PROBE_GPU:-1}" = 0 ]; then
      # one GPU: an engine counts what others allocate during its memory
      # profile as its own (docs/evidence.md), so nothing starts beside it
      # GS_PROBE_PROOF=0: the benchmark alone (the proof ran in an earlier sitting)
      ([ "${GS_PROBE_PROOF:-1}" = 0 ] || one probe; touch "$G/proofs.done"; bench) &
      p1=$!
      p2=$!
      p3=
    elif [ "${GS_PLAN:-}" = probe ]; then
      one probe &
      p1=$!
      p2=$!
      bench &
      p3=$!
    elif [ "${GS_PLAN:-}" = rule ]; then
      rule_runs &
      p1=$!
      p2=$!
      p3=
    elif [ "${GS_PLAN:-}" = tail ]; then
      one model-tp2 &
      p1=$!
      one poison &
      p2=$!
      p3=
    elif [ "${GS_PLAN:-}" = short ]; then
      one e2e-tp1 &
      p1=$!
      (GS_MODEL_GPU=1 one model-tp1) &
      p2=$!
      bench &
      p3=$!
    else
      lane e2e-tp2 model-tp2 &
      p1=$!
      lane e2e-tp1 poison probe &
      p2=$!
      (one model-tp1; bench) &
      p3=$!
    fi
    wait "$p1" "$p2"
    touch "$G/proofs.done"
    say "proofs done"
    [ -n "$p3" ] && wait "$p3"
    touch "$G/all.done"
    say "all done"
    ;;
  more) # a second plan on a warm host: no b1 or b2 to unpack, the site already patched
    [ -d .devbundle/b3 ] && do_ bash .devtools/unpack.sh .devbundle/b3
    ls -l /opt/site/vllm/_moe_C* >"$G/moe-file.txt" 2>&1
    [ -n "${DRY:-}" ] || [ -d /opt/site/vllm ] || { say "no vLLM in /opt/site: run b1 and b2 of a plan first"; exit 1; }
    say "building this plan's models and starting its proofs in the background"
    detach more build
    detach more proofs # it waits for build.done
    wait_for "$G/all.done" "${GS_WAIT:-480}"
    summary
    pack more
    ;;
  collect)
    wait_for "$G/all.done" "${GS_WAIT:-540}"
    summary
    pack "collect-$(date +%H%M%S)"
    ;;
  dry) # on the CPU machine: every step's commands printed, packing and summary run
    export DRY=1 GS_DIR=${GS_DIR:-/tmp/gs-dry} GS_SLEEP=1
    rm -rf "$GS_DIR"
    for s in b1 b3 b2; do # b1 and b2 start build and proofs in the background
      GS_WAIT=1 bash scripts/proofs/gpu_session.sh "$s" || exit 1
    done
    GS_WAIT=60 bash scripts/proofs/gpu_session.sh collect
    tar tzf "$GS_DIR"/out/gs-collect-*.tar.gz
    ;;
  *)
    echo "unknown step $STEP" >&2
    exit 2
    ;;
esac
