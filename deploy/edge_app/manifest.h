// manifest.json of a blockforge artifact: parsed and type-checked from its bytes,
// before any file it names is touched. The rules (and the limits below) are the ones
// blockforge's Python loader applies (compile/artifact/manifest.py); a test runs one table of
// hostile manifests against both, and a fuzz test compares their verdicts.
#ifndef EDGE_APP_MANIFEST_H_
#define EDGE_APP_MANIFEST_H_

#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "json.h"

namespace edge {

constexpr const char* kManifestFormat = "blockforge.artifact/1";
constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 20;  // real ones are ~2 KiB
constexpr uint64_t kMaxArtifactFileBytes = uint64_t{4} << 30;  // = the ONNX model limit
constexpr size_t kMaxFiles = 64;
constexpr size_t kMaxTensors = 64;
constexpr size_t kMaxRank = 32;
constexpr int64_t kMaxStaticDim = 2147483647;
constexpr size_t kMaxNameBytes = 256;
constexpr size_t kMaxPackageFiles = 16;  // a package ships 3 (bin/edge_app, lib/libtvm_*.so)
constexpr size_t kMaxWeights = 4096;
constexpr uint64_t kWeightsAlign = 64;

// The dtypes weights.bin may hold and their bytes per element (manifest.py, WEIGHT_DTYPES:
// the same table, in the same order: it is quoted in a message).
struct WeightDtype {
  const char* name;
  uint64_t size;
};
constexpr WeightDtype kWeightDtypes[] = {{"float32", 4}, {"float16", 2}, {"bfloat16", 2}, {"float64", 8},
                                         {"int8", 1},    {"uint8", 1},   {"int16", 2},    {"uint16", 2},
                                         {"int32", 4},   {"uint32", 4},  {"int64", 8},    {"uint64", 8},
                                         {"bool", 1}};

struct ManifestError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One tensor of the signature: per dim a size, a symbol (bound by the inputs) or
// anonymous (null in the manifest: any size, bound to nothing).
struct TensorSig {
  static constexpr int64_t kSymbol = -1;
  static constexpr int64_t kAnonymous = -2;
  std::string name;
  std::string dtype;
  std::vector<std::string> dims;  // as text, for messages
  std::vector<int64_t> fixed;     // the size, or kSymbol / kAnonymous
};

// One lifted weight: main's parameter after the inputs, stored at `offset` in weights.bin.
struct WeightTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t offset = 0, nbytes = 0;
};

struct Manifest {
  std::string module;
  std::map<std::string, std::string> files;  // plain name -> sha256 (64 lowercase hex)
  std::vector<TensorSig> inputs, outputs;
  bool has_arch = false, has_device = false;  // target.arch / target.device are strings
  std::string arch, device;
  bool device_null = false;  // device: null marks a build-only artifact
  // A package's bin/ and lib/ files: "bin/NAME" or "lib/NAME" -> sha256.
  bool has_package_files = false;
  std::map<std::string, std::string> package_files;
  // 'decode', as written: checked only by a decode loop (decode.h), as in the Python loader.
  bool has_decode = false;
  json::Value decode;
  // 'step' (compile/decode/entries.py): a call binding `step_dim` to 1 runs `step_function`
  // (always "decode": main at seq 1), every other call main.
  bool has_step = false;
  std::string step_function, step_dim;
  // 'inplace' (compile/decode/inplace.py): a decode loop's steps after the prompt run
  // `inplace_function` (always "decode_inplace") on cache buffers of `inplace_capacity` rows
  // along the past axis (`inplace_dim`), each step writing only its new row.
  bool has_inplace = false;
  std::string inplace_function, inplace_dim;
  int64_t inplace_capacity = 0;
  // 'weights' (compile/artifact/weights.py): the file, its size, the tensors in parameter order.
  bool has_weights = false;
  std::string weights_file;
  uint64_t weights_bytes = 0;
  std::vector<WeightTensor> weights;
};

// The index of the input named `name` in the manifest's signature, or -1.
inline long InputIndex(const Manifest& m, const std::string& name) {
  for (size_t i = 0; i < m.inputs.size(); ++i)
    if (m.inputs[i].name == name) return static_cast<long>(i);
  return -1;
}

