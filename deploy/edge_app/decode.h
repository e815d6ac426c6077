// The cache pairing of a decode loop (edge_app --decode N): which present output feeds
// which past input at the next call, and along which axis it grows. The same rules and
// words as blockforge's compile/decode/pairing.py: inferred from the manifest's signature
// (blockforge's present_X -> past_X, exporters' present.{i}.key/.value ->
// past_key_values.{i}.key/.value), and the manifest's recorded 'decode' must be exactly
// that pairing (an untrusted manifest cannot swap key and value or feed an output into
// an input it does not name).
#ifndef EDGE_APP_DECODE_H_
#define EDGE_APP_DECODE_H_

#include <cctype>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "json.h"
#include "manifest.h"

namespace edge {

struct DecodeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct CachePair {
  std::string present, past;
  int axis = 0;
  size_t out_index = 0, in_index = 0;
};

struct TokenFeed {
  bool on = false;
  std::string logits, input_ids, attention_mask, position_ids;  // empty: absent
};

struct Pairing {
  std::vector<CachePair> pairs;
  TokenFeed tokens;
};

namespace decode_detail {

inline std::vector<std::string> PastCandidates(const std::string& present) {
  std::vector<std::string> out;
  const std::string p = "present";
  if (present.compare(0, p.size(), p) == 0) out.push_back("past" + present.substr(p.size()));
  // present.{1-4 digits}.key|value
  if (present.size() > 9 && present.compare(0, 8, "present.") == 0) {
    size_t i = 8, digits = 0;
    while (i < present.size() && std::isdigit(static_cast<unsigned char>(present[i]))) ++i, ++digits;
    std::string rest = present.substr(i);
    if (digits >= 1 && digits <= 4 && (rest == ".key" || rest == ".value")) {
      out.push_back("past_key_values." + present.substr(8));
    }
  }
  return out;
}

inline std::string Dims(const TensorSig& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.dims.size(); ++i) {
    out += (i ? ", " : "") + (s.fixed[i] >= 0 ? s.dims[i] : "'" + s.dims[i] + "'");
  }
  return out + "]";
}

inline int GrowAxis(const TensorSig& past, const TensorSig& present) {
  const std::string pn = json::Printable(past.name), qn = json::Printable(present.name);
  if (past.dtype != present.dtype) {
    throw DecodeError(qn + " (" + present.dtype + ") cannot feed " + pn + " (" + past.dtype + ")");
  }
  if (past.dims.size() != present.dims.size()) {
    throw DecodeError(qn + " has rank " + std::to_string(present.dims.size()) + ", " + pn + " rank " +
                      std::to_string(past.dims.size()));
  }
  std::vector<int> differ;
  for (size_t i = 0; i < past.dims.size(); ++i) {
    bool same = past.fixed[i] == present.fixed[i] && past.dims[i] == present.dims[i] &&
                past.fixed[i] != TensorSig::kAnonymous;
    if (!same) differ.push_back(static_cast<int>(i));
  }
  if (differ.size() != 1) {
    std::string which = "no axis differs";
    if (!differ.empty()) {
      which = "axes [";
      for (size_t i = 0; i < differ.size(); ++i) which += (i ? ", " : "") + std::to_string(differ[i]);
      which += "] differ";
    }
    throw DecodeError("cannot tell which axis of " + pn + " " + Dims(past) + " grows into " + qn + " " +
                      Dims(present) + " (" + which + ")");
  }
  int axis = differ[0];
  if (past.fixed[axis] != TensorSig::kSymbol) {
    throw DecodeError(pn + "'s past length is fixed at " + past.dims[axis] +
                      " (the artifact was compiled with it bound): a decode loop needs it symbolic; compile "
                      "without binding it in --shape");
  }
  return axis;
}

}  // namespace decode_detail

