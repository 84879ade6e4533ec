#include "grammar/structured_output.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "grammar/ebnf.h"
#include "grammar/json_schema.h"
#include "grammar/regex_grammar.h"

namespace kestrel::grammar {

std::string StructuredOutput::key() const {
  nlohmann::json j = {{"kind", static_cast<int>(kind)}, {"text", text}, {"choices", choices},
                      {"ws", any_whitespace}, {"strict", strict}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Grammar build_grammar(const StructuredOutput& s) {
  const JsonSchemaOptions json_opts{.any_whitespace = s.any_whitespace, .strict = s.strict};
  switch (s.kind) {
    case StructuredOutput::Kind::json_schema: {
      nlohmann::ordered_json schema;
      try {
        schema = nlohmann::ordered_json::parse(s.text);
      } catch (const nlohmann::json::parse_error& e) {
        fail("the JSON schema is not valid JSON: {}", e.what());
      }
      return json_schema_grammar(schema, json_opts);
    }
    case StructuredOutput::Kind::json_object: return json_object_grammar(json_opts);
    case StructuredOutput::Kind::regex: return regex_grammar(s.text);
    case StructuredOutput::Kind::grammar: return parse_ebnf(s.text);
    case StructuredOutput::Kind::choice: {
      KESTREL_CHECK(!s.choices.empty(), "a choice needs at least one string");
      Grammar g;
      std::vector<ExprId> alts;
      for (const std::string& c : s.choices) alts.push_back(g.bytes(c));
      g.set_root(g.add_rule("root", g.alt(std::move(alts))));
      return g;
    }
  }
  fail("unknown structured output kind");
}

}  // namespace kestrel::grammar
