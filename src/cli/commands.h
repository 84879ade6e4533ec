// The kestrel subcommands. Each file under src/cli/ adds one subcommand to the CLI11 app and runs it.
#pragma once
#include <functional>

#include <CLI/CLI.hpp>

namespace kestrel::cli {

// Registers a subcommand on `app` and returns the function that runs it once parsing has selected it.
using Runner = std::function<int()>;
Runner add_make_model(CLI::App& app);
Runner add_generate(CLI::App& app);
Runner add_inspect_cache(CLI::App& app);
Runner add_tokenize(CLI::App& app);
Runner add_serve(CLI::App& app);
Runner add_bench(CLI::App& app);

}  // namespace kestrel::cli