// A file name inside the artifact: no separators, no "." or "..", no leading dot,
// nothing a shell or a message could misread. What compile writes (module.so,
// kernels.cu, device.fatbin) fits.
inline bool IsPlainName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    if (!(alnum || c == '_' || (i > 0 && (c == '.' || c == '+' || c == '-')))) return false;
  }
  return true;
}

// Tensor and symbol names: any UTF-8 (ONNX allows it), but bounded and one line.
inline bool IsLabel(const std::string& s) {
  if (s.empty() || s.size() > kMaxNameBytes) return false;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) return false;
  }
  return true;
}

inline bool IsDtypeName(const std::string& s) {
  if (s.empty() || s.size() > 16 || !(s[0] >= 'a' && s[0] <= 'z')) return false;
  for (char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) return false;
  }
  return true;
}

// "bin/NAME" or "lib/NAME" with NAME a plain name: what 'package_files' may list.
inline bool IsPackageName(const std::string& name) {
  return name.size() > 4 && (name.compare(0, 4, "bin/") == 0 || name.compare(0, 4, "lib/") == 0) &&
         IsPlainName(name.substr(4));
}

inline bool IsSha256Hex(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

namespace manifest_detail {

constexpr const char* kOutside = "(a path could reach outside the artifact)";

[[noreturn]] inline void Bad(const std::string& msg) { throw ManifestError(msg); }

// 'files' and 'package_files': an object of at most `limit` names that `name_ok` accepts
// -> 64 lowercase hex.
inline std::map<std::string, std::string> Digests(const json::Value& listing, const std::string& key, size_t limit,
                                                  bool (*name_ok)(const std::string&), const std::string& shape,
                                                  const std::string& kind) {
  if (!listing.is_object()) Bad("'" + key + "' must be an object of " + shape + " -> sha256");
  if (listing.object.size() > limit) Bad("'" + key + "' lists more than " + std::to_string(limit) + " files");
  std::map<std::string, std::string> out;
  for (const auto& [name, digest] : listing.object) {
    if (!name_ok(name)) Bad("'" + key + "' names '" + json::Printable(name) + "': not a " + kind + " " + kOutside);
    if (!digest.is_string() || !IsSha256Hex(digest.str)) {
      Bad("'" + key + "': the sha256 of " + name + " is not 64 lowercase hex digits");
    }
    out[name] = digest.str;
  }
  return out;
}

// A signature or 'weights' entry: an object whose 'name' is a label not seen before in its
// list (`seen`); the messages are the Python reader's (manifest.py), one wording for both lists.
inline const json::Value* EntryName(const json::Value& item, const std::string& entry, std::set<std::string>& seen) {
  if (!item.is_object()) Bad(entry + " is not an object");
  const json::Value* name = item.get("name");
  if (!name || !name->is_string() || !IsLabel(name->str)) {
    Bad(entry + ": 'name' must be a one-line string of 1 to " + std::to_string(kMaxNameBytes) + " bytes");
  }
  if (!seen.insert(name->str).second) Bad(entry + ": name '" + json::Printable(name->str) + "' appears twice");
  return name;
}

inline std::vector<TensorSig> Sigs(const json::Value& root, const char* key) {
  const json::Value* list = root.get(key);
  const std::string where = std::string("'") + key + "'";
  if (!list->is_array()) Bad(where + " must be a list of {name, shape, dtype}");
  if (list->array.size() > kMaxTensors) Bad(where + " lists more than " + std::to_string(kMaxTensors) + " tensors");
  std::vector<TensorSig> sigs;
  std::set<std::string> seen;
  for (size_t k = 0; k < list->array.size(); ++k) {
    const json::Value& item = list->array[k];
    const std::string entry = where + " entry " + std::to_string(k);
    const json::Value* name = EntryName(item, entry, seen);
    const json::Value* dtype = item.get("dtype");
    const json::Value* shape = item.get("shape");
    if (!dtype || !dtype->is_string() || !IsDtypeName(dtype->str)) {
      Bad(entry + ": 'dtype' must be a dtype name such as float32");
    }
    if (!shape || !shape->is_array() || shape->array.size() > kMaxRank) {
      Bad(entry + ": 'shape' must be a list of at most " + std::to_string(kMaxRank) + " dims");
    }
    TensorSig s{name->str, dtype->str, {}, {}};
    for (const json::Value& d : shape->array) {
      // Range-checked while still a double: casting 1e23 to int64_t is undefined.
      if (d.is_int() && d.number >= 0 && d.number <= static_cast<double>(kMaxStaticDim)) {
        s.fixed.push_back(static_cast<int64_t>(d.number));
        s.dims.push_back(std::to_string(s.fixed.back()));
      } else if (d.is_string() && IsLabel(d.str)) {
        s.fixed.push_back(TensorSig::kSymbol);
        s.dims.push_back(d.str);
      } else if (d.kind == json::Value::kNull) {
        s.fixed.push_back(TensorSig::kAnonymous);
        s.dims.push_back("?");
      } else {
        Bad(entry + ": bad dim in 'shape' (dims are integers in [0, " + std::to_string(kMaxStaticDim) +
            "], symbol names or null)");
      }
    }
    sigs.push_back(std::move(s));
  }
  return sigs;
}

// An integer in [0, limit] (checked while still a double).
inline bool IsCount(const json::Value* v, double limit) {
  return v && v->is_int() && v->number >= 0 && v->number <= limit;
}

// The 'weights' table, in the Python reader's order (manifest.py, _weights).
inline void Weights(const json::Value& w, Manifest& m) {
  const json::Value* file = w.get("file");
  const json::Value* bytes = w.get("bytes");
  const json::Value* tensors = w.get("tensors");
  if (!w.is_object() || !file || !file->is_string() || !bytes || !bytes->is_int() || !tensors || !tensors->is_array()) {
    Bad("'weights' must be an object with 'file' (a string), 'bytes' (an integer) and 'tensors' (a list)");
  }
  if (!IsPlainName(file->str)) {
    Bad("'weights' file '" + json::Printable(file->str) + "' is not a plain file name " + kOutside);
  }
  if (!m.files.count(file->str) || file->str == m.module) {
    Bad("'weights' file " + file->str + " is not one of the hashed 'files' (besides 'module')");
  }
  if (!IsCount(bytes, static_cast<double>(kMaxArtifactFileBytes))) {
    Bad("'weights' bytes must be an integer in [0, " + std::to_string(kMaxArtifactFileBytes) + "]");
  }
  if (tensors->array.size() > kMaxWeights) Bad("'weights' lists more than " + std::to_string(kMaxWeights) + " tensors");
  m.has_weights = true;
  m.weights_file = file->str;
  m.weights_bytes = static_cast<uint64_t>(bytes->number);
  std::set<std::string> seen;
  uint64_t end = 0;
  for (size_t k = 0; k < tensors->array.size(); ++k) {
    const json::Value& t = tensors->array[k];
    const std::string entry = "'weights' entry " + std::to_string(k);
    const json::Value* name = EntryName(t, entry, seen);
    const json::Value* dtype = t.get("dtype");
    const json::Value* shape = t.get("shape");
    const json::Value* offset = t.get("offset");
    const json::Value* nbytes = t.get("nbytes");
    uint64_t size = 0;
    std::string names;
    for (const WeightDtype& d : kWeightDtypes) {
      if (dtype && dtype->is_string() && dtype->str == d.name) size = d.size;
      names += std::string(names.empty() ? "" : ", ") + d.name;
    }
    if (!size) Bad(entry + ": 'dtype' must be one of " + names);
    bool shape_ok = shape && shape->is_array() && shape->array.size() <= kMaxRank;
    for (size_t i = 0; shape_ok && i < shape->array.size(); ++i) {
      shape_ok = IsCount(&shape->array[i], static_cast<double>(kMaxStaticDim));
    }
    if (!shape_ok) {
      Bad(entry + ": 'shape' must be a list of at most " + std::to_string(kMaxRank) + " integers in [0, " +
          std::to_string(kMaxStaticDim) + "]");
    }
    WeightTensor wt{name->str, dtype->str, {}, 0, 0};
    for (const json::Value& d : shape->array) {
      const uint64_t dim = static_cast<uint64_t>(d.number);  // <= 2^31 - 1; size <= 4 GiB: no overflow
      wt.shape.push_back(static_cast<int64_t>(dim));
      size *= dim;
      if (size > kMaxArtifactFileBytes) Bad(entry + ": its shape holds more than " + std::to_string(kMaxArtifactFileBytes >> 30) + " GiB");
    }
    if (!IsCount(offset, static_cast<double>(kMaxArtifactFileBytes)) ||
        static_cast<uint64_t>(offset->number) % kWeightsAlign != 0) {
      Bad(entry + ": 'offset' must be a multiple of " + std::to_string(kWeightsAlign) + " in [0, " +
          std::to_string(kMaxArtifactFileBytes) + "]");
    }
    wt.offset = static_cast<uint64_t>(offset->number);
    if (!nbytes || !nbytes->is_int() || nbytes->number != static_cast<double>(size)) {
      Bad(entry + ": 'nbytes' must be " + std::to_string(size) + " (its shape's elements times its dtype's size)");
    }
    wt.nbytes = size;
    if (wt.offset < end) {
      Bad(entry + ": 'offset' " + std::to_string(wt.offset) + " overlaps the tensor before it (which ends at " +
          std::to_string(end) + ")");
    }
    if (wt.offset + wt.nbytes > m.weights_bytes) {
      Bad(entry + ": reaches past the end of the weights file (" + std::to_string(wt.offset) + " + " +
          std::to_string(wt.nbytes) + " > " + std::to_string(m.weights_bytes) + " bytes)");
    }
    end = wt.offset + wt.nbytes;
    m.weights.push_back(std::move(wt));
  }
}

// 'step', in the Python reader's order (manifest.py, _step).
inline void Step(const json::Value& st, Manifest& m) {
  const json::Value* fn = st.get("function");
  const json::Value* dim = st.get("dim");
  if (!st.is_object() || st.object.size() != 2 || !fn || !fn->is_string() || !dim || !dim->is_string()) {
    Bad("'step' must be an object with exactly 'function' and 'dim' (strings)");
  }
  if (fn->str != "decode") {
    Bad("'step' function '" + json::Printable(fn->str) + "' is not decode (the only step entry a loader calls)");
  }
  bool found = false;
  for (const TensorSig& s : m.inputs) {
    for (size_t k = 0; k < s.dims.size(); ++k) {
      if (s.fixed[k] == TensorSig::kSymbol && s.dims[k] == dim->str) found = true;
    }
  }
  if (!found) Bad("'step' dim '" + json::Printable(dim->str) + "' is not a symbolic dim of the inputs");
  m.has_step = true;
  m.step_function = fn->str;
  m.step_dim = dim->str;
}

// The largest in-place capacity a manifest may ask for (compile/decode/inplace.py
// MAX_CAPACITY, graph/model_io.py MAX_BOUND_DIM).
constexpr int64_t kMaxInplaceCapacity = 65536;

// 'inplace', in the Python reader's order (manifest.py, _inplace); after 'step' and 'decode'.
inline void Inplace(const json::Value& ip, Manifest& m, const json::Value* decode) {
  const json::Value* fn = ip.get("function");
  const json::Value* dim = ip.get("dim");
  const json::Value* cap = ip.get("capacity");
  if (!ip.is_object() || ip.object.size() != 3 || !fn || !fn->is_string() || !dim || !dim->is_string() || !cap ||
      !cap->is_int()) {
    Bad("'inplace' must be an object with exactly 'function', 'dim' (strings) and 'capacity' (an integer)");
  }
  if (fn->str != "decode_inplace") {
    Bad("'inplace' function '" + json::Printable(fn->str) +
        "' is not decode_inplace (the only in-place entry a loader calls)");
  }
  if (!(cap->number >= 1 && cap->number <= static_cast<double>(kMaxInplaceCapacity))) {
    Bad("'inplace' capacity is not in [1, " + std::to_string(kMaxInplaceCapacity) + "]");  // (no value: manifest.py)
  }
  if (!m.has_step || !decode || !decode->is_object()) {
    Bad("'inplace' needs 'step' and 'decode' (the step entry and the cache pairing)");
  }
  const json::Value* pairs = decode->get("pairs");
  const json::Value* first = pairs && pairs->is_array() && !pairs->array.empty() && pairs->array[0].is_object()
                                 ? &pairs->array[0] : nullptr;
  const json::Value* past = first ? first->get("past") : nullptr;
  const json::Value* axis = first ? first->get("axis") : nullptr;
  bool ok = false;
  for (const TensorSig& s : m.inputs) {
    if (!past || !past->is_string() || s.name != past->str || !axis || !axis->is_int()) continue;
    const double a = axis->number;
    ok = a >= 0 && a < static_cast<double>(s.dims.size()) && s.fixed[static_cast<size_t>(a)] == TensorSig::kSymbol &&
         s.dims[static_cast<size_t>(a)] == dim->str;
    break;
  }
  if (!ok) Bad("'inplace' dim '" + json::Printable(dim->str) + "' is not the past dim of the first cache input");
  m.has_inplace = true;
  m.inplace_function = fn->str;
  m.inplace_dim = dim->str;
  m.inplace_capacity = static_cast<int64_t>(cap->number);
}

}  // namespace manifest_detail

// Parses and type-checks manifest.json's bytes (already size-bounded by the caller).
inline Manifest ParseManifest(const std::string& text) {
  using manifest_detail::Bad;
  using manifest_detail::kOutside;
  Manifest m;
  if (text.size() > kMaxManifestBytes) Bad("manifest.json is larger than 1 MiB");
  json::Value root;
  try {
    root = json::Parse(text);
  } catch (const json::ParseError& e) {
    Bad(std::string("corrupt manifest (") + e.what() + ")");
  }
  const json::Value* fmt = root.get("format");
  if (!fmt || !fmt->is_string() || fmt->str != kManifestFormat) {
    Bad(std::string("unknown manifest format (expected ") + kManifestFormat + ")");
  }
  for (const char* key : {"files", "target", "inputs", "outputs", "module"}) {
    if (!root.get(key)) Bad(std::string("manifest lacks '") + key + "'");
  }
  m.files = manifest_detail::Digests(*root.get("files"), "files", kMaxFiles, IsPlainName, "file name",
                                     "plain file name");
  const json::Value* module = root.get("module");
  if (!module->is_string()) Bad("'module' must be a string naming one of the hashed 'files'");
  if (!IsPlainName(module->str)) {
    Bad("'module' '" + json::Printable(module->str) + "' is not a plain file name " + kOutside);
  }
  if (!m.files.count(module->str)) Bad("'module' " + module->str + " is not one of the hashed 'files'");
  m.module = module->str;
  const json::Value* target = root.get("target");
  const json::Value* tname = target->get("name");
  const json::Value* tjson = target->get("json");
  const json::Value* arch = target->get("arch");
  const json::Value* device = target->get("device");
  auto string_or_null = [](const json::Value* v) {
    return !v || v->is_string() || v->kind == json::Value::kNull;
  };
  if (!target->is_object() || !tname || !tname->is_string() || !tjson || !tjson->is_object() ||
      !string_or_null(arch) || !string_or_null(device)) {
    Bad("'target' must be an object with 'name' (a string), 'json' (an object), 'arch' and 'device' "
        "(strings or null)");
  }
  m.has_arch = arch && arch->is_string();
  m.has_device = device && device->is_string();
  if (m.has_arch) m.arch = arch->str;
  if (m.has_device) m.device = device->str;
  m.device_null = device && device->kind == json::Value::kNull;
  m.inputs = manifest_detail::Sigs(root, "inputs");
  m.outputs = manifest_detail::Sigs(root, "outputs");
  if (const json::Value* pf = root.get("package_files")) {
    m.package_files = manifest_detail::Digests(*pf, "package_files", kMaxPackageFiles, IsPackageName,
                                               "bin/NAME or lib/NAME", "bin/ or lib/ file name");
    m.has_package_files = true;
  }
  if (const json::Value* w = root.get("weights")) manifest_detail::Weights(*w, m);
  if (const json::Value* st = root.get("step")) manifest_detail::Step(*st, m);
  if (const json::Value* d = root.get("decode")) {
    m.has_decode = true;
    m.decode = *d;
  }
  if (const json::Value* ip = root.get("inplace")) manifest_detail::Inplace(*ip, m, root.get("decode"));
  return m;
}

}  // namespace edge

#endif  // EDGE_APP_MANIFEST_H_
