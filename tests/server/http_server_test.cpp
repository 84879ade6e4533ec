// The HTTP layer against a raw socket client (issue 21): 500s say nothing of the internal error and are counted,
// HTTP/1.0 clients get no chunked encoding, and per-phase deadlines close idle, slow-header and slow-body
// connections. Waits are bounded by generous socket timeouts, never by the timing of the server.
#include <sys/socket.h>
#include <sys/time.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "server/http_server.h"
#include "server/text_pool.h"
#include "server/api_error.h"

namespace kestrel::server {
namespace {

using tcp = net::ip::tcp;

struct Fixture {
  std::mutex mu;
  std::map<int, int> statuses;
  HttpServerOptions opts;
  std::unique_ptr<HttpServer> server;
  int port = 0;

  explicit Fixture(HttpServer::Handler h, HttpServerOptions o = {}) : opts(o) {
    opts.host = "127.0.0.1";
    opts.port = 0;
    opts.threads = 2;
    opts.on_status = [this](int s) {
      std::lock_guard lock(mu);
      ++statuses[s];
    };
    server = std::make_unique<HttpServer>(opts, std::move(h));
    port = server->listen();
    server->start();
  }
  ~Fixture() { server->stop(); }
  int count(int status) {
    std::lock_guard lock(mu);
    return statuses[status];
  }
};

// A blocking client: connects, sends `request`, reads until the server closes (or 20 s pass).
std::string exchange(int port, const std::string& request, bool read_to_close = true) {
  net::io_context io;
  tcp::socket s(io);
  s.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
  timeval tv{20, 0};
  setsockopt(s.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (!request.empty()) net::write(s, net::buffer(request));
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(s.native_handle(), buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (!read_to_close && out.find("\r\n\r\n") != std::string::npos) break;
  }
  return out;
}

TEST(HttpServer, InternalErrorsAreGenericAndCounted) {
  Fixture f([](HttpExchange&) -> awaitable<void> {
    throw std::runtime_error("secret internal detail at 0xdeadbeef");
    co_return;
  });
  const std::string r = exchange(f.port, "GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 500", 0), 0u) << r;
  EXPECT_EQ(r.find("secret"), std::string::npos) << r;
  EXPECT_NE(r.find("internal server error"), std::string::npos) << r;
  EXPECT_EQ(f.count(500), 1);
}

TEST(HttpServer, Http10EventsAreNotChunked) {
  auto handler = [](HttpExchange& ex) -> awaitable<void> {
    co_await ex.begin_events();
    co_await ex.send_event("a");
    co_await ex.send_event("b");
    co_await ex.end_events();
  };
  Fixture f(handler);
  const std::string r10 = exchange(f.port, "GET /s HTTP/1.0\r\n\r\n");
  EXPECT_EQ(r10.rfind("HTTP/1.0 200", 0), 0u) << r10;
  EXPECT_EQ(r10.find("Transfer-Encoding"), std::string::npos) << r10;
  const size_t body = r10.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos);
  EXPECT_EQ(r10.substr(body + 4), "data: a\n\ndata: b\n\n");  // ended by the close
  const std::string r11 = exchange(f.port, "GET /s HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  EXPECT_NE(r11.find("Transfer-Encoding: chunked"), std::string::npos) << r11;
  EXPECT_EQ(f.count(200), 2);
}

awaitable<void> ok_handler(HttpExchange& ex) { co_await ex.reply(200, "{}"); }

TEST(HttpServer, IdleKeepAliveConnectionsAreClosed) {
  HttpServerOptions o;
  o.idle_timeout = 0.3;
  Fixture f(ok_handler, o);
  // Silent from the start: closed without an answer.
  EXPECT_EQ(exchange(f.port, ""), "");
  // After one request on a keep-alive connection, the idle connection is closed too.
  const std::string r = exchange(f.port, "GET /x HTTP/1.1\r\nHost: a\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << r;
  // Closed connections no longer count against --max-connections.
  for (int i = 0; i < 200 && f.server->open_connections() > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(f.server->open_connections(), 0);
}

TEST(HttpServer, SlowHeaderAndSlowBodyAreClosed) {
  HttpServerOptions o;
  o.header_timeout = 0.3;
  o.body_min_rate = 1000;
  o.idle_timeout = 60;  // the phases below are not idle ones
  Fixture f(ok_handler, o);
  // A header never finished: closed after header_timeout, with nothing answered (20 s would fail the read).
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(exchange(f.port, "POST /x HTTP/1.1\r\nHost: a\r\n"), "");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15));
  // 10 bytes of a 1 MB body: at 1000 bytes/s after 0.3 s of grace the deadline passes long before it could be in.
  EXPECT_EQ(exchange(f.port, "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 1000000\r\n\r\n0123456789"), "");
  EXPECT_EQ(f.count(200), 0);
  // A complete request is still served.
  const std::string r = exchange(f.port, "GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << r;
}

TEST(TextPool, StopCancelsRunningAndFailsQueued) {
  TextPool pool(1, 2);
  std::atomic<bool> started{false};
  auto running = pool.submit(
      [&](const std::atomic<bool>& cancel) {
        started = true;
        while (!cancel) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        throw Error("cancelled");
      },
      nullptr);
  while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto queued = pool.submit([](const std::atomic<bool>&) {}, nullptr);
  auto queued2 = pool.submit([](const std::atomic<bool>&) {}, nullptr);
  EXPECT_EQ(pool.running(), 1u);  // what kestrel:num_text_tasks_running / _waiting show
  EXPECT_EQ(pool.queued(), 2u);
  try {  // the queue holds 2
    pool.submit([](const std::atomic<bool>&) {}, nullptr);
    FAIL() << "no 429";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 429);
  }
  pool.stop();
  EXPECT_TRUE(running->done && queued->done && queued2->done);
  EXPECT_EQ(pool.running(), 0u);
  EXPECT_EQ(pool.queued(), 0u);
  EXPECT_TRUE(running->cancel);
  ASSERT_TRUE(queued->error);
  try {
    std::rethrow_exception(queued->error);
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 503);
  }
  try {
    pool.submit([](const std::atomic<bool>&) {}, nullptr);
    FAIL() << "no 503";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 503);
  }
}

}  // namespace
}  // namespace kestrel::server
