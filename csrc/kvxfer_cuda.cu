/*
 * kvxfer_cuda.cu: the CUDA gather/scatter (libkvxfer_cuda.so).
 *
 * Owns: KvxferCopyKernel and the two launchers kvxfer_gather_cuda / kvxfer_scatter_cuda,
 * KvxferPoolCopyKernel and its launcher kvxfer_copy_cuda (pool -> pool), declared in kvxfer.h.
 * Addresses come from kvxfer_index.h, the same functions the CPU library (and its tests) use. Must
 * not: allocate or free device memory, synchronize the stream, or include torch. The caller owns
 * the pointer table and page ids (device memory) and keeps them alive until the stream has run the
 * kernel.
 *
 * Launch shape: grid.y = (layer, K|V) pairs, so one launch covers all layers and both K
 * and V; grid.x = tiles of tokens. A CTA first resolves each of its tokens to a pool byte
 * offset (one page id read per token, kept in shared memory), then its threads walk the
 * tile's staging bytes in VEC-byte vectors. Inside a tile the staging side is contiguous,
 * so a thread's staging address is just tile_base + u * VEC; only the pool side needs the
 * (token, head, vector) decomposition. Each thread keeps kCudaUnroll loads in flight before
 * storing, which is what lets a plain copy loop approach device-to-device copy bandwidth.
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kvxfer.h"
#include "kvxfer_index.h"

namespace {

using kvxfer::kCudaThreads;
using kvxfer::kCudaUnroll;

thread_local std::string g_last_error;

int fail(int status, const std::string& message) {
  g_last_error = message;
  return status;
}

// A width-byte word; copies are bitwise, so any element type of size <= width works.
template <int VEC>
struct Word;
template <>
struct Word<16> {
  using type = uint4;
};
template <>
struct Word<8> {
  using type = uint2;
};
template <>
struct Word<4> {
  using type = unsigned int;
};
template <>
struct Word<2> {
  using type = unsigned short;
};
template <>
struct Word<1> {
  using type = unsigned char;
};

struct Params {
  const uint64_t* table;  // num_kv * L layer pointers: K of every layer, then V (HND_KV: kvxfer.h)
  const int64_t* page_ids;
  char* staging;
  kvxfer_pool_t pool;
  kvxfer_slice_t slice;
  int64_t tile_tokens;
  int64_t num_tiles;
};

template <int VEC, bool GATHER>
__global__ void __launch_bounds__(kCudaThreads) KvxferCopyKernel(const Params p) {
  using W = typename Word<VEC>::type;
  __shared__ int64_t s_token_offset[kvxfer::kCudaMaxTileTokens];  // -1: page id out of range

  const int64_t layer = blockIdx.y / p.pool.num_kv;
  const int64_t kv = blockIdx.y - layer * p.pool.num_kv;
  char* const buffer = reinterpret_cast<char*>(p.table[kv * p.pool.num_layers + layer]);
  const int64_t row = kv == 0 ? p.pool.k_row_bytes : p.pool.v_row_bytes;
  const int64_t head_stride = kvxfer::pool_head_stride(p.pool.layout, p.pool.page_size,
                                                       kvxfer::pool_row_pitch(p.pool, row));
  const uint32_t row_vecs = static_cast<uint32_t>(row / VEC);
  const uint32_t token_vecs = static_cast<uint32_t>(p.slice.num_heads) * row_vecs;
  char* const block = p.staging + kvxfer::staging_block_offset(
                                      layer, kv, p.pool.num_kv, p.slice.num_tokens,
                                      p.slice.num_heads, p.pool.k_row_bytes, p.pool.v_row_bytes);

  for (int64_t tile = blockIdx.x; tile < p.num_tiles; tile += gridDim.x) {
    const int64_t first = tile * p.tile_tokens;
    const int64_t left = p.slice.num_tokens - first;
    const int tile_n = static_cast<int>(left < p.tile_tokens ? left : p.tile_tokens);
    __syncthreads();  // the previous tile is done with s_token_offset
    for (int i = threadIdx.x; i < tile_n; i += kCudaThreads) {
      s_token_offset[i] = kvxfer::token_pool_offset(p.pool, p.slice, p.page_ids, first + i, row);
    }
    __syncthreads();

    char* const stage = block + kvxfer::staging_row_offset(first, 0, p.slice.num_heads, row);
    const uint32_t total = static_cast<uint32_t>(tile_n) * token_vecs;
    // kCudaUnroll loads in flight per thread before the stores.
    for (uint32_t u0 = threadIdx.x; u0 < total; u0 += kCudaThreads * kCudaUnroll) {
      W words[kCudaUnroll];
      int64_t pool_at[kCudaUnroll];
#pragma unroll
      for (int k = 0; k < kCudaUnroll; ++k) {
        const uint32_t u = u0 + k * kCudaThreads;
        pool_at[k] = -1;
        if (u < total) {
          pool_at[k] = kvxfer::tile_vector_pool_offset(s_token_offset, u, token_vecs, row_vecs,
                                                       head_stride, VEC);
          if (GATHER) {
            words[k] = pool_at[k] >= 0 ? *reinterpret_cast<const W*>(buffer + pool_at[k]) : W{};
          } else {
            words[k] = *reinterpret_cast<const W*>(stage + static_cast<int64_t>(u) * VEC);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kCudaUnroll; ++k) {
        const uint32_t u = u0 + k * kCudaThreads;
        if (u < total) {
          if (GATHER) {
            *reinterpret_cast<W*>(stage + static_cast<int64_t>(u) * VEC) = words[k];
          } else if (pool_at[k] >= 0) {
            *reinterpret_cast<W*>(buffer + pool_at[k]) = words[k];
          }
        }
      }
    }
  }
}

template <bool GATHER>
int launch(const Params& params, int64_t width, dim3 grid, cudaStream_t stream) {
  switch (width) {
    case 16:
      KvxferCopyKernel<16, GATHER><<<grid, kCudaThreads, 0, stream>>>(params);
      break;
    case 8:
      KvxferCopyKernel<8, GATHER><<<grid, kCudaThreads, 0, stream>>>(params);
      break;
    case 4:
      KvxferCopyKernel<4, GATHER><<<grid, kCudaThreads, 0, stream>>>(params);
      break;
    case 2:
      KvxferCopyKernel<2, GATHER><<<grid, kCudaThreads, 0, stream>>>(params);
      break;
    default:
      KvxferCopyKernel<1, GATHER><<<grid, kCudaThreads, 0, stream>>>(params);
      break;
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return fail(KVXFER_ERR_CUDA, std::string("kernel launch failed: ") + cudaGetErrorString(err));
  }
  return KVXFER_OK;
}

template <bool GATHER>
int run(const kvxfer_pool_t* pool, const uint64_t* dev_table, int64_t layer_ptr_align,
        const int64_t* dev_page_ids, const kvxfer_slice_t* slice, char* staging,
        int64_t staging_bytes, void* stream) {
  char msg[512];
  const int status = kvxfer::check_args(pool, slice, dev_table, dev_page_ids, staging,
                                        staging_bytes, msg, sizeof msg);
  if (status != KVXFER_OK) return fail(status, msg);
  if (kvxfer::check_launch(*pool, *slice, layer_ptr_align, staging, msg, sizeof msg) != KVXFER_OK) {
    return fail(KVXFER_ERR_INVALID, msg);
  }
  if (slice->num_tokens == 0) return KVXFER_OK;
  const kvxfer::LaunchShape shape = kvxfer::launch_shape(*pool, *slice, layer_ptr_align, staging);
  Params params;
  params.table = dev_table;
  params.page_ids = dev_page_ids;
  params.staging = staging;
  params.pool = *pool;
  params.slice = *slice;
  params.tile_tokens = shape.tile_tokens;
  params.num_tiles = shape.num_tiles;
  const dim3 grid(static_cast<unsigned>(std::min(shape.num_tiles, kvxfer::kCudaMaxGridX)),
                  static_cast<unsigned>(pool->num_layers * pool->num_kv));
  return launch<GATHER>(params, shape.width, grid, static_cast<cudaStream_t>(stream));
}

struct CopyParams {
  const uint64_t* src_table;
  const uint64_t* dst_table;
  const int64_t* src_page_ids;
  const int64_t* dst_page_ids;
  kvxfer_pool_t src, dst;
  kvxfer_slice_t src_slice, dst_slice;
  int64_t tile_tokens;
  int64_t num_tiles;
};

/* Pool -> pool: the gather kernel's decomposition with a destination pool in place of the
 * staging buffer. A CTA resolves its tokens on both sides (two page ids per token), then
 * vector u of the tile splits into (token, head, vector) on both sides. */