// The pairing the signature implies; DecodeError (the reason) when there is none.
inline Pairing InferPairing(const Manifest& m) {
  using decode_detail::GrowAxis;
  Pairing p;
  std::set<std::string> fed;
  for (size_t o = 0; o < m.outputs.size(); ++o) {
    std::vector<std::pair<std::string, long>> found;
    for (const auto& c : decode_detail::PastCandidates(m.outputs[o].name)) {
      long i = InputIndex(m, c);
      if (i >= 0) found.emplace_back(c, i);
    }
    if (found.size() > 1) {
      throw DecodeError("output " + json::Printable(m.outputs[o].name) + " could feed " +
                        json::Printable(found[0].first) + " or " + json::Printable(found[1].first) + ": ambiguous");
    }
    if (found.empty()) continue;
    CachePair c;
    c.present = m.outputs[o].name;
    c.past = found[0].first;
    c.out_index = o;
    c.in_index = static_cast<size_t>(found[0].second);
    c.axis = GrowAxis(m.inputs[c.in_index], m.outputs[o]);
    fed.insert(c.past);
    p.pairs.push_back(c);
  }
  if (p.pairs.empty()) {
    throw DecodeError("no output is a key/value cache (present_* or present.N.key/value feeding past_* or "
                      "past_key_values.N.*)");
  }
  for (const auto& s : m.inputs) {
    if (s.name.compare(0, 4, "past") == 0 && !fed.count(s.name)) {
      throw DecodeError("input " + json::Printable(s.name) + " looks like a cache but no present output feeds it");
    }
  }
  bool logits = false;
  for (const auto& s : m.outputs) logits = logits || s.name == "logits";
  if (logits && InputIndex(m, "input_ids") >= 0) {
    p.tokens.on = true;
    p.tokens.logits = "logits";
    p.tokens.input_ids = "input_ids";
    if (InputIndex(m, "attention_mask") >= 0) p.tokens.attention_mask = "attention_mask";
    if (InputIndex(m, "position_ids") >= 0) p.tokens.position_ids = "position_ids";
  }
  return p;
}

// manifest.json's 'decode' (the raw value; absent: nullptr) against the inferred pairing.
inline void CheckRecorded(const json::Value* d, const Pairing& p) {
  if (!d) throw DecodeError("manifest.json records no cache pairing (compiled by an older blockforge? recompile it)");
  auto bad = [](const std::string& what) { throw DecodeError("'decode' " + what); };
  const json::Value* pairs = d->get("pairs");
  const json::Value* tokens = d->get("tokens");
  if (!d->is_object() || d->object.size() != 2 || !pairs || !tokens) bad("must be an object with 'pairs' and 'tokens'");
  if (!pairs->is_array() || pairs->array.empty()) bad("'pairs' must be a non-empty list of {present, past, axis}");
  for (size_t k = 0; k < pairs->array.size(); ++k) {
    const json::Value& e = pairs->array[k];
    const json::Value *pr = e.get("present"), *pa = e.get("past"), *ax = e.get("axis");
    if (!e.is_object() || e.object.size() != 3 || !pr || !pr->is_string() || !pa || !pa->is_string() || !ax ||
        !ax->is_int()) {
      bad("'pairs' entry " + std::to_string(k) + " must be {present: string, past: string, axis: integer}");
    }
  }
  const char* keys[] = {"logits", "input_ids", "attention_mask", "position_ids"};
  if (tokens->kind != json::Value::kNull) {
    bool ok = tokens->is_object() && tokens->object.size() == 4;
    for (int i = 0; ok && i < 4; ++i) {
      const json::Value* v = tokens->get(keys[i]);
      ok = v && (v->is_string() || (i >= 2 && v->kind == json::Value::kNull));
    }
    if (!ok) bad("'tokens' must be null or {logits, input_ids, attention_mask, position_ids}");
  }
  bool same = pairs->array.size() == p.pairs.size() && (tokens->kind == json::Value::kNull) == !p.tokens.on;
  for (size_t k = 0; same && k < p.pairs.size(); ++k) {
    const json::Value& e = pairs->array[k];
    same = e.get("present")->str == p.pairs[k].present && e.get("past")->str == p.pairs[k].past &&
           e.get("axis")->number == p.pairs[k].axis;
  }
  if (same && p.tokens.on) {
    const std::string* want[] = {&p.tokens.logits, &p.tokens.input_ids, &p.tokens.attention_mask,
                                 &p.tokens.position_ids};
    for (int i = 0; same && i < 4; ++i) {
      const json::Value* v = tokens->get(keys[i]);
      same = want[i]->empty() ? v->kind == json::Value::kNull : (v->is_string() && v->str == *want[i]);
    }
  }
  if (!same) {
    throw DecodeError("'decode' does not match the pairing the artifact's signature implies; refusing to feed "
                      "outputs into inputs it does not name");
  }
}

}  // namespace edge

#endif  // EDGE_APP_DECODE_H_
