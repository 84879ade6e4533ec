// kestrel bench latency and kestrel bench throughput end to end on a tiny kimi_k3 checkpoint: the JSON fields,
// the printed lines agreeing with them, and the numbers consistent with the sizes asked for. Skipped when the
// binary has not been built.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

namespace fs = std::filesystem;

std::string binary() { return std::string(KESTREL_BINARY_DIR) + "/src/kestrel"; }

// Runs a command single-threaded (CI runs test binaries side by side on two cores); returns its stdout, and its
// exit status in `status`.
std::string run(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen(("OMP_NUM_THREADS=1 " + cmd + " 2>/dev/null").c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  *status = pclose(p);
  return out;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

class BenchCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(binary())) return;
    dir_ = fs::temp_directory_path() / ("kestrel_bench_cli_test_" + std::to_string(::getpid()));
    int status = 0;
    run(binary() + " make-model --arch kimi_k3 --preset tiny --out " + dir_ + "/m --seed 3", &status);
    ASSERT_EQ(status, 0);
  }
  static void TearDownTestSuite() {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  void SetUp() override {
    if (!fs::exists(binary())) GTEST_SKIP() << "no kestrel binary at " << binary();
  }
  static std::string dir_;
};
std::string BenchCli::dir_;

TEST_F(BenchCli, LatencyReportsEveryIterationAndNumpyPercentiles) {
  const std::string json = dir_ + "/latency.json";
  int status = 0;
  const std::string out = run(binary() + " bench latency " + dir_ + "/m --input-len 8 --output-len 4 --batch-size 2 " +
                                  "--num-iters-warmup 1 --num-iters 3 --seed 1 --output-json " + json,
                              &status);
  ASSERT_EQ(status, 0) << out;
  const nlohmann::json j = read_json(json);
  std::vector<double> lat = j.at("latencies").get<std::vector<double>>();
  ASSERT_EQ(lat.size(), 3u);
  for (double l : lat) EXPECT_GT(l, 0.0);
  EXPECT_NEAR(j.at("avg_latency").get<double>(), std::accumulate(lat.begin(), lat.end(), 0.0) / 3, 1e-12);
  // numpy's linear interpolation on 3 sorted values s: the p-th percentile sits at rank p/100 * 2.
  std::sort(lat.begin(), lat.end());
  const nlohmann::json& pct = j.at("percentiles");
  ASSERT_EQ(pct.size(), 6u);
  EXPECT_DOUBLE_EQ(pct.at("50").get<double>(), lat[1]);
  EXPECT_NEAR(pct.at("25").get<double>(), (lat[0] + lat[1]) / 2, 1e-12);
  EXPECT_NEAR(pct.at("10").get<double>(), lat[0] + 0.2 * (lat[1] - lat[0]), 1e-12);
  EXPECT_NEAR(pct.at("99").get<double>(), lat[1] + 0.98 * (lat[2] - lat[1]), 1e-12);
  double prev = 0;
  for (const char* p : {"10", "25", "50", "75", "90", "99"}) {
    EXPECT_GE(pct.at(p).get<double>(), prev) << p;
    prev = pct.at(p).get<double>();
  }
  // The printed lines carry the same numbers.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("Avg latency: ([0-9.e+-]+) seconds"))) << out;
  EXPECT_DOUBLE_EQ(std::stod(m[1]), j["avg_latency"].get<double>());
  ASSERT_TRUE(std::regex_search(out, m, std::regex("90% percentile latency: ([0-9.e+-]+) seconds"))) << out;
  EXPECT_DOUBLE_EQ(std::stod(m[1]), pct["90"].get<double>());
}

TEST_F(BenchCli, ThroughputCountsEveryToken) {
  const std::string json = dir_ + "/throughput.json";
  int status = 0;
  const std::string out = run(binary() + " bench throughput " + dir_ + "/m --num-prompts 5 --input-len 8 " +
                                  "--output-len 3 --seed 2 --output-json " + json,
                              &status);
  ASSERT_EQ(status, 0) << out;
  const nlohmann::json j = read_json(json);
  const double t = j.at("elapsed_time").get<double>();
  ASSERT_GT(t, 0.0);
  EXPECT_EQ(j.at("num_requests").get<int>(), 5);
  EXPECT_EQ(j.at("total_num_prompt_tokens").get<int>(), 5 * 8);
  EXPECT_EQ(j.at("total_num_output_tokens").get<int>(), 5 * 3);
  EXPECT_EQ(j.at("total_num_tokens").get<int>(), 5 * (8 + 3));
  EXPECT_NEAR(j.at("requests_per_second").get<double>() * t, 5, 1e-9);
  EXPECT_NEAR(j.at("tokens_per_second").get<double>() * t, 55, 1e-9);
  EXPECT_NEAR(j.at("output_tokens_per_second").get<double>() * t, 15, 1e-9);
  // The printed rates stand in the ratios 1 : 11 : 3 of requests, tokens and output tokens; each is rounded to
  // 2 decimals (off by 0.005 at most), so Y - 11 X is off by 0.005 * 12 at most and Z - 3 X by 0.005 * 4.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      out, m,
      std::regex("Throughput: ([0-9.]+) requests/s, ([0-9.]+) total tokens/s, ([0-9.]+) output tokens/s")))
      << out;
  const double req = std::stod(m[1]);
  EXPECT_GT(req, 0.0);
  EXPECT_NEAR(std::stod(m[2]), 11 * req, 0.005 * 12 + 1e-9);
  EXPECT_NEAR(std::stod(m[3]), 3 * req, 0.005 * 4 + 1e-9);
}

TEST_F(BenchCli, ThroughputWithSeveralCompletionsCountsThePromptOnce) {
  const std::string json = dir_ + "/throughput_n.json";
  int status = 0;
  run(binary() + " bench throughput " + dir_ + "/m --num-prompts 2 --input-len 5 --output-len 2 --n 3 " +
          "--output-json " + json,
      &status);
  ASSERT_EQ(status, 0);
  const nlohmann::json j = read_json(json);
  EXPECT_EQ(j.at("num_requests").get<int>(), 2);
  EXPECT_EQ(j.at("total_num_output_tokens").get<int>(), 2 * 3 * 2);
  EXPECT_EQ(j.at("total_num_tokens").get<int>(), 2 * 5 + 2 * 3 * 2);
}

TEST_F(BenchCli, RefusesWhatItCannotRun) {
  int status = 0;
  run(binary() + " bench throughput " + dir_ + "/m --num-prompts 1 --dataset-name sharegpt", &status);
  EXPECT_NE(status, 0);
  run(binary() + " bench latency " + dir_ + "/m --input-len 0", &status);
  EXPECT_NE(status, 0);
  run(binary() + " bench latency " + dir_ + "/m --num-iters 0", &status);
  EXPECT_NE(status, 0);
}

}  // namespace
