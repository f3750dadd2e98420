// memkit/peft/module_pattern.hpp — the regular expressions of PEFT's adapter_config.json, matched without
// backtracking.
//
// adapter_config.json may give target_modules / exclude_modules as a Python regular expression (matched
// with re.fullmatch against each module path), and rank_pattern / alpha_pattern keys that PEFT wraps as
// (.*\.)?(KEY)$. Those strings and the module paths come from the file, so they are untrusted: std::regex
// backtracks (a pattern like (a+)+b never finishes on a crafted path) and recurses per character (a 200 KB
// path overflowed the stack). module_pattern compiles the pattern into a Thompson NFA and simulates it over
// the path one character at a time, keeping a set of states: time O(pattern x path), memory O(pattern), no
// recursion on the input.
//
// The subset accepted (what PEFT configs use), anything else a memkit::error naming the pattern:
//   literals; \. \\ and any escaped punctuation; \d \D \w \W \s \S; .  (any character);
//   [abc] [a-z] [^...] (with those escapes inside); groups (...) and (?:...); alternation |;
//   quantifiers * + ? {n} {n,} {n,m} (n, m <= 100), each greedy or lazy (the ? suffix matches the same
//   set of strings, which is all a full match asks); ^ at the very start and $ at the very end (no-ops
//   under a full match). Not accepted: backreferences, lookaround, possessive quantifiers, inline flags,
//   named groups, \b and other anchors inside the pattern.
// Limits: patterns of at most 4,096 characters compiling to at most 65,536 states; paths of at most 4,096
// characters (a module path is a few dozen).
#pragma once

#include <bitset>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace peft {

inline constexpr std::size_t max_pattern_length = 4096;
inline constexpr std::size_t max_matched_length = 4096;

class module_pattern {
 public:
  module_pattern() = default;
  // Compiles `pattern`; `what` names it in errors (e.g. "adapter_config.json: target_modules").
  module_pattern(std::string_view pattern, const std::string& what) : text_(pattern) {
    if (pattern.size() > max_pattern_length)
      throw error(what + ": the pattern is " + std::to_string(pattern.size()) + " characters long, more than " +
                  std::to_string(max_pattern_length));
    std::string_view body = pattern;
    if (!body.empty() && body.front() == '^') body.remove_prefix(1);
    if (!body.empty() && body.back() == '$' && !escaped_at_end(body)) body.remove_suffix(1);
    compiler c{body, what + ": pattern \"" + std::string(pattern) + "\"", states_};
    const fragment f = c.parse_alternation();
    if (c.at != body.size()) c.fail("unexpected ')'");
    const int match = c.add({node::match, {}, -1, -1});
    c.patch(f, match);
    start_ = f.start;
  }

  const std::string& text() const noexcept { return text_; }
  bool empty() const noexcept { return states_.empty(); }

  // Whether the whole of `input` matches (Python's re.fullmatch). Throws for inputs above
  // max_matched_length (`what` names the input).
  bool full_match(std::string_view input, const std::string& what = "module path") const {
    if (states_.empty()) return false;
    if (input.size() > max_matched_length)
      throw error(what + " of " + std::to_string(input.size()) + " characters is longer than the " +
                  std::to_string(max_matched_length) + " a pattern is matched against");
    std::vector<int> current, next;
    std::vector<std::uint32_t> mark(states_.size(), 0);
    std::uint32_t generation = 1;
    add_state(current, mark, generation, start_);
    for (const char ch : input) {
      ++generation;
      next.clear();
      const auto byte = static_cast<unsigned char>(ch);
      for (const int s : current)
        if (states_[static_cast<std::size_t>(s)].kind == node::set && states_[static_cast<std::size_t>(s)].chars[byte])
          add_state(next, mark, generation, states_[static_cast<std::size_t>(s)].out);
      current.swap(next);
      if (current.empty()) return false;
    }
    for (const int s : current)
      if (states_[static_cast<std::size_t>(s)].kind == node::match) return true;
    return false;
  }

 private:
  struct node {
    enum kind_t : std::uint8_t { set, split, match } kind;
    std::bitset<256> chars;
    int out, out2;
  };
  struct fragment {
    int start = -1;
    std::vector<std::pair<int, int>> holes;  // (state, 0 for out / 1 for out2) still unconnected
  };

  static bool escaped_at_end(std::string_view s) {
    std::size_t backslashes = 0;
    for (std::size_t i = s.size() - 1; i > 0 && s[i - 1] == '\\'; --i) ++backslashes;
    return backslashes % 2 == 1;
  }

  // Follows split states (epsilon moves) from `s`, adding each state once per generation.
  void add_state(std::vector<int>& list, std::vector<std::uint32_t>& mark, std::uint32_t generation, int s) const {
    std::vector<int> stack{s};
    while (!stack.empty()) {
      const int t = stack.back();
      stack.pop_back();
      if (t < 0 || mark[static_cast<std::size_t>(t)] == generation) continue;
      mark[static_cast<std::size_t>(t)] = generation;
      const node& n = states_[static_cast<std::size_t>(t)];
      if (n.kind == node::split) {
        stack.push_back(n.out2);
        stack.push_back(n.out);
      } else {
        list.push_back(t);
      }
    }
  }

