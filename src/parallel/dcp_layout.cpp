#include "parallel/dcp_layout.h"

#include "core/error.h"

namespace kestrel::parallel {
namespace {

void check_world(int world) { KESTREL_CHECK(world >= 1, "DCP: world size must be at least 1, got {}", world); }

void check_position(int64_t position) {
  KESTREL_CHECK(position >= 0, "DCP: position must not be negative, got {}", position);
}

}  // namespace

int dcp_owner(int64_t position, int world) {
  check_world(world);
  check_position(position);
  return static_cast<int>(position % world);
}

int64_t dcp_local_index(int64_t position, int world) {
  check_world(world);
  check_position(position);
  return position / world;
}

int64_t dcp_position(int64_t local_index, int rank, int world) {
  check_world(world);
  KESTREL_CHECK(rank >= 0 && rank < world, "DCP: rank {} out of range [0, {})", rank, world);
  KESTREL_CHECK(local_index >= 0, "DCP: local index must not be negative, got {}", local_index);
  return local_index * world + rank;
}

int64_t dcp_local_count(int64_t context_len, int rank, int world) {
  check_world(world);
  KESTREL_CHECK(rank >= 0 && rank < world, "DCP: rank {} out of range [0, {})", rank, world);
  KESTREL_CHECK(context_len >= 0, "DCP: context length must not be negative, got {}", context_len);
  return context_len > rank ? (context_len - rank + world - 1) / world : 0;
}

DcpSlot dcp_slot(int64_t position, int world, int block_size) {
  KESTREL_CHECK(block_size >= 1, "DCP: block size must be at least 1, got {}", block_size);
  const int64_t local = dcp_local_index(position, world);
  return {dcp_owner(position, world), local / block_size, local % block_size};
}

int64_t dcp_local_blocks(int64_t context_len, int rank, int world, int block_size) {
  KESTREL_CHECK(block_size >= 1, "DCP: block size must be at least 1, got {}", block_size);
  return (dcp_local_count(context_len, rank, world) + block_size - 1) / block_size;
}

int64_t dcp_physical_row(std::span<const int32_t> rank_block_table, int64_t position, int world, int block_size) {
  const DcpSlot slot = dcp_slot(position, world, block_size);
  KESTREL_CHECK(slot.local_block < static_cast<int64_t>(rank_block_table.size()),
                "DCP: position {} needs local block {} but rank {}'s block table has {} blocks", position,
                slot.local_block, slot.rank, rank_block_table.size());
  return static_cast<int64_t>(rank_block_table[slot.local_block]) * block_size + slot.offset;
}

}  // namespace kestrel::parallel
