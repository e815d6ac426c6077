// A small JSON reader (RFC 8259): enough to read manifest.json. Values form a
// tree; numbers are kept as double plus whether they were integral.
//
// It accepts exactly what blockforge's Python reader (compile/artifact/manifest.py) accepts, so
// that the two can never read one manifest two ways: UTF-8 text only, containers nested
// at most kMaxDepth deep, no duplicate object keys (json.loads would keep the last,
// a hand-written reader might keep the first), numbers in RFC grammar of at most
// kMaxNumberChars characters, \u escapes that form valid code points (no lone
// surrogates). Every failure is a ParseError.
#ifndef EDGE_APP_JSON_H_
#define EDGE_APP_JSON_H_

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace edge {
namespace json {

constexpr int kMaxDepth = 32;          // containers; blockforge's manifests nest 4 deep
constexpr size_t kMaxNumberChars = 100;

struct ParseError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Text from the file as it may appear in a message: control bytes (NUL included, which
// would cut the message short) as \xNN, so that a message is one line. blockforge's
// Python reader escapes the same way (compile/artifact/manifest.py, _printable).
inline std::string Printable(const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

struct Value {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = kNull;
  bool boolean = false;
  double number = 0;
  bool integral = false;
  std::string str;
  std::vector<Value> array;
  std::map<std::string, Value> object;

  bool is_object() const { return kind == kObject; }
  bool is_array() const { return kind == kArray; }
  bool is_string() const { return kind == kString; }
  bool is_int() const { return kind == kNumber && integral; }
  // Member lookup; nullptr when absent or this is not an object.
  const Value* get(const std::string& key) const {
    if (kind != kObject) return nullptr;
    auto it = object.find(key);
    return it == object.end() ? nullptr : &it->second;
  }
};

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  Value Parse() {
    CheckUtf8();
    Value v = ParseValue(0);
    SkipWs();
    if (pos_ != s_.size()) Fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void Fail(const std::string& what) {
    throw ParseError("invalid JSON at byte " + std::to_string(pos_) + ": " + what);
  }

  // Strict UTF-8 (what Python's decoder takes): no overlong forms, no encoded
  // surrogates, nothing above U+10FFFF.
  void CheckUtf8() {
    const size_t n = s_.size();
    for (size_t i = 0; i < n;) {
      const unsigned char c = static_cast<unsigned char>(s_[i]);
      size_t len = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3
                 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
      bool ok = len > 0 && len <= n - i;
      for (size_t k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(s_[i + k]) & 0xC0) == 0x80;
      if (ok && len >= 3) {
        const unsigned char c1 = static_cast<unsigned char>(s_[i + 1]);
        ok = !(c == 0xE0 && c1 < 0xA0) && !(c == 0xED && c1 >= 0xA0) && !(c == 0xF0 && c1 < 0x90) &&
             !(c == 0xF4 && c1 >= 0x90);
      }
      if (!ok) {
        pos_ = i;
        Fail("not UTF-8");
      }
      i += len;
    }
  }
  void SkipWs() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  char Peek() {
    SkipWs();
    if (pos_ >= s_.size()) Fail("unexpected end");
    return s_[pos_];
  }
  void Expect(char c) {
    if (Peek() != c) Fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  bool Literal(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (s_.compare(pos_, n, word) == 0) {
      pos_ += n;
      return true;
    }
    return false;
  }

  // depth: the containers around this value.
  Value ParseValue(int depth) {
    Value v;
    char c = Peek();
    if ((c == '{' || c == '[') && depth + 1 > kMaxDepth) {
      Fail("nested more than " + std::to_string(kMaxDepth) + " deep");
    }
    if (c == '{') {
      ++pos_;
      v.kind = Value::kObject;
      if (Peek() == '}') {
        ++pos_;
        return v;
      }
      while (true) {
        if (Peek() != '"') Fail("expected a string key");
        std::string key = ParseString();
        Expect(':');
        Value item = ParseValue(depth + 1);
        if (!v.object.emplace(key, std::move(item)).second) Fail("duplicate key '" + Printable(key) + "'");
        if (Peek() == ',') {
          ++pos_;
          continue;
        }
        Expect('}');
        return v;
      }
    }
    if (c == '[') {
      ++pos_;
      v.kind = Value::kArray;
      if (Peek() == ']') {
        ++pos_;
        return v;
      }
      while (true) {
        v.array.push_back(ParseValue(depth + 1));
        if (Peek() == ',') {
          ++pos_;
          continue;
        }
        Expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = Value::kString;
      v.str = ParseString();
      return v;
    }
    if (Literal("true")) {
      v.kind = Value::kBool;
      v.boolean = true;
      return v;
    }
    if (Literal("false")) {
      v.kind = Value::kBool;
      return v;
    }
    if (Literal("null")) return v;
    if (c == '-' || (c >= '0' && c <= '9')) return ParseNumber();
    Fail("unexpected character '" + Printable(std::string(1, c)) + "'");
  }

  // RFC 8259: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?
  Value ParseNumber() {
    const size_t start = pos_;
    auto digits = [&]() {
      size_t from = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    bool integral = true;
    if (s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
    } else if (digits() == 0) {
      Fail("bad number");
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      integral = false;
      if (digits() == 0) Fail("bad number");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      integral = false;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) Fail("bad number");
    }
    if (pos_ - start > kMaxNumberChars) {
      pos_ = start;
      Fail("number longer than " + std::to_string(kMaxNumberChars) + " characters");
    }
    std::string tok = s_.substr(start, pos_ - start);
    Value v;
    v.kind = Value::kNumber;
    v.number = std::strtod(tok.c_str(), nullptr);  // grammar checked; huge values become +-inf
    v.integral = integral;
    return v;
  }

  static void AppendUtf8(std::string* out, uint32_t cp) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  uint32_t Hex4() {
    if (pos_ + 4 > s_.size()) Fail("short \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
      else Fail("bad \\u escape");
    }
    return v;
  }

  std::string ParseString() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) Fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) Fail("control character in string");
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) Fail("unterminated string");
      char e = s_[pos_++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          uint32_t cp = Hex4();
          if (cp >= 0xDC00 && cp < 0xE000) Fail("lone surrogate in \\u escape");
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (s_.compare(pos_, 2, "\\u") != 0) Fail("lone surrogate in \\u escape");
            pos_ += 2;
            uint32_t lo = Hex4();
            if (lo < 0xDC00 || lo >= 0xE000) Fail("lone surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          AppendUtf8(&out, cp);
          break;
        }
        default: Fail("bad escape");
      }
    }
  }

  const std::string& s_;
  size_t pos_ = 0;
};

inline Value Parse(const std::string& text) { return Parser(text).Parse(); }

}  // namespace json
}  // namespace edge

#endif  // EDGE_APP_JSON_H_
