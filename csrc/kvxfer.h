/*
 * kvxfer.h: the C ABI of the sglang_kvxfer gather/scatter kernels.
 *
 * Owns: the two plain structs that describe a KV pool and a token/head slice of it, the
 * status codes, and the entry points of the CPU library (libkvxfer_cpu.so) and the CUDA
 * library (libkvxfer_cuda.so). Python calls these through ctypes.
 * Must not: include torch or any framework header, allocate device memory, or throw
 * across the C boundary. Every entry point validates its arguments and returns a status;
 * the message of the last failure on the calling thread is kept for *_last_error().
 *
 * gather:  pool pages -> staging      scatter: staging -> pool pages
 * copy:    pool pages -> pool pages (a gather and a scatter fused: both page tables in one
 *          pass, for a destination pool mapped in the caller's address space)
 *
 * Staging layout (token-major, the same bytes on both sides of a transfer), for each
 * layer l = 0..L-1 in order:
 *     K block [num_tokens][num_heads][k_row_bytes]
 *     V block [num_tokens][num_heads][v_row_bytes]      (absent when num_kv == 1, MLA)
 * Staging token i is request token t = token_offset + i, stored in the pool at page
 * page_ids[t / page_size], slot t % page_size. Heads are pool heads
 * [head_start, head_start + num_heads).
 *
 * Pool layout of one layer buffer (row = one head of one token, row_bytes bytes):
 *     NHD:    [num_pages * page_size][pool_heads][row]
 *     HND:    [num_pages][pool_heads][page_size][row]
 *     HND_KV: [num_pages][pool_heads][2][page_size][row]   (vLLM's CPU cache)
 *     NHD_KV: [num_pages][page_size][pool_heads][k_row | v_row] (vLLM's GPU cache, LBNHC)
 * HND_KV keeps K and V of a layer in one buffer: each (page, head) tile holds the K rows of
 * its page_size tokens, then their V rows. It is described as two "layer buffers" like the
 * others: the V pointer of layer l is its K pointer + page_size * k_row_bytes, and rows of
 * both step over the other kind's half of every tile (k_row_bytes == v_row_bytes).
 * NHD_KV keeps one token's K row and V row of a head side by side: the V pointer of layer l
 * is its K pointer + k_row_bytes, and rows of both kinds step k_row_bytes + v_row_bytes
 * (v_row_bytes may differ from k_row_bytes).
 */
#ifndef KVXFER_H_
#define KVXFER_H_

#include <stdint.h>

#if defined(_WIN32)
#define KVXFER_API __declspec(dllexport)
#else
#define KVXFER_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct or a signature below changes; Python checks it at load. */
#define KVXFER_ABI_VERSION 3 /* 2: KVXFER_LAYOUT_HND_KV; 3: NHD_KV, kvxfer_copy_* */

#define KVXFER_LAYOUT_NHD 0
#define KVXFER_LAYOUT_HND 1
#define KVXFER_LAYOUT_HND_KV 2
#define KVXFER_LAYOUT_NHD_KV 3

#define KVXFER_OK 0
#define KVXFER_ERR_INVALID 1  /* an argument is out of range; nothing was copied */
#define KVXFER_ERR_CUDA 2     /* a CUDA runtime call or the launch failed */
#define KVXFER_ERR_INTERNAL 3 /* a host-side failure (thread creation, out of memory) */

/* One side's KV pool: L layers, each with a K buffer and (num_kv == 2) a V buffer. */
typedef struct kvxfer_pool {
  int64_t num_layers;  /* L >= 1 */
  int64_t num_kv;      /* 2: K and V per layer; 1: one buffer per layer (MLA) */
  int64_t num_pages;   /* pages per layer buffer; page ids must be in [0, num_pages) */
  int64_t page_size;   /* tokens per page */
  int64_t pool_heads;  /* heads per token stored in the pool (the rank's local heads) */
  int64_t itemsize;    /* bytes per element: 1, 2 or 4 (copies are bitwise) */
  int64_t k_row_bytes; /* k_dim * itemsize */
  int64_t v_row_bytes; /* v_dim * itemsize; ignored when num_kv == 1 */
  int32_t layout;      /* KVXFER_LAYOUT_NHD, _HND, _HND_KV or _NHD_KV */
  int32_t reserved;    /* must be 0 */
} kvxfer_pool_t;

/* Which tokens and heads of a request move. */
typedef struct kvxfer_slice {
  int64_t head_start;   /* first pool head of the slice */
  int64_t num_heads;    /* heads in the slice (>= 1) */
  int64_t token_offset; /* request token of staging token 0 (>= 0) */
  int64_t num_tokens;   /* tokens to move (>= 0) */
  int64_t num_page_ids; /* length of the page id array */
} kvxfer_slice_t;

/* ---- CPU library (libkvxfer_cpu.so) ------------------------------------------------
 * layer_ptrs: num_kv * L host pointers, K of layers 0..L-1 then V of layers 0..L-1
 *   (HND_KV: V pointer l must be K pointer l + page_size * k_row_bytes; NHD_KV: K pointer l
 *   + k_row_bytes; checked).
 * page_ids: host array of num_page_ids int64. num_threads <= 0 means one thread.
 * streaming_min_bytes: calls moving at least this many bytes use non-temporal stores
 *   (bypassing the cache: right for big transfers read next by a NIC); < 0 selects the
 *   library default, KVXFER_CPU_STREAMING_MIN_BYTES_DEFAULT.
 * Every page id the slice uses is range-checked before any byte moves. A scatter's page ids
 * must not repeat (two tokens would race for one slot): the caller checks that. */
