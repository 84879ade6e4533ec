// Collectives over a group of W ranks (one rank per GPU under NCCL; one thread per rank in LocalWorld).
// Buffers are raw bytes with explicit counts, so that the NCCL backend implements the same calls on device memory.
// Every rank must call the same collectives, in the same order, with consistent counts.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"

namespace kestrel::parallel {

// Thrown in a rank whose collective cannot complete because another rank failed; the run reports the original error.
class CollectiveAborted : public Error {
 public:
  using Error::Error;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // recv[r*bytes, (r+1)*bytes) receives rank r's `bytes` bytes. Every rank passes the same `bytes`.
  virtual void all_gather(const void* send, size_t bytes, void* recv) = 0;
  // Rank r contributes recv_bytes[r] bytes (its send_bytes must equal that); recv holds all contributions back to
  // back in rank order. recv_bytes has size() entries and is the same on every rank.
  virtual void all_gather_v(const void* send, size_t send_bytes, void* recv, std::span<const size_t> recv_bytes) = 0;
  // send holds the blocks for ranks 0..W-1 back to back (send_bytes[d] bytes for rank d); recv gets the blocks from
  // ranks 0..W-1 back to back (recv_bytes[s] from rank s). send_bytes[d] on rank s must equal recv_bytes[s] on rank d.
  virtual void all_to_all_v(const void* send, std::span<const size_t> send_bytes, void* recv,
                            std::span<const size_t> recv_bytes) = 0;
  // In place, element-wise: data = data_0 + data_1 + ... + data_{W-1}, added in this rank order in fp32, so every
  // rank gets the same bits on every run.
  virtual void all_reduce_sum(float* data, size_t n) = 0;
  // Point to point, one byte row per call; recv names the exact size it expects (a mismatch is an error). Rows from
  // one sender arrive in the order sent. Do not rely on sends being buffered: NCCL sends block until the matching
  // receive is posted, so two ranks exchanging rows must not both send first.
  virtual void send(int dst, const void* data, size_t bytes) = 0;
  virtual void recv(int src, void* data, size_t bytes) = 0;
  virtual void barrier() = 0;
};

// Every rank's byte count, in rank order (one all_gather of 8 bytes per rank).
std::vector<size_t> all_gather_sizes(Communicator& comm, size_t my_bytes);
// A row whose size the receiver does not know: the size goes first as 8 bytes, then the row.
void send_row(Communicator& comm, int dst, std::span<const uint8_t> row);
std::vector<uint8_t> recv_row(Communicator& comm, int src);

}  // namespace kestrel::parallel
