/*
 * kvxfer_index.h: the index math shared by the CPU and CUDA kernels.
 *
 * Owns: where a (page, slot, head) row lives inside a pool layer buffer, where a
 * (layer, K|V, token, head) row lives inside the staging buffer, how a request token maps
 * to (page index, slot), and the host-side argument check both libraries run before they
 * touch memory. Everything is in bytes: rows are copied bitwise, so the element type only
 * matters through itemsize (1, 2 or 4) and the alignment it implies.
 * Must not: depend on CUDA or torch; the same functions compile for host (C++) and device
 * (nvcc), which is how the CPU tests also check the GPU addressing.
 */
#ifndef KVXFER_INDEX_H_
#define KVXFER_INDEX_H_

#include <stdint.h>
#include <stdio.h>

#include "kvxfer.h"

#if defined(__CUDACC__)
#define KVXFER_HD __host__ __device__ __forceinline__
#else
#define KVXFER_HD inline
#endif

namespace kvxfer {

/* Rows of one (page, head) tile of a head-major layout: a page of one kind (HND), or a
 * page of K then a page of V (HND_KV, whose V "layer pointer" is the K one + page_size rows). */
KVXFER_HD int64_t tile_rows(int32_t layout, int64_t page_size) {
  return layout == KVXFER_LAYOUT_HND_KV ? 2 * page_size : page_size;
}

/* Token-major layouts keep a token's heads side by side (NHD, NHD_KV). */
KVXFER_HD bool token_major(int32_t layout) {
  return layout == KVXFER_LAYOUT_NHD || layout == KVXFER_LAYOUT_NHD_KV;
}

/* Bytes from a row of one kind to the next row of the same kind in a layer buffer: the row
 * itself, or for NHD_KV a K row plus a V row (each (token, head) holds K then V, and the V
 * "layer pointer" is the K one + k_row_bytes). */
KVXFER_HD int64_t pool_row_pitch(const kvxfer_pool_t& p, int64_t row_bytes) {
  return p.layout == KVXFER_LAYOUT_NHD_KV ? p.k_row_bytes + p.v_row_bytes : row_bytes;
}

/* Byte offset, from a layer pointer, of the row holding head `head` of the token in slot
 * `slot` of page `page`; `pitch` is pool_row_pitch() of the row's kind. */
KVXFER_HD int64_t pool_row_offset(int32_t layout, int64_t page, int64_t slot, int64_t head,
                                  int64_t page_size, int64_t pool_heads, int64_t pitch) {
  if (token_major(layout)) {
    return ((page * page_size + slot) * pool_heads + head) * pitch;
  }
  return ((page * pool_heads + head) * tile_rows(layout, page_size) + slot) * pitch;
}

/* Bytes between head h and head h + 1 of the same token in a layer buffer. NHD and NHD_KV
 * keep a token's heads side by side; HND and HND_KV put a whole (page, head) tile between
 * them. */
KVXFER_HD int64_t pool_head_stride(int32_t layout, int64_t page_size, int64_t pitch) {
  return token_major(layout) ? pitch : tile_rows(layout, page_size) * pitch;
}

/* Staging bytes of one layer: its K block and, when num_kv == 2, its V block. */
KVXFER_HD int64_t staging_layer_bytes(int64_t num_kv, int64_t num_tokens, int64_t num_heads,
                                      int64_t k_row_bytes, int64_t v_row_bytes) {
  return num_tokens * num_heads * (k_row_bytes + (num_kv == 2 ? v_row_bytes : 0));
}

/* Staging byte offset of the first row of the (layer, kv) block; kv 0 is K, 1 is V. */
KVXFER_HD int64_t staging_block_offset(int64_t layer, int64_t kv, int64_t num_kv,
                                       int64_t num_tokens, int64_t num_heads, int64_t k_row_bytes,
                                       int64_t v_row_bytes) {
  return layer * staging_layer_bytes(num_kv, num_tokens, num_heads, k_row_bytes, v_row_bytes) +
         kv * num_tokens * num_heads * k_row_bytes;
}

/* Staging byte offset of (token, head) inside one block: blocks are [token][head][row]. */
KVXFER_HD int64_t staging_row_offset(int64_t token, int64_t head, int64_t num_heads,
                                     int64_t row_bytes) {
  return (token * num_heads + head) * row_bytes;
}

/* Request token t lives in page_ids[t / page_size] at slot t % page_size. */
struct TokenPos {
  int64_t page_index;
  int64_t slot;
};

KVXFER_HD TokenPos token_position(int64_t token, int64_t page_size) {
  TokenPos pos;
  pos.page_index = token / page_size;
  pos.slot = token - pos.page_index * page_size;
  return pos;
}

/* ---- the CUDA kernel's work decomposition (also run on the host by the emulator) ----
 * A CTA owns one (layer, K|V) pair (grid.y) and a tile of tile_tokens tokens (grid.x).
 * Inside a tile the staging bytes are contiguous, so vector u of the tile sits at staging
 * tile_base + u * width; on the pool side u splits into (token, head, vector-in-row). */

/* Pool byte offset of the first sliced head of staging token i, or -1 when its page id is
 * out of range (the kernel then skips the row instead of leaving the pool). */
KVXFER_HD int64_t token_pool_offset(const kvxfer_pool_t& p, const kvxfer_slice_t& s,
                                    const int64_t* page_ids, int64_t i, int64_t row_bytes) {
  const TokenPos pos = token_position(s.token_offset + i, p.page_size);
  const int64_t page = pos.page_index < s.num_page_ids ? page_ids[pos.page_index] : -1;
  if (page < 0 || page >= p.num_pages) return -1;
  return pool_row_offset(p.layout, page, pos.slot, s.head_start, p.page_size, p.pool_heads,
                         pool_row_pitch(p, row_bytes));
}

/* Pool byte offset of vector u of a tile, given the tile's per-token offsets. */
KVXFER_HD int64_t tile_vector_pool_offset(const int64_t* token_offsets, uint32_t u,
                                          uint32_t token_vecs, uint32_t row_vecs,
                                          int64_t head_stride, int64_t width) {
  const uint32_t i = u / token_vecs;
  const uint32_t r = u - i * token_vecs;
  const uint32_t h = r / row_vecs;
  const uint32_t v = r - h * row_vecs;
  const int64_t base = token_offsets[i];
  return base < 0 ? -1 : base + h * head_stride + static_cast<int64_t>(v) * width;
}

/* Largest of 16/8/4/2/1 dividing x (x > 0). */
inline int64_t vector_width(uint64_t x) {
  int64_t w = 16;
  while (w > 1 && x % static_cast<uint64_t>(w) != 0) w /= 2;
  return w;
}

constexpr int kCudaThreads = 256;
constexpr int kCudaUnroll = 4;
constexpr int64_t kCudaMaxTileTokens = 1024;
constexpr int64_t kCudaTileVectors = kCudaThreads * kCudaUnroll * 4;
constexpr int64_t kCudaMaxGridX = 1 << 20;

struct LaunchShape {
  int64_t width;       /* bytes per vector access */
  int64_t tile_tokens; /* tokens per tile (per CTA iteration) */
  int64_t num_tiles;
  int64_t max_token_vecs; /* vectors of one token's slice for the wider of K/V */
};

/* How the kernel splits a (checked) call. Every address is a base pointer plus multiples
 * of the row sizes, so one width dividing all of them keeps every access aligned. */
inline LaunchShape launch_shape(const kvxfer_pool_t& p, const kvxfer_slice_t& s,
                                int64_t layer_ptr_align, const void* staging) {
  LaunchShape shape;
  int64_t w = vector_width(static_cast<uint64_t>(layer_ptr_align));
  w = w < vector_width(p.k_row_bytes) ? w : vector_width(p.k_row_bytes);
  if (p.num_kv == 2) w = w < vector_width(p.v_row_bytes) ? w : vector_width(p.v_row_bytes);
  const int64_t ws = vector_width(reinterpret_cast<uintptr_t>(staging) | 16u);
  shape.width = w < ws ? w : ws;
  const int64_t row_max =
      p.num_kv == 2 && p.v_row_bytes > p.k_row_bytes ? p.v_row_bytes : p.k_row_bytes;
  shape.max_token_vecs = s.num_heads * row_max / shape.width;
  int64_t tile = kCudaTileVectors / shape.max_token_vecs;
  tile = tile < 1 ? 1 : (tile > kCudaMaxTileTokens ? kCudaMaxTileTokens : tile);
  shape.tile_tokens = tile;
  shape.num_tiles = (s.num_tokens + tile - 1) / tile;
  return shape;
}

/* ---- host-only argument checks ------------------------------------------------------ */

/* a * b when it fits in int64 (both non-negative), else -1. */
inline int64_t checked_mul(int64_t a, int64_t b) {
  if (a < 0 || b < 0) return -1;
  if (a != 0 && b > INT64_MAX / a) return -1;
  return a * b;
}

/* Bytes of staging a slice needs, or -1 when it overflows int64. */
inline int64_t staging_nbytes(const kvxfer_pool_t& p, const kvxfer_slice_t& s) {
  int64_t row = p.k_row_bytes + (p.num_kv == 2 ? p.v_row_bytes : 0);
  int64_t per_layer = checked_mul(checked_mul(s.num_tokens, s.num_heads), row);
  return per_layer < 0 ? -1 : checked_mul(per_layer, p.num_layers);
}

#define KVXFER_CHECK(cond, ...)             \
  do {                                      \
    if (!(cond)) {                          \
      snprintf(msg, msg_size, __VA_ARGS__); \
      return KVXFER_ERR_INVALID;            \
    }                                       \
  } while (0)

/* Everything about one side of a call (a pool and its slice) that can be checked without
 * reading page ids. On failure it writes a message naming the field and value into msg and
 * returns KVXFER_ERR_INVALID. */
inline int check_side(const kvxfer_pool_t* pool, const kvxfer_slice_t* slice,
                      const void* layer_ptrs, const void* page_ids, char* msg, size_t msg_size) {
  KVXFER_CHECK(pool != nullptr && slice != nullptr, "pool and slice must not be NULL");
  const kvxfer_pool_t& p = *pool;
  const kvxfer_slice_t& s = *slice;
  KVXFER_CHECK(p.num_layers >= 1, "num_layers=%lld must be >= 1", (long long)p.num_layers);
  KVXFER_CHECK(p.num_kv == 1 || p.num_kv == 2, "num_kv=%lld must be 1 or 2", (long long)p.num_kv);
  KVXFER_CHECK(p.num_pages >= 1, "num_pages=%lld must be >= 1", (long long)p.num_pages);
  KVXFER_CHECK(p.page_size >= 1, "page_size=%lld must be >= 1", (long long)p.page_size);
  KVXFER_CHECK(p.pool_heads >= 1, "pool_heads=%lld must be >= 1", (long long)p.pool_heads);
  KVXFER_CHECK(p.itemsize == 1 || p.itemsize == 2 || p.itemsize == 4,
               "itemsize=%lld must be 1, 2 or 4", (long long)p.itemsize);
  KVXFER_CHECK(p.k_row_bytes >= 1 && p.k_row_bytes % p.itemsize == 0,
               "k_row_bytes=%lld must be a positive multiple of itemsize=%lld",
               (long long)p.k_row_bytes, (long long)p.itemsize);
  KVXFER_CHECK(p.num_kv == 1 || (p.v_row_bytes >= 1 && p.v_row_bytes % p.itemsize == 0),
               "v_row_bytes=%lld must be a positive multiple of itemsize=%lld",
               (long long)p.v_row_bytes, (long long)p.itemsize);
  KVXFER_CHECK(p.layout == KVXFER_LAYOUT_NHD || p.layout == KVXFER_LAYOUT_HND ||
                   p.layout == KVXFER_LAYOUT_HND_KV || p.layout == KVXFER_LAYOUT_NHD_KV,
               "layout=%d must be %d (NHD), %d (HND) or %d (HND_KV), or %d (NHD_KV)", (int)p.layout,
               KVXFER_LAYOUT_NHD, KVXFER_LAYOUT_HND, KVXFER_LAYOUT_HND_KV, KVXFER_LAYOUT_NHD_KV);
  KVXFER_CHECK(
      p.layout != KVXFER_LAYOUT_HND_KV || (p.num_kv == 2 && p.v_row_bytes == p.k_row_bytes),
      "layout HND_KV needs num_kv=2 and v_row_bytes == k_row_bytes, got num_kv=%lld, "
      "k_row_bytes=%lld, v_row_bytes=%lld",
      (long long)p.num_kv, (long long)p.k_row_bytes, (long long)p.v_row_bytes);
  KVXFER_CHECK(p.layout != KVXFER_LAYOUT_NHD_KV || p.num_kv == 2,
               "layout NHD_KV needs num_kv=2 (K and V in one row), got num_kv=%lld",
               (long long)p.num_kv);
  KVXFER_CHECK(p.reserved == 0, "reserved=%d must be 0", (int)p.reserved);
  // The largest offset inside a layer buffer must fit in int64.
  int64_t row_max = p.k_row_bytes > p.v_row_bytes || p.num_kv == 1 ? p.k_row_bytes : p.v_row_bytes;
  if (p.layout == KVXFER_LAYOUT_NHD_KV) row_max = p.k_row_bytes + p.v_row_bytes;
  KVXFER_CHECK(checked_mul(checked_mul(checked_mul(p.num_pages, tile_rows(p.layout, p.page_size)),
                                       p.pool_heads),
                           row_max) >= 0,
               "pool of %lld pages x %lld rows x %lld heads x %lld bytes overflows int64",
               (long long)p.num_pages, (long long)tile_rows(p.layout, p.page_size),
               (long long)p.pool_heads, (long long)row_max);
  KVXFER_CHECK(s.head_start >= 0 && s.num_heads >= 1 && s.head_start <= p.pool_heads &&
                   s.num_heads <= p.pool_heads - s.head_start,
               "heads [%lld, %lld + %lld) are not inside the pool's %lld heads",
               (long long)s.head_start, (long long)s.head_start, (long long)s.num_heads,
               (long long)p.pool_heads);
  KVXFER_CHECK(s.token_offset >= 0, "token_offset=%lld must be >= 0", (long long)s.token_offset);
  KVXFER_CHECK(s.num_tokens >= 0, "num_tokens=%lld must be >= 0", (long long)s.num_tokens);
  KVXFER_CHECK(s.num_page_ids >= 0, "num_page_ids=%lld must be >= 0", (long long)s.num_page_ids);
  int64_t capacity = checked_mul(s.num_page_ids, p.page_size);
  KVXFER_CHECK(
      capacity >= 0 && s.token_offset <= capacity && s.num_tokens <= capacity - s.token_offset,
      "tokens [%lld, %lld + %lld) exceed %lld page ids x page_size %lld", (long long)s.token_offset,
      (long long)s.token_offset, (long long)s.num_tokens, (long long)s.num_page_ids,
      (long long)p.page_size);
  int64_t need = staging_nbytes(p, s);
  KVXFER_CHECK(need >= 0, "slice size overflows int64");
  if (s.num_tokens > 0) {
    KVXFER_CHECK(layer_ptrs != nullptr, "layer pointer table must not be NULL");
    KVXFER_CHECK(page_ids != nullptr, "page_ids must not be NULL");
  }
  return KVXFER_OK;
}

/* check_side plus the staging buffer of a gather or scatter. */
inline int check_args(const kvxfer_pool_t* pool, const kvxfer_slice_t* slice,
                      const void* layer_ptrs, const void* page_ids, const void* staging,
                      int64_t staging_bytes, char* msg, size_t msg_size) {
  const int status = check_side(pool, slice, layer_ptrs, page_ids, msg, msg_size);
  if (status != KVXFER_OK) return status;
  const int64_t need = staging_nbytes(*pool, *slice);
  KVXFER_CHECK(staging_bytes >= need, "staging_bytes=%lld is smaller than the %lld needed",
               (long long)staging_bytes, (long long)need);
  KVXFER_CHECK(slice->num_tokens == 0 || staging != nullptr, "staging must not be NULL");
  return KVXFER_OK;
}

/* A pool -> pool copy: both sides checked, and what must agree between them (the same
 * rows, heads and tokens; layouts, page sizes, pool heads and head starts may differ). */
inline int check_copy(const kvxfer_pool_t* src, const kvxfer_slice_t* src_slice,
                      const void* src_layer_ptrs, const void* src_page_ids,
                      const kvxfer_pool_t* dst, const kvxfer_slice_t* dst_slice,
                      const void* dst_layer_ptrs, const void* dst_page_ids, char* msg,
                      size_t msg_size) {
  char side[448];
  if (check_side(src, src_slice, src_layer_ptrs, src_page_ids, side, sizeof side) != KVXFER_OK) {
    snprintf(msg, msg_size, "source: %s", side);
    return KVXFER_ERR_INVALID;
  }
  if (check_side(dst, dst_slice, dst_layer_ptrs, dst_page_ids, side, sizeof side) != KVXFER_OK) {
    snprintf(msg, msg_size, "destination: %s", side);
    return KVXFER_ERR_INVALID;
  }
#define KVXFER_SAME(a, b, what)                                                               \
  KVXFER_CHECK((a) == (b), "%s differs: source %lld, destination %lld", what, (long long)(a), \
               (long long)(b))
  KVXFER_SAME(src->num_layers, dst->num_layers, "num_layers");
  KVXFER_SAME(src->num_kv, dst->num_kv, "num_kv");
  KVXFER_SAME(src->itemsize, dst->itemsize, "itemsize");
  KVXFER_SAME(src->k_row_bytes, dst->k_row_bytes, "k_row_bytes");
  if (src->num_kv == 2) KVXFER_SAME(src->v_row_bytes, dst->v_row_bytes, "v_row_bytes");
  KVXFER_SAME(src_slice->num_heads, dst_slice->num_heads, "num_heads");
  KVXFER_SAME(src_slice->num_tokens, dst_slice->num_tokens, "num_tokens");
#undef KVXFER_SAME
  return KVXFER_OK;
}

/* The CUDA launcher's own limits, on top of check_args (also run by the emulator). */
inline int check_launch(const kvxfer_pool_t& p, const kvxfer_slice_t& s, int64_t layer_ptr_align,
                        const void* staging, char* msg, size_t msg_size) {
  KVXFER_CHECK(layer_ptr_align >= 1 && (layer_ptr_align & (layer_ptr_align - 1)) == 0,
               "layer_ptr_align=%lld must be a power of two", (long long)layer_ptr_align);
  KVXFER_CHECK(p.num_layers * p.num_kv <= 65535,
               "num_layers * num_kv = %lld exceeds the 65535 CUDA grid rows",
               (long long)(p.num_layers * p.num_kv));
  const LaunchShape shape = launch_shape(p, s, layer_ptr_align, staging);
  KVXFER_CHECK(shape.max_token_vecs <= INT32_MAX / 2,
               "one token's slice (%lld vectors) is too large for the kernel's 32-bit index",
               (long long)shape.max_token_vecs);
  return KVXFER_OK;
}

#undef KVXFER_CHECK

}  // namespace kvxfer

#endif /* KVXFER_INDEX_H_ */
