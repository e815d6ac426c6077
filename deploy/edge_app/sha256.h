// SHA-256 (FIPS 180-4), self-contained: enough to check module.so against its
// manifest digest before it is loaded.
#ifndef EDGE_APP_SHA256_H_
#define EDGE_APP_SHA256_H_

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

namespace edge {

class Sha256 {
 public:
  Sha256() { Reset(); }

  void Reset() {
    static const uint32_t init[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    std::memcpy(h_, init, sizeof(h_));
    len_ = 0;
    fill_ = 0;
  }

  void Update(const void* data, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    len_ += n;
    while (n > 0) {
      size_t take = 64 - fill_ < n ? 64 - fill_ : n;
      std::memcpy(buf_ + fill_, p, take);
      fill_ += take;
      p += take;
      n -= take;
      if (fill_ == 64) {
        Block(buf_);
        fill_ = 0;
      }
    }
  }

  // Lower-case hex digest; the object must be Reset() before reuse.
  std::string HexDigest() {
    uint64_t bits = len_ * 8;
    uint8_t pad = 0x80;
    Update(&pad, 1);
    uint8_t zero = 0;
    while (fill_ != 56) Update(&zero, 1);
    uint8_t lenbe[8];
    for (int i = 0; i < 8; ++i) lenbe[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
    Update(lenbe, 8);
    static const char* hex = "0123456789abcdef";
    std::string out;
    for (uint32_t v : h_) {
      for (int s = 28; s >= 0; s -= 4) out.push_back(hex[(v >> s) & 15]);
    }
    return out;
  }

 private:
  static uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

  void Block(const uint8_t* b) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = (uint32_t(b[4 * i]) << 24) | (uint32_t(b[4 * i + 1]) << 16) |
             (uint32_t(b[4 * i + 2]) << 8) | uint32_t(b[4 * i + 3]);
    }
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h_[0], b2 = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6],
             h = h_[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = h + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b2) ^ (a & c) ^ (b2 & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b2;
      b2 = a;
      a = t1 + t2;
    }
    h_[0] += a;
    h_[1] += b2;
    h_[2] += c;
    h_[3] += d;
    h_[4] += e;
    h_[5] += f;
    h_[6] += g;
    h_[7] += h;
  }

  uint32_t h_[8];
  uint8_t buf_[64];
  size_t fill_;
  uint64_t len_;
};

// Hex SHA-256 of a file; false when it cannot be read.
// The digest of an open file's bytes, read through its descriptor (the bytes hashed
// are the bytes of the file that was type- and size-checked, not of whatever the path
// names by now). False when the file no longer has the size it was opened with, or when
// `sink` (given each chunk as it is hashed: a copy that holds exactly the hashed bytes) fails.
inline bool Sha256Fd(int fd, uint64_t size, std::string* hex,
                     const std::function<bool(const char*, size_t)>& sink = nullptr) {
  Sha256 h;
  char buf[1 << 16];
  uint64_t off = 0;
  while (off < size) {
    size_t want = size - off < sizeof(buf) ? static_cast<size_t>(size - off) : sizeof(buf);
    ssize_t n = ::pread(fd, buf, want, static_cast<off_t>(off));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    h.Update(buf, static_cast<size_t>(n));
    if (sink && !sink(buf, static_cast<size_t>(n))) return false;
    off += static_cast<uint64_t>(n);
  }
  char extra;
  if (::pread(fd, &extra, 1, static_cast<off_t>(size)) != 0) return false;  // it grew
  *hex = h.HexDigest();
  return true;
}

}  // namespace edge

#endif  // EDGE_APP_SHA256_H_
