// JSON Schema to grammar, following xgrammar's reading of schemas (vLLM's and SGLang's engine), so that the same
// schema admits the same texts:
//  - whitespace between tokens is [ \n\r\t]* (any_whitespace; without it the separators are ", " and ": ");
//  - object properties come in the schema's order, the required ones always, the others optionally; without
//    `additionalProperties` (strict) no other key is allowed; with it, other keys (never a defined key's exact text)
//    follow the defined ones; likewise a tuple (prefixItems) without `items` takes no further items (strict);
//  - integers are canonical (no leading zeros, no "-0"); bounded numbers are decimals without exponent and with at
//    most 6 fractional digits; unbounded numbers are any JSON number;
//  - enum and const values are their compact JSON serialization.
// Supported: type (and type lists), enum, const, properties, required, additionalProperties (bool or schema),
// items (schema or false), prefixItems, minItems, maxItems, anyOf, oneOf (as anyOf), allOf of one schema, $ref to
// the document (#, #/$defs/..., #/definitions/..., any JSON pointer; recursion allowed), $defs/definitions,
// minLength, maxLength, pattern, format (date, time, date-time, duration, uuid, email, hostname, ipv4), minimum,
// maximum, exclusiveMinimum, exclusiveMaximum, annotations (title, description, $comment, ...: ignored), keywords
// JSON Schema does not define (ignored, as JSON Schema says) and formats it does not define (annotations: a plain
// string). Keywords that assert something this engine cannot enforce (multipleOf, uniqueItems, contains,
// patternProperties, propertyNames, minProperties, maxProperties, dependentRequired, dependentSchemas,
// if/then/else, not, allOf of several schemas, remote $ref, JSON Schema's formats without a regex here: ipv6, uri,
// ...) are refused with an Error naming the keyword and where it is; their values that assert nothing
// ("uniqueItems": false, "minProperties": 0, "minContains": 0) are ignored.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "grammar/grammar.h"

namespace kestrel::grammar {

struct JsonSchemaOptions {
  bool any_whitespace = true;
  // false: objects without additionalProperties accept any other key (JSON Schema's own default); true: none
  // (xgrammar's strict mode, and OpenAI's strict structured outputs).
  bool strict = true;
  int max_depth = 128;  // nesting of subschemas
};

Grammar json_schema_grammar(const nlohmann::ordered_json& schema, const JsonSchemaOptions& opts = {});
// Any JSON value whose top level is an object (response_format json_object).
Grammar json_object_grammar(const JsonSchemaOptions& opts = {});

// Adds a JSON Schema's grammar to g (rules named under `prefix`); returns the rule of the value of the subschema at
// `pointer` (a JSON pointer into `schema`, "#" for all of it), its $refs resolved against `schema`.
RuleId add_json_schema(Grammar& g, const nlohmann::ordered_json& schema, const std::string& prefix,
                       const JsonSchemaOptions& opts = {}, const std::string& pointer = "#");

}  // namespace kestrel::grammar
