// --speculative-config on the kestrel binary: generate gives the same greedy tokens with and without it, bench
// latency / throughput report the acceptance, and bad configs are errors naming the field (generate, bench, serve).
// Skipped when the binary has not been built.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

namespace fs = std::filesystem;

std::string binary() { return std::string(KESTREL_BINARY_DIR) + "/src/kestrel"; }

// Runs a command single-threaded; stdout in `out`, stderr in `err`, the exit status returned.
int run(const std::string& cmd, std::string* out, std::string* err = nullptr) {
  const std::string err_file = fs::temp_directory_path() / ("kestrel_spec_cli_err_" + std::to_string(::getpid()));
  std::string o;
  FILE* p = popen(("OMP_NUM_THREADS=1 " + cmd + " 2>" + err_file).c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) o.append(buf, n);
  const int status = pclose(p);
  if (out) *out = o;
  std::ifstream f(err_file);
  const std::string e((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (err) *err = e;
  fs::remove(err_file);
  return status;
}

std::string quoted(const std::string& json) { return "'" + json + "'"; }

class SpecCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(binary())) return;
    dir_ = fs::temp_directory_path() / ("kestrel_spec_cli_test_" + std::to_string(::getpid()));
    std::string out;
    ASSERT_EQ(run(binary() + " make-model --arch kimi_k3 --preset tiny --out " + dir_ + "/m --seed 3 --dspark-out " +
                      dir_ + "/dspark",
                  &out),
              0);
  }
  static void TearDownTestSuite() {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  void SetUp() override {
    if (!fs::exists(binary())) GTEST_SKIP() << "no kestrel binary at " << binary();
  }
  static std::string dir_;
};
std::string SpecCli::dir_;

const std::string kNgram = R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1})";

TEST_F(SpecCli, GenerateWithNgramEqualsWithout) {
  const std::string args = " generate " + dir_ + "/m --prompt-ids 5,6,7,8,5,6,7,8,5,6,7,8 --prompt-ids 9,3,9,3,9 " +
                           "--max-tokens 16 --ignore-eos --logprobs 0 --output-json ";
  std::string plain, spec, err;
  ASSERT_EQ(run(binary() + args + dir_ + "/plain.jsonl", &plain, &err), 0) << err;
  ASSERT_EQ(run(binary() + args + dir_ + "/spec.jsonl --speculative-config " + quoted(kNgram), &spec, &err), 0)
      << err;
  EXPECT_EQ(spec, plain);
  EXPECT_FALSE(plain.empty());
  EXPECT_NE(err.find("[kestrel] speculative decoding: "), std::string::npos) << err;
  // Log-probabilities too (the JSON prints floats exactly enough to tell bits apart: shortest round trip).
  std::ifstream a(dir_ + "/plain.jsonl"), b(dir_ + "/spec.jsonl");
  std::string la, lb;
  int lines = 0;
  while (std::getline(a, la)) {
    ASSERT_TRUE(std::getline(b, lb));
    EXPECT_EQ(nlohmann::json::parse(la), nlohmann::json::parse(lb));
    ++lines;
  }
  EXPECT_EQ(lines, 2);
}

// make-model's DSpark drafter through generate: greedy tokens and log-probabilities as without speculation.
TEST_F(SpecCli, GenerateWithDsparkEqualsWithout) {
  const std::string args = " generate " + dir_ + "/m --prompt-ids 5,6,7,8,5,6,7,8,5,6,7,8 --prompt-ids 9,3,9,3,9 " +
                           "--max-tokens 16 --ignore-eos --logprobs 0 --output-json ";
  const std::string cfg = R"({"method": "dspark", "num_speculative_tokens": 4, "draft_sample_method": "probabilistic", "model": ")" +
                          dir_ + R"(/dspark"})";
  std::string plain, spec, err;
  ASSERT_EQ(run(binary() + args + dir_ + "/plain_d.jsonl", &plain, &err), 0) << err;
  ASSERT_EQ(run(binary() + args + dir_ + "/spec_d.jsonl --speculative-config " + quoted(cfg), &spec, &err), 0) << err;
  EXPECT_EQ(spec, plain);
  EXPECT_NE(err.find("[kestrel] speculative decoding: "), std::string::npos) << err;
  std::ifstream a(dir_ + "/plain_d.jsonl"), b(dir_ + "/spec_d.jsonl");
  std::string la, lb;
  int lines = 0;
  while (std::getline(a, la)) {
    ASSERT_TRUE(std::getline(b, lb));
    EXPECT_EQ(nlohmann::json::parse(la), nlohmann::json::parse(lb));
    ++lines;
  }
  EXPECT_EQ(lines, 2);
}

