// .npy files (NumPy format 1.0; 2.0/3.0 are read too): little-endian, C order.
// The dtype is kept as its name ("float32", "float16", "bool", ...).
#ifndef EDGE_APP_NPY_H_
#define EDGE_APP_NPY_H_

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "edge_app reads and writes little-endian .npy data in place: little-endian hosts only"
#endif

namespace edge {

struct NpyArray {
  std::string dtype;           // numpy name, e.g. "float32"
  size_t itemsize = 0;
  std::vector<int64_t> shape;
  std::vector<char> data;      // C-order bytes

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

namespace npy_detail {

struct DescrInfo {
  const char* descr;  // little-endian / byte-order-free form
  const char* name;
  size_t itemsize;
};

inline const DescrInfo* Table() {
  static const DescrInfo t[] = {
      {"<f4", "float32", 4}, {"<f2", "float16", 2}, {"<f8", "float64", 8}, {"|b1", "bool", 1},
      {"|i1", "int8", 1},    {"<i2", "int16", 2},   {"<i4", "int32", 4},   {"<i8", "int64", 8},
      {"|u1", "uint8", 1},   {"<u2", "uint16", 2},  {"<u4", "uint32", 4},  {"<u8", "uint64", 8},
      {nullptr, nullptr, 0}};
  return t;
}

// Value of 'key' in the header dict, as raw text up to the next top-level ',' or '}'.
inline std::string DictField(const std::string& header, const std::string& key) {
  for (const char q : {'\'', '"'}) {
    std::string pat = std::string(1, q) + key + std::string(1, q);
    size_t at = header.find(pat);
    if (at == std::string::npos) continue;
    size_t colon = header.find(':', at + pat.size());
    if (colon == std::string::npos) break;
    size_t i = colon + 1;
    while (i < header.size() && header[i] == ' ') ++i;
    int depth = 0;
    size_t start = i;
    for (; i < header.size(); ++i) {
      char c = header[i];
      if (c == '(' || c == '[') ++depth;
      if (c == ')' || c == ']') --depth;
      if (depth == 0 && (c == ',' || c == '}')) break;
      if (depth < 0) break;
    }
    std::string v = header.substr(start, i - start);
    while (!v.empty() && v.back() == ' ') v.pop_back();
    return v;
  }
  throw std::runtime_error("header has no '" + key + "'");
}

}  // namespace npy_detail

inline NpyArray ReadNpy(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error(path + ": cannot open (" + std::strerror(errno) + ")");
  struct Closer {
    FILE* f;
    ~Closer() { std::fclose(f); }
  } closer{f};
  auto fail = [&](const std::string& why) -> std::runtime_error {
    return std::runtime_error(path + ": not a .npy file this app reads (" + why + ")");
  };
  unsigned char pre[8];
  if (std::fread(pre, 1, 8, f) != 8 || std::memcmp(pre, "\x93NUMPY", 6) != 0) {
    throw fail("bad magic");
  }
  size_t hlen = 0;
  if (pre[6] == 1) {
    unsigned char b[2];
    if (std::fread(b, 1, 2, f) != 2) throw fail("truncated header");
    hlen = b[0] | (size_t(b[1]) << 8);
  } else if (pre[6] == 2 || pre[6] == 3) {
    unsigned char b[4];
    if (std::fread(b, 1, 4, f) != 4) throw fail("truncated header");
    hlen = b[0] | (size_t(b[1]) << 8) | (size_t(b[2]) << 16) | (size_t(b[3]) << 24);
  } else {
    throw fail("format version " + std::to_string(pre[6]));
  }
  if (hlen > (1u << 20)) throw fail("header too large");
  std::string header(hlen, '\0');
  if (std::fread(&header[0], 1, hlen, f) != hlen) throw fail("truncated header");

  NpyArray arr;
  std::string descr;
  try {
    descr = npy_detail::DictField(header, "descr");
    std::string fortran = npy_detail::DictField(header, "fortran_order");
    std::string shape = npy_detail::DictField(header, "shape");
    if (descr.size() < 2 || (descr.front() != '\'' && descr.front() != '"')) {
      throw std::runtime_error("descr " + descr);
    }
    descr = descr.substr(1, descr.size() - 2);
    if (fortran != "False") throw std::runtime_error("Fortran order; save with np.ascontiguousarray");
    if (shape.empty() || shape.front() != '(' || shape.back() != ')') {
      throw std::runtime_error("shape " + shape);
    }
    std::string inner = shape.substr(1, shape.size() - 2);
    size_t i = 0;
    while (i < inner.size()) {
      while (i < inner.size() && (inner[i] == ' ' || inner[i] == ',')) ++i;
      if (i >= inner.size()) break;
      size_t j = i;
      while (j < inner.size() && inner[j] >= '0' && inner[j] <= '9') ++j;
      if (j == i) throw std::runtime_error("shape " + shape);
      arr.shape.push_back(std::stoll(inner.substr(i, j - i)));
      i = j;
    }
  } catch (const std::runtime_error& e) {
    throw fail(e.what());
  }
  // "=" and "<" are the same on a little-endian host; "|" is byte-order free.
  std::string norm = descr;
  if (!norm.empty() && (norm[0] == '=' || norm[0] == '|')) norm[0] = '<';
  for (const npy_detail::DescrInfo* d = npy_detail::Table(); d->descr; ++d) {
    std::string want = d->descr;
    want[0] = '<';
    if (norm == want) {
      arr.dtype = d->name;
      arr.itemsize = d->itemsize;
    }
  }
  if (arr.dtype.empty()) {
    throw fail("dtype " + descr + "; use little-endian float32, float16 or bool");
  }
  size_t nbytes = static_cast<size_t>(arr.numel()) * arr.itemsize;
  arr.data.resize(nbytes);
  if (nbytes && std::fread(arr.data.data(), 1, nbytes, f) != nbytes) {
    throw fail("data shorter than its shape says");
  }
  return arr;
}

// Writes atomically (temporary file, then rename).
inline void WriteNpy(const std::string& path, const std::string& dtype,
                     const std::vector<int64_t>& shape, const void* data, size_t nbytes) {
  const char* descr = nullptr;
  for (const npy_detail::DescrInfo* d = npy_detail::Table(); d->descr; ++d) {
    if (dtype == d->name) descr = d->descr;
  }
  if (!descr) throw std::runtime_error("cannot write dtype " + dtype + " to .npy");
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) {
    dict += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dict += ",";
    if (i + 1 < shape.size()) dict += " ";
  }
  dict += "), }";
  size_t total = 10 + dict.size() + 1;  // magic+version+len, dict, '\n'
  size_t pad = (64 - total % 64) % 64;
  dict.append(pad, ' ');
  dict.push_back('\n');
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw std::runtime_error(path + ": cannot write (" + std::strerror(errno) + ")");
  unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
                           static_cast<unsigned char>(dict.size() & 0xff),
                           static_cast<unsigned char>(dict.size() >> 8)};
  bool ok = std::fwrite(pre, 1, 10, f) == 10 && std::fwrite(dict.data(), 1, dict.size(), f) == dict.size() &&
            (nbytes == 0 || std::fwrite(data, 1, nbytes, f) == nbytes);
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error(path + ": cannot write (" + std::strerror(errno) + ")");
  }
}

}  // namespace edge

#endif  // EDGE_APP_NPY_H_
