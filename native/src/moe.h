// SwiGLU expert jobs for the pool: y[token] += w * down(silu(gate x) * up x), and a STREAM-style read.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels.h"
#include "pool.h"

namespace killick {

constexpr int kMaxTokens = 4;       // tokens sharing one pass of the vector kernels over an expert's weights
constexpr int kMaxTileTokens = 16;  // and of the tile path (KernelTable::tile)
// row_block values for the stream walks (DotStreamsFn): kPairWalk, an expert's gate and up rows side by side in
// phase 0 and two experts' down rows in phase 1; kQuadWalk, both halves of the gate and up rows, four experts'
// down rows. 0 and 1 are DotRowsFn's walks.
constexpr int kPairWalk = 2;
constexpr int kQuadWalk = 3;

// One (layer, expert) and the tokens that route to it. gate_up: [2I, H] rows (gate rows 0..I-1, up rows
// I..2I-1), row stride ld_gu elements; down: [H, I], row stride ld_dn elements. out: each token's output row
// (gather mode, see MoeArgs).
struct ExpertGroup {
  const void* gate_up;
  const void* down;
  int ntok;
  int tok[kMaxTileTokens];
  float w[kMaxTileTokens];
  int64_t out[kMaxTileTokens];
};

struct MoeArgs {
  const KernelTable* table;
  Format fmt;
  int H, I;
  int64_t ld_gu, ld_dn;
  const void* x;  // [T, H] in x_fmt, row stride x_stride elements
  Format x_fmt;
  int64_t x_stride;
  // Accumulate mode: [T, H] f32, y[token] += w * expert(x[token]). Gather mode (plan's out_rows): task i's
  // expert(x[token]) overwrites row out_rows[i], in y_fmt, weights ignored.
  void* y;
  Format y_fmt;
  int64_t y_stride;
  int T;
  int prefetch_bytes;
  int prefetch_hint;  // see DotRowsFn
  int row_block;  // see DotRowsFn, kPairWalk and kQuadWalk
  int claim_rows;  // rows a worker claims at a time (clamped to 1..kChunkRows)
  bool guided;     // claims shrink towards the end of each phase (see MoeJob::claim)
  int least_claim;  // to this many rows (clamped to 1..claim_rows)
  // The tile path (table->tile, bf16 weights, H and I multiples of 32) runs a call whose tasks average this
  // many tokens an expert or more, kMaxTileTokens a pass; 0: never.
  int tile_tokens;
};

class MoeJob;

// Plans SwiGLU jobs into one job object reused call after call (task grouping, activations and scratch are
// kept and only grow), so a warm MoE-layer call allocates nothing: each call runs with caches emptied by the
// previous call's streaming, where every fresh allocation and page costs. One per Runner; plan() only while
// the previous plan is not in flight (Pool::wait() first).
class MoePlanner {
 public:
  MoePlanner();
  ~MoePlanner();
  // Tasks as parallel arrays (gate_up address, down address, token, weight or, in gather mode, output row);
  // tasks on the same expert are grouped in first-appearance order, kMaxTokens tokens per pass over its
  // weights (kMaxTileTokens on the tile path). out_rows null: accumulate mode (weights), else gather mode
  // (weights may be null). Returns the job to submit.
  std::shared_ptr<Job> plan(const MoeArgs& args, size_t n, const uint64_t* gate_up, const uint64_t* down,
                            const int64_t* tokens, const float* weights, const int64_t* out_rows = nullptr);
  bool last_tiles() const;  // did the last plan take the tile path?

 private:
  std::shared_ptr<MoeJob> job_;
};

// XOR-reads [p, p + nbytes) split over the pool's workers, each reading its part as `streams` streams
// (see ReadFn); returns the folded XOR. chunk_bytes 0: worker w reads the w-th contiguous part (STREAM's
// static split); else the workers claim chunk_bytes pieces in turn (a multiple of 64 keeps lines whole).
uint64_t pool_read(Pool& pool, const KernelTable* table, const void* p, size_t nbytes, int streams = 1,
                   size_t chunk_bytes = 0);

}  // namespace killick