TEST_F(SpecCli, BenchReportsMeanAcceptanceLength) {
  // Random prompts long enough that prompt lookup finds a few 1-gram matches (the run is seeded: always the same).
  for (const std::string& sub : std::vector<std::string>{"latency --batch-size 2 --num-iters-warmup 0 --num-iters 1 --input-len 128 --output-len 32",
                                "throughput --num-prompts 2 --input-len 128 --output-len 32"}) {
    const std::string json = dir_ + "/bench.json";
    const std::string cfg = R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [1.0, 1.0]})";
    std::string out, err;
    ASSERT_EQ(run(binary() + " bench " + sub + " " + dir_ + "/m --seed 1 --output-json " + json +
                      " --speculative-config " + quoted(cfg),
                  &out, &err),
              0)
        << err;
    EXPECT_NE(out.find("Mean acceptance length: "), std::string::npos) << out;
    std::ifstream f(json);
    const nlohmann::json j = nlohmann::json::parse(f);
    const nlohmann::json& s = j.at("spec_decode");
    const int64_t drafts = s.at("num_drafts"), draft_tokens = s.at("num_draft_tokens"),
                  accepted = s.at("num_accepted_tokens");
    // Forced acceptance: every draft kept.
    EXPECT_GT(drafts, 0);
    EXPECT_EQ(accepted, draft_tokens);
    EXPECT_DOUBLE_EQ(s.at("mean_acceptance_length").get<double>(),
                     1.0 + static_cast<double>(accepted) / static_cast<double>(std::max<int64_t>(drafts, 1)));
    EXPECT_NE(out.find("Draft acceptance rate: 1.000"), std::string::npos) << out;
  }
}

TEST_F(SpecCli, BadConfigsAreErrorsNamingTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{not json", "--speculative-config is not valid JSON"},
      {R"({"method": "eagle", "num_speculative_tokens": 2})", "'method' 'eagle' is not one of ngram, mtp, dspark"},
      {R"({"method": "ngram", "num_speculative_tokens": 2, "speed": 9})", "unknown field 'speed'"},
      {R"({"method": "ngram", "num_speculative_tokens": "two"})", "'num_speculative_tokens' must be an integer"},
      {R"({"method": "ngram", "num_speculative_tokens": 99})", "'num_speculative_tokens' must be in [1, 32]"},
      {R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": true})",
       "'prompt_lookup_min' must be an integer"},
      {R"({"method": "dspark", "num_speculative_tokens": 2, "model": "d"})", "'model' d: cannot open d/config.json"},
      {R"({"method": "dspark", "num_speculative_tokens": 9, "model": ")" + dir_ + R"(/dspark"})",
       "'num_speculative_tokens' 9 is beyond the DSpark drafter's dspark_block_size 5"},
      {R"({"method": "mtp", "num_speculative_tokens": 1})", "config.json's num_nextn_predict_layers is 0"},
  };
  for (const auto& [cfg, words] : cases) {
    for (const std::string& cmd : std::vector<std::string>{
             " generate " + dir_ + "/m --prompt-ids 1,2 --max-tokens 2",
             " bench latency " + dir_ + "/m --input-len 4 --output-len 2 --num-iters 1"}) {
      std::string out, err;
      EXPECT_NE(run(binary() + cmd + " --speculative-config " + quoted(cfg), &out, &err), 0) << cmd << " " << cfg;
      EXPECT_NE(err.find(words), std::string::npos) << cmd << " " << cfg << ": " << err;
    }
  }
  // serve checks the config before it loads anything.
  std::string out, err;
  EXPECT_NE(run(binary() + " serve " + dir_ + "/m --port 0 --speculative-config " +
                    quoted(R"({"method": "ngram", "num_speculative_tokens": 2, "promt_lookup_max": 3})"),
                &out, &err),
            0);
  EXPECT_NE(err.find("unknown field 'promt_lookup_max'"), std::string::npos) << err;
  EXPECT_NE(run(binary() + " serve " + dir_ + "/m --port 0 --speculative-config " +
                    quoted(R"({"method": "dspark", "num_speculative_tokens": 2})"),
                &out, &err),
            0);
  EXPECT_NE(err.find("method 'dspark' needs 'model'"), std::string::npos) << err;
}

}  // namespace
