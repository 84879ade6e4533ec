#include "server/http_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <exception>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "core/error.h"
#include "server/api_error.h"

namespace kestrel::server {

using tcp = net::ip::tcp;
using net::use_awaitable;

namespace {

constexpr auto kWriteTimeout = std::chrono::seconds(120);  // a client that stops reading
constexpr auto kDrainTimeout = std::chrono::seconds(10);
constexpr uint64_t kMaxDrainBytes = uint64_t{1} << 30;

http::response<http::string_body> make_response(int status, std::string body, const char* content_type,
                                                 bool keep_alive, unsigned version) {
  http::response<http::string_body> res{static_cast<http::status>(status), version};
  res.set(http::field::server, "kestrel");
  res.set(http::field::content_type, content_type);
  res.keep_alive(keep_alive);
  res.body() = std::move(body);
  res.prepare_payload();
  return res;
}

// Answers 413 and then reads (and drops) what the client still sends, so that a client which writes its whole
// body before reading gets the answer instead of a reset connection.
awaitable<void> reject_too_large(beast::tcp_stream& stream, uint64_t limit, bool client_waits_for_continue) {
  beast::error_code ec;
  auto res = make_response(413, error_body(413, fmt::format("the request body exceeds the limit of {} bytes", limit)),
                           "application/json", false, 11);
  stream.expires_after(kWriteTimeout);
  co_await http::async_write(stream, res, net::redirect_error(use_awaitable, ec));
  // Beast reports end_of_stream after writing a "Connection: close" message: that is success.
  if ((ec && ec != http::error::end_of_stream) || client_waits_for_continue) co_return;
  stream.expires_after(kDrainTimeout);
  std::vector<char> sink(1 << 16);
  uint64_t drained = 0;
  while (drained < kMaxDrainBytes) {
    const size_t n = co_await stream.async_read_some(net::buffer(sink), net::redirect_error(use_awaitable, ec));
    if (ec) break;
    drained += n;
  }
}

}  // namespace

std::string error_body(int status, const std::string& message) { return ApiError(status, message).body().dump(); }

struct HttpExchange::Shared {
  explicit Shared(const net::any_io_executor& ex) : executor(ex), signal(ex, net::steady_timer::time_point::max()) {}
  net::any_io_executor executor;
  net::steady_timer signal;
  std::atomic<bool> notified{false};
  bool gone = false;  // strand only
  bool watching = false;
};

HttpExchange::HttpExchange(beast::tcp_stream& stream, http::request<http::string_body>& req,
                           const HttpServerOptions* opts)
    : stream_(stream), req_(req), shared_(std::make_shared<Shared>(stream.get_executor())), opts_(opts) {
  keep_alive_ = req.keep_alive();
}

HttpExchange::~HttpExchange() {
  if (shared_->watching) {
    beast::error_code ec;
    stream_.socket().cancel(ec);
  }
}

std::string HttpExchange::path() const {
  const std::string_view t(req_.target().data(), req_.target().size());
  return std::string(t.substr(0, t.find('?')));
}

void HttpExchange::started(int status) {
  if (opts_ && opts_->on_status) opts_->on_status(status);
}

// vLLM's CORS middleware: a request with an allowed Origin gets Access-Control-Allow-Origin; a preflight (OPTIONS
// with Access-Control-Request-Method) also the methods and headers it may use.
template <typename Response>
void HttpExchange::add_cors(Response& res) const {
  if (!opts_ || opts_->allowed_origins.empty()) return;
  const auto o = req_.find(http::field::origin);
  if (o == req_.end()) return;
  const std::string origin(o->value());
  const auto& allowed = opts_->allowed_origins;
  if (std::find(allowed.begin(), allowed.end(), "*") != allowed.end()) {
    res.set(http::field::access_control_allow_origin, "*");
  } else if (std::find(allowed.begin(), allowed.end(), origin) != allowed.end()) {
    res.set(http::field::access_control_allow_origin, origin);
    res.set(http::field::vary, "Origin");
  } else {
    return;
  }
  if (req_.method() == http::verb::options) {
    res.set(http::field::access_control_allow_methods, "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT");
    const auto h = req_.find(http::field::access_control_request_headers);
    if (h != req_.end()) res.set(http::field::access_control_allow_headers, h->value());
    res.set(http::field::access_control_max_age, "600");
  }
}

awaitable<void> HttpExchange::reply(int status, std::string body, const char* content_type) {
  replied_ = true;
  started(status);
  auto res = make_response(status, std::move(body), content_type, keep_alive_, req_.version());
  add_cors(res);
  beast::error_code ec;
  stream_.expires_after(kWriteTimeout);
  co_await http::async_write(stream_, res, net::redirect_error(use_awaitable, ec));
  stream_.expires_never();
  if (ec && ec != http::error::end_of_stream) shared_->gone = true;
}

awaitable<bool> HttpExchange::begin_events() {
  replied_ = true;
  started(200);
  http::response<http::empty_body> res{http::status::ok, req_.version()};
  add_cors(res);
  res.set(http::field::server, "kestrel");
  res.set(http::field::content_type, "text/event-stream");
  res.set(http::field::cache_control, "no-cache");
  // HTTP/1.0 has no chunked encoding: the body runs to the connection's close.
  chunked_ = req_.version() >= 11;
  if (!chunked_) keep_alive_ = false;
  res.keep_alive(keep_alive_);
  res.chunked(chunked_);
  http::response_serializer<http::empty_body> sr{res};
  beast::error_code ec;
  stream_.expires_after(kWriteTimeout);
  co_await http::async_write_header(stream_, sr, net::redirect_error(use_awaitable, ec));
  stream_.expires_never();
  if (ec) shared_->gone = true;
  co_return !shared_->gone;
}

awaitable<bool> HttpExchange::send_event(const std::string& data) {
  if (shared_->gone) co_return false;
  const std::string event = "data: " + data + "\n\n";
  beast::error_code ec;
  stream_.expires_after(kWriteTimeout);
  if (chunked_)
    co_await net::async_write(stream_, http::make_chunk(net::buffer(event)), net::redirect_error(use_awaitable, ec));
  else
    co_await net::async_write(stream_, net::buffer(event), net::redirect_error(use_awaitable, ec));
  stream_.expires_never();
  if (ec) shared_->gone = true;
  co_return !shared_->gone;
}

awaitable<void> HttpExchange::end_events() {
  if (shared_->gone || !chunked_) co_return;  // without chunks the close ends the body
  beast::error_code ec;
  stream_.expires_after(kWriteTimeout);
  co_await net::async_write(stream_, http::make_chunk_last(), net::redirect_error(use_awaitable, ec));
  stream_.expires_never();
  if (ec) shared_->gone = true;
}

std::function<void()> HttpExchange::notifier() {
  return [weak = std::weak_ptr<Shared>(shared_)] {
    const auto s = weak.lock();
    if (!s) return;
    s->notified = true;
    net::post(s->executor, [weak] {
      if (const auto s2 = weak.lock()) s2->signal.cancel();
    });
  };
}

awaitable<void> HttpExchange::wait() {
  if (shared_->notified.exchange(false) || shared_->gone) co_return;
  shared_->signal.expires_at(net::steady_timer::time_point::max());
  beast::error_code ec;
  co_await shared_->signal.async_wait(net::redirect_error(use_awaitable, ec));
  shared_->notified = false;
}

namespace {

// Waits for the socket to turn readable and then peeks: end of stream or an error means the client closed the
// connection; no byte (a spurious wake-up) waits again; a byte (a pipelined next request) ends the watch.
template <typename Shared>
void arm_disconnect_watch(const std::shared_ptr<Shared>& s, tcp::socket& sock) {
  sock.async_wait(tcp::socket::wait_read, [s, &sock](beast::error_code ec) {
    if (ec == net::error::operation_aborted) return;  // the exchange ended (the socket may be gone)
    if (!ec) {
      char byte = 0;
      const ssize_t n = ::recv(sock.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n > 0) return;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        arm_disconnect_watch(s, sock);
        return;
      }
    }
    s->gone = true;
    s->signal.cancel();
  });
}

}  // namespace

