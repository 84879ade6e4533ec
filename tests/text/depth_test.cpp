// Nesting bounds of the text module: template data, template source and tokenizer.json nested 100k deep give a
// kestrel::Error naming the bound instead of overflowing the stack. Every case runs on a thread with an 8 MB
// stack (Linux's default main-thread stack), so a recursion that escaped its bound would crash the test.
#include <pthread.h>

#include <exception>
#include <functional>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/jinja.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

using nlohmann::ordered_json;

constexpr int kDeep = 100'000;

void run_on_8mb_stack(const std::function<void()>& fn) {
  struct Job {
    const std::function<void()>* fn;
    std::exception_ptr error;
  } job{&fn, nullptr};
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, size_t{8} << 20), 0);
  pthread_t thread;
  const auto body = [](void* p) -> void* {
    auto* j = static_cast<Job*>(p);
    try {
      (*j->fn)();
    } catch (...) {
      j->error = std::current_exception();
    }
    return nullptr;
  };
  ASSERT_EQ(pthread_create(&thread, &attr, body, &job), 0);
  pthread_join(thread, nullptr);
  pthread_attr_destroy(&attr);
  if (job.error) std::rethrow_exception(job.error);
}

// The kestrel::Error message `fn` throws on an 8 MB stack, or "(no error)".
std::string error_of(const std::function<void()>& fn) {
  std::string message = "(no error)";
  run_on_8mb_stack([&] {
    try {
      fn();
    } catch (const Error& e) {
      message = e.what();
    }
  });
  return message;
}

bool mentions(const std::string& message, const std::string& part) { return message.find(part) != std::string::npos; }

std::string repeat(const std::string& s, int n) {
  std::string out;
  out.reserve(s.size() * static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

// `levels` arrays nested around `inner` (0 levels: `inner` itself). Parsed, never copied: nlohmann's parser and
// destructor are iterative, its copy and dump are not.
std::string nested_arrays(int levels, const std::string& inner = "1") {
  return repeat("[", levels) + inner + repeat("]", levels);
}

std::string render(const std::string& src, const ordered_json& context) {
  return ChatTemplate(src).render_context(context);
}

TEST(Depth, DeepRequestJsonIsAnError) {
  const std::string deep_dict_text = repeat("{\"a\":", kDeep) + "1" + repeat("}", kDeep);
  const ordered_json deep_list = ordered_json::parse(nested_arrays(kDeep));
  const ordered_json deep_dict = ordered_json::parse(deep_dict_text);
  const ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  const ChatTemplate chat("{{ messages | tojson }}{{ tools | tojson }}");
  for (const ordered_json* tools : {&deep_list, &deep_dict}) {
    const std::string e = error_of([&] { chat.render(messages, *tools, true); });
    EXPECT_TRUE(mentions(e, "nesting deeper than 256")) << e;
  }
  const ordered_json deep_message = ordered_json::parse("[{\"role\": \"user\", \"content\": " + deep_dict_text + "}]");
  for (const ordered_json* deep : {&deep_list, &deep_message}) {
    const std::string as_messages = error_of([&] { chat.render(*deep, nullptr, true); });
    EXPECT_TRUE(mentions(as_messages, "nesting deeper than 256")) << as_messages;
  }
}

TEST(Depth, ValueBoundIsExactly256Levels) {
  // 256 nested lists convert, print and serialise; each walk gives back the source text (single-element lists
  // have no separators, and str() of a list is its repr).
  run_on_8mb_stack([] {
    const std::string at_bound = nested_arrays(256);
    const ordered_json ctx = {{"x", ordered_json::parse(at_bound)}};
    EXPECT_EQ(render("{{ x }}", ctx), at_bound);
    EXPECT_EQ(render("{{ x | tojson }}", ctx), at_bound);
    EXPECT_EQ(render("{{ x == x }}", ctx), "True");
  });
  const ordered_json over = {{"x", ordered_json::parse(nested_arrays(257))}};
  const std::string e = error_of([&] { render("{{ x }}", over); });
  EXPECT_TRUE(mentions(e, "template data: lists/dicts nesting deeper than 256")) << e;
}

TEST(Depth, DeepValuesBuiltByATemplateAreBoundedWhenWalked) {
  // A loop wraps a list 100k times: walking it is an Error, destroying it must not recurse.
  const std::string build = "{% set ns = namespace(x=0) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}"
                            "{% endfor %}";
  std::string out;
  run_on_8mb_stack([&] { out = render(build + "{{ ns.x | length }}", ordered_json::object()); });
  EXPECT_EQ(out, "1");
  for (const char* walk : {"{{ ns.x }}", "{{ ns.x | tojson }}", "{{ ns.x == ns.x }}", "{{ ns.x < ns.x }}"}) {
    const std::string e = error_of([&] { render(build + walk, ordered_json::object()); });
    EXPECT_TRUE(mentions(e, "nesting deeper than 256")) << walk << ": " << e;
  }
}

TEST(Depth, DeepTemplateSourceIsAnError) {
  const std::string ex = "expressions nesting deeper than 128";
  const struct {
    std::string src, want;
  } cases[] = {
      {"{{ " + repeat("(", kDeep) + "1" + repeat(")", kDeep) + " }}", ex},
      {"{{ " + nested_arrays(kDeep) + " }}", ex},
      {"{{ " + repeat("{'a': ", kDeep) + "1" + repeat("}", kDeep) + " }}", ex},
      {"{{ " + repeat("not ", kDeep) + "x }}", ex},
      {"{{ " + repeat("- ", kDeep) + "1 }}", ex},
      {"{{ 1" + repeat(" + 1", kDeep) + " }}", ex},
      {"{{ x" + repeat(".a", kDeep) + " }}", ex},
      {"{{ x" + repeat("[0]", kDeep) + " }}", ex},
      {"{{ x" + repeat("|string", kDeep) + " }}", ex},
      {"{{ x" + repeat(" or x", kDeep) + " }}", ex},
      {"{{ x" + repeat(" if x else x", kDeep) + " }}", ex},
      {repeat("{% if true %}", kDeep) + repeat("{% endif %}", kDeep), "blocks nesting deeper than 128"},
      {repeat("{% for i in [1] %}", kDeep) + repeat("{% endfor %}", kDeep), "blocks nesting deeper than 128"},
  };
  for (const auto& c : cases) {
    const std::string e = error_of([&] { ChatTemplate t(c.src); });
    EXPECT_TRUE(mentions(e, c.want)) << c.src.substr(0, 40) << ": " << e;
  }
}

TEST(Depth, TemplateNestingUpToTheBoundRenders) {
  run_on_8mb_stack([] {
    // 128 nested blocks; an expression 101 levels high (parentheses around a 100-term left-deep sum).
    EXPECT_EQ(render(repeat("{% if true %}", 128) + "in" + repeat("{% endif %}", 128), ordered_json::object()), "in");
    const std::string sum = "{{ " + repeat("(", 27) + "0" + repeat(" + 1", 100) + repeat(")", 27) + " }}";
    EXPECT_EQ(render(sum, ordered_json::object()), "100");
  });
  const std::string e =
      error_of([] { ChatTemplate t(repeat("{% if true %}", 129) + repeat("{% endif %}", 129)); });
  EXPECT_TRUE(mentions(e, "blocks nesting deeper than 128")) << e;
}

TEST(Depth, RecursiveMacroAtFullNestingStaysOnTheStack) {
  // The worst a template can do: a macro recursing without end, each call inside 127 blocks (128 with the macro)
  // and a 128-level expression (a filter chain over the call). It must stop with an Error well inside 8 MB.
  const std::string call = "m(n + 1)" + repeat("|string", 125);
  const std::string src = "{% macro m(n) %}" + repeat("{% if true %}", 127) + "{{ " + call + " }}" +
                          repeat("{% endif %}", 127) + "{% endmacro %}{{ m(0) }}";
  const std::string e = error_of([&] { render(src, ordered_json::object()); });
  EXPECT_TRUE(mentions(e, "macro recursion deeper than 64")) << e;
}

// A byte-level BPE tokenizer.json (one token per byte, as GPT-2 maps bytes to characters, no merges) with
// `field` set to the JSON text `value`.
std::string tokenizer_json(const std::string& field, const std::string& value, const std::string& merges = "[]") {
  ordered_json vocab = ordered_json::object();
  int next_free = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    std::string ch;
    utf8_append(ch, static_cast<char32_t>(printable ? b : next_free++));
    vocab[ch] = b;
  }
  std::string j = R"({"model": {"type": "BPE", "vocab": )" + vocab.dump() + R"(, "merges": )" + merges +
                  R"(}, "decoder": {"type": "ByteLevel"}, "pre_tokenizer": {"type": "ByteLevel",
                     "add_prefix_space": false, "use_regex": true})";
  return j + ", \"" + field + "\": " + value + "}";
}

