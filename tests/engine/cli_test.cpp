// The kestrel binary's engine subcommands end to end: generate with several prompts and n > 1 (one line and one
// JSON object per completion), and inspect-cache printing the K3.1 Pro numbers. Skipped when the binary has not
// been built.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "model/lora.h"

namespace {

namespace fs = std::filesystem;

std::string binary() { return std::string(KESTREL_BINARY_DIR) + "/src/kestrel"; }

// Runs a command; returns its stdout, and its exit status in `status`.
std::string run(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen((cmd + " 2>/dev/null").c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  *status = pclose(p);
  return out;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(binary())) GTEST_SKIP() << "no kestrel binary at " << binary();
    dir_ = fs::temp_directory_path() / ("kestrel_cli_test_" + std::to_string(::getpid()));
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string dir_;
};

TEST_F(Cli, GenerateManyPromptsWithCompletions) {
  int status = 0;
  run(binary() + " make-model --arch kimi_linear --preset tiny --out " + dir_ + "/m --seed 2", &status);
  ASSERT_EQ(status, 0);
  const std::string json = dir_ + "/out.jsonl";
  const std::string out = run(binary() + " generate " + dir_ + "/m --prompt-ids 1,2,3 --prompt-ids 7,8,9,10 --n 2 " +
                                  "--max-tokens 4 --ignore-eos --temperature 1 --seed 5 --max-num-batched-tokens 64 " +
                                  "--output-json " + json,
                              &status);
  ASSERT_EQ(status, 0);
  std::istringstream lines(out);
  std::string line;
  int n_lines = 0;
  while (std::getline(lines, line)) {
    std::istringstream ids(line);
    int count = 0, id;
    while (ids >> id) ++count;
    EXPECT_EQ(count, 4) << line;
    ++n_lines;
  }
  EXPECT_EQ(n_lines, 4);  // 2 prompts x 2 completions
  std::ifstream f(json);
  std::vector<nlohmann::json> objs;
  while (std::getline(f, line)) objs.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(objs.size(), 4u);
  EXPECT_EQ(objs[0]["prompt_ids"], nlohmann::json({1, 2, 3}));
  EXPECT_EQ(objs[2]["prompt_ids"], nlohmann::json({7, 8, 9, 10}));
  EXPECT_EQ(objs[1]["index"], 1);
  EXPECT_EQ(objs[3]["finish_reason"], "length");
  EXPECT_EQ(objs[3]["output_ids"].size(), 4u);
  // --dump-logits is for one sequence.
  run(binary() + " generate " + dir_ + "/m --prompt-ids 1 --prompt-ids 2 --dump-logits " + dir_ + "/l.npy", &status);
  EXPECT_NE(status, 0);
}

// make-model --lora-out: a random PEFT adapter over every module LoRA adapts, which load_lora_adapter reads.
TEST_F(Cli, MakeModelWritesALoraAdapter) {
  int status = 0;
  const std::string out = run(binary() + " make-model --arch deepseek_v32 --preset tiny --out " + dir_ + "/m " +
                                  "--lora-out " + dir_ + "/lora --lora-rank 16",
                              &status);
  ASSERT_EQ(status, 0) << out;
  EXPECT_NE(out.find("rank-16 LoRA adapter"), std::string::npos) << out;
  const kestrel::LoraAdapter a = kestrel::load_lora_adapter(dir_ + "/lora");
  EXPECT_EQ(a.rank, 16);
  EXPECT_EQ(a.scale, 2.0f);
  EXPECT_TRUE(a.modules.count("model.layers.0.self_attn.o_proj"));
  run(binary() + " make-model --arch deepseek_v32 --preset tiny --out " + dir_ + "/m2 --lora-out " + dir_ +
          "/lora2 --lora-rank 65",
      &status);
  EXPECT_NE(status, 0);
}

TEST_F(Cli, InspectCacheK31Pro) {
  int status = 0;
  const std::string out =
      run(binary() + " inspect-cache --preset k3.1-pro --tp 8 --cache-gib 64 --kv-cache-dtype nvfp4 --index-dtype mxfp4",
          &status);
  ASSERT_EQ(status, 0);
  for (const char* n : {"13,824 B per token", "16,992 B per token", "10,080 B per token", "TP8 + DCP8"})
    EXPECT_NE(out.find(n), std::string::npos) << n << " missing from\n" << out;
  run(binary() + " inspect-cache --preset tiny", &status);  // tiny exists for every architecture
  EXPECT_NE(status, 0);
}

}  // namespace
