#!/usr/bin/env bash
# Build the third offline bundle: vLLM's MoE extension, which make-bundles.sh
# (../shared/device, carried as .devtools) leaves out of b1 and b2 for size.
#
#   scripts/make-moe-bundle.sh [VERSION] [OUTDIR]     (defaults: 0.26.0 .devbundle)
#
# Writes OUTDIR/b3/vllm_moe.tar.xz holding vllm/_moe_C*.so from the cached
# wheel (~/.cache/patchkit-device/vllm-VERSION/, where make-bundles.sh keeps
# it). Without it every MoE engine stops at start with
# "'_OpNamespace' '_moe_C' object has no attribute 'topk_softmax'"
# (docs/evidence.md). On the GPU host, `bash .devtools/unpack.sh
# .devbundle/b3` unpacks it into /opt/site, so the file lands in
# /opt/site/vllm/ next to the rest of vLLM (b1, b2), where
# vllm.platforms.cuda.CudaPlatform.import_kernels imports it.
#
# What the MoE + LoRA path of 0.26.0 needs beyond Python and Triton (read in
# vllm/_custom_ops.py and vllm/model_executor/layers/fused_moe/; on an H200
# the unquantized oracle picks TritonExperts with LoRA): topk_softmax,
# moe_align_block_size, moe_lora_align_block_size and moe_sum from _moe_C
# (this bundle); silu_and_mul and the other activations from _C (b1). The
# FlashInfer TRT-LLM LoRA experts are for sm_100 only; DeepGEMM is turned off
# (VLLM_USE_DEEP_GEMM=0) by patchkit.verify.serving.
#
# The extension is CUDA code for several architectures and compresses
# poorly (47.5 MB to about 40 MB): the bundle travels in a device call of its
# own (with .devtools, .whl and the repository, about 42 MiB of the 64 MiB).
set -euo pipefail
VERSION=${1:-0.26.0}
OUT=${2:-.devbundle}
CACHE=${PATCHKIT_WHEEL_CACHE:-$HOME/.cache/patchkit-device}
WHEEL=$(ls "$CACHE/vllm-$VERSION"/vllm-*.whl 2>/dev/null | head -1 || true)
[ -n "$WHEEL" ] || {
  echo "no vLLM $VERSION wheel under $CACHE/vllm-$VERSION: run make-bundles.sh $VERSION first" >&2
  exit 1
}
mkdir -p "$OUT/b3"
OUT=$(cd "$OUT" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
unzip -q "$WHEEL" 'vllm/_moe_C*'
ls vllm/_moe_C*.so >/dev/null
tar cf - vllm | xz -T2 -9e >"$OUT/b3/vllm_moe.tar.xz"
size=$(du -sm "$OUT/b3" | cut -f1)
ls -l "$OUT/b3/vllm_moe.tar.xz"
[ "$size" -le 48 ] || { echo "b3 is ${size} MB: over the 48 MB this bundle may take" >&2; exit 1; }
echo "MoE bundle for vLLM $VERSION in $OUT/b3 (${size} MB)"
