/*
 * kvxfer_cpu.cpp: the CPU gather/scatter (libkvxfer_cpu.so).
 *
 * Owns: the host implementation of kvxfer_gather_cpu / kvxfer_scatter_cpu declared in
 * kvxfer.h. Addresses come from kvxfer_index.h only, so a test of this library is also a
 * test of the CUDA kernel's addressing.
 * Must not: throw across the C boundary, touch memory before every argument and every page
 * id it will use has been checked, or keep threads alive between calls.
 *
 * Speed: the copy is memory bound, so the work is a stream of copies of whole rows.
 * Consecutive rows that continue each other on both sides (a page's tokens when the slice
 * covers all heads, runs of consecutive page ids) are merged into one copy. A gather
 * prefetches the rows of the tokens ahead; big calls use non-temporal stores. Work is split
 * into equal contiguous ranges of (layer, K|V, token) items over std::thread workers;
 * threads are created per call because a call moves megabytes (tens of microseconds of
 * thread start-up against milliseconds of copying) and a persistent pool would need a
 * lifetime the C ABI does not have.
 */
#include <algorithm>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kvxfer.h"
#include "kvxfer_index.h"

namespace {

thread_local std::string g_last_error;

int fail(int status, const std::string& message) {
  g_last_error = message;
  return status;
}

/* Copies len bytes with non-temporal (cache-bypassing) stores where the CPU has them.
 * Large transfers are streamed once and read next by a NIC or another process, so caching
 * the destination only costs a read-for-ownership of every line and evicts useful data;
 * glibc's memcpy does the same for big copies, which is what the plain-copy baseline gets.
 * Measured on an AVX-512 EPYC: a 256-byte-row gather goes from ~0.35x to ~0.7x of a plain
 * copy with these stores plus the prefetching in copy_items. */
#if defined(__x86_64__)
__attribute__((target("avx2"))) void copy_streaming_avx2(char* dst, const char* src, size_t len) {
  for (size_t off = 0; off < len; off += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + off));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + off + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + off), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + off + 32), b);
  }
}

void copy_streaming_sse2(char* dst, const char* src, size_t len) {
  for (size_t off = 0; off < len; off += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + off));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + off + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + off + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + off + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + off), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + off + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + off + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + off + 48), d);
  }
}

bool detect_avx2() {
  __builtin_cpu_init();  // needed when this runs from a static initializer
  return __builtin_cpu_supports("avx2");
}

const bool g_has_avx2 = detect_avx2();
#endif

void copy_streaming(char* dst, const char* src, size_t len) {
#if defined(__x86_64__)
  // Head: plain copy up to a 32-byte aligned destination (what the AVX2 stores need).
  const size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
  if (len < head + 64) {
    std::memcpy(dst, src, len);
    return;
  }
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  len -= head;
  const size_t body = len & ~static_cast<size_t>(63);
  if (g_has_avx2) {
    copy_streaming_avx2(dst, src, body);
  } else {
    copy_streaming_sse2(dst, src, body);
  }
  if (len > body) std::memcpy(dst + body, src + body, len - body);
#else
  std::memcpy(dst, src, len);
#endif
}

/* Orders this thread's non-temporal stores before the call returns (they are weakly
 * ordered; thread join alone does not drain them). */
void fence_streaming() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

/* Merges copies that continue the previous one on both sides into one copy. */
class RunCopier {
 public:
  explicit RunCopier(bool streaming) : streaming_(streaming) {}
  ~RunCopier() { flush(); }
  void add(char* dst, const char* src, size_t len) {
    if (len_ != 0 && dst == dst_ + len_ && src == src_ + len_) {
      len_ += len;
      return;
    }
    flush();
    dst_ = dst;
    src_ = src;
    len_ = len;
  }
  void flush() {
    if (len_ == 0) return;
    if (streaming_) {
      copy_streaming(dst_, src_, len_);
    } else {
      std::memcpy(dst_, src_, len_);
    }
    len_ = 0;
  }

