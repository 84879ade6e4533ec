// Hand-worked tests of the Jinja interpreter and the chat-template environment. (Equality with Python jinja2 on
// many templates and message lists is checked by tests/python/test_text_template.py.)
#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/jinja.h"

namespace kestrel::text {
namespace {

using nlohmann::ordered_json;

std::string render(const std::string& src, const ordered_json& ctx = ordered_json::object(), jinja::Options o = {}) {
  jinja::DictData d;
  for (const auto& [k, v] : ctx.items()) d.set(k, jinja::Value::from_json(v));
  return jinja::Template(src, o).render(d);
}

std::string error_of(const std::string& src, const ordered_json& ctx = ordered_json::object()) {
  try {
    render(src, ctx);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Jinja, ExpressionsFollowPython) {
  EXPECT_EQ(render("{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 5 }} {{ 1 + 2 * 3 }}"), "3 -4 2 3.5 32 7");
  EXPECT_EQ(render("{{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e-5 }} {{ 0.0001 }} {{ 3.0 }} {{ 2.5e-300 }}"),
            "0.30000000000000004 1e+16 1e-05 0.0001 3.0 2.5e-300");
  EXPECT_EQ(render("{{ none }} {{ true }} {{ [1, 'a', none] }} {{ {'k': 'it\\'s'} }} {{ (1,) }}"),
            "None True [1, 'a', None] {'k': \"it's\"} (1,)");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none }} {{ 'ab' * 2 }} {{ [1] + [2] }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }}"),
            "a1None abab [1, 2] True False");
  EXPECT_EQ(render("{{ x or 'd' }} {{ 0 and 'no' }} {{ 'y' if x else 'n' }} {{ not x }}"), "d 0 n True");
  EXPECT_EQ(render("{{ 'héllo wörld'[1:4] }} {{ 'héllo'|length }} {{ 'abc'[::-1] }} {{ [1,2,3][-1] }}"),
            "éll 5 cba 3");
}

TEST(Jinja, WhitespaceControlAsJinja2) {
  // trim_blocks drops the newline after a block tag; lstrip_blocks drops indentation before it.
  jinja::Options hf;
  hf.trim_blocks = hf.lstrip_blocks = true;
  EXPECT_EQ(render("a\n  {% if true %}\n  b\n  {% endif %}\nc", {}, hf), "a\n  b\nc");
  EXPECT_EQ(render("a\n  {% if true %}\n  b\n  {% endif %}\nc"), "a\n  \n  b\n  \nc");
  EXPECT_EQ(render("a  {{- 'b' -}}  \n c"), "abc");
  EXPECT_EQ(render("x {#- note -#} y"), "xy");
  EXPECT_EQ(render("  {%+ if true %}k{% endif %}", {}, hf), "  k");
  EXPECT_EQ(render("{% raw %}{{ x }}{% endraw %}"), "{{ x }}");
  EXPECT_EQ(render("last line\n"), "last line");  // jinja2 drops one trailing newline
}

TEST(Jinja, LoopsScopesAndNamespaces) {
  EXPECT_EQ(render("{% for x in [1,2,3] %}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }},{% endfor %}"),
            "1TrueFalse3,2FalseFalse3,3FalseTrue3,");
  EXPECT_EQ(render("{% for x in [1,2,3,4] if x is even %}{{ x }}{{ loop.index }}{% endfor %}"), "2142");
  EXPECT_EQ(render("{% for x in [] %}a{% else %}empty{% endfor %}"), "empty");
  // A set inside a loop stays in the loop; a namespace carries state out.
  EXPECT_EQ(render("{% set a = 0 %}{% set ns = namespace(a=0) %}{% for x in [1,2] %}{% set a = x %}"
                   "{% set ns.a = ns.a + x %}{% endfor %}{{ a }} {{ ns.a }}"),
            "0 3");
  EXPECT_EQ(render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}{{ v }}{% endfor %}"), "a1b2");
  EXPECT_EQ(render("{% for x in [1,2,3,4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}"
                   "{% endif %}{{ x }}{% endfor %}"),
            "13");
  EXPECT_EQ(render("{% for a in [1,2] %}{% for b in [3] %}{{ loop.depth }}{% endfor %}{{ loop.depth }}{% endfor %}"),
            "2121");
}

