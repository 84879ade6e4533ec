// kestrel: command-line entry point. Each subcommand lives in its own file under src/cli/.
#include <cstdio>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  try {
    CLI::App app{"Kestrel: inference and serving for hybrid sparse-attention MoE models"};
    app.require_subcommand(1);
    app.set_version_flag("--version", "kestrel 0.1.0");
    const std::vector<kestrel::cli::Runner> runners = {kestrel::cli::add_make_model(app),
                                                       kestrel::cli::add_generate(app),
                                                       kestrel::cli::add_tokenize(app),
                                                       kestrel::cli::add_inspect_cache(app),
                                                       kestrel::cli::add_serve(app),
                                                       kestrel::cli::add_bench(app)};
    CLI11_PARSE(app, argc, argv);
    for (const auto& run : runners) {
      const int rc = run();
      if (rc >= 0) return rc;
    }
    return 1;
  } catch (const kestrel::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