 private:
  bool streaming_;
  char* dst_ = nullptr;
  const char* src_ = nullptr;
  size_t len_ = 0;
};

struct Job {
  kvxfer_pool_t pool;
  kvxfer_slice_t slice;
  char* const* layers;  // num_kv * L: K of every layer, then V of every layer
  const int64_t* page_ids;
  char* staging;
  bool gather;     // true: pool -> staging; false: staging -> pool
  bool streaming;  // non-temporal stores (large calls)
};

/* Walks request tokens as (page index, slot) without a division per token. */
struct Cursor {
  Cursor(int64_t token, int64_t tokens_per_page)
      : pos(kvxfer::token_position(token, tokens_per_page)), page_size(tokens_per_page) {}
  void next() {
    if (++pos.slot == page_size) {
      pos.slot = 0;
      ++pos.page_index;
    }
  }
  kvxfer::TokenPos pos;
  int64_t page_size;
};

/* Byte offset of the cursor's token's first sliced head in a layer buffer. */
inline int64_t cur_row(const kvxfer_pool_t& p, const kvxfer_slice_t& s, const int64_t* page_ids,
                       const Cursor& c, int64_t row) {
  return kvxfer::pool_row_offset(p.layout, page_ids[c.pos.page_index], c.pos.slot, s.head_start,
                                 p.page_size, p.pool_heads, row);
}

/* Tokens to prefetch ahead, between 2 and 32: about 16 KiB of rows in flight for NHD pools
 * (one short run per token row; with 4 KiB a 2-head slice stalled at ~0.56x of a copy here,
 * with 16 KiB it reaches ~0.67x), 4 KiB for HND pools (a run per head already spreads the
 * reads; more distance measured slower; HND_KV reads like HND). */
inline int64_t prefetch_distance(int64_t token_bytes, bool nhd) {
  const int64_t d = (nhd ? 16384 : 4096) / (token_bytes > 0 ? token_bytes : 1);
  return d < 2 ? 2 : (d > 32 ? 32 : d);
}

inline void prefetch(const char* at, int64_t len) {
  for (int64_t off = 0; off < len; off += 64) __builtin_prefetch(at + off, 0, 0);
}

/* Copies items [begin, end), item = (layer * num_kv + kv) * num_tokens + token. */
void copy_items(const Job& job, int64_t begin, int64_t end) {
  const kvxfer_pool_t& p = job.pool;
  const kvxfer_slice_t& s = job.slice;
  const int64_t num_tokens = s.num_tokens;
  RunCopier run(job.streaming);
  int64_t item = begin;
  while (item < end) {
    const int64_t lk = item / num_tokens;
    const int64_t first = item - lk * num_tokens;
    const int64_t last = std::min(num_tokens, first + (end - item));
    const int64_t layer = lk / p.num_kv;
    const int64_t kv = lk - layer * p.num_kv;
    char* buffer = job.layers[kv * p.num_layers + layer];
    const int64_t row = kv == 0 ? p.k_row_bytes : p.v_row_bytes;
    const int64_t head_stride = kvxfer::pool_head_stride(p.layout, p.page_size, row);
    char* block =
        job.staging + kvxfer::staging_block_offset(layer, kv, p.num_kv, num_tokens, s.num_heads,
                                                   p.k_row_bytes, p.v_row_bytes);
    // NHD: a token's slice of heads is one contiguous run; HND, HND_KV: one row per head.
    const bool nhd = p.layout == KVXFER_LAYOUT_NHD;
    const int64_t run_bytes = nhd ? s.num_heads * row : row;
    const int64_t runs_per_token = nhd ? 1 : s.num_heads;
    // Walk (page index, slot) incrementally: no division per token. A gather reads rows
    // scattered over the pool, which the hardware prefetchers do not follow across pages,
    // so a second cursor runs `ahead` tokens in front and prefetches their rows.
    Cursor cur(s.token_offset + first, p.page_size);
    Cursor pre = cur;
    const int64_t ahead = job.gather ? prefetch_distance(run_bytes * runs_per_token, nhd) : 0;
    for (int64_t k = 0; k < ahead && first + k < last; ++k) pre.next();
    for (int64_t i = first; i < last; ++i) {
      if (ahead != 0 && i + ahead < last) {
        const char* future = buffer + cur_row(p, s, job.page_ids, pre, row);
        for (int64_t h = 0; h < runs_per_token; ++h) prefetch(future + h * head_stride, run_bytes);
        pre.next();
      }
      char* pool_row = buffer + cur_row(p, s, job.page_ids, cur, row);
      char* stage_row = block + kvxfer::staging_row_offset(i, 0, s.num_heads, row);
      for (int64_t h = 0; h < runs_per_token; ++h) {
        char* pool_at = pool_row + h * head_stride;
        char* stage_at = stage_row + h * row;
        if (job.gather) {
          run.add(stage_at, pool_at, static_cast<size_t>(run_bytes));
        } else {
          run.add(pool_at, stage_at, static_cast<size_t>(run_bytes));
        }
      }
      cur.next();
    }
    item += last - first;
  }
  run.flush();
  if (job.streaming) fence_streaming();
}