TEST(Depth, DeepTokenizerJsonIsAnError) {
  const auto sequence = [](const std::string& list_key, const std::string& leaf, int levels) {
    return repeat(R"({"type": "Sequence", ")" + list_key + R"(": [)", levels) + leaf + repeat("]}", levels);
  };
  const struct {
    std::string field, list_key, leaf, what;
  } cases[] = {
      {"normalizer", "normalizers", R"({"type": "Strip"})", "normalizer"},
      {"post_processor", "processors", R"({"type": "ByteLevel"})", "post-processor"},
      {"decoder", "decoders", R"({"type": "ByteLevel"})", "decoder"},
      {"pre_tokenizer", "pretokenizers", R"({"type": "ByteLevel"})", "pre-tokenizer"},
  };
  for (const auto& c : cases) {
    // A later duplicate key replaces the base value in nlohmann's parser.
    const std::string ok = tokenizer_json(c.field, sequence(c.list_key, c.leaf, 32));
    EXPECT_EQ(error_of([&] { Tokenizer::from_hf_json(ok); }), "(no error)") << c.field;
    const std::string deep = tokenizer_json(c.field, sequence(c.list_key, c.leaf, kDeep));
    const std::string e = error_of([&] { Tokenizer::from_hf_json(deep); });
    EXPECT_TRUE(mentions(e, c.what + " Sequence nesting deeper than 32")) << e;
  }
  // A malformed merge is named by its type, not printed (printing would recurse through it).
  const std::string bad_merge = tokenizer_json("normalizer", "null", "[" + nested_arrays(kDeep) + "]");
  const std::string e = error_of([&] { Tokenizer::from_hf_json(bad_merge); });
  EXPECT_TRUE(mentions(e, "a merge must be")) << e;
}

}  // namespace
}  // namespace kestrel::text
