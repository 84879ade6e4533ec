#include "grammar/number_range.h"

#include <algorithm>

#include "core/error.h"

namespace kestrel::grammar {
namespace {

// An exact integer: sign and magnitude digits (no leading zeros; "0" is never negative).
struct Int {
  bool neg = false;
  std::string mag = "0";
};

std::string strip(std::string d) {
  const size_t nz = d.find_first_not_of('0');
  return nz == std::string::npos ? "0" : d.substr(nz);
}

int compare_mag(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return a.size() < b.size() ? -1 : 1;
  return a < b ? -1 : a > b ? 1 : 0;
}

int compare(const Int& a, const Int& b) {
  if (a.neg != b.neg) return a.neg ? -1 : 1;
  const int c = compare_mag(a.mag, b.mag);
  return a.neg ? -c : c;
}

std::string add1_mag(std::string m) {
  int i = static_cast<int>(m.size()) - 1;
  while (i >= 0 && m[static_cast<size_t>(i)] == '9') m[static_cast<size_t>(i--)] = '0';
  if (i < 0) return "1" + m;
  ++m[static_cast<size_t>(i)];
  return m;
}
std::string sub1_mag(std::string m) {  // m >= 1
  int i = static_cast<int>(m.size()) - 1;
  while (m[static_cast<size_t>(i)] == '0') m[static_cast<size_t>(i--)] = '9';
  --m[static_cast<size_t>(i)];
  return strip(m);
}
Int plus1(const Int& x) {
  if (!x.neg) return {false, add1_mag(x.mag)};
  const std::string m = sub1_mag(x.mag);
  return {m != "0", m};
}
Int minus1(const Int& x) {
  if (x.neg) return {true, add1_mag(x.mag)};
  if (x.mag == "0") return {true, "1"};
  return {false, sub1_mag(x.mag)};
}

// A JSON number text as sign, integer digits and fraction digits (exponent applied).
struct Decimal {
  bool neg = false;
  std::string digits;  // all significant digits
  int64_t point = 0;   // digits before the decimal point (may be <= 0 or > size)
};
Decimal parse(const std::string& text) {
  Decimal d;
  size_t i = 0;
  if (i < text.size() && text[i] == '-') d.neg = true, ++i;
  std::string digits;
  int64_t point = -1;
  for (; i < text.size() && text[i] != 'e' && text[i] != 'E'; ++i) {
    if (text[i] == '.') point = static_cast<int64_t>(digits.size());
    else if (text[i] >= '0' && text[i] <= '9') digits += text[i];
    else fail("'{}' is not a number", text);
  }
  if (point < 0) point = static_cast<int64_t>(digits.size());
  if (i < text.size()) point += std::stoll(text.substr(i + 1));
  KESTREL_CHECK(point > -100000 && point < 100000, "number {} is out of range", text);
  d.digits = digits;
  d.point = point;
  return d;
}
// floor or ceil of value * 10^scale, and whether it was exact.
Int scaled(const std::string& text, int scale, bool up, bool& exact) {
  const Decimal d = parse(text);
  const int64_t p = d.point + scale;
  std::string whole, rest;
  if (p <= 0) rest = d.digits;
  else if (p >= static_cast<int64_t>(d.digits.size())) whole = d.digits + std::string(static_cast<size_t>(p - static_cast<int64_t>(d.digits.size())), '0');
  else whole = d.digits.substr(0, static_cast<size_t>(p)), rest = d.digits.substr(static_cast<size_t>(p));
  exact = rest.find_first_not_of('0') == std::string::npos;
  Int q{false, strip(whole.empty() ? "0" : whole)};
  if (d.neg && q.mag != "0") q.neg = true;
  if (!exact) {
    if (!d.neg && up) q = plus1(q);
    if (d.neg && !up) q = minus1(q);
    if (d.neg && up && q.mag == "0") q.neg = false;
  }
  return q;
}
// The least scaled integer within a lower bound, the greatest within an upper.
Int lower_limit(const Bound& b, int scale) {
  bool exact = false;
  Int v = scaled(b.value, scale, true, exact);
  if (b.exclusive && exact) v = plus1(v);
  return v;
}
Int upper_limit(const Bound& b, int scale) {
  bool exact = false;
  Int v = scaled(b.value, scale, false, exact);
  if (b.exclusive && exact) v = minus1(v);
  return v;
}

class RangeBuilder {
 public:
  explicit RangeBuilder(Grammar& g) : g_(g) {}

  ExprId digit(char lo, char hi) { return g_.chars({{static_cast<uint32_t>(lo), static_cast<uint32_t>(hi)}}); }
  ExprId any_digits(int64_t n) { return n == 0 ? g_.empty() : g_.repeat(digit('0', '9'), n, n); }