#define KVXFER_CPU_STREAMING_MIN_BYTES_DEFAULT (16LL << 20)
KVXFER_API int kvxfer_cpu_abi_version(void);
KVXFER_API const char* kvxfer_cpu_last_error(void);
KVXFER_API int kvxfer_gather_cpu(const kvxfer_pool_t* pool, void* const* layer_ptrs,
                                 const int64_t* page_ids, const kvxfer_slice_t* slice,
                                 void* staging, int64_t staging_bytes, int32_t num_threads,
                                 int64_t streaming_min_bytes);
KVXFER_API int kvxfer_scatter_cpu(const kvxfer_pool_t* pool, void* const* layer_ptrs,
                                  const int64_t* page_ids, const kvxfer_slice_t* slice,
                                  const void* staging, int64_t staging_bytes, int32_t num_threads,
                                  int64_t streaming_min_bytes);

/* Pool -> pool: the rows a gather of (src_pool, src_slice) would stage are written where a
 * scatter of the same staging into (dst_pool, dst_slice) would put them, in one pass (no
 * staging). Layouts, page sizes, pool heads, head starts and token offsets may differ; the
 * layer count, num_kv, itemsize, row sizes, num_heads and num_tokens must agree. Both sides'
 * page ids are range-checked before any byte moves, and the destination's (those the slice
 * uses) must not repeat. The source and destination rows must not overlap. */
KVXFER_API int kvxfer_copy_cpu(const kvxfer_pool_t* src_pool, void* const* src_layer_ptrs,
                               const int64_t* src_page_ids, const kvxfer_slice_t* src_slice,
                               const kvxfer_pool_t* dst_pool, void* const* dst_layer_ptrs,
                               const int64_t* dst_page_ids, const kvxfer_slice_t* dst_slice,
                               int32_t num_threads, int64_t streaming_min_bytes);

/* Test hook: runs the CUDA kernel's exact work decomposition (launch_shape, tiles, per-token
 * offsets, width-byte vectors; kvxfer_index.h) serially on the host, with host pointers in
 * place of device ones. gather != 0 gathers, else scatters. Like the kernel, it does not
 * pre-check page ids: rows of out-of-range page ids are skipped (gather writes zeros). */
KVXFER_API int kvxfer_emulate_cuda_cpu(int32_t gather, const kvxfer_pool_t* pool,
                                       const uint64_t* table, int64_t layer_ptr_align,
                                       const int64_t* page_ids, const kvxfer_slice_t* slice,
                                       void* staging, int64_t staging_bytes);

/* Test hook: kvxfer_copy_cuda's decomposition on the host (host pointer tables and page ids);
 * rows with an out-of-range page id on either side are skipped, like the kernel does. */
KVXFER_API int kvxfer_emulate_cuda_copy_cpu(
    const kvxfer_pool_t* src_pool, const uint64_t* src_table, const int64_t* src_page_ids,
    const kvxfer_slice_t* src_slice, const kvxfer_pool_t* dst_pool, const uint64_t* dst_table,
    const int64_t* dst_page_ids, const kvxfer_slice_t* dst_slice, int64_t layer_ptr_align);

/* ---- CUDA library (libkvxfer_cuda.so) -----------------------------------------------
 * dev_table: device array of num_kv * L uint64 layer pointers (same order as above).
 * dev_page_ids: device array of num_page_ids int64 (the caller range-checks them; the
 *   kernel skips a row whose page id is out of range instead of touching memory outside
 *   the pool, and gather writes zeros there).
 * layer_ptr_align: a power of two (<= 16 is enough) dividing every layer pointer; the
 *   vector width is the largest of 16/8/4/2/1 bytes dividing it, the row sizes and the
 *   staging pointer. stream: a cudaStream_t (NULL = legacy default stream).
 * One launch covers all layers and K and V. The call is asynchronous on the stream. */
KVXFER_API int kvxfer_cuda_abi_version(void);
KVXFER_API const char* kvxfer_cuda_last_error(void);
/* KVXFER_OK when the CUDA runtime linked into the library can see at least one device. */
KVXFER_API int kvxfer_cuda_probe(void);
KVXFER_API int kvxfer_gather_cuda(const kvxfer_pool_t* pool, const uint64_t* dev_table,
                                  int64_t layer_ptr_align, const int64_t* dev_page_ids,
                                  const kvxfer_slice_t* slice, void* staging, int64_t staging_bytes,
                                  void* stream);
KVXFER_API int kvxfer_scatter_cuda(const kvxfer_pool_t* pool, const uint64_t* dev_table,
                                   int64_t layer_ptr_align, const int64_t* dev_page_ids,
                                   const kvxfer_slice_t* slice, const void* staging,
                                   int64_t staging_bytes, void* stream);
/* kvxfer_copy_cpu on the device: both tables and both page id arrays in device memory (the
 * caller range-checks the ids and their uniqueness; the kernel skips rows whose page id is
 * out of range on either side). layer_ptr_align divides every pointer of both tables. */
KVXFER_API int kvxfer_copy_cuda(const kvxfer_pool_t* src_pool, const uint64_t* src_dev_table,
                                const int64_t* src_dev_page_ids, const kvxfer_slice_t* src_slice,
                                const kvxfer_pool_t* dst_pool, const uint64_t* dst_dev_table,
                                const int64_t* dst_dev_page_ids, const kvxfer_slice_t* dst_slice,
                                int64_t layer_ptr_align, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* KVXFER_H_ */
