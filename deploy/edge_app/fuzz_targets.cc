// The parsers under fuzz, and the promises each makes about what it accepts.
// Compiled with -fsanitize-coverage=trace-pc: the driver counts the edges run here.
#include <exception>
#include <string>

#include "fuzz_parsers.h"
#include "manifest.h"
#include "npy.h"

namespace edge_fuzz {

namespace {

std::string CheckNpy(const edge::NpyArray& a) {
  if (a.shape.size() > edge::kMaxNpyRank) return "rank above the bound";
  unsigned __int128 n = a.itemsize;
  for (int64_t d : a.shape) {
    if (d < 0) return "negative dim";
    n *= static_cast<uint64_t>(d);
    if (n > (static_cast<unsigned __int128>(1) << 64)) return "size overflow accepted";
  }
  if (n != a.data.size()) return "data size disagrees with shape x itemsize";
  if (a.itemsize == 0 || a.dtype.empty()) return "no dtype";
  return "";
}

std::string CheckManifest(const edge::Manifest& m) {
  if (!m.files.count(m.module)) return "module not among the hashed files";
  if (m.files.size() > edge::kMaxFiles) return "too many files";
  for (const auto& [name, digest] : m.files) {
    if (!edge::IsPlainName(name) || name.find('/') != std::string::npos || name == "..") return "unsafe file name";
    if (!edge::IsSha256Hex(digest)) return "bad digest";
  }
  for (const auto* list : {&m.inputs, &m.outputs}) {
    if (list->size() > edge::kMaxTensors) return "too many tensors";
    for (const edge::TensorSig& s : *list) {
      if (s.fixed.size() != s.dims.size() || s.fixed.size() > edge::kMaxRank) return "bad rank";
      for (int64_t d : s.fixed) {
        if (d > edge::kMaxStaticDim || (d < 0 && d != edge::TensorSig::kSymbol && d != edge::TensorSig::kAnonymous)) {
          return "dim out of range";
        }
      }
    }
  }
  // weights.bin's table: what ReadWeights relies on (aligned, in order, inside the file).
  if (m.has_weights && (!m.files.count(m.weights_file) || m.weights_file == m.module)) return "weights file not hashed";
  if (m.weights.size() > edge::kMaxWeights || m.weights_bytes > edge::kMaxArtifactFileBytes) return "weights too big";
  uint64_t end = 0;
  for (const edge::WeightTensor& w : m.weights) {
    if (w.offset % edge::kWeightsAlign || w.offset < end || w.nbytes > m.weights_bytes ||
        w.offset > m.weights_bytes - w.nbytes) {
      return "weight outside its file or overlapping";
    }
    if (w.shape.size() > edge::kMaxRank) return "weight rank";
    uint64_t n = 1;  // every prefix of the product is bounded (ParseManifest multiplies left to right)
    for (int64_t d : w.shape) {
      if (d < 0 || d > edge::kMaxStaticDim) return "weight dim out of range";
      n *= static_cast<uint64_t>(d);
      if (n > edge::kMaxArtifactFileBytes) return "weight size unbounded";
    }
    if (n > w.nbytes) return "weight nbytes below its elements";
    end = w.offset + w.nbytes;
  }
  return "";
}

}  // namespace

Verdict RunTarget(Kind kind, const std::string& data, std::string* message) {
  try {
    std::string broken;
    if (kind == Kind::kNpy) {
      broken = CheckNpy(edge::ParseNpy(data));
    } else {
      broken = CheckManifest(edge::ParseManifest(data));
    }
    *message = broken;
    return broken.empty() ? Verdict::kAccepted : Verdict::kBug;
  } catch (const edge::NpyError& e) {
    *message = e.what();
    return kind == Kind::kNpy ? Verdict::kRefused : Verdict::kBug;
  } catch (const edge::ManifestError& e) {
    *message = e.what();
    return kind == Kind::kManifest ? Verdict::kRefused : Verdict::kBug;
  } catch (const std::exception& e) {
    *message = std::string("unexpected exception: ") + e.what();
    return Verdict::kBug;
  }
}

}  // namespace edge_fuzz