TEST(Jinja, MacrosFiltersAndTests) {
  EXPECT_EQ(render("{% macro m(a, b='x') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(2, 'y') }}{{ m(b='z', a=3) }}"),
            "[1x][2y][3z]");
  EXPECT_EQ(render("{{ ' a ' | trim }}|{{ [3,1,2] | sort | join(',') }}|{{ 'x' | upper }}|{{ [1,2] | length }}"),
            "a|1,2,3|X|2");
  EXPECT_EQ(render("{{ m | selectattr('r', 'equalto', 'u') | map(attribute='c') | join }}",
                   {{"m", {{{"r", "u"}, {"c", "A"}}, {{"r", "a"}, {"c", "B"}}, {{"r", "u"}, {"c", "C"}}}}}),
            "AC");
  EXPECT_EQ(render("{{ x is defined }} {{ y is none }} {{ 3 is odd }} {{ 'a' is string }} {{ y is not none }}",
                   {{"y", nullptr}}),
            "False True True True False");
  EXPECT_EQ(render("{{ d | tojson }}|{{ d | tojson(separators=(',', ':')) }}|{{ d | tojson(indent=1) }}",
                   {{"d", {{"b", "é\n"}, {"a", {1, 2.5, nullptr, true}}}}}),
            "{\"b\": \"é\\n\", \"a\": [1, 2.5, null, true]}|{\"b\":\"é\\n\",\"a\":[1,2.5,null,true]}|"
            "{\n \"b\": \"é\\n\",\n \"a\": [\n  1,\n  2.5,\n  null,\n  true\n ]\n}");
  EXPECT_EQ(render("{{ d | tojson(ensure_ascii=true) }}", {{"d", "é😀"}}), "\"\\u00e9\\ud83d\\ude00\"");
  EXPECT_EQ(render("{{ 'a,b,c'.split(',')[1] }} {{ ' x '.strip() }} {{ 'abc'.startswith('ab') }} {{ 'a-b'.replace('-', '+') }}"),
            "b x True a+b");
  EXPECT_EQ(render("{{ d.get('k', 5) }} {{ d.get('z') }} {{ d.keys() | list }}", {{"d", {{"k", 1}}}}), "1 None ['k']");
  EXPECT_EQ(render("{% set x %}in{{ 1 }}{% endset %}{{ x }}{% filter upper %}up{% endfilter %}"), "in1UP");
  EXPECT_EQ(render("{% generation %}kept{% endgeneration %}"), "kept");
}

TEST(Jinja, ErrorsNameTheProblemAndLine) {
  EXPECT_NE(error_of("a\n{% frob %}").find("line 2: unknown or unsupported tag 'frob'"), std::string::npos);
  EXPECT_NE(error_of("{{ x | nope }}").find("no filter named 'nope'"), std::string::npos);
  EXPECT_NE(error_of("{{ x is nope }}").find("no test named 'nope'"), std::string::npos);
  EXPECT_NE(error_of("{% if x %}").find("expected 'endif'"), std::string::npos);
  EXPECT_NE(error_of("{{ 'unterminated }}").find("unterminated string"), std::string::npos);
  EXPECT_NE(error_of("x\n\n{{ 'a' + 1 }}").find("line 3: unsupported operand type(s) for +: 'str' and 'int'"),
            std::string::npos);
  EXPECT_NE(error_of("{{ f() }}").find("'f' is undefined"), std::string::npos);
  EXPECT_NE(error_of("{{ x.y.z }}").find("'x' is undefined"), std::string::npos);
  EXPECT_NE(error_of("{% break %}").find("'break' outside of a loop"), std::string::npos);
  EXPECT_NE(error_of("{% for x in range(100000000) %}{% endfor %}").find("range too large"), std::string::npos);
  EXPECT_THROW(jinja::Template("{{ 'bad \xFF' }}"), Error);
}