template <int VEC>
__global__ void __launch_bounds__(kCudaThreads) KvxferPoolCopyKernel(const CopyParams p) {
  using W = typename Word<VEC>::type;
  __shared__ int64_t s_src[kvxfer::kCudaMaxTileTokens];  // -1: page id out of range
  __shared__ int64_t s_dst[kvxfer::kCudaMaxTileTokens];

  const int64_t layer = blockIdx.y / p.src.num_kv;
  const int64_t kv = blockIdx.y - layer * p.src.num_kv;
  const char* const src_buf =
      reinterpret_cast<const char*>(p.src_table[kv * p.src.num_layers + layer]);
  char* const dst_buf = reinterpret_cast<char*>(p.dst_table[kv * p.dst.num_layers + layer]);
  const int64_t row = kv == 0 ? p.src.k_row_bytes : p.src.v_row_bytes;
  const int64_t src_hs =
      kvxfer::pool_head_stride(p.src.layout, p.src.page_size, kvxfer::pool_row_pitch(p.src, row));
  const int64_t dst_hs =
      kvxfer::pool_head_stride(p.dst.layout, p.dst.page_size, kvxfer::pool_row_pitch(p.dst, row));
  const uint32_t row_vecs = static_cast<uint32_t>(row / VEC);
  const uint32_t token_vecs = static_cast<uint32_t>(p.src_slice.num_heads) * row_vecs;

  for (int64_t tile = blockIdx.x; tile < p.num_tiles; tile += gridDim.x) {
    const int64_t first = tile * p.tile_tokens;
    const int64_t left = p.src_slice.num_tokens - first;
    const int tile_n = static_cast<int>(left < p.tile_tokens ? left : p.tile_tokens);
    __syncthreads();
    for (int i = threadIdx.x; i < tile_n; i += kCudaThreads) {
      s_src[i] = kvxfer::token_pool_offset(p.src, p.src_slice, p.src_page_ids, first + i, row);
      s_dst[i] = kvxfer::token_pool_offset(p.dst, p.dst_slice, p.dst_page_ids, first + i, row);
    }
    __syncthreads();

    const uint32_t total = static_cast<uint32_t>(tile_n) * token_vecs;
    for (uint32_t u0 = threadIdx.x; u0 < total; u0 += kCudaThreads * kCudaUnroll) {
      W words[kCudaUnroll];
      int64_t to[kCudaUnroll];
#pragma unroll
      for (int k = 0; k < kCudaUnroll; ++k) {
        const uint32_t u = u0 + k * kCudaThreads;
        to[k] = -1;
        if (u < total) {
          const int64_t from =
              kvxfer::tile_vector_pool_offset(s_src, u, token_vecs, row_vecs, src_hs, VEC);
          to[k] = kvxfer::tile_vector_pool_offset(s_dst, u, token_vecs, row_vecs, dst_hs, VEC);
          if (from < 0) to[k] = -1;
          words[k] = to[k] >= 0 ? *reinterpret_cast<const W*>(src_buf + from) : W{};
        }
      }
#pragma unroll
      for (int k = 0; k < kCudaUnroll; ++k) {
        if (to[k] >= 0) *reinterpret_cast<W*>(dst_buf + to[k]) = words[k];
      }
    }
  }
}

