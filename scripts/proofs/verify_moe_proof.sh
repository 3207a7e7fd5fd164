#!/usr/bin/env bash
# verify's MoE verdicts on one H200, in one command: the 35B-A3B-wide stand-in of
# scripts/proofs/verify_model_gpu.py (--preset wide35b: 8 layers 3 GDN : 1 attention, 256
# experts top 8, a rank-16 adapter on attention, GDN, shared and routed experts) built,
# then two verify runs side by side:
#   healthy   `--lora a0=...`, no --reference (verify picks; expected: the merged
#             reference undecided, the PEFT reference chosen, PASSED, exit 0, every
#             control rejected: "would have caught: 50 % strength, experts ignored,
#             adapter ignored")
#   poisoned  `--lora poisoned=...` (an inf in one lora_B) with --reference peft
#             (no merge needed; expected: FAILED, exit 1)
#   engine-bug (VMP_RUNS names it; VMP_BUGGED_SITE: a hard-linked copy of the serving
#             site with scripts/proofs/inject_engine_bug.py's bug in it, first on
#             PYTHONPATH) `--lora a0=...` as healthy (expected: FAILED, exit 1: the
#             bug is of no kind the controls make)
#   bash scripts/proofs/verify_moe_proof.sh OUT [LIMIT_S] [MAX_MODEL_LEN]
# VMP_RUNS (default "healthy poisoned") picks the runs, side by side; VMP_SEED (11) the
# seed of every run (the healthy adapter over seeds 1-5: one sitting each).
# VMP_ONE_AT_A_TIME=1: the runs one after another, in VMP_RUNS's order, each alone on
# the GPU (an H100 holds one wide run's engines and float32 reference, and a run's time
# alone is what verify's time target bounds). VMP_BUG_REFERENCE=peft: the
# engine-bug run names its reference (saves the merges, about 25 GiB, on a short sitting;
# the MoE's merged reference is undecided and verify picks PEFT anyway).
# OUT/<run>.txt is each verify's report with its exit status last, <run>.rss.json the
# peak host memory of its process tree (scripts/proofs/tree_rss.py), <run>.err its
# stderr, OUT/<run>/ its --keep directory (served.json and its .xz, vLLM's and PEFT's
# logs; the merged copies and each run's own compile cache, VLLM_CACHE_ROOT=OUT/cache-<run>,
# are removed to spare the disk).
set -u
out=$1
limit=${2:-450}
len=${3:-4112}
mkdir -p "$out"
start=$(date +%s)
[ -d "$out/user/model" ] || python3 scripts/proofs/verify_model_gpu.py "$out/user" --preset wide35b \
  --poison a0 >"$out/build.txt" 2>&1 || { echo "build failed"; tail -5 "$out/build.txt"; exit 1; }
echo "built in $(($(date +%s) - start)) s" >>"$out/build.txt"
u=$out/user
one() {
  local name=$1
  shift
  (
    begin=$(date +%s)
    site=
    [ "$name" = engine-bug ] && site="${VMP_BUGGED_SITE:?engine-bug needs VMP_BUGGED_SITE}:"
    PYTHONPATH="$site${PYTHONPATH:-}" VLLM_CACHE_ROOT="$out/cache-$name" \
      python3 scripts/proofs/tree_rss.py "$out/$name.rss.json" -- timeout "$limit" \
      python3 -m patchkit verify --seed "${VMP_SEED:-11}" --keep "$out/$name" \
      --model "$u/model" --max-model-len "$len" "$@" >"$out/$name.txt" 2>"$out/$name.err"
    echo "exit $? after $(($(date +%s) - begin)) s" >>"$out/$name.txt"
    rm -rf "$out/$name"/model/merged-* "$out/$name"/model/rounding-* "$out/cache-$name"
    # served.json (about 4 MB) is over what a sitting packs (3 MB): xz makes it 0.8 MB
    [ -f "$out/$name/model/served.json" ] && xz -9 -k "$out/$name/model/served.json"
  ) &
  if [ "${VMP_ONE_AT_A_TIME:-0}" = 1 ]; then wait; else sleep 20; fi # staggered: the runs do
  # not read free GPU memory at the same moment
}
runs=${VMP_RUNS:-healthy poisoned}
for run in $runs; do
  case $run in
  healthy) one healthy --lora "a0=$u/a0" ;;
  engine-bug) one engine-bug --lora "a0=$u/a0" ${VMP_BUG_REFERENCE:+--reference "$VMP_BUG_REFERENCE"} ;;
  poisoned) one poisoned --lora "poisoned=$u/poisoned" --reference peft ;;
  esac
done
wait
nvidia-smi --query-gpu=name,memory.used --format=csv >"$out/nvidia-smi.txt" 2>&1
echo "all in $(($(date +%s) - start)) s" | tee -a "$out/build.txt"
for run in $runs; do
  echo "== $run"
  grep -E "^adapter |^  (reference|why|would have caught|could not tell apart)|^verify |^exit " \
    "$out/$run.txt"
  grep -hE '"(peak_rss_bytes|peak_pss_bytes|peak_private_bytes|largest_process_rss_bytes|seconds)"' "$out/$run.rss.json" 2>/dev/null | tr -d '\n'
  echo
done