TEST(ChatTemplate, TransformersEnvironment) {
  const ordered_json cfg = {{"bos_token", "<s>"}, {"eos_token", {{"content", "</s>"}}}};
  const ChatTemplate t(
      "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
      "{{ raise_exception('bad role ' ~ m.role) }}{% endif %}\n"
      "  {% if m.role == 'user' %}U:{{ m.content }}\n{% else %}A:{{ m.content }}{{ eos_token }}\n{% endif %}"
      "{% endfor %}{% if tools is none %}no tools{% endif %}{% if add_generation_prompt %}A:{% endif %}",
      cfg);
  const ordered_json msgs = {{{"role", "user"}, {"content", "hi"}}, {{"role", "assistant"}, {"content", "yo"}}};
  EXPECT_EQ(t.render(msgs, nullptr, true), "<s>U:hi\nA:yo</s>\nno toolsA:");
  const ordered_json bad = {{{"role", "robot"}, {"content", "x"}}};
  try {
    t.render(bad, nullptr, false);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("chat template raised an exception: bad role robot"), std::string::npos);
  }
  EXPECT_THROW(t.render(ordered_json::object(), nullptr, false), Error);
}

// ---- Issue 21: total budgets enforced inside the renderer ----

std::string limited_error(const std::string& src, const jinja::Limits& limits) {
  try {
    jinja::Template(src).render({}, limits);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(JinjaBudget, MacroCallsCountAsSteps) {
  // Two self-calls per level, 40 levels deep: 2^40 calls. Only `for` iterations were counted before.
  const std::string src =
      "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}";
  jinja::Limits l;
  l.max_steps = 100'000;
  EXPECT_NE(limited_error(src, l).find("exceeded its budget of 100000 steps"), std::string::npos);
  // The same macro over few levels renders.
  EXPECT_EQ(jinja::Template("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% else %}x{% endif %}"
                            "{% endmacro %}{{ f(3) }}")
                .render({}, l),
            "xxxxxxxx");
}

TEST(JinjaBudget, StringRepetitionIsSizedFirst) {
  // '' * huge looped once per unit before; it is empty at once now, as in Python.
  EXPECT_EQ(jinja::Template("[{{ '' * 4611686018427387904 }}]").render({}), "[]");
  EXPECT_NE(limited_error("{{ 'ab' * 4611686018427387904 }}", {}).find("over the limit"), std::string::npos);
  EXPECT_NE(limited_error("{{ [1, 2] * 4611686018427387904 }}", {}).find("over the limit"), std::string::npos);
  jinja::Limits l;
  l.max_string_bytes = 1000;
  EXPECT_NE(limited_error("{{ 'ab' * 501 }}", l).find("over the limit of 1000"), std::string::npos);
  EXPECT_EQ(jinja::Template("{{ ('ab' * 500) | length }}").render({}, l), "1000");
}

TEST(JinjaBudget, IntermediateStringsAreCapped) {
  // A doubling loop: each `~` and `+` result is charged before it is built.
  const std::string tilde = "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                            "{% endfor %}{{ ns.s | length }}";
  const std::string plus = "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                           "{% endfor %}{{ ns.s | length }}";
  jinja::Limits l;
  l.max_string_bytes = 1 << 20;
  EXPECT_NE(limited_error(tilde, l).find("built a string of 2097152 bytes (the limit is 1048576)"),
            std::string::npos);
  EXPECT_NE(limited_error(plus, l).find("built a string of 2097152 bytes"), std::string::npos);
  // The total over all strings: 4000 strings of 1000 bytes each pass the per-string cap but not a 1 MB total.
  jinja::Limits t;
  t.max_total_bytes = 1'000'000;
  EXPECT_NE(limited_error("{% for i in range(4000) %}{% set s = 'a' * 500 ~ 'b' * 500 %}{% endfor %}", t)
                .find("more than 1000000 bytes of strings in all"),
            std::string::npos);
  // Filters that build strings are capped while they build (replace with an empty pattern inserts everywhere).
  EXPECT_NE(limited_error("{{ ('a' * 2000) | replace('', 'b' * 1000) }}", l).find("more than 1048576 bytes"),
            std::string::npos);
  EXPECT_NE(limited_error("{{ 'x' | indent(100000000000) }}", l).find("more than 1048576 bytes"), std::string::npos);
  // Lists too: a doubling loop of `l + l` stops at a million items.
  EXPECT_NE(limited_error("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                          "{% endfor %}",
                          {})
                .find("built a list of 1048576 items (the limit is 1000000)"),
            std::string::npos);
}

TEST(JinjaBudget, OutputIsCapped) {
  jinja::Limits l;
  l.max_output_bytes = 10'000;
  EXPECT_NE(limited_error("{% for i in range(100000) %}0123456789{% endfor %}", l).find("output exceeds 10000 bytes"),
            std::string::npos);
}

TEST(JinjaBudget, RangeWithInt64Extremes) {
  // The span overflowed int64 and wrapped under the item cap before.
  EXPECT_NE(limited_error("{{ range(-9223372036854775807 - 1, 9223372036854775807) | length }}", {})
                .find("range too large"),
            std::string::npos);
  EXPECT_NE(limited_error("{{ range(9223372036854775807, -9223372036854775807 - 1, -1) | length }}", {})
                .find("range too large"),
            std::string::npos);
  EXPECT_NE(limited_error("{{ range(0, 9223372036854775807, 2) | length }}", {}).find("range too large"),
            std::string::npos);
  // Near the extremes, small ranges are exact and do not overflow on the last step.
  EXPECT_EQ(jinja::Template("{{ range(9223372036854775805, 9223372036854775807) | list }}").render({}),
            "[9223372036854775805, 9223372036854775806]");
  EXPECT_EQ(jinja::Template("{{ range(-9223372036854775807 - 1, -9223372036854775807 + 1) | list }}").render({}),
            "[-9223372036854775808, -9223372036854775807]");
  EXPECT_EQ(jinja::Template("{{ range(5, 0, -2) | list }}").render({}), "[5, 3, 1]");
}

TEST(JinjaBudget, NestedLoopsStopAtTheStepBudget) {
  jinja::Limits l;
  l.max_steps = 1'000'000;
  EXPECT_NE(limited_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", l)
                .find("exceeded its budget of 1000000 steps"),
            std::string::npos);
}

TEST(JinjaBudget, WallTimeAndCancellation) {
  // A render that would run for minutes within its step budget stops at its time budget.
  const std::string slow = "{% for i in range(1000000) %}{% set s = 'x' * 40000 %}{% endfor %}";
  jinja::Limits l;
  l.max_steps = int64_t{1} << 60;
  l.max_total_bytes = size_t{1} << 62;
  l.max_seconds = 0.2;
  EXPECT_NE(limited_error(slow, l).find("exceeded its time budget"), std::string::npos);
  // A flag set before (or during) the render stops it.
  std::atomic<bool> cancel{true};
  jinja::Limits c;
  c.cancel = &cancel;
  EXPECT_NE(limited_error("{{ 1 }}", c).find("template render cancelled"), std::string::npos);
  std::atomic<bool> later{false};
  c.cancel = &later;
  c.max_seconds = 0;
  c.max_steps = int64_t{1} << 60;
  c.max_total_bytes = size_t{1} << 62;
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    later = true;
  });
  EXPECT_NE(limited_error(slow + slow + slow, c).find("template render cancelled"), std::string::npos);
  setter.join();
}