  // Fixed-width digit strings (leading zeros allowed) between x and y, equal lengths, x <= y.
  ExprId fixed(const std::string& x, const std::string& y) {
    if (x.empty()) return g_.empty();
    if (x == y) return g_.bytes(x);
    const std::string xr = x.substr(1), yr = y.substr(1);
    if (x[0] == y[0]) return g_.seq({g_.bytes(std::string(1, x[0])), fixed(xr, yr)});
    const int64_t rest = static_cast<int64_t>(xr.size());
    const std::string zeros(xr.size(), '0'), nines(xr.size(), '9');
    if (xr == zeros && yr == nines) return g_.seq({digit(x[0], y[0]), any_digits(rest)});
    std::vector<ExprId> alts;
    char lo_mid = x[0];
    if (xr == zeros) {
      --lo_mid;  // x[0] joins the middle
    } else {
      alts.push_back(g_.seq({g_.bytes(std::string(1, x[0])), fixed(xr, nines)}));
    }
    char hi_mid = y[0];
    const bool y_full = yr == nines;
    if (!y_full) --hi_mid;
    if (lo_mid + 1 <= hi_mid) alts.push_back(g_.seq({digit(static_cast<char>(lo_mid + 1), hi_mid), any_digits(rest)}));
    if (!y_full) alts.push_back(g_.seq({g_.bytes(std::string(1, y[0])), fixed(zeros, yr)}));
    return g_.alt(std::move(alts));
  }

  // Canonical non-negative integers in [a, b] (b empty: unbounded); a <= b.
  ExprId naturals(const std::string& a, const std::optional<std::string>& b) {
    std::vector<ExprId> alts;
    size_t len = a.size();
    if (a == "0") {
      alts.push_back(g_.bytes("0"));
      if (b && *b == "0") return alts[0];
      return g_.alt({alts[0], naturals("1", b)});
    }
    const size_t top = b ? b->size() : a.size();
    for (; len <= top; ++len) {
      const std::string lo = len == a.size() ? a : "1" + std::string(len - 1, '0');
      const std::string hi = b && len == b->size() ? *b : std::string(len, '9');
      alts.push_back(fixed(lo, hi));
    }
    if (!b) alts.push_back(g_.seq({digit('1', '9'), g_.repeat(digit('0', '9'), static_cast<int64_t>(a.size()), -1)}));
    return g_.alt(std::move(alts));
  }

  // Canonical integers in [lo, hi] (nullopt: open); -1 when empty.
  ExprId integers(const std::optional<Int>& lo, const std::optional<Int>& hi) {
    if (lo && hi && compare(*lo, *hi) > 0) return -1;
    std::vector<ExprId> alts;
    // Negative part: magnitudes in [max(1, -hi), -lo].
    if (!lo || lo->neg) {
      std::string m_lo = "1";
      if (hi && hi->neg) m_lo = hi->mag;
      const std::optional<std::string> m_hi = lo ? std::optional<std::string>(lo->mag) : std::nullopt;
      alts.push_back(g_.seq({g_.bytes("-"), naturals(m_lo, m_hi)}));
    }
    // Non-negative part: [max(0, lo), hi].
    if (!hi || !hi->neg) {
      const std::string a = lo && !lo->neg ? lo->mag : "0";
      alts.push_back(naturals(a, hi ? std::optional<std::string>(hi->mag) : std::nullopt));
    }
    return g_.alt(std::move(alts));
  }

