// kestrel bench latency and kestrel bench throughput: vLLM's offline benchmarks on the engine in this process.
#pragma once
#include "cli/commands.h"

namespace kestrel::cli {

// Adds `latency` and `throughput` under the `bench` subcommand; the runner returns -1 when neither was selected.
Runner add_bench_offline(CLI::App& bench);

}  // namespace kestrel::cli