TEST(JinjaBudget, ChatTemplatePassesLimits) {
  const text::ChatTemplate t("{% for m in messages %}{% for i in range(1000) %}{{ m.content }}{% endfor %}{% endfor %}");
  jinja::Limits l;
  l.max_steps = 5000;
  const ordered_json msgs = ordered_json::parse(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
    {"role": "user", "content": "c"}, {"role": "user", "content": "d"}, {"role": "user", "content": "e"},
    {"role": "user", "content": "f"}])");
  EXPECT_THROW(t.render(msgs, nullptr, false, nullptr, l), Error);
  EXPECT_EQ(t.render(ordered_json::array({msgs[0]}), nullptr, false, nullptr, l).size(), 1000u);
}

TEST(JinjaBudget, ManyTemplateKwargsAreLinear) {
  // chat_template_kwargs of 200000 keys: each was searched for among those before it (2e10 comparisons, tens of
  // seconds); now the context is built in one pass. The bound is generous: it is milliseconds.
  ordered_json kwargs = ordered_json::object();
  auto& items = kwargs.get_ref<ordered_json::object_t&>();  // appended directly: ordered_json's own insert is quadratic
  for (int i = 0; i < 200000; ++i) items.emplace_back(fmt::format("k{}", i), i);
  items.emplace_back("add_generation_prompt", "overridden");  // a key the context has: replaced, not duplicated
  const text::ChatTemplate t("{{ k199999 }} {{ k0 }} {{ add_generation_prompt }}");
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(t.render(ordered_json::array(), nullptr, true, kwargs), "199999 0 overridden");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

}  // namespace
}  // namespace kestrel::text
