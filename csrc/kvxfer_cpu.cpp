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

/* Byte offset of the cursor's token's first sliced head in a layer buffer (pitch: the
 * row kind's kvxfer::pool_row_pitch). */
inline int64_t cur_row(const kvxfer_pool_t& p, const kvxfer_slice_t& s, const int64_t* page_ids,
                       const Cursor& c, int64_t pitch) {
  return kvxfer::pool_row_offset(p.layout, page_ids[c.pos.page_index], c.pos.slot, s.head_start,
                                 p.page_size, p.pool_heads, pitch);
}

/* Tokens to prefetch ahead, between 2 and 32: about 16 KiB of rows in flight for NHD pools
 * (one short run per token row; with 4 KiB a 2-head slice stalled at ~0.56x of a copy here,
 * with 16 KiB it reaches ~0.67x), 4 KiB for HND pools (a run per head already spreads the
 * reads; more distance measured slower; HND_KV reads like HND, NHD_KV like NHD). */
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
    const int64_t pitch = kvxfer::pool_row_pitch(p, row);
    const int64_t head_stride = kvxfer::pool_head_stride(p.layout, p.page_size, pitch);
    char* block =
        job.staging + kvxfer::staging_block_offset(layer, kv, p.num_kv, num_tokens, s.num_heads,
                                                   p.k_row_bytes, p.v_row_bytes);
    // NHD: a token's slice of heads is one contiguous run; HND, HND_KV, NHD_KV (K and V rows
    // alternate): one row per head.
    const bool adjacent = head_stride == row;
    const bool nhd = kvxfer::token_major(p.layout);
    const int64_t run_bytes = adjacent ? s.num_heads * row : row;
    const int64_t runs_per_token = adjacent ? 1 : s.num_heads;
    // Walk (page index, slot) incrementally: no division per token. A gather reads rows
    // scattered over the pool, which the hardware prefetchers do not follow across pages,
    // so a second cursor runs `ahead` tokens in front and prefetches their rows.
    Cursor cur(s.token_offset + first, p.page_size);
    Cursor pre = cur;
    const int64_t ahead = job.gather ? prefetch_distance(run_bytes * runs_per_token, nhd) : 0;
    for (int64_t k = 0; k < ahead && first + k < last; ++k) pre.next();
    for (int64_t i = first; i < last; ++i) {
      if (ahead != 0 && i + ahead < last) {
        const char* future = buffer + cur_row(p, s, job.page_ids, pre, pitch);
        for (int64_t h = 0; h < runs_per_token; ++h) prefetch(future + h * head_stride, run_bytes);
        pre.next();
      }
      char* pool_row = buffer + cur_row(p, s, job.page_ids, cur, pitch);
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
 * K pointers (one buffer per layer, K and V tiles interleaved; kvxfer.h), an NHD_KV pool's one
 * K row past them (K and V rows interleaved). */
template <typename Ptr>
int check_layer_pointers(const kvxfer_pool_t& p, const Ptr* ptrs) {
  for (int64_t k = 0; k < p.num_kv * p.num_layers; ++k) {
    if (address(ptrs[k]) == 0) {
      return fail(KVXFER_ERR_INVALID, "layer pointer " + std::to_string(k) + " is NULL");
    }
  }
  if (p.layout != KVXFER_LAYOUT_HND_KV && p.layout != KVXFER_LAYOUT_NHD_KV) return KVXFER_OK;
  const bool hnd = p.layout == KVXFER_LAYOUT_HND_KV;
  const uintptr_t v_shift =
      static_cast<uintptr_t>(hnd ? p.page_size * p.k_row_bytes : p.k_row_bytes);
  for (int64_t l = 0; l < p.num_layers; ++l) {
    if (address(ptrs[p.num_layers + l]) != address(ptrs[l]) + v_shift) {
      return fail(KVXFER_ERR_INVALID,
                  std::string(hnd ? "layout HND_KV" : "layout NHD_KV") + ": V pointer of layer " +
                      std::to_string(l) + " must be its K pointer + " +
                      (hnd ? "page_size * k_row_bytes" : "k_row_bytes") + " = " +
                      std::to_string(v_shift) + " bytes (one buffer per layer)");
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

/* Runs fn(begin, end) over [0, total) split in equal contiguous ranges over num_threads. */
template <typename Fn>
int run_items(int64_t total, int32_t num_threads, const Fn& fn) {
  if (total == 0) return KVXFER_OK;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, total));
  const int64_t chunk = (total + workers - 1) / workers;
  std::vector<std::thread> threads;
  int64_t next = chunk;  // the calling thread takes [0, chunk)
  try {
    threads.reserve(static_cast<size_t>(workers - 1));
    for (; next < total && static_cast<int64_t>(threads.size()) < workers - 1; next += chunk) {
      const int64_t lo = next, hi = std::min(total, next + chunk);
      threads.emplace_back([&fn, lo, hi] { fn(lo, hi); });
    }
  } catch (const std::exception&) {
    // Could not start a thread: the remaining ranges run on this thread below.
  }
  fn(0, std::min(total, chunk));
  for (; next < total; next += chunk) fn(next, std::min(total, next + chunk));
  for (std::thread& t : threads) t.join();
  return KVXFER_OK;
}

int run_job(const Job& job, int32_t num_threads) {
  const int64_t total = job.pool.num_layers * job.pool.num_kv * job.slice.num_tokens;
  return run_items(total, num_threads, [&job](int64_t lo, int64_t hi) { copy_items(job, lo, hi); });
}

/* ---- pool -> pool (kvxfer_copy_cpu) ---- */

struct CopyJob {
  kvxfer_pool_t src, dst;
  kvxfer_slice_t src_slice, dst_slice;
  char* const* src_layers;
  char* const* dst_layers;
  const int64_t* src_page_ids;
  const int64_t* dst_page_ids;
  bool streaming;
};

/* Copies items [begin, end), item = (layer * num_kv + kv) * num_tokens + token: the token's
 * sliced heads go from their source rows to their destination rows. Runs that continue each
 * other on both sides merge (a token's heads when both sides are NHD, whole pages of them when
 * page ids are consecutive too); the source rows of tokens ahead are prefetched. */
void copy_pool_items(const CopyJob& job, int64_t begin, int64_t end) {
  const kvxfer_pool_t& sp = job.src;
  const kvxfer_pool_t& dp = job.dst;
  const kvxfer_slice_t& ss = job.src_slice;
  const kvxfer_slice_t& ds = job.dst_slice;
  const int64_t num_tokens = ss.num_tokens;
  const int64_t num_heads = ss.num_heads;
  RunCopier run(job.streaming);
  int64_t item = begin;
  while (item < end) {
    const int64_t lk = item / num_tokens;
    const int64_t first = item - lk * num_tokens;
    const int64_t last = std::min(num_tokens, first + (end - item));
    const int64_t layer = lk / sp.num_kv;
    const int64_t kv = lk - layer * sp.num_kv;
    const char* src_buf = job.src_layers[kv * sp.num_layers + layer];
    char* dst_buf = job.dst_layers[kv * dp.num_layers + layer];
    const int64_t row = kv == 0 ? sp.k_row_bytes : sp.v_row_bytes;
    const int64_t src_pitch = kvxfer::pool_row_pitch(sp, row);
    const int64_t dst_pitch = kvxfer::pool_row_pitch(dp, row);
    const int64_t src_hs = kvxfer::pool_head_stride(sp.layout, sp.page_size, src_pitch);
    const int64_t dst_hs = kvxfer::pool_head_stride(dp.layout, dp.page_size, dst_pitch);
    // Both sides keep the sliced heads of a token side by side: one run per token.
    const bool adjacent = src_hs == row && dst_hs == row;
    const int64_t run_bytes = adjacent ? num_heads * row : row;
    const int64_t runs_per_token = adjacent ? 1 : num_heads;
    const int64_t src_run_span = adjacent ? run_bytes : row;
    Cursor src_cur(ss.token_offset + first, sp.page_size);
    Cursor dst_cur(ds.token_offset + first, dp.page_size);
    Cursor pre = src_cur;
    const int64_t ahead =
        prefetch_distance(run_bytes * runs_per_token, kvxfer::token_major(sp.layout));
    for (int64_t k = 0; k < ahead && first + k < last; ++k) pre.next();
    for (int64_t i = first; i < last; ++i) {
      if (i + ahead < last) {
        const char* future = src_buf + cur_row(sp, ss, job.src_page_ids, pre, src_pitch);
        for (int64_t h = 0; h < runs_per_token; ++h) prefetch(future + h * src_hs, src_run_span);
        pre.next();
      }
      const char* src_row = src_buf + cur_row(sp, ss, job.src_page_ids, src_cur, src_pitch);
      char* dst_row = dst_buf + cur_row(dp, ds, job.dst_page_ids, dst_cur, dst_pitch);
      for (int64_t h = 0; h < runs_per_token; ++h) {
        run.add(dst_row + h * dst_hs, src_row + h * src_hs, static_cast<size_t>(run_bytes));
      }
      src_cur.next();
      dst_cur.next();
    }
    item += last - first;
  }
  run.flush();
  if (job.streaming) fence_streaming();
}

/* The destination page ids the slice writes must be distinct (two tokens would race for a
 * slot; a pool -> pool copy has no separate caller check in C). */
int check_distinct_pages(const kvxfer_pool_t& p, const kvxfer_slice_t& s, const int64_t* page_ids) {
  if (s.num_tokens == 0) return KVXFER_OK;
  const int64_t first = s.token_offset / p.page_size;
  const int64_t last = (s.token_offset + s.num_tokens - 1) / p.page_size;
  std::vector<int64_t> ids(page_ids + first, page_ids + last + 1);
  std::sort(ids.begin(), ids.end());
  const auto dup = std::adjacent_find(ids.begin(), ids.end());
  if (dup != ids.end()) {
    return fail(KVXFER_ERR_INVALID, "destination page_ids repeat page " + std::to_string(*dup) +
                                        ": two tokens would be written to one slot");
  }
  return KVXFER_OK;
}

/* Everything a pool -> pool call checks before any byte moves (CPU library and emulator). */
template <typename Ptr>
int check_copy_call(const kvxfer_pool_t* src, const Ptr* src_ptrs, const int64_t* src_ids,
                    const kvxfer_slice_t* ss, const kvxfer_pool_t* dst, const Ptr* dst_ptrs,
                    const int64_t* dst_ids, const kvxfer_slice_t* ds) {
  char msg[512];
  int status =
      kvxfer::check_copy(src, ss, src_ptrs, src_ids, dst, ds, dst_ptrs, dst_ids, msg, sizeof msg);
  if (status != KVXFER_OK) return fail(status, msg);
  if (ss->num_tokens == 0) return KVXFER_OK;
  if ((status = check_layer_pointers(*src, src_ptrs)) != KVXFER_OK) {
    return fail(status, "source: " + g_last_error);
  }
  if ((status = check_layer_pointers(*dst, dst_ptrs)) != KVXFER_OK) {
    return fail(status, "destination: " + g_last_error);
  }
  if ((status = check_page_ids(*src, *ss, src_ids)) != KVXFER_OK) {
    return fail(status, "source: " + g_last_error);
  }
  if ((status = check_page_ids(*dst, *ds, dst_ids)) != KVXFER_OK) {
    return fail(status, "destination: " + g_last_error);
  }
  return check_distinct_pages(*dst, *ds, dst_ids);
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
    const int64_t head_stride =
        kvxfer::pool_head_stride(p.layout, p.page_size, kvxfer::pool_row_pitch(p, row));
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

/* kvxfer_copy_cuda's loops, one thread: like emulate_cuda, with a per-token offset table for
 * each side and the vector u of a tile split into (token, head, vector) on both sides. */
void emulate_cuda_copy(const kvxfer_pool_t& sp, const kvxfer_slice_t& ss, const uint64_t* src_table,
                       const int64_t* src_ids, const kvxfer_pool_t& dp, const kvxfer_slice_t& ds,
                       const uint64_t* dst_table, const int64_t* dst_ids,
                       const kvxfer::LaunchShape& shape) {
  std::vector<int64_t> src_off(static_cast<size_t>(kvxfer::kCudaMaxTileTokens));
  std::vector<int64_t> dst_off(static_cast<size_t>(kvxfer::kCudaMaxTileTokens));
  if (shape.tile_tokens > kvxfer::kCudaMaxTileTokens || shape.tile_tokens < 1) {
    throw std::logic_error("tile_tokens=" + std::to_string(shape.tile_tokens) +
                           " does not fit the kernel's shared memory");
  }
  const int64_t w = shape.width;
  for (int64_t y = 0; y < sp.num_layers * sp.num_kv; ++y) {
    const int64_t layer = y / sp.num_kv, kv = y - layer * sp.num_kv;
    const char* src_buf = reinterpret_cast<const char*>(src_table[kv * sp.num_layers + layer]);
    char* dst_buf = reinterpret_cast<char*>(dst_table[kv * dp.num_layers + layer]);
    const int64_t row = kv == 0 ? sp.k_row_bytes : sp.v_row_bytes;
    const int64_t src_hs =
        kvxfer::pool_head_stride(sp.layout, sp.page_size, kvxfer::pool_row_pitch(sp, row));
    const int64_t dst_hs =
        kvxfer::pool_head_stride(dp.layout, dp.page_size, kvxfer::pool_row_pitch(dp, row));
    const uint32_t row_vecs = static_cast<uint32_t>(row / w);
    const uint32_t token_vecs = static_cast<uint32_t>(ss.num_heads) * row_vecs;
    for (int64_t tile = 0; tile < shape.num_tiles; ++tile) {
      const int64_t first = tile * shape.tile_tokens;
      const int64_t tile_n = std::min(shape.tile_tokens, ss.num_tokens - first);
      for (int64_t i = 0; i < tile_n; ++i) {
        src_off[i] = kvxfer::token_pool_offset(sp, ss, src_ids, first + i, row);
        dst_off[i] = kvxfer::token_pool_offset(dp, ds, dst_ids, first + i, row);
      }
      const uint32_t total = static_cast<uint32_t>(tile_n) * token_vecs;
      for (uint32_t u = 0; u < total; ++u) {
        const int64_t from =
            kvxfer::tile_vector_pool_offset(src_off.data(), u, token_vecs, row_vecs, src_hs, w);
        const int64_t to =
            kvxfer::tile_vector_pool_offset(dst_off.data(), u, token_vecs, row_vecs, dst_hs, w);
        if (from >= 0 && to >= 0) std::memcpy(dst_buf + to, src_buf + from, static_cast<size_t>(w));
      }
    }
  }
}

}  // namespace

extern "C" {

KVXFER_API int kvxfer_copy_cpu(const kvxfer_pool_t* src_pool, void* const* src_layer_ptrs,
                               const int64_t* src_page_ids, const kvxfer_slice_t* src_slice,
                               const kvxfer_pool_t* dst_pool, void* const* dst_layer_ptrs,
                               const int64_t* dst_page_ids, const kvxfer_slice_t* dst_slice,
                               int32_t num_threads, int64_t streaming_min_bytes) {
  try {
    const int status = check_copy_call(src_pool, src_layer_ptrs, src_page_ids, src_slice, dst_pool,
                                       dst_layer_ptrs, dst_page_ids, dst_slice);
    if (status != KVXFER_OK || src_slice->num_tokens == 0) return status;
    if (streaming_min_bytes < 0) streaming_min_bytes = KVXFER_CPU_STREAMING_MIN_BYTES_DEFAULT;
    const bool streaming = kvxfer::staging_nbytes(*src_pool, *src_slice) >= streaming_min_bytes;
    CopyJob job{*src_pool,
                *dst_pool,
                *src_slice,
                *dst_slice,
                reinterpret_cast<char* const*>(src_layer_ptrs),
                reinterpret_cast<char* const*>(dst_layer_ptrs),
                src_page_ids,
                dst_page_ids,
                streaming};
    const int64_t total = src_pool->num_layers * src_pool->num_kv * src_slice->num_tokens;
    return run_items(total, num_threads,
                     [&job](int64_t lo, int64_t hi) { copy_pool_items(job, lo, hi); });
  } catch (const std::exception& exc) {
    return fail(KVXFER_ERR_INTERNAL, exc.what());
  } catch (...) {
    return fail(KVXFER_ERR_INTERNAL, "unknown C++ exception");
  }
}

KVXFER_API int kvxfer_emulate_cuda_copy_cpu(
    const kvxfer_pool_t* src_pool, const uint64_t* src_table, const int64_t* src_page_ids,
    const kvxfer_slice_t* src_slice, const kvxfer_pool_t* dst_pool, const uint64_t* dst_table,
    const int64_t* dst_page_ids, const kvxfer_slice_t* dst_slice, int64_t layer_ptr_align) {
  try {
    char msg[512];
    if (kvxfer::check_copy(src_pool, src_slice, src_table, src_page_ids, dst_pool, dst_slice,
                           dst_table, dst_page_ids, msg, sizeof msg) != KVXFER_OK ||
        kvxfer::check_launch(*src_pool, *src_slice, layer_ptr_align, nullptr, msg, sizeof msg) !=
            KVXFER_OK) {
      return fail(KVXFER_ERR_INVALID, msg);
    }
    if (src_slice->num_tokens == 0) return KVXFER_OK;
    int status = check_layer_pointers(*src_pool, src_table);
    if (status != KVXFER_OK) return fail(status, "source: " + g_last_error);
    status = check_layer_pointers(*dst_pool, dst_table);
    if (status != KVXFER_OK) return fail(status, "destination: " + g_last_error);
    const kvxfer::LaunchShape shape =
        kvxfer::launch_shape(*src_pool, *src_slice, layer_ptr_align, nullptr);
    emulate_cuda_copy(*src_pool, *src_slice, src_table, src_page_ids, *dst_pool, *dst_slice,
                      dst_table, dst_page_ids, shape);
    return KVXFER_OK;
  } catch (const std::exception& exc) {
    return fail(KVXFER_ERR_INTERNAL, exc.what());
  }
}

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
