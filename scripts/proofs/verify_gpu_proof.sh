#!/usr/bin/env bash
# verify's GPU proof on a 2-GPU H200 host, the three runs side by side (one
# device call): `verify --e2e` at TP=2 (dense + MoE), `verify --model` at TP=1
# and at TP=2 on the stand-in user model of scripts/proofs/verify_model_gpu.py.
#   [RUNS="e2e-tp2 model-tp2"] bash scripts/proofs/verify_gpu_proof.sh OUT [LIMIT_S]
# OUT/<run>.txt is each verify's report (stderr in <run>.err), OUT/<run>/ its
# --keep directory (served results, references, vLLM logs).
set -u
out=$1
limit=${2:-520}
mkdir -p "$out"
[ -d "$out/user/model" ] || python3 scripts/proofs/verify_model_gpu.py "$out/user" >"$out/build.txt" 2>&1
u=$out/user
adapters=(--lora "full=$u/full" --lora "qkv=$u/qkv" --lora "z=$u/z")
one() {
  local name=$1
  shift
  (
    start=$(date +%s)
    timeout "$limit" python3 -m patchkit verify --seed 11 --keep "$out/$name" "$@" \
      >"$out/$name.txt" 2>"$out/$name.err"
    echo "exit $? after $(($(date +%s) - start)) s" >>"$out/$name.txt"
  ) &
}
for run in ${RUNS:-e2e-tp2 model-tp1 model-tp2}; do
  case $run in
    e2e-tp2) one e2e-tp2 --e2e --tensor-parallel-size 2 ;;
    model-tp1) one model-tp1 --model "$u/model" "${adapters[@]}" --tensor-parallel-size 1 ;;
    model-tp2) one model-tp2 --model "$u/model" "${adapters[@]}" --tensor-parallel-size 2 ;;
  esac
done
wait
nvidia-smi --query-gpu=name,memory.used --format=csv >"$out/nvidia-smi.txt" 2>&1
