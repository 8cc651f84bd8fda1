#!/usr/bin/env bash
# Compile the outside kernels that calibrate the lab's bounds (FlashAttention-2's forward, three instantiations of
# FlashInfer's decode) for sm_90, without a GPU, and leave ptxas -v's report and nvdisasm's listing of each in OUT. `python -m cacheattn.lab.calibration --derive OUT --write
# docs/calibration-sass.json` then reads them with the project's SASS reader. CI never runs this; it reads the
# committed statistics only.
#
#   cacheattn/lab/calibration_build.sh SRC OUT
#
# SRC holds the sources, unpacked at the commits docs/calibration-sass.json names:
#   SRC/flash-attention  github.com/Dao-AILab/flash-attention   (csrc/flash_attn/src is enough)
#   SRC/cutlass          github.com/NVIDIA/cutlass at flash-attention's csrc/cutlass submodule commit (include/)
#   SRC/flashinfer       github.com/flashinfer-ai/flashinfer    (include/ is enough)
#   SRC/cccl             github.com/NVIDIA/cccl at flashinfer's 3rdparty/cccl submodule commit
#                        (libcudacxx/include, cub, thrust: flashinfer needs cuda::fast_mod_div, newer than CUDA 13.0's)
# e.g. from bare clones: git --git-dir=flash-attention.git archive HEAD csrc/flash_attn/src | tar -x -C SRC/flash-attention
#
# Tools: nvcc (CUDA 13.0 was used: /usr/local/cuda-13.0, or NVCC=...) and nvdisasm (NVDISASM=..., else PATH; the
# nvidia-cuda-nvdisasm wheel's nvidia/cu13/bin/nvdisasm, 13.5, was used). Nothing is installed; OUT gets the drivers, the shims, the cubins and
# the tools' text output.
set -euo pipefail
SRC=$(cd "${1:?usage: calibration_build.sh SRC OUT}" && pwd)
OUT=${2:?usage: calibration_build.sh SRC OUT}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda-13.0/bin/nvcc)}
NVDISASM=${NVDISASM:-$(command -v nvdisasm || true)}
[ -n "$NVDISASM" ] || { echo "nvdisasm not found: set NVDISASM (the nvidia-cuda-nvdisasm wheel has one)" >&2; exit 2; }
"$NVCC" --version | tail -2 > "$OUT/nvcc.version"
"$NVDISASM" --version | tail -2 > "$OUT/nvdisasm.version"

# The three torch headers FlashAttention-2's forward includes, reduced to what its kernel needs: two no-op error
# macros and the philox state it unpacks (dead code with dropout off).
mkdir -p "$OUT/shim/c10/cuda" "$OUT/shim/ATen/cuda/detail"
cat > "$OUT/shim/c10/cuda/CUDAException.h" <<'EOF'
#pragma once
#define C10_CUDA_CHECK(expr) (void)(expr)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ((void)0)
EOF
cat > "$OUT/shim/ATen/cuda/PhiloxCudaState.h" <<'EOF'
#pragma once
#include <cstdint>
namespace at { struct PhiloxCudaState { uint64_t seed_ = 0, offset_ = 0; }; }
EOF
cat > "$OUT/shim/ATen/cuda/detail/UnpackRaw.cuh" <<'EOF'
#pragma once
#include <tuple>
namespace at { namespace cuda { namespace philox {
__host__ __device__ inline std::tuple<uint64_t, uint64_t> unpack(at::PhiloxCudaState s) { return {s.seed_, s.offset_}; }
} } }
EOF

# FlashAttention-2 forward: the instantiation run_mha_fwd_hdim128 launches on sm_90 (not sm_8x) for float16 without
# dropout: Flash_fwd_kernel_traits<128, 128, 64, 4> (128 query rows, 64-key tiles, 4 warps), not causal, no local
# window / ALiBi / softcap / returned softmax, seqlens multiples of the tiles (Is_even_MN), head_dim 128 (Is_even_K).
cat > "$OUT/fa2_fwd_hdim128.cu" <<'EOF'
#include "namespace_config.h"
#include "flash_fwd_launch_template.h"
namespace FLASH_NAMESPACE {
using Traits = Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::half_t>;
template __global__ void flash_fwd_kernel<Traits, false, false, false, false, true, true, false, false>(
    KERNEL_PARAM_MODIFIER const Flash_fwd_params params);
}
EOF
# flash-attention's setup.py flags (its -DFLASHATTENTION_DISABLE_* stay off, as in its default build).
"$NVCC" -arch=sm_90 -cubin -O3 -std=c++17 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ \
  -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda \
  --use_fast_math -I "$OUT/shim" -I "$SRC/flash-attention/csrc/flash_attn/src" -I "$SRC/cutlass/include" \
  -Xptxas -v -o "$OUT/fa2_fwd_hdim128.cubin" "$OUT/fa2_fwd_hdim128.cu" > "$OUT/fa2_fwd_hdim128.ptxas" 2>&1
"$NVDISASM" -c "$OUT/fa2_fwd_hdim128.cubin" > "$OUT/fa2_fwd_hdim128.sass"

