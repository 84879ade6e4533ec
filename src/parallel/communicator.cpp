#include "parallel/communicator.h"

namespace kestrel::parallel {

std::vector<size_t> all_gather_sizes(Communicator& comm, size_t my_bytes) {
  const uint64_t mine = my_bytes;
  std::vector<uint64_t> all(comm.size());
  comm.all_gather(&mine, sizeof(mine), all.data());
  return {all.begin(), all.end()};
}

void send_row(Communicator& comm, int dst, std::span<const uint8_t> row) {
  const uint64_t bytes = row.size();
  comm.send(dst, &bytes, sizeof(bytes));
  comm.send(dst, row.data(), row.size());
}

std::vector<uint8_t> recv_row(Communicator& comm, int src) {
  uint64_t bytes = 0;
  comm.recv(src, &bytes, sizeof(bytes));
  std::vector<uint8_t> row(bytes);
  comm.recv(src, row.data(), row.size());
  return row;
}

}  // namespace kestrel::parallel
