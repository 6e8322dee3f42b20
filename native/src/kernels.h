// Shared declarations between the generic code (baseline flags) and the ISA translation units.
// Nothing in here may be an inline function or template: the ISA files are compiled with wider
// instruction sets, and a shared inline symbol could be linked into the generic code (SIGILL on old CPUs).
#pragma once
#include <cstddef>
#include <cstdint>

namespace killick {

// Weight format tag. Dequantising formats (fp8, 4-bit blocks) get new tags and new dot functions.
enum Format : int { kF32 = 0, kBF16 = 1 };

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

// out[t * out_stride + r] = sum_k W[r * ld + k] * x[t][k] for r < rows, t < T (1..4), fp32 accumulation.
// W is `rows` rows of K elements in the table's format; x points at fp32 vectors or, when the table's
// `x_bf16` is set, at bf16 vectors (VDPBF16PS and the AVX2 bf16 path take both operands in bf16).
// row_block 0: walk up to 4 rows side by side (one weight load feeds T tokens x 4 rows of FMAs);
// row_block 1: one row at a time, two lines per step into independent accumulators (one sequential stream).
// prefetch_bytes ahead along each row stream (0: none), with prefetch_hint as __builtin_prefetch's locality
// (3: prefetcht0 into L1, 2: prefetcht1, 1: prefetcht2, 0: prefetchnta).
// then: the rows the caller walks next (same ld, at least 4 of them) or null: row_block 0's prefetches run on
// from the last rows into them instead of stopping at the end of the call.
using DotRowsFn = void (*)(const void* W, int64_t ld, int K, int rows, const void* const* x, int T,
                           float* out, int out_stride, int prefetch_bytes, int prefetch_hint, int row_block,
                           const void* then);
// Rows r < rows of S matrices (S = 2 or 4) walked side by side, S sequential streams: row r of W[s] against
// the activations x[s] (T of them) into out[s][t * out_stride + r]; same formats and activations as DotRowsFn.
using DotStreamsFn = void (*)(int S, const void* const* W, int64_t ld, int K, int rows, const void* const* const* x,
                              int T, float* const* out, int out_stride, int prefetch_bytes, int prefetch_hint);
// XOR of every 8-byte word in [p, p + nbytes): a read-only pass the compiler cannot drop. streams 1: one
// sequential pass (STREAM read); 2 or 4: that many equal parts read side by side.
using ReadFn = uint64_t (*)(const void* p, size_t nbytes, int streams);
// The tile path, bf16 weights only, 1 to kMaxTileTokens (16) tokens in one pass over the rows: out[s][t *
// out_stride + r] = sum_k W[s][r * ld + k] * x_t[k] for s < S (1 or 2 matrices sharing the activations: an
// expert's gate and up rows), r < rows, t < T; K a multiple of 32. The activations come packed in pairs,
// token-minor: word xp[p * T + t] holds x_t[2p] (low half) and x_t[2p + 1] (high half) as bf16, the layout a
// tile multiply reads as its right-hand operand. prefetch_bytes ahead along each weight row (0: none).
using DotTileFn = void (*)(int S, const void* const* W, int64_t ld, int K, int rows, const uint32_t* xp, int T,
                           float* const* out, int out_stride, int prefetch_bytes);

struct KernelTable {
  const char* name;
  DotRowsFn dot[2];   // indexed by Format
  DotStreamsFn dots[2];  // indexed by Format
  bool x_bf16[2];        // per Format: do dot[] and dots[] want bf16 activations?
  ReadFn read;
  DotTileFn tile;  // null: no tile path (the vector kernels take up to 4 tokens a pass)
};

const KernelTable* table_scalar();
const KernelTable* table_avx2();
const KernelTable* table_avx512();
const KernelTable* table_avx512bf16();
const KernelTable* table_amx();

}  // namespace killick
