// blockforge edge_app: stand-in for <tvm/support/io.h>, which the runtime sources
// shipped in the apache-tvm wheel include but the wheel does not ship. Written for
// the cross-built runtime only; interface as used by tvm/src/runtime.
#ifndef BLOCKFORGE_COMPAT_TVM_SUPPORT_IO_H_
#define BLOCKFORGE_COMPAT_TVM_SUPPORT_IO_H_

#include <cstddef>
#include <cstdint>

namespace tvm {
namespace support {

// Binary encoding of one type; specialised in <tvm/support/serializer.h> and by
// runtime headers (VMFuncInfo, FunctionInfo).
template <typename T, typename Enable = void>
struct Serializer {
  static constexpr bool enabled = false;
};

// A byte stream: subclasses move raw bytes; typed values go through Serializer<T>.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual size_t Read(void* ptr, size_t size) = 0;
  virtual size_t Write(const void* ptr, size_t size) = 0;

  template <typename T>
  void Write(const T& value) {
    static_assert(Serializer<T>::enabled, "type has no Serializer");
    Serializer<T>::Write(this, value);
  }
  template <typename T>
  bool Read(T* out) {
    static_assert(Serializer<T>::enabled, "type has no Serializer");
    return Serializer<T>::Read(this, out);
  }
  template <typename T>
  void WriteArray(const T* values, size_t n) {
    for (size_t i = 0; i < n; ++i) Write<T>(values[i]);
  }
  template <typename T>
  bool ReadArray(T* out, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (!Read<T>(out + i)) return false;
    }
    return true;
  }
};

}  // namespace support
}  // namespace tvm

#endif  // BLOCKFORGE_COMPAT_TVM_SUPPORT_IO_H_
