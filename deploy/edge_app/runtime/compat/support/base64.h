// blockforge edge_app: stand-in for tvm/src/support/base64.h (not in the wheel).
// Standard base64 (RFC 4648, '=' padding) layered on another Stream; the runtime
// uses it only for the JSON form of tensors.
#ifndef BLOCKFORGE_COMPAT_SUPPORT_BASE64_H_
#define BLOCKFORGE_COMPAT_SUPPORT_BASE64_H_

#include <tvm/ffi/error.h>
#include <tvm/support/io.h>

#include <cctype>
#include <cstdint>
#include <string>

namespace tvm {
namespace support {

namespace base64_detail {
inline const char* Alphabet() {
  return "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
}
inline int Decode(int c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}
}  // namespace base64_detail

class Base64OutStream : public Stream {
 public:
  using Stream::Read;
  using Stream::Write;
  explicit Base64OutStream(Stream* sink) : sink_(sink) {}
  size_t Write(const void* ptr, size_t size) final {
    const unsigned char* p = static_cast<const unsigned char*>(ptr);
    for (size_t i = 0; i < size; ++i) {
      buf_[n_++] = p[i];
      if (n_ == 3) Emit();
    }
    return size;
  }
  size_t Read(void*, size_t) final {
    TVM_FFI_THROW(InternalError) << "Base64OutStream is write-only";
    TVM_FFI_UNREACHABLE();
  }
  // Writes the last partial group with padding.
  void Finish() {
    if (n_ != 0) Emit();
  }

 private:
  void Emit() {
    const char* a = base64_detail::Alphabet();
    uint32_t v = (uint32_t(buf_[0]) << 16) | (n_ > 1 ? uint32_t(buf_[1]) << 8 : 0) |
                 (n_ > 2 ? uint32_t(buf_[2]) : 0);
    char out[4] = {a[(v >> 18) & 63], a[(v >> 12) & 63], n_ > 1 ? a[(v >> 6) & 63] : '=',
                   n_ > 2 ? a[v & 63] : '='};
    sink_->Write(static_cast<const void*>(out), 4);
    n_ = 0;
  }
  Stream* sink_;
  unsigned char buf_[3] = {0, 0, 0};
  int n_ = 0;
};

class Base64InStream : public Stream {
 public:
  using Stream::Read;
  using Stream::Write;
  explicit Base64InStream(Stream* src) : src_(src) {}
  // Skips leading whitespace.
  void InitPosition() {
    int c;
    while ((c = Next()) != -1 && std::isspace(c)) {
    }
    pushback_ = c;
  }
  size_t Read(void* ptr, size_t size) final {
    unsigned char* p = static_cast<unsigned char*>(ptr);
    size_t done = 0;
    while (done < size) {
      if (have_ == 0 && !Refill()) break;
      p[done++] = out_[3 - have_];
      --have_;
    }
    return done;
  }
  size_t Write(const void*, size_t) final {
    TVM_FFI_THROW(InternalError) << "Base64InStream is read-only";
    TVM_FFI_UNREACHABLE();
  }

 private:
  int Next() {
    if (pushback_ != -2) {
      int c = pushback_;
      pushback_ = -2;
      return c;
    }
    unsigned char ch;
    return src_->Read(&ch, 1) == 1 ? ch : -1;
  }
  bool Refill() {
    if (done_) return false;
    int q[4];
    for (int i = 0; i < 4; ++i) {
      q[i] = Next();
      if (q[i] == -1 || std::isspace(q[i])) {
        done_ = true;
        return false;
      }
    }
    int a = base64_detail::Decode(q[0]), b = base64_detail::Decode(q[1]);
    TVM_FFI_ICHECK(a >= 0 && b >= 0) << "invalid base64 data";
    uint32_t v = (uint32_t(a) << 18) | (uint32_t(b) << 12);
    int count = 1;
    if (q[2] != '=') {
      int c = base64_detail::Decode(q[2]);
      TVM_FFI_ICHECK(c >= 0) << "invalid base64 data";
      v |= uint32_t(c) << 6;
      ++count;
      if (q[3] != '=') {
        int d = base64_detail::Decode(q[3]);
        TVM_FFI_ICHECK(d >= 0) << "invalid base64 data";
        v |= uint32_t(d);
        ++count;
      }
    }
    if (count < 3) done_ = true;
    unsigned char bytes[3] = {static_cast<unsigned char>(v >> 16), static_cast<unsigned char>(v >> 8),
                              static_cast<unsigned char>(v)};
    // out_ is consumed from index 3 - have_, so right-align the decoded bytes.
    for (int i = 0; i < 3; ++i) out_[i] = 0;
    for (int i = 0; i < count; ++i) out_[3 - count + i] = bytes[i];
    have_ = count;
    return true;
  }
  Stream* src_;
  int pushback_ = -2;  // -2: none
  unsigned char out_[3] = {0, 0, 0};
  int have_ = 0;
  bool done_ = false;
};

}  // namespace support
}  // namespace tvm

#endif  // BLOCKFORGE_COMPAT_SUPPORT_BASE64_H_
