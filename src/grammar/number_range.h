// Decimal texts whose value lies within bounds, as grammar expressions: canonical integers (no leading zeros, no
// "-0") in a range, and decimals with at most a given number of fractional digits and no exponent in a range (a
// sign on zero only with a fraction: "-0.0" but not "-0", as xgrammar). Bounds are decimal texts (JSON numbers,
// exponents allowed) compared exactly, not as doubles.
#pragma once
#include <optional>
#include <string>

#include "grammar/grammar.h"

namespace kestrel::grammar {

struct Bound {
  std::string value;       // a JSON number's text
  bool exclusive = false;
};

// <0, 0, >0 as a < b, a == b, a > b (exact decimal comparison of JSON number texts).
int compare_decimal(const std::string& a, const std::string& b);
// The integers in [lo, hi] (either side may be open); -1 when there is none.
ExprId integer_range(Grammar& g, const std::optional<Bound>& lo, const std::optional<Bound>& hi);
// Decimals with at most `frac_digits` fractional digits in [lo, hi]; -1 when there is none.
ExprId decimal_range(Grammar& g, const std::optional<Bound>& lo, const std::optional<Bound>& hi, int frac_digits);

}  // namespace kestrel::grammar