int launch_copy(const CopyParams& params, int64_t width, dim3 grid, cudaStream_t stream) {
  switch (width) {
    case 16:
      KvxferPoolCopyKernel<16><<<grid, kCudaThreads, 0, stream>>>(params);
      break;
    case 8:
      KvxferPoolCopyKernel<8><<<grid, kCudaThreads, 0, stream>>>(params);
      break;
    case 4:
      KvxferPoolCopyKernel<4><<<grid, kCudaThreads, 0, stream>>>(params);
      break;
    case 2:
      KvxferPoolCopyKernel<2><<<grid, kCudaThreads, 0, stream>>>(params);
      break;
    default:
      KvxferPoolCopyKernel<1><<<grid, kCudaThreads, 0, stream>>>(params);
      break;
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return fail(KVXFER_ERR_CUDA, std::string("kernel launch failed: ") + cudaGetErrorString(err));
  }
  return KVXFER_OK;
}

}  // namespace

extern "C" {

KVXFER_API int kvxfer_cuda_abi_version(void) {
  return KVXFER_ABI_VERSION;
}

KVXFER_API const char* kvxfer_cuda_last_error(void) {
  return g_last_error.c_str();
}

static std::string cuda_version_text(int version) {
  if (version <= 0) return "none";
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

KVXFER_API int kvxfer_cuda_probe(void) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // The usual cause is a driver older than the runtime this library uses: say both.
    int driver = 0, runtime = 0;
    (void)cudaDriverGetVersion(&driver);
    (void)cudaRuntimeGetVersion(&runtime);
    return fail(KVXFER_ERR_CUDA, std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err) +
                                     " (the driver supports CUDA " + cuda_version_text(driver) +
                                     ", this library's runtime is CUDA " +
                                     cuda_version_text(runtime) + ")");
  }
  if (count < 1) return fail(KVXFER_ERR_CUDA, "no CUDA device is visible");
  return KVXFER_OK;
}