void HttpExchange::watch_disconnect() {
  if (shared_->watching) return;
  shared_->watching = true;
  arm_disconnect_watch(shared_, stream_.socket());
}

bool HttpExchange::client_gone() const { return shared_->gone; }

awaitable<void> HttpExchange::sleep(std::chrono::milliseconds d) {
  net::steady_timer t(stream_.get_executor(), d);
  beast::error_code ec;
  co_await t.async_wait(net::redirect_error(use_awaitable, ec));
}

HttpServer::HttpServer(const HttpServerOptions& opts, Handler handler)
    : opts_(opts), handler_(std::move(handler)), ioc_(opts.threads), acceptor_(ioc_) {}

HttpServer::~HttpServer() { stop(); }

int HttpServer::listen() {
  beast::error_code ec;
  const auto addr = net::ip::make_address(opts_.host, ec);
  if (ec) fail("--host '{}' is not an IP address", opts_.host);
  const tcp::endpoint ep(addr, static_cast<unsigned short>(opts_.port));
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
  if (ec) fail("cannot listen on {}:{}: {}", opts_.host, opts_.port, ec.message());
  return acceptor_.local_endpoint().port();
}

void HttpServer::start() {
  net::co_spawn(ioc_, accept_loop(), net::detached);
  for (int i = 0; i < opts_.threads; ++i) threads_.emplace_back([this] { ioc_.run(); });
}

