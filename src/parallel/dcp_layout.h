// Decode context parallelism (DCP) shards a request's cache by token: position t lives on rank t mod W at local
// index t / W, and each rank pages its local tokens into blocks of B rows (local block (t/W)/B, offset (t/W)%B).
// Latent and index-key caches follow the same map, so a rank's local index i is the same token in both.
#pragma once
#include <cstdint>
#include <span>

namespace kestrel::parallel {

int dcp_owner(int64_t position, int world);
int64_t dcp_local_index(int64_t position, int world);
// Inverse of (dcp_owner, dcp_local_index).
int64_t dcp_position(int64_t local_index, int rank, int world);
// How many of the positions [0, context_len) rank `rank` holds.
int64_t dcp_local_count(int64_t context_len, int rank, int world);

struct DcpSlot {
  int rank;
  int64_t local_block;  // index into the owning rank's block table of the request
  int64_t offset;       // row inside that block
};
DcpSlot dcp_slot(int64_t position, int world, int block_size);
// Blocks rank `rank` needs for the positions [0, context_len).
int64_t dcp_local_blocks(int64_t context_len, int rank, int world, int block_size);
// The cache row of `position` on its owning rank: rank_block_table[local_block] * block_size + offset, where
// rank_block_table is the owning rank's block table for the request.
int64_t dcp_physical_row(std::span<const int32_t> rank_block_table, int64_t position, int world, int block_size);

}  // namespace kestrel::parallel