inline uintptr_t address(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr);
}
inline uintptr_t address(uint64_t ptr) {
  return static_cast<uintptr_t>(ptr);
}

/* No layer pointer is NULL, and an HND_KV pool's V pointers sit page_size K rows past the
 * K pointers (one buffer per layer, K and V tiles interleaved; kvxfer.h). */
template <typename Ptr>
int check_layer_pointers(const kvxfer_pool_t& p, const Ptr* ptrs) {
  for (int64_t k = 0; k < p.num_kv * p.num_layers; ++k) {
    if (address(ptrs[k]) == 0) {
      return fail(KVXFER_ERR_INVALID, "layer pointer " + std::to_string(k) + " is NULL");
    }
  }
  if (p.layout != KVXFER_LAYOUT_HND_KV) return KVXFER_OK;
  const uintptr_t v_shift = static_cast<uintptr_t>(p.page_size * p.k_row_bytes);
  for (int64_t l = 0; l < p.num_layers; ++l) {
    if (address(ptrs[p.num_layers + l]) != address(ptrs[l]) + v_shift) {
      return fail(KVXFER_ERR_INVALID, "layout HND_KV: V pointer of layer " + std::to_string(l) +
                                          " must be its K pointer + page_size * k_row_bytes = " +
                                          std::to_string(v_shift) +
                                          " bytes (one buffer per layer)");
    }
  }
  return KVXFER_OK;
}

/* Every page id the slice will read, checked before any byte moves. */
int check_page_ids(const kvxfer_pool_t& p, const kvxfer_slice_t& s, const int64_t* page_ids) {
  if (s.num_tokens == 0) return KVXFER_OK;
  const int64_t first = s.token_offset / p.page_size;
  const int64_t last = (s.token_offset + s.num_tokens - 1) / p.page_size;
  for (int64_t k = first; k <= last; ++k) {
    if (page_ids[k] < 0 || page_ids[k] >= p.num_pages) {
      return fail(KVXFER_ERR_INVALID, "page_ids[" + std::to_string(k) +
                                          "]=" + std::to_string(page_ids[k]) + " is outside [0, " +
                                          std::to_string(p.num_pages) + ")");
    }
  }
  return KVXFER_OK;
}

