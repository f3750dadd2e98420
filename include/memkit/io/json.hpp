// memkit/io/json.hpp — a small strict JSON reader and writer helpers, enough for file headers.
//
// memkit's headers depend on no JSON library. This reader accepts RFC 8259 JSON only: no comments, no
// trailing commas, no duplicate object keys, no leading zeros, no control characters in strings, valid
// \u escapes (surrogate pairs joined), well-formed UTF-8 only (no overlong forms, surrogates, stray
// continuation bytes or code points above U+10FFFF), nesting at most 64 deep. Numbers keep their text, so
// integers are read exactly (as int64) and floats are converted once (as double; a value beyond double's
// range is an error, not Inf). Errors say what was wrong and where. The writer helpers never produce
// invalid JSON: quote() refuses malformed UTF-8 and number() refuses NaN and Inf.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace json {

class value {
 public:
  enum class kind : std::uint8_t { null, boolean, number, string, array, object };

  value() = default;
  static value make_null() { return value(); }
  static value make_bool(bool b) {
    value v;
    v.kind_ = kind::boolean;
    v.boolean_ = b;
    return v;
  }
  static value make_number(std::string text) {
    value v;
    v.kind_ = kind::number;
    v.text_ = std::move(text);
    return v;
  }
  static value make_string(std::string text) {
    value v;
    v.kind_ = kind::string;
    v.text_ = std::move(text);
    return v;
  }
  static value make_array(std::vector<value> items) {
    value v;
    v.kind_ = kind::array;
    v.items_ = std::move(items);
    return v;
  }
  // Members in the order they appeared.
  static value make_object(std::vector<std::pair<std::string, value>> members) {
    value v;
    v.kind_ = kind::object;
    v.members_ = std::move(members);
    return v;
  }

  kind type() const noexcept { return kind_; }
  bool is_null() const noexcept { return kind_ == kind::null; }
  bool is_bool() const noexcept { return kind_ == kind::boolean; }
  bool is_number() const noexcept { return kind_ == kind::number; }
  bool is_string() const noexcept { return kind_ == kind::string; }
  bool is_array() const noexcept { return kind_ == kind::array; }
  bool is_object() const noexcept { return kind_ == kind::object; }

  bool as_bool() const { return expect(kind::boolean).boolean_; }
  const std::string& as_string() const { return expect(kind::string).text_; }
  const std::string& number_text() const { return expect(kind::number).text_; }
  // The number as an exact integer; throws for fractions, exponents or values outside int64.
  std::int64_t as_int() const {
    const std::string& text = number_text();
    require(text.find_first_of(".eE") == std::string::npos, "json: " + text + " is not an integer");
    errno = 0;
    char* end = nullptr;
    const long long parsed = std::strtoll(text.c_str(), &end, 10);
    require(errno == 0 && end == text.c_str() + text.size(), "json: integer " + text + " is out of range");
    return parsed;
  }
  // The number as a double; throws when its magnitude is beyond double's range (strtod would give Inf).
  double as_double() const {
    const std::string& text = number_text();
    const double parsed = std::strtod(text.c_str(), nullptr);
    require(std::isfinite(parsed), "json: number " + text + " is outside the range of a double");
    return parsed;
  }
  const std::vector<value>& as_array() const { return expect(kind::array).items_; }
  const std::vector<std::pair<std::string, value>>& as_object() const { return expect(kind::object).members_; }

  // Member `key` of an object, or nullptr.
  const value* find(std::string_view key) const {
    for (const auto& [name, member] : as_object())
      if (name == key) return &member;
    return nullptr;
  }
  const value& at(std::string_view key) const {
    const value* member = find(key);
    require(member != nullptr, "json: missing key \"" + std::string(key) + "\"");
    return *member;
  }

  static const char* kind_name(kind k) noexcept {
    switch (k) {
      case kind::null: return "null";
      case kind::boolean: return "a boolean";
      case kind::number: return "a number";
      case kind::string: return "a string";
      case kind::array: return "an array";
      case kind::object: return "an object";
    }
    return "unknown";
  }

