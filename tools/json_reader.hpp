// A small JSON reader for memkit-budget: enough for Hugging Face config.json files (objects, arrays,
// strings with escapes, numbers, literals). Errors throw memkit::error with the byte offset.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <memkit/config.hpp>

namespace memkit_tools {

struct json_value {
  enum class kind { null, boolean, number, string, array, object };
  kind type = kind::null;
  bool boolean = false;
  double number = 0;
  std::string text;  // string value, or a number's source text
  std::vector<json_value> items;
  std::map<std::string, json_value, std::less<>> members;

  const json_value* find(std::string_view key) const {
    if (type != kind::object) return nullptr;
    auto found = members.find(key);
    return found == members.end() ? nullptr : &found->second;
  }
};

class json_parser {
 public:
  explicit json_parser(std::string_view text) : text_(text) {}

  json_value parse_document() {
    json_value value = parse_value(0);
    skip_space();
    if (position_ != text_.size()) fail("unexpected text after the JSON value");
    return value;
  }

 private:
  std::string_view text_;
  std::size_t position_ = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw memkit::error("invalid JSON at byte " + std::to_string(position_) + ": " + what);
  }
  void skip_space() {
    while (position_ < text_.size() &&
           (text_[position_] == ' ' || text_[position_] == '\n' || text_[position_] == '\r' || text_[position_] == '\t'))
      ++position_;
  }
  char peek() {
    skip_space();
    if (position_ >= text_.size()) fail("unexpected end of input");
    return text_[position_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++position_;
  }
  bool consume_literal(std::string_view word) {
    if (text_.substr(position_, word.size()) != word) return false;
    position_ += word.size();
    return true;
  }

  json_value parse_value(int depth) {
    if (depth > 64) fail("nesting too deep");
    json_value value;
    const char c = peek();
    if (c == '{') {
      value.type = json_value::kind::object;
      ++position_;
      if (peek() == '}') {
        ++position_;
        return value;
      }
      while (true) {
        if (peek() != '"') fail("expected a string key");
        std::string key = parse_string();
        expect(':');
        value.members[key] = parse_value(depth + 1);
        if (peek() == ',') {
          ++position_;
          continue;
        }
        expect('}');
        return value;
      }
    }
    if (c == '[') {
      value.type = json_value::kind::array;
      ++position_;
      if (peek() == ']') {
        ++position_;
        return value;
      }
      while (true) {
        value.items.push_back(parse_value(depth + 1));
        if (peek() == ',') {
          ++position_;
          continue;
        }
        expect(']');
        return value;
      }
    }
    if (c == '"') {
      value.type = json_value::kind::string;
      value.text = parse_string();
      return value;
    }
    if (consume_literal("true")) {
      value.type = json_value::kind::boolean;
      value.boolean = true;
      return value;
    }
    if (consume_literal("false")) {
      value.type = json_value::kind::boolean;
      return value;
    }
    if (consume_literal("null")) return value;
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
    fail(std::string("unexpected character '") + c + "'");
  }

  json_value parse_number() {
    const std::size_t start = position_;
    if (text_[position_] == '-') ++position_;
    auto digits = [&] {
      const std::size_t from = position_;
      while (position_ < text_.size() && text_[position_] >= '0' && text_[position_] <= '9') ++position_;
      if (position_ == from) fail("malformed number");
    };
    digits();
    if (position_ < text_.size() && text_[position_] == '.') {
      ++position_;
      digits();
    }
    if (position_ < text_.size() && (text_[position_] == 'e' || text_[position_] == 'E')) {
      ++position_;
      if (position_ < text_.size() && (text_[position_] == '+' || text_[position_] == '-')) ++position_;
      digits();
    }
    json_value value;
    value.type = json_value::kind::number;
    value.text = std::string(text_.substr(start, position_ - start));
    value.number = std::stod(value.text);
    return value;
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    while (true) {
      if (position_ >= text_.size()) fail("unterminated string");
      const char c = text_[position_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (position_ >= text_.size()) fail("unterminated escape");
      const char escape = text_[position_++];
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
          if (position_ + 4 > text_.size()) fail("short \\u escape");
          const unsigned code = static_cast<unsigned>(std::stoul(std::string(text_.substr(position_, 4)), nullptr, 16));
          position_ += 4;
          // Config files only need the code point kept readable; encode it as UTF-8 (BMP only).
          if (code < 0x80) {
            out += static_cast<char>(code);
          } else if (code < 0x800) {
            out += static_cast<char>(0xC0 | (code >> 6));
            out += static_cast<char>(0x80 | (code & 0x3F));
          } else {
            out += static_cast<char>(0xE0 | (code >> 12));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (code & 0x3F));
          }
          break;
        }
        default: fail("unknown escape");
      }
    }
  }
};

inline json_value parse_json(std::string_view text) { return json_parser(text).parse_document(); }

}  // namespace memkit_tools