int run_job(const Job& job, int32_t num_threads) {
  const int64_t total = job.pool.num_layers * job.pool.num_kv * job.slice.num_tokens;
  if (total == 0) return KVXFER_OK;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, total));
  const int64_t chunk = (total + workers - 1) / workers;
  std::vector<std::thread> threads;
  int64_t next = chunk;  // the calling thread takes [0, chunk)
  try {
    threads.reserve(static_cast<size_t>(workers - 1));
    for (; next < total && static_cast<int64_t>(threads.size()) < workers - 1; next += chunk) {
      const int64_t lo = next, hi = std::min(total, next + chunk);
      threads.emplace_back([&job, lo, hi] { copy_items(job, lo, hi); });
    }
  } catch (const std::exception&) {
    // Could not start a thread: the remaining ranges run on this thread below.
  }
  copy_items(job, 0, std::min(total, chunk));
  for (; next < total; next += chunk) copy_items(job, next, std::min(total, next + chunk));
  for (std::thread& t : threads) t.join();
  return KVXFER_OK;
}

int run(const kvxfer_pool_t* pool, void* const* layer_ptrs, const int64_t* page_ids,
        const kvxfer_slice_t* slice, void* staging, int64_t staging_bytes, int32_t num_threads,
        int64_t streaming_min_bytes, bool gather) {
  try {
    char msg[512];
    int status = kvxfer::check_args(pool, slice, layer_ptrs, page_ids, staging, staging_bytes, msg,
                                    sizeof msg);
    if (status != KVXFER_OK) return fail(status, msg);
    if (slice->num_tokens == 0) return KVXFER_OK;
    status = check_layer_pointers(*pool, layer_ptrs);
    if (status != KVXFER_OK) return status;
    status = check_page_ids(*pool, *slice, page_ids);
    if (status != KVXFER_OK) return status;
    // Past a few tens of MiB the destination would not stay cached anyway.
    if (streaming_min_bytes < 0) streaming_min_bytes = KVXFER_CPU_STREAMING_MIN_BYTES_DEFAULT;
    const bool streaming = kvxfer::staging_nbytes(*pool, *slice) >= streaming_min_bytes;
    Job job{*pool,
            *slice,
            reinterpret_cast<char* const*>(layer_ptrs),
            page_ids,
            static_cast<char*>(staging),
            gather,
            streaming};
    return run_job(job, num_threads);
  } catch (const std::exception& exc) {
    return fail(KVXFER_ERR_INTERNAL, exc.what());
  } catch (...) {
    return fail(KVXFER_ERR_INTERNAL, "unknown C++ exception");
  }
}

/* The CUDA kernel's loops, one thread: tiles of grid.x, (layer, K|V) of grid.y, and the
 * vectors u of a tile (the kernel hands u = tid + k * threads + j * threads * unroll to
 * thread tid, which visits every u of [0, total) exactly once). */
void emulate_cuda(bool gather, const kvxfer_pool_t& p, const kvxfer_slice_t& s,
                  const uint64_t* table, const int64_t* page_ids, char* staging,
                  const kvxfer::LaunchShape& shape) {
  // Sized like the kernel's shared-memory array, so a tile too large for it fails here.
  std::vector<int64_t> token_offsets(static_cast<size_t>(kvxfer::kCudaMaxTileTokens));
  if (shape.tile_tokens > kvxfer::kCudaMaxTileTokens || shape.tile_tokens < 1) {
    throw std::logic_error("tile_tokens=" + std::to_string(shape.tile_tokens) +
                           " does not fit the kernel's shared memory");
  }
  const int64_t w = shape.width;
  for (int64_t y = 0; y < p.num_layers * p.num_kv; ++y) {
    const int64_t layer = y / p.num_kv, kv = y - layer * p.num_kv;
    char* buffer = reinterpret_cast<char*>(table[kv * p.num_layers + layer]);
    const int64_t row = kv == 0 ? p.k_row_bytes : p.v_row_bytes;
    const int64_t head_stride = kvxfer::pool_head_stride(p.layout, p.page_size, row);
    const uint32_t row_vecs = static_cast<uint32_t>(row / w);
    const uint32_t token_vecs = static_cast<uint32_t>(s.num_heads) * row_vecs;
    char* block = staging + kvxfer::staging_block_offset(layer, kv, p.num_kv, s.num_tokens,
                                                         s.num_heads, p.k_row_bytes, p.v_row_bytes);
    for (int64_t tile = 0; tile < shape.num_tiles; ++tile) {
      const int64_t first = tile * shape.tile_tokens;
      const int64_t tile_n = std::min(shape.tile_tokens, s.num_tokens - first);
      for (int64_t i = 0; i < tile_n; ++i) {
        token_offsets[i] = kvxfer::token_pool_offset(p, s, page_ids, first + i, row);
      }
      char* stage = block + kvxfer::staging_row_offset(first, 0, s.num_heads, row);
      const uint32_t total = static_cast<uint32_t>(tile_n) * token_vecs;
      for (uint32_t u = 0; u < total; ++u) {
        const int64_t at = kvxfer::tile_vector_pool_offset(token_offsets.data(), u, token_vecs,
                                                           row_vecs, head_stride, w);
        char* stage_at = stage + static_cast<int64_t>(u) * w;
        if (gather) {
          if (at >= 0) {
            std::memcpy(stage_at, buffer + at, static_cast<size_t>(w));
          } else {
            std::memset(stage_at, 0, static_cast<size_t>(w));
          }
        } else if (at >= 0) {
          std::memcpy(buffer + at, stage_at, static_cast<size_t>(w));
        }
      }
    }
  }
}

}  // namespace