 private:
  const value& expect(kind k) const {
    require(kind_ == k, std::string("json: expected ") + kind_name(k) + ", found " + kind_name(kind_));
    return *this;
  }

  kind kind_ = kind::null;
  bool boolean_ = false;
  std::string text_;
  std::vector<value> items_;
  std::vector<std::pair<std::string, value>> members_;
};

namespace detail {

// Length of the well-formed UTF-8 sequence starting at text[pos] (Unicode's table 3-7), or 0 when the
// bytes there are not one: a stray continuation byte, an overlong form, a surrogate, a code point above
// U+10FFFF or a truncated sequence.
inline std::size_t utf8_sequence_length(std::string_view text, std::size_t pos) noexcept {
  auto byte = [&](std::size_t i) { return pos + i < text.size() ? static_cast<unsigned char>(text[pos + i]) : 0u; };
  auto continuation = [](unsigned b, unsigned low = 0x80, unsigned high = 0xBF) { return b >= low && b <= high; };
  const unsigned b0 = byte(0);
  if (b0 < 0x80) return pos < text.size() ? 1 : 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) return continuation(byte(1)) ? 2 : 0;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    const unsigned low = b0 == 0xE0 ? 0xA0 : 0x80;   // E0 80..9F would be overlong
    const unsigned high = b0 == 0xED ? 0x9F : 0xBF;  // ED A0..BF would be a surrogate
    return continuation(byte(1), low, high) && continuation(byte(2)) ? 3 : 0;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    const unsigned low = b0 == 0xF0 ? 0x90 : 0x80;   // F0 80..8F would be overlong
    const unsigned high = b0 == 0xF4 ? 0x8F : 0xBF;  // F4 90.. would be above U+10FFFF
    return continuation(byte(1), low, high) && continuation(byte(2)) && continuation(byte(3)) ? 4 : 0;
  }
  return 0;  // 80..C1 (continuation or overlong lead) and F5..FF never start a character
}

// Byte offset of the first malformed UTF-8 sequence in `text`, or npos.
inline std::size_t first_invalid_utf8(std::string_view text) noexcept {
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t length = utf8_sequence_length(text, pos);
    if (length == 0) return pos;
    pos += length;
  }
  return std::string_view::npos;
}

class parser {
 public:
  parser(std::string_view text, std::string_view what) : text_(text), what_(what) {}

  value parse_document() {
    skip_space();
    value result = parse_value(0);
    skip_space();
    if (pos_ != text_.size()) fail("unexpected text after the JSON value");
    return result;
  }

 private:
  [[noreturn]] void fail(const std::string& message) const {
    throw error(std::string(what_) + ": invalid JSON at byte " + std::to_string(pos_) + ": " + message);
  }
  bool at_end() const noexcept { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }
  void skip_space() {
    while (!at_end() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }
  void expect_literal(std::string_view literal) {
    if (text_.substr(pos_, literal.size()) != literal) fail("expected '" + std::string(literal) + "'");
    pos_ += literal.size();
  }

  value parse_value(int depth) {
    if (depth > 64) fail("nesting deeper than 64 levels");
    if (at_end()) fail("unexpected end of input");
    switch (peek()) {
      case '{': return parse_object(depth);
      case '[': return parse_array(depth);
      case '"': return value::make_string(parse_string());
      case 't': expect_literal("true"); return value::make_bool(true);
      case 'f': expect_literal("false"); return value::make_bool(false);
      case 'n': expect_literal("null"); return value::make_null();
      default: return parse_number();
    }
  }

  value parse_object(int depth) {
    ++pos_;  // '{'
    std::vector<std::pair<std::string, value>> members;
    skip_space();
    if (peek() == '}') {
      ++pos_;
      return value::make_object(std::move(members));
    }
    std::map<std::string, bool> seen;
    for (;;) {
      skip_space();
      if (peek() != '"') fail("expected a string key");
      std::string key = parse_string();
      if (!seen.emplace(key, true).second) fail("duplicate key \"" + key + "\"");
      skip_space();
      if (peek() != ':') fail("expected ':' after a key");
      ++pos_;
      skip_space();
      members.emplace_back(std::move(key), parse_value(depth + 1));
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return value::make_object(std::move(members));
      }
      fail("expected ',' or '}' in an object");
    }
  }

