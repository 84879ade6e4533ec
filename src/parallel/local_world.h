// W simulated ranks in one process: one std::thread per rank, each with a Communicator whose collectives are
// exact and deterministic. This is the CPU implementation every parallel algorithm is tested on.
#pragma once
#include <functional>

#include "parallel/communicator.h"

namespace kestrel::parallel {

class LocalWorld {
 public:
  explicit LocalWorld(int size);
  int size() const { return size_; }

  // Runs fn on size() threads, rank r with a Communicator of rank r, and returns when all have returned.
  // If a rank throws, the collectives the others are blocked in (or enter later) throw CollectiveAborted, and
  // run rethrows the original exception of the lowest failing rank. A rank that returns while another waits in a
  // collective, collectives whose kinds or counts disagree across ranks, and rows sent but never received are
  // reported as kestrel::Error instead of hanging or passing silently.
  void run(const std::function<void(Communicator&)>& fn) const;

 private:
  int size_;
};

}  // namespace kestrel::parallel
