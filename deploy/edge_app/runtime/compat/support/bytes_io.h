// blockforge edge_app: stand-in for tvm/src/support/bytes_io.h (not in the wheel):
// streams over an in-memory byte string.
#ifndef BLOCKFORGE_COMPAT_SUPPORT_BYTES_IO_H_
#define BLOCKFORGE_COMPAT_SUPPORT_BYTES_IO_H_

#include <tvm/ffi/string.h>
#include <tvm/support/io.h>
#include <tvm/support/serializer.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace tvm {
namespace support {

// Reads from a byte string that outlives the stream (an ffi::Bytes is kept alive).
class BytesInStream : public Stream {
 public:
  using Stream::Read;
  using Stream::Write;
  explicit BytesInStream(const std::string& s) : data_(s.data()), size_(s.size()) {}
  BytesInStream(std::string&&) = delete;  // would dangle
  explicit BytesInStream(const ffi::Bytes& b) : keep_(b), data_(keep_.data()), size_(keep_.size()) {}
  BytesInStream(const char* data, size_t size) : data_(data), size_(size) {}

  size_t Read(void* ptr, size_t size) final {
    size_t n = std::min(size, size_ - pos_);
    if (n != 0) std::memcpy(ptr, data_ + pos_, n);
    pos_ += n;
    return n;
  }
  size_t Write(const void*, size_t) final {
    TVM_FFI_THROW(InternalError) << "BytesInStream is read-only";
    TVM_FFI_UNREACHABLE();
  }
  size_t Tell() const { return pos_; }
  void Seek(size_t pos) { pos_ = std::min(pos, size_); }

 private:
  ffi::Bytes keep_;
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
};

// Appends to a std::string.
class BytesOutStream : public Stream {
 public:
  using Stream::Read;
  using Stream::Write;
  explicit BytesOutStream(std::string* out) : out_(out) {}
  size_t Write(const void* ptr, size_t size) final {
    out_->append(static_cast<const char*>(ptr), size);
    return size;
  }
  size_t Read(void*, size_t) final {
    TVM_FFI_THROW(InternalError) << "BytesOutStream is write-only";
    TVM_FFI_UNREACHABLE();
  }

 private:
  std::string* out_;
};

}  // namespace support
}  // namespace tvm

#endif  // BLOCKFORGE_COMPAT_SUPPORT_BYTES_IO_H_
