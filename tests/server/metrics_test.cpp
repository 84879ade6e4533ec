// Prometheus rendering: hand-worked histogram buckets, sums and counts, and the SERVING.md names with the
// model_name label.
#include <gtest/gtest.h>

#include <string>

#include "server/metrics.h"

namespace kestrel::server {
namespace {

bool has_line(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.starts_with(line + "\n");
}

TEST(Metrics, HistogramBucketsAreCumulative) {
  Histogram h({0.01, 0.1, 1.0});
  for (double v : {0.005, 0.01, 0.05, 2.0}) h.observe(v);  // 0.01 falls in le="0.01": bounds are inclusive
  std::string out;
  h.render(out, "x", "model_name=\"m\"");
  EXPECT_TRUE(has_line(out, "x_bucket{model_name=\"m\",le=\"0.01\"} 2")) << out;
  EXPECT_TRUE(has_line(out, "x_bucket{model_name=\"m\",le=\"0.1\"} 3")) << out;
  EXPECT_TRUE(has_line(out, "x_bucket{model_name=\"m\",le=\"1\"} 3")) << out;
  EXPECT_TRUE(has_line(out, "x_bucket{model_name=\"m\",le=\"+Inf\"} 4")) << out;
  EXPECT_TRUE(has_line(out, "x_sum{model_name=\"m\"} 2.065")) << out;
  EXPECT_TRUE(has_line(out, "x_count{model_name=\"m\"} 4")) << out;
}

TEST(Metrics, RequestRecordsFeedCountersAndHistograms) {
  ServerMetrics m("my \"model\"");
  RequestRecord r;
  r.arrival = 10.0;
  r.scheduled = 10.5;
  r.first_token = 11.0;
  r.finished = 13.0;
  r.token_gaps = {0.5, 1.5};
  r.prompt_tokens = 7;
  r.generation_tokens = 3;
  r.finished_reason = "length";
  m.record(r);
  m.record_rejected(429);
  EngineSnapshot s;
  s.num_running = 2;
  s.num_waiting = 5;
  s.kv_cache_usage = 0.25;
  s.prefix.query_tokens = 100;
  s.prefix.hit_tokens = 64;
  const std::string out = m.render(s);
  const std::string lab = "model_name=\"my \\\"model\\\"\"";
  EXPECT_TRUE(has_line(out, "kestrel:num_requests_running{" + lab + "} 2")) << out;
  EXPECT_TRUE(has_line(out, "kestrel:num_requests_waiting{" + lab + "} 5"));
  EXPECT_TRUE(has_line(out, "kestrel:kv_cache_usage_perc{" + lab + "} 0.25"));
  EXPECT_TRUE(has_line(out, "kestrel:prefix_cache_queries_total{" + lab + "} 100"));
  EXPECT_TRUE(has_line(out, "kestrel:prefix_cache_hits_total{" + lab + "} 64"));
  EXPECT_TRUE(has_line(out, "kestrel:prompt_tokens_total{" + lab + "} 7"));
  EXPECT_TRUE(has_line(out, "kestrel:generation_tokens_total{" + lab + "} 3"));
  EXPECT_TRUE(has_line(out, "kestrel:request_success_total{" + lab + ",finished_reason=\"length\"} 1"));
  EXPECT_TRUE(has_line(out, "kestrel:request_success_total{" + lab + ",finished_reason=\"stop\"} 0"));
  EXPECT_TRUE(has_line(out, "kestrel:request_rejected_total{" + lab + ",status=\"429\"} 1"));
  EXPECT_TRUE(has_line(out, "kestrel:time_to_first_token_seconds_sum{" + lab + "} 1"));
  EXPECT_TRUE(has_line(out, "kestrel:e2e_request_latency_seconds_sum{" + lab + "} 3"));
  EXPECT_TRUE(has_line(out, "kestrel:request_queue_time_seconds_sum{" + lab + "} 0.5"));
  EXPECT_TRUE(has_line(out, "kestrel:inter_token_latency_seconds_sum{" + lab + "} 2"));
  EXPECT_TRUE(has_line(out, "kestrel:inter_token_latency_seconds_count{" + lab + "} 2"));
  EXPECT_TRUE(has_line(out, "# TYPE kestrel:time_to_first_token_seconds histogram"));
  EXPECT_TRUE(has_line(out, "# TYPE kestrel:prompt_tokens_total counter"));
}

// The HTTP side's gauges: open connections and the text threads' queue.
TEST(Metrics, ConnectionAndTextWorkGauges) {
  ServerMetrics m("m");
  const std::string lab = "model_name=\"m\"";
  const std::string idle = m.render(EngineSnapshot{});
  EXPECT_TRUE(has_line(idle, "kestrel:num_open_connections{" + lab + "} 0")) << idle;
  EXPECT_TRUE(has_line(idle, "kestrel:num_text_tasks_waiting{" + lab + "} 0"));
  EXPECT_TRUE(has_line(idle, "kestrel:num_text_tasks_running{" + lab + "} 0"));
  ServerGauges g;
  g.open_connections = 7;
  g.text_tasks_waiting = 3;
  g.text_tasks_running = 2;
  const std::string out = m.render(EngineSnapshot{}, g);
  EXPECT_TRUE(has_line(out, "kestrel:num_open_connections{" + lab + "} 7")) << out;
  EXPECT_TRUE(has_line(out, "kestrel:num_text_tasks_waiting{" + lab + "} 3"));
  EXPECT_TRUE(has_line(out, "kestrel:num_text_tasks_running{" + lab + "} 2"));
  EXPECT_TRUE(has_line(out, "# TYPE kestrel:num_open_connections gauge"));
}

// Speculative decoding's counters (vLLM's names) appear only with a speculative config (accepted_per_pos sized k).
TEST(Metrics, SpecDecodeCountersWithVllmNames) {
  ServerMetrics m("m");
  EngineSnapshot s;
  EXPECT_EQ(m.render(s).find("spec_decode"), std::string::npos);
  s.spec.num_drafts = 10;
  s.spec.num_draft_tokens = 30;
  s.spec.num_accepted_tokens = 14;
  s.spec.accepted_per_pos = {8, 4, 2};
  const std::string out = m.render(s);
  const std::string lab = "model_name=\"m\"";
  EXPECT_TRUE(has_line(out, "kestrel:spec_decode_num_drafts_total{" + lab + "} 10")) << out;
  EXPECT_TRUE(has_line(out, "kestrel:spec_decode_num_draft_tokens_total{" + lab + "} 30"));
  EXPECT_TRUE(has_line(out, "kestrel:spec_decode_num_accepted_tokens_total{" + lab + "} 14"));
  EXPECT_TRUE(has_line(out, "kestrel:spec_decode_num_accepted_tokens_per_pos_total{" + lab + ",position=\"0\"} 8"));
  EXPECT_TRUE(has_line(out, "kestrel:spec_decode_num_accepted_tokens_per_pos_total{" + lab + ",position=\"2\"} 2"));
  EXPECT_TRUE(has_line(out, "# TYPE kestrel:spec_decode_num_accepted_tokens_per_pos_total counter"));
  EXPECT_DOUBLE_EQ(s.spec.mean_acceptance_length(), 2.4);
}

}  // namespace
}  // namespace kestrel::server
