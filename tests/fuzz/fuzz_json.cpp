// Fuzz target: memkit::json::parse on arbitrary bytes. Invariants for every document it accepts: each
// string is well-formed UTF-8, json::quote writes it as JSON that parses back to the same string, and
// numbers convert or throw memkit::error.
#include <memkit/io/json.hpp>

#include <string>
#include <string_view>

#include "fuzz_target.hpp"

namespace {
void check_string(const std::string& text) {
  MEMKIT_FUZZ_CHECK(memkit::json::detail::first_invalid_utf8(text) == std::string_view::npos);
  const memkit::json::value again = memkit::json::parse(memkit::json::quote(text));
  MEMKIT_FUZZ_CHECK(again.is_string() && again.as_string() == text);
}

void walk(const memkit::json::value& v) {
  using kind = memkit::json::value::kind;
  switch (v.type()) {
    case kind::string: check_string(v.as_string()); break;
    case kind::number:
      try {
        (void)v.as_int();
      } catch (const memkit::error&) {
      }
      try {
        const double d = v.as_double();
        // The writer's text for it reads back as the same number.
        MEMKIT_FUZZ_CHECK(memkit::json::parse(memkit::json::number(d)).as_double() == d);
      } catch (const memkit::error&) {
      }
      break;
    case kind::array:
      for (const auto& item : v.as_array()) walk(item);
      break;
    case kind::object:
      for (const auto& [key, member] : v.as_object()) {
        check_string(key);
        walk(member);
      }
      break;
    default: break;
  }
}
}  // namespace

MEMKIT_FUZZ_TARGET(json) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  memkit::json::value document;
  try {
    document = memkit::json::parse(text, "fuzz input");
  } catch (const memkit::error&) {
    return 0;
  }
  walk(document);
  return 0;
}