void HttpServer::stop() {
  if (stopped_.exchange(true)) return;
  net::post(ioc_, [this] {
    beast::error_code ec;
    acceptor_.close(ec);
  });
  ioc_.stop();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

awaitable<void> HttpServer::accept_loop() {
  while (acceptor_.is_open()) {
    beast::error_code ec;
    tcp::socket socket = co_await acceptor_.async_accept(net::make_strand(ioc_), net::redirect_error(use_awaitable, ec));
    if (ec) {
      if (!acceptor_.is_open()) co_return;
      // Out of descriptors or a transient error: back off briefly rather than spin.
      net::steady_timer pause(ioc_, std::chrono::milliseconds(50));
      co_await pause.async_wait(net::redirect_error(use_awaitable, ec));
      continue;
    }
    const auto ex = socket.get_executor();
    net::co_spawn(ex, session(std::move(socket)), net::detached);
  }
}

awaitable<void> HttpServer::session(tcp::socket socket) {
  struct Count {
    std::atomic<int>& n;
    explicit Count(std::atomic<int>& c) : n(c) { ++n; }
    ~Count() { --n; }
  } count(connections_);
  beast::tcp_stream stream(std::move(socket));
  beast::flat_buffer buffer;
  beast::error_code ec;
  if (connections_ > opts_.max_connections) {
    auto res = make_response(503, error_body(503, "too many open connections"), "application/json", false, 11);
    stream.expires_after(kWriteTimeout);
    co_await http::async_write(stream, res, net::redirect_error(use_awaitable, ec));
    stream.socket().shutdown(tcp::socket::shutdown_both, ec);
    co_return;
  }
  using clock = std::chrono::steady_clock;
  auto after = [](double seconds) {
    return clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(seconds));
  };
  while (!stopped_) {
    http::request_parser<http::string_body> parser;
    parser.body_limit(opts_.max_body_bytes);
    // Idle: wait for the first byte of the next request (unless a pipelined one is buffered already).
    if (buffer.size() == 0) {
      stream.expires_at(after(opts_.idle_timeout));
      const size_t n = co_await stream.async_read_some(buffer.prepare(4096), net::redirect_error(use_awaitable, ec));
      if (ec) break;  // closed, or idle too long
      buffer.commit(n);
    }
    stream.expires_at(after(opts_.header_timeout));
    co_await http::async_read_header(stream, buffer, parser, net::redirect_error(use_awaitable, ec));
    if (ec == http::error::body_limit) {  // the Content-Length is over the limit
      co_await reject_too_large(stream, opts_.max_body_bytes,
                                beast::iequals(parser.get()[http::field::expect], "100-continue"));
      break;
    }
    // A header that did not arrive in time: the stream's timer has closed the connection (as uvicorn does).
    if (ec == beast::error::timeout) break;
    if (ec) {
      if (ec != http::error::end_of_stream && ec != net::error::eof &&
          ec != net::error::connection_reset && ec != net::error::operation_aborted) {
        auto res = make_response(400, error_body(400, "malformed HTTP request: " + ec.message()), "application/json",
                                 false, 11);
        co_await http::async_write(stream, res, net::redirect_error(use_awaitable, ec));
      }
      break;
    }
    const bool expect_continue = beast::iequals(parser.get()[http::field::expect], "100-continue");
    if (parser.content_length() && *parser.content_length() > opts_.max_body_bytes) {
      co_await reject_too_large(stream, opts_.max_body_bytes, expect_continue);
      break;
    }
    if (expect_continue) {
      static const std::string cont = "HTTP/1.1 100 Continue\r\n\r\n";
      co_await net::async_write(stream, net::buffer(cont), net::redirect_error(use_awaitable, ec));
      if (ec) break;
    }
    // The body, at an average of at least body_min_rate bytes/s after a grace of header_timeout.
    const auto body_start = clock::now();
    uint64_t body_read = 0;
    while (!parser.is_done()) {
      const double allowed = opts_.header_timeout + static_cast<double>(body_read) / std::max(opts_.body_min_rate, 1.0);
      stream.expires_at(body_start +
                        std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(allowed)));
      body_read += co_await http::async_read_some(stream, buffer, parser, net::redirect_error(use_awaitable, ec));
      if (ec) break;
    }
    if (ec == beast::error::timeout) break;  // the body arrived too slowly: closed likewise
    if (ec == http::error::body_limit) {
      co_await reject_too_large(stream, opts_.max_body_bytes, false);
      break;
    }
    if (ec) {
      if (ec != net::error::eof && ec != http::error::end_of_stream && ec != beast::error::timeout &&
          ec != http::error::partial_message && ec != net::error::connection_reset) {
        auto res = make_response(400, error_body(400, "malformed HTTP request: " + ec.message()), "application/json",
                                 false, 11);
        co_await http::async_write(stream, res, net::redirect_error(use_awaitable, ec));
      }
      break;
    }
    stream.expires_never();
    http::request<http::string_body> req = parser.release();
    bool keep_alive = false;
    {
      HttpExchange ex(stream, req, &opts_);
      std::string failure;
      try {
        co_await handler_(ex);
      } catch (const std::exception& e) {
        failure = e.what();
        if (failure.empty()) failure = "unknown error";
      }
      if (!failure.empty()) {
        // Logged in full; the client gets a generic message (internal text is not for it).
        std::fprintf(stderr, "[kestrel] request %s failed: %s\n", ex.path().c_str(), failure.c_str());
        if (!ex.replied()) co_await ex.reply(500, error_body(500, "internal server error; the server's log has the details"));
      }
      keep_alive = failure.empty() && ex.keep_alive() && !ex.client_gone();
    }
    if (!keep_alive) break;
  }
  stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  stream.socket().close(ec);
}

}  // namespace kestrel::server
