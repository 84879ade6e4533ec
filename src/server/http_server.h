// HTTP/1.1 on Boost.Beast and Asio: a pool of threads running one io_context, one coroutine per connection (on
// its own strand), keep-alive, a request-size limit answered with 413, and for each request an HttpExchange that
// the route handler uses to reply, to stream server-sent events, to wait for the engine and to notice a client
// that went away.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without it
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace kestrel::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
template <typename T>
using awaitable = net::awaitable<T>;

struct HttpServerOptions;

class HttpExchange {
 public:
  // `opts` (may be null): the server's options (the status callback, CORS origins).
  HttpExchange(beast::tcp_stream& stream, http::request<http::string_body>& req,
               const HttpServerOptions* opts = nullptr);
  ~HttpExchange();
  HttpExchange(const HttpExchange&) = delete;
  HttpExchange& operator=(const HttpExchange&) = delete;

  const http::request<http::string_body>& request() const { return req_; }
  // The request path without the query string.
  std::string path() const;

  // A whole response. Keeps the connection open when the client asked for it.
  awaitable<void> reply(int status, std::string body, const char* content_type = "application/json");
  bool replied() const { return replied_; }

  // Server-sent events: the header, then one `data: ...` event per call, then the end of the stream. Each returns
  // false once the client is gone (a failed write), after which the handler should stop.
  awaitable<bool> begin_events();
  awaitable<bool> send_event(const std::string& data);
  awaitable<void> end_events();

  // A function any thread may call to wake wait(); safe to call after the exchange ended.
  std::function<void()> notifier();
  // Returns when notifier() was called since the last wait, or the client went away.
  awaitable<void> wait();
  // Watches the connection for the client closing it, while the handler waits on something else.
  void watch_disconnect();
  bool client_gone() const;
  // Waits `d` on the connection's strand.
  awaitable<void> sleep(std::chrono::milliseconds d);
  bool keep_alive() const { return keep_alive_; }

 private:
  struct Shared;
  beast::tcp_stream& stream_;
  http::request<http::string_body>& req_;
  std::shared_ptr<Shared> shared_;
  const HttpServerOptions* opts_ = nullptr;
  void started(int status);
  template <typename Response>
  void add_cors(Response& res) const;
  bool replied_ = false, keep_alive_ = true;
  bool chunked_ = true;  // events in chunks (HTTP/1.1); HTTP/1.0 clients get a body ended by the connection's close
};

struct HttpServerOptions {
  std::string host = "0.0.0.0";
  int port = 8000;
  int threads = 4;
  uint64_t max_body_bytes = uint64_t{64} << 20;
  int max_connections = 4096;  // beyond it a connection gets 503 and is closed
  std::function<void(int)> on_status;  // told the status of every response (metrics); may be empty
  // Deadlines per phase, so that slow or silent clients cannot hold connections (and --max-connections) for long:
  // a keep-alive connection with no request is closed after idle_timeout; once a request's first byte is in, its
  // header must arrive within header_timeout; its body must keep an average of body_min_rate bytes/s after a grace
  // of header_timeout.
  double idle_timeout = 5;       // seconds (uvicorn's --timeout-keep-alive default)
  double header_timeout = 10;    // seconds
  double body_min_rate = 16384;  // bytes per second
  // CORS: origins whose browser requests are allowed ("*": any); empty: no CORS headers.
  std::vector<std::string> allowed_origins;
};

class HttpServer {
 public:
  using Handler = std::function<awaitable<void>(HttpExchange&)>;
  HttpServer(const HttpServerOptions& opts, Handler handler);
  ~HttpServer();

  // Binds and listens (Error when the address is taken); returns the bound port (useful with port 0).
  int listen();
  // Serves on the thread pool until stop().
  void start();
  // Stops accepting; open connections are closed.
  void stop();
  net::io_context& context() { return ioc_; }
  int open_connections() const { return connections_.load(); }

 private:
  awaitable<void> accept_loop();
  awaitable<void> session(net::ip::tcp::socket socket);

  HttpServerOptions opts_;
  Handler handler_;
  net::io_context ioc_;
  net::ip::tcp::acceptor acceptor_;
  std::vector<std::thread> threads_;
  std::atomic<int> connections_{0};
  std::atomic<bool> stopped_{false};
};

// An OpenAI-style error body for `status` (used by the HTTP layer itself for 400/413/503).
std::string error_body(int status, const std::string& message);

}  // namespace kestrel::server