extern "C" {

KVXFER_API int kvxfer_emulate_cuda_cpu(int32_t gather, const kvxfer_pool_t* pool,
                                       const uint64_t* table, int64_t layer_ptr_align,
                                       const int64_t* page_ids, const kvxfer_slice_t* slice,
                                       void* staging, int64_t staging_bytes) {
  try {
    char msg[512];
    if (kvxfer::check_args(pool, slice, table, page_ids, staging, staging_bytes, msg, sizeof msg) !=
            KVXFER_OK ||
        kvxfer::check_launch(*pool, *slice, layer_ptr_align, staging, msg, sizeof msg) !=
            KVXFER_OK) {
      return fail(KVXFER_ERR_INVALID, msg);
    }
    if (slice->num_tokens == 0) return KVXFER_OK;
    const int status = check_layer_pointers(*pool, table);
    if (status != KVXFER_OK) return status;
    const kvxfer::LaunchShape shape = kvxfer::launch_shape(*pool, *slice, layer_ptr_align, staging);
    emulate_cuda(gather != 0, *pool, *slice, table, page_ids, static_cast<char*>(staging), shape);
    return KVXFER_OK;
  } catch (const std::exception& exc) {
    return fail(KVXFER_ERR_INTERNAL, exc.what());
  }
}

KVXFER_API int kvxfer_cpu_abi_version(void) {
  return KVXFER_ABI_VERSION;
}

KVXFER_API const char* kvxfer_cpu_last_error(void) {
  return g_last_error.c_str();
}

KVXFER_API int kvxfer_gather_cpu(const kvxfer_pool_t* pool, void* const* layer_ptrs,
                                 const int64_t* page_ids, const kvxfer_slice_t* slice,
                                 void* staging, int64_t staging_bytes, int32_t num_threads,
                                 int64_t streaming_min_bytes) {
  return run(pool, layer_ptrs, page_ids, slice, staging, staging_bytes, num_threads,
             streaming_min_bytes, true);
}

KVXFER_API int kvxfer_scatter_cpu(const kvxfer_pool_t* pool, void* const* layer_ptrs,
                                  const int64_t* page_ids, const kvxfer_slice_t* slice,
                                  const void* staging, int64_t staging_bytes, int32_t num_threads,
                                  int64_t streaming_min_bytes) {
  // Scatter only reads staging; the Job is shared with gather, hence the const_cast.
  return run(pool, layer_ptrs, page_ids, slice, const_cast<void*>(staging), staging_bytes,
             num_threads, streaming_min_bytes, false);
}

}  // extern "C"