# FlashInfer batch decode over a paged cache: the instantiation BatchDecodeWithPagedKVCacheDispatched launches for
# float16 q / kv / o, int32 indices, head_dim 128, 32 query heads over 8 kv heads (group 4), no positional encoding,
# mask, window, softcap or ALiBi: vec_size max(16 / 2, 128 / 32) = 8, bdx 16, bdy 4 (the group), 128 threads so
# bdz 2, tile_size_per_bdx 1, two shared-memory stages (compute capability 8 and later).
cat > "$OUT/fi_decode_hdim128_gqa4.cu" <<'EOF'
#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/default_decode_params.cuh>
#include <flashinfer/attention/variants.cuh>
namespace flashinfer {
using Params = BatchDecodeParams<half, half, half, int32_t>;
using Variant = DefaultAttention<false, false, false, false>;
template __global__ void BatchDecodeWithPagedKVCacheKernel<PosEncodingMode::kNone, 2, 1, 8, 16, 4, 2, Variant, Params>(
    const __grid_constant__ Params params);
}
EOF
# flashinfer's JIT flags (flashinfer/jit/core.py: -O3 -DNDEBUG -use_fast_math; cpp_ext.py: --expt-relaxed-constexpr,
# its vendored CCCL first on the include path).
"$NVCC" -arch=sm_90 -cubin -O3 -DNDEBUG -std=c++17 --use_fast_math --expt-relaxed-constexpr \
  -I "$SRC/cccl/libcudacxx/include" -I "$SRC/cccl/cub" -I "$SRC/cccl/thrust" -I "$SRC/flashinfer/include" \
  -Xptxas -v -o "$OUT/fi_decode_hdim128_gqa4.cubin" "$OUT/fi_decode_hdim128_gqa4.cu" \
  > "$OUT/fi_decode_hdim128_gqa4.ptxas" 2>&1
"$NVDISASM" -c "$OUT/fi_decode_hdim128_gqa4.cubin" > "$OUT/fi_decode_hdim128_gqa4.sass"
# The same batch decode at group 8 (32 query heads over 4 kv heads, llama2-70b at tp 2, the blog's batch GQA figure):
# bdy 8, 128 threads so bdz 1.
sed -e 's/<PosEncodingMode::kNone, 2, 1, 8, 16, 4, 2, Variant, Params>/<PosEncodingMode::kNone, 2, 1, 8, 16, 8, 1, Variant, Params>/' \
  "$OUT/fi_decode_hdim128_gqa4.cu" > "$OUT/fi_decode_hdim128_gqa8.cu"
"$NVCC" -arch=sm_90 -cubin -O3 -DNDEBUG -std=c++17 --use_fast_math --expt-relaxed-constexpr \
  -I "$SRC/cccl/libcudacxx/include" -I "$SRC/cccl/cub" -I "$SRC/cccl/thrust" -I "$SRC/flashinfer/include" \
  -Xptxas -v -o "$OUT/fi_decode_hdim128_gqa8.cubin" "$OUT/fi_decode_hdim128_gqa8.cu" \
  > "$OUT/fi_decode_hdim128_gqa8.ptxas" 2>&1
"$NVDISASM" -c "$OUT/fi_decode_hdim128_gqa8.cubin" > "$OUT/fi_decode_hdim128_gqa8.sass"

# FlashInfer single-request decode, the kernel of its blog's GQA figure (llama2-70b at tp 2: 32 query heads over 4 kv
# heads, group 8): SingleDecodeWithKVCacheDispatched for float16, head_dim 128, no positional encoding: vec_size 8,
# bdx 16, bdy 8, get_heuristic_num_threads(8, 2 bytes) = 512 threads so bdz 4, tile_size_per_bdx 1, two stages.
cat > "$OUT/fi_single_decode_hdim128_gqa8.cu" <<'EOF2'
#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/default_decode_params.cuh>
#include <flashinfer/attention/variants.cuh>
namespace flashinfer {
using Params = SingleDecodeParams<half, half, half>;
using Variant = DefaultAttention<false, false, false, false>;
template __global__ void SingleDecodeWithKVCacheKernel<PosEncodingMode::kNone, 2, 1, 8, 16, 8, 4, Variant, Params>(
    const __grid_constant__ Params params);
}
EOF2
"$NVCC" -arch=sm_90 -cubin -O3 -DNDEBUG -std=c++17 --use_fast_math --expt-relaxed-constexpr \
  -I "$SRC/cccl/libcudacxx/include" -I "$SRC/cccl/cub" -I "$SRC/cccl/thrust" -I "$SRC/flashinfer/include" \
  -Xptxas -v -o "$OUT/fi_single_decode_hdim128_gqa8.cubin" "$OUT/fi_single_decode_hdim128_gqa8.cu" \
  > "$OUT/fi_single_decode_hdim128_gqa8.ptxas" 2>&1
"$NVDISASM" -c "$OUT/fi_single_decode_hdim128_gqa8.cubin" > "$OUT/fi_single_decode_hdim128_gqa8.sass"
echo "wrote $OUT: $(ls "$OUT" | tr '\n' ' ')"