  struct compiler {
    std::string_view p;
    std::string what;
    std::vector<node>& states;
    std::size_t at = 0;
    int depth = 0;

    [[noreturn]] void fail(const std::string& problem) const {
      throw error(what + ": " + problem + " at character " + std::to_string(at) +
                  " (memkit accepts literals, escapes, ., [classes], groups, |, * + ? {n,m}; "
                  "docs/peft_interop.md lists the subset)");
    }
    int add(node n) {
      if (states.size() >= 65536) fail("the pattern compiles to more than 65,536 states");
      states.push_back(n);
      return static_cast<int>(states.size()) - 1;
    }
    void patch(const fragment& f, int target) {
      for (const auto& [s, which] : f.holes) (which == 0 ? states[static_cast<std::size_t>(s)].out : states[static_cast<std::size_t>(s)].out2) = target;
    }
    bool done() const { return at >= p.size(); }

    fragment parse_alternation() {
      fragment left = parse_sequence();
      while (!done() && p[at] == '|') {
        ++at;
        fragment right = parse_sequence();
        const int split = add({node::split, {}, left.start, right.start});
        fragment joined{split, left.holes};
        joined.holes.insert(joined.holes.end(), right.holes.begin(), right.holes.end());
        left = std::move(joined);
      }
      return left;
    }
    // A sequence of quantified atoms; an empty sequence is an epsilon (a split whose both edges dangle).
    fragment parse_sequence() {
      bool any = false;
      fragment result{};
      while (!done() && p[at] != '|' && p[at] != ')') {
        fragment next = parse_quantified();
        if (!any) {
          result = std::move(next);
          any = true;
        } else {
          patch(result, next.start);
          result.holes = std::move(next.holes);
        }
      }
      if (!any) {
        const int empty = add({node::split, {}, -1, -1});
        return {empty, {{empty, 0}}};  // out2 stays -1: no edge
      }
      return result;
    }
    // Parses one atom and returns where it starts in the pattern, so a bounded repeat can copy it.
    fragment parse_quantified() {
      const std::size_t atom_begin = at;
      fragment atom = parse_atom();
      const std::size_t atom_end = at;
      if (done()) return atom;
      const char q = p[at];
      if (q == '*' || q == '+' || q == '?') {
        ++at;
        if (!done() && p[at] == '?') ++at;  // lazy: the same language under a full match
        if (!done() && (p[at] == '+' || p[at] == '*' || p[at] == '?' || p[at] == '{')) fail("a quantifier after a quantifier");
        if (q == '*') return star(atom);
        if (q == '+') {
          fragment loop = star(copy_atom(atom_begin, atom_end));
          patch(atom, loop.start);
          atom.holes = std::move(loop.holes);
          return atom;
        }
        const int split = add({node::split, {}, atom.start, -1});
        fragment f{split, atom.holes};
        f.holes.push_back({split, 1});
        return f;
      }
      if (q != '{') return atom;
      // {n}, {n,}, {n,m}
      const std::size_t brace = at;
      ++at;
      auto number = [&]() {
        std::size_t value = 0, digits = 0;
        while (!done() && p[at] >= '0' && p[at] <= '9') {
          value = value * 10 + static_cast<std::size_t>(p[at] - '0');
          ++at;
          if (++digits > 3) fail("a repeat count above 100");
        }
        return digits == 0 ? std::size_t(-1) : value;
      };
      const std::size_t low = number();
      std::size_t high = low;
      bool unbounded = false;
      if (!done() && p[at] == ',') {
        ++at;
        high = number();
        if (high == std::size_t(-1)) unbounded = true;
      }
      if (done() || p[at] != '}' || low == std::size_t(-1)) {
        at = brace;
        fail("a '{' that is not a repeat {n}, {n,} or {n,m}");
      }
      ++at;
      if (!done() && p[at] == '?') ++at;
      if (low > 100 || (!unbounded && (high > 100 || high < low))) {
        at = brace;
        fail("a repeat {n,m} needs n <= m <= 100");
      }
      // atom (copies) low times, then (high - low) optional copies or a star.
      fragment result = atom;
      bool have = low > 0;
      if (low == 0) result = {};
      for (std::size_t i = 1; i < low; ++i) {
        fragment next = copy_atom(atom_begin, atom_end);
        patch(result, next.start);
        result.holes = std::move(next.holes);
      }
      auto append = [&](fragment next) {
        if (!have) {
          result = std::move(next);
          have = true;
          return;
        }
        patch(result, next.start);
        result.holes = std::move(next.holes);
      };
      if (unbounded) {
        append(star(low > 0 ? copy_atom(atom_begin, atom_end) : atom));
      } else {
        for (std::size_t i = low; i < high; ++i) {
          fragment optional_copy = (i == 0 && low == 0) ? atom : copy_atom(atom_begin, atom_end);
          const int split = add({node::split, {}, optional_copy.start, -1});
          fragment f{split, optional_copy.holes};
          f.holes.push_back({split, 1});
          append(std::move(f));
        }
      }
      if (!have) {  // {0} or {0,0}: matches the empty string
        const int empty = add({node::split, {}, -1, -1});
        return {empty, {{empty, 0}}};
      }
      return result;
    }
    fragment star(fragment atom) {
      const int split = add({node::split, {}, atom.start, -1});
      patch(atom, split);
      return {split, {{split, 1}}};
    }
    // A fresh copy of the atom spelled p[begin, end) (compiled again: states are not shared).
    fragment copy_atom(std::size_t begin, std::size_t end) {
      const std::size_t saved = at;
      at = begin;
      fragment f = parse_atom();
      if (at != end) fail("internal: a repeated atom compiled differently");
      at = saved;
      return f;
    }
    fragment single(const std::bitset<256>& chars) {
      const int s = add({node::set, chars, -1, -1});
      return {s, {{s, 0}}};
    }
    fragment parse_atom() {
      const char c = p[at];
      if (c == '(') {
        if (++depth > 64) fail("groups nested deeper than 64");
        ++at;
        if (!done() && p[at] == '?') {
          if (at + 1 < p.size() && p[at + 1] == ':') at += 2;
          else fail("a group extension (?...) other than (?:...)");
        }
        fragment inner = parse_alternation();
        if (done() || p[at] != ')') fail("a '(' without its ')'");
        ++at;
        --depth;
        return inner;
      }
      if (c == '[') return single(parse_class());
      if (c == '.') {
        ++at;
        std::bitset<256> all;
        all.set();
        all.reset(static_cast<unsigned char>('\n'));  // Python's . does not match a newline
        return single(all);
      }
      if (c == '\\') return single(parse_escape(false));
      if (c == '*' || c == '+' || c == '?' || c == '{') fail("a quantifier with nothing to repeat");
      if (c == '^' || c == '$') fail("an anchor inside the pattern");
      ++at;
      std::bitset<256> one;
      one.set(static_cast<unsigned char>(c));
      return single(one);
    }
    std::bitset<256> parse_escape(bool in_class) {
      ++at;  // the backslash
      if (done()) fail("a trailing backslash");
      const char e = p[at++];
      std::bitset<256> s;
      auto range = [&](char a, char b) {
        for (int x = static_cast<unsigned char>(a); x <= static_cast<unsigned char>(b); ++x) s.set(static_cast<std::size_t>(x));
      };
      switch (e) {
        case 'd': range('0', '9'); return s;
        case 'D': range('0', '9'); return s.flip();
        case 'w': range('0', '9'); range('a', 'z'); range('A', 'Z'); s.set('_'); return s;
        case 'W': range('0', '9'); range('a', 'z'); range('A', 'Z'); s.set('_'); return s.flip();
        case 's': for (char x : {' ', '\t', '\n', '\r', '\f', '\v'}) s.set(static_cast<unsigned char>(x)); return s;
        case 'S': for (char x : {' ', '\t', '\n', '\r', '\f', '\v'}) s.set(static_cast<unsigned char>(x)); return s.flip();
        case 't': s.set('\t'); return s;
        case 'n': s.set('\n'); return s;
        default: break;
      }
      const bool punctuation = (e >= '!' && e <= '/') || (e >= ':' && e <= '@') || (e >= '[' && e <= '`') ||
                               (e >= '{' && e <= '~');
      (void)in_class;
      if (!punctuation) {
        --at;
        fail(std::string("the escape \\") + e + " (backreferences, \\b and other escapes are not accepted)");
      }
      s.set(static_cast<unsigned char>(e));
      return s;
    }
    std::bitset<256> parse_class() {
      ++at;  // [
      bool negate = false;
      if (!done() && p[at] == '^') {
        negate = true;
        ++at;
      }
      std::bitset<256> s;
      bool first = true;
      while (true) {
        if (done()) fail("a '[' without its ']'");
        if (p[at] == ']' && !first) {
          ++at;
          break;
        }
        first = false;
        int low = -1;
        if (p[at] == '\\') {
          const std::bitset<256> e = parse_escape(true);
          if (e.count() != 1) {
            s |= e;
            continue;
          }
          for (int x = 0; x < 256; ++x)
            if (e[static_cast<std::size_t>(x)]) low = x;
        } else {
          low = static_cast<unsigned char>(p[at++]);
        }
        if (at + 1 < p.size() && p[at] == '-' && p[at + 1] != ']') {
          ++at;
          int high;
          if (p[at] == '\\') {
            const std::bitset<256> e = parse_escape(true);
            if (e.count() != 1) fail("a class range ending in a class escape");
            high = 0;
            for (int x = 0; x < 256; ++x)
              if (e[static_cast<std::size_t>(x)]) high = x;
          } else {
            high = static_cast<unsigned char>(p[at++]);
          }
          if (high < low) fail("a class range whose end is below its start");
          for (int x = low; x <= high; ++x) s.set(static_cast<std::size_t>(x));
        } else {
          s.set(static_cast<std::size_t>(low));
        }
      }
      return negate ? s.flip() : s;
    }
  };

  std::string text_;
  std::vector<node> states_;
  int start_ = -1;
};

}  // namespace peft

MEMKIT_NAMESPACE_END
