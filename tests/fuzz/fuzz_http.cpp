// libFuzzer harness: bytes from a client through the HTTP request parser as the server sets it up (Beast's
// request_parser with a string body under a body limit), fed in pieces, then for a parsed request what the server
// reads of it (target, keep-alive, Expect, Content-Length).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace http = boost::beast::http;
  http::request_parser<http::string_body> parser;
  parser.body_limit(1 << 16);
  parser.eager(true);
  boost::beast::error_code ec;
  // Pieces of at most 7 bytes: the parser must cope with any split of the stream.
  std::string buf;
  for (size_t at = 0; at < size && !parser.is_done();) {
    const size_t n = std::min<size_t>(7, size - at);
    buf.append(reinterpret_cast<const char*>(data) + at, n);
    at += n;
    for (;;) {
      const size_t used = parser.put(boost::asio::buffer(buf), ec);
      buf.erase(0, used);
      if (ec == http::error::need_more) {
        ec = {};
        break;
      }
      if (ec) return 0;
      if (parser.is_done() || used == 0 || buf.empty()) break;
    }
  }
  if (parser.is_header_done()) {
    const auto& req = parser.get();
    const std::string target(req.target());
    (void)target.find('?');
    (void)req.keep_alive();
    (void)boost::beast::iequals(req[http::field::expect], "100-continue");
    (void)parser.content_length();
  }
  return 0;
}