  value parse_array(int depth) {
    ++pos_;  // '['
    std::vector<value> items;
    skip_space();
    if (peek() == ']') {
      ++pos_;
      return value::make_array(std::move(items));
    }
    for (;;) {
      skip_space();
      items.push_back(parse_value(depth + 1));
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return value::make_array(std::move(items));
      }
      fail("expected ',' or ']' in an array");
    }
  }

  value parse_number() {
    const std::size_t begin = pos_;
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
    } else if (peek() >= '1' && peek() <= '9') {
      while (peek() >= '0' && peek() <= '9') ++pos_;
    } else {
      fail("expected a value");
    }
    if (peek() == '.') {
      ++pos_;
      if (!(peek() >= '0' && peek() <= '9')) fail("expected a digit after '.'");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    if (peek() == 'e' || peek() == 'E') {
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (!(peek() >= '0' && peek() <= '9')) fail("expected a digit in the exponent");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    if (peek() >= '0' && peek() <= '9') fail("leading zeros are not allowed");
    return value::make_number(std::string(text_.substr(begin, pos_ - begin)));
  }

  unsigned parse_hex4() {
    if (pos_ + 4 > text_.size()) fail("truncated \\u escape");
    unsigned code = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_++];
      code <<= 4;
      if (c >= '0' && c <= '9') code |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') code |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') code |= static_cast<unsigned>(c - 'A' + 10);
      else fail("bad hex digit in a \\u escape");
    }
    return code;
  }

  static void append_utf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (static_cast<unsigned char>(c) >= 0x80) {
        --pos_;
        const std::size_t length = utf8_sequence_length(text_, pos_);
        if (length == 0) fail("invalid UTF-8 in a string");
        out.append(text_.substr(pos_, length));
        pos_ += length;
        continue;
      }
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_end()) fail("unterminated escape");
      const char escape = text_[pos_++];
      switch (escape) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned code = parse_hex4();
          if (code >= 0xD800 && code <= 0xDBFF) {
            if (text_.substr(pos_, 2) != "\\u") fail("unpaired high surrogate");
            pos_ += 2;
            const unsigned low = parse_hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("bad low surrogate");
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          } else if (code >= 0xDC00 && code <= 0xDFFF) {
            fail("unpaired low surrogate");
          }
          append_utf8(out, code);
          break;
        }
        default: fail(std::string("unknown escape '\\") + escape + "'");
      }
    }
  }

  std::string_view text_;
  std::string_view what_;
  std::size_t pos_ = 0;
};

}  // namespace detail

// Parses one JSON document; `what` names the input in error messages ("safetensors header", ...).
inline value parse(std::string_view text, std::string_view what = "json") {
  return detail::parser(text, what).parse_document();
}

// A JSON string literal for `text` (quotes and escapes added); throws when `text` is not well-formed UTF-8.
inline std::string quote(std::string_view text) {
  const std::size_t bad = detail::first_invalid_utf8(text);
  require(bad == std::string_view::npos,
          "json::quote: text is not valid UTF-8 (byte " + std::to_string(bad) + "); JSON strings must be UTF-8");
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// The shortest decimal text that reads back as the same double (as Python's repr writes floats). JSON has
// no NaN or Inf: they throw rather than produce a document no reader accepts.
inline std::string number(double v) {
  require(std::isfinite(v), "json::number: " + std::string(std::isnan(v) ? "NaN" : "Inf") +
                                " cannot be written as JSON");
  char text[40];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, v);
    if (std::strtod(text, nullptr) == v) break;
  }
  return text;
}

}  // namespace json

MEMKIT_NAMESPACE_END