KVXFER_API int kvxfer_gather_cuda(const kvxfer_pool_t* pool, const uint64_t* dev_table,
                                  int64_t layer_ptr_align, const int64_t* dev_page_ids,
                                  const kvxfer_slice_t* slice, void* staging, int64_t staging_bytes,
                                  void* stream) {
  try {
    return run<true>(pool, dev_table, layer_ptr_align, dev_page_ids, slice,
                     static_cast<char*>(staging), staging_bytes, stream);
  } catch (...) {
    return fail(KVXFER_ERR_INTERNAL, "host exception in kvxfer_gather_cuda");
  }
}

KVXFER_API int kvxfer_scatter_cuda(const kvxfer_pool_t* pool, const uint64_t* dev_table,
                                   int64_t layer_ptr_align, const int64_t* dev_page_ids,
                                   const kvxfer_slice_t* slice, const void* staging,
                                   int64_t staging_bytes, void* stream) {
  try {
    // The kernel only reads staging when scattering; Params keeps one pointer type.
    return run<false>(pool, dev_table, layer_ptr_align, dev_page_ids, slice,
                      static_cast<char*>(const_cast<void*>(staging)), staging_bytes, stream);
  } catch (...) {
    return fail(KVXFER_ERR_INTERNAL, "host exception in kvxfer_scatter_cuda");
  }
}

KVXFER_API int kvxfer_copy_cuda(const kvxfer_pool_t* src_pool, const uint64_t* src_dev_table,
                                const int64_t* src_dev_page_ids, const kvxfer_slice_t* src_slice,
                                const kvxfer_pool_t* dst_pool, const uint64_t* dst_dev_table,
                                const int64_t* dst_dev_page_ids, const kvxfer_slice_t* dst_slice,
                                int64_t layer_ptr_align, void* stream) {
  try {
    char msg[512];
    if (kvxfer::check_copy(src_pool, src_slice, src_dev_table, src_dev_page_ids, dst_pool,
                           dst_slice, dst_dev_table, dst_dev_page_ids, msg,
                           sizeof msg) != KVXFER_OK ||
        kvxfer::check_launch(*src_pool, *src_slice, layer_ptr_align, nullptr, msg, sizeof msg) !=
            KVXFER_OK) {
      return fail(KVXFER_ERR_INVALID, msg);
    }
    if (src_slice->num_tokens == 0) return KVXFER_OK;
    const kvxfer::LaunchShape shape =
        kvxfer::launch_shape(*src_pool, *src_slice, layer_ptr_align, nullptr);
    CopyParams params;
    params.src_table = src_dev_table;
    params.dst_table = dst_dev_table;
    params.src_page_ids = src_dev_page_ids;
    params.dst_page_ids = dst_dev_page_ids;
    params.src = *src_pool;
    params.dst = *dst_pool;
    params.src_slice = *src_slice;
    params.dst_slice = *dst_slice;
    params.tile_tokens = shape.tile_tokens;
    params.num_tiles = shape.num_tiles;
    const dim3 grid(static_cast<unsigned>(std::min(shape.num_tiles, kvxfer::kCudaMaxGridX)),
                    static_cast<unsigned>(src_pool->num_layers * src_pool->num_kv));
    return launch_copy(params, shape.width, grid, static_cast<cudaStream_t>(stream));
  } catch (...) {
    return fail(KVXFER_ERR_INTERNAL, "host exception in kvxfer_copy_cuda");
  }
}

}  // extern "C"