  // Non-negative decimals "P" or "P.F" (1 <= |F| <= frac) whose value times 10^frac is in [lo, hi] (hi open when
  // nullopt; lo >= 0). allow_bare_zero: "0" itself.
  ExprId decimals(const std::string& lo, const std::optional<std::string>& hi, int frac, bool allow_bare_zero) {
    std::vector<ExprId> alts;
    for (int f = 0; f <= frac; ++f) {
      // Values with exactly f fraction digits: M = value * 10^f in [ceil(lo / 10^(frac-f)), floor(hi / 10^(frac-f))].
      const size_t cut = static_cast<size_t>(frac - f);
      auto div_ceil = [&](const std::string& v) {
        if (v.size() <= cut) return std::string(v == "0" ? "0" : "1");
        const std::string q = strip(v.substr(0, v.size() - cut));
        const bool rem = v.substr(v.size() - cut).find_first_not_of('0') != std::string::npos;
        return rem ? add1_mag(q) : q;
      };
      auto div_floor = [&](const std::string& v) {
        if (v.size() <= cut) return std::string("0");
        return strip(v.substr(0, v.size() - cut));
      };
      std::string m_lo = div_ceil(lo);
      if (f == 0 && !allow_bare_zero && m_lo == "0") m_lo = "1";
      const std::optional<std::string> m_hi = hi ? std::optional<std::string>(div_floor(*hi)) : std::nullopt;
      if (m_hi && compare_mag(m_lo, *m_hi) > 0) continue;
      if (f == 0) {
        alts.push_back(naturals(m_lo, m_hi));
        continue;
      }
      const size_t fs = static_cast<size_t>(f);
      auto split = [&](const std::string& m, std::string& p, std::string& r) {
        const std::string padded = m.size() <= fs ? std::string(fs + 1 - m.size(), '0') + m : m;
        p = strip(padded.substr(0, padded.size() - fs));
        r = padded.substr(padded.size() - fs);
      };
      std::string p_lo, r_lo, p_hi, r_hi;
      split(m_lo, p_lo, r_lo);
      if (m_hi) split(*m_hi, p_hi, r_hi);
      const std::string zeros(fs, '0'), nines(fs, '9');
      const ExprId point = g_.bytes(".");
      if (m_hi && p_lo == p_hi) {
        alts.push_back(g_.seq({g_.bytes(p_lo), point, fixed(r_lo, r_hi)}));
        continue;
      }
      alts.push_back(g_.seq({g_.bytes(p_lo), point, fixed(r_lo, nines)}));
      const std::string mid_lo = add1_mag(p_lo);
      if (!m_hi) {
        alts.push_back(g_.seq({naturals(mid_lo, std::nullopt), point, any_digits(f)}));
      } else {
        if (compare_mag(mid_lo, sub1_mag(p_hi)) <= 0 && p_hi != "0")
          alts.push_back(g_.seq({naturals(mid_lo, sub1_mag(p_hi)), point, any_digits(f)}));
        alts.push_back(g_.seq({g_.bytes(p_hi), point, fixed(zeros, r_hi)}));
      }
    }
    if (alts.empty()) return -1;
    return g_.alt(std::move(alts));
  }

 private:
  Grammar& g_;
};

}  // namespace

int compare_decimal(const std::string& a, const std::string& b) {
  const int scale = 400;  // beyond any double's digits: exact comparison of the texts' values
  const Decimal x = parse(a), y = parse(b);
  auto key = [&](const Decimal& d) {
    std::string digits = d.digits;
    const int64_t p = d.point + scale;
    if (p <= 0) return Int{};
    if (p >= static_cast<int64_t>(digits.size())) digits += std::string(static_cast<size_t>(p) - digits.size(), '0');
    else digits = digits.substr(0, static_cast<size_t>(p));
    Int v{false, strip(digits)};
    v.neg = d.neg && v.mag != "0";
    return v;
  };
  return compare(key(x), key(y));
}

ExprId integer_range(Grammar& g, const std::optional<Bound>& lo, const std::optional<Bound>& hi) {
  RangeBuilder b(g);
  return b.integers(lo ? std::optional<Int>(lower_limit(*lo, 0)) : std::nullopt,
                    hi ? std::optional<Int>(upper_limit(*hi, 0)) : std::nullopt);
}

ExprId decimal_range(Grammar& g, const std::optional<Bound>& lo, const std::optional<Bound>& hi, int frac_digits) {
  RangeBuilder b(g);
  const std::optional<Int> l = lo ? std::optional<Int>(lower_limit(*lo, frac_digits)) : std::nullopt;
  const std::optional<Int> h = hi ? std::optional<Int>(upper_limit(*hi, frac_digits)) : std::nullopt;
  if (l && h && compare(*l, *h) > 0) return -1;
  std::vector<ExprId> alts;
  // Negative values: "-" and a magnitude in [max(0, -h), -l] (zero only with a fraction, "-0.0", and only when the
  // lower bound is below zero, as xgrammar).
  if (!l || l->neg) {
    const std::string m_lo = h && h->neg ? h->mag : "0";
    const std::optional<std::string> m_hi = l ? std::optional<std::string>(l->mag) : std::nullopt;
    if (const ExprId e = b.decimals(m_lo, m_hi, frac_digits, false); e >= 0) alts.push_back(g.seq({g.bytes("-"), e}));
  }
  if (!h || !h->neg) {
    const std::string a = l && !l->neg ? l->mag : "0";
    if (const ExprId e = b.decimals(a, h ? std::optional<std::string>(h->mag) : std::nullopt, frac_digits, true); e >= 0)
      alts.push_back(e);
  }
  if (alts.empty()) return -1;
  return g.alt(std::move(alts));
}

}  // namespace kestrel::grammar
