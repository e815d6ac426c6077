// blockforge edge_app: stand-in for <tvm/support/serializer.h> (not shipped in the
// apache-tvm wheel). The wire format must match what TVM writes when it exports a
// module: little-endian scalars; strings, vectors, arrays and maps as a uint64
// element count followed by the elements; DLDataType as code:u8 bits:u8 lanes:u16;
// DLDevice as type:i32 id:i32.
#ifndef BLOCKFORGE_COMPAT_TVM_SUPPORT_SERIALIZER_H_
#define BLOCKFORGE_COMPAT_TVM_SUPPORT_SERIALIZER_H_

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/endian.h>
#include <tvm/ffi/string.h>
#include <tvm/support/io.h>

#include <map>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tvm {
namespace support {

namespace compat_detail {
inline bool ReadCount(Stream* s, uint64_t* n);
inline void WriteCount(Stream* s, uint64_t n);
}  // namespace compat_detail

template <typename T>
struct Serializer<T, std::enable_if_t<std::is_arithmetic_v<T>>> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const T& v) {
    T x = v;
    if (!TVM_FFI_IO_NO_ENDIAN_SWAP) ffi::ByteSwap(&x, sizeof(T), 1);
    s->Write(static_cast<const void*>(&x), sizeof(T));
  }
  static bool Read(Stream* s, T* v) {
    if (s->Read(static_cast<void*>(v), sizeof(T)) != sizeof(T)) return false;
    if (!TVM_FFI_IO_NO_ENDIAN_SWAP) ffi::ByteSwap(v, sizeof(T), 1);
    return true;
  }
};

template <typename T>
struct Serializer<T, std::enable_if_t<std::is_enum_v<T>>> {
  static constexpr bool enabled = true;
  using U = std::underlying_type_t<T>;
  static void Write(Stream* s, const T& v) { Serializer<U>::Write(s, static_cast<U>(v)); }
  static bool Read(Stream* s, T* v) {
    U u{};
    if (!Serializer<U>::Read(s, &u)) return false;
    *v = static_cast<T>(u);
    return true;
  }
};

template <>
struct Serializer<std::string> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const std::string& v) {
    compat_detail::WriteCount(s, v.size());
    if (!v.empty()) s->Write(static_cast<const void*>(v.data()), v.size());
  }
  static bool Read(Stream* s, std::string* v) {
    uint64_t n;
    if (!compat_detail::ReadCount(s, &n)) return false;
    v->resize(static_cast<size_t>(n));
    return n == 0 || s->Read(static_cast<void*>(&(*v)[0]), v->size()) == v->size();
  }
};

template <>
struct Serializer<ffi::String> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const ffi::String& v) {
    compat_detail::WriteCount(s, v.size());
    if (v.size() != 0) s->Write(static_cast<const void*>(v.data()), v.size());
  }
  static bool Read(Stream* s, ffi::String* v) {
    std::string tmp;
    if (!Serializer<std::string>::Read(s, &tmp)) return false;
    *v = ffi::String(std::move(tmp));
    return true;
  }
};

template <typename T>
struct Serializer<std::vector<T>> {
  static constexpr bool enabled = true;
  static constexpr bool kRaw = std::is_arithmetic_v<T> && TVM_FFI_IO_NO_ENDIAN_SWAP;
  static void Write(Stream* s, const std::vector<T>& v) {
    compat_detail::WriteCount(s, v.size());
    if constexpr (kRaw) {
      if (!v.empty()) s->Write(static_cast<const void*>(v.data()), v.size() * sizeof(T));
    } else {
      for (const T& x : v) Serializer<T>::Write(s, x);
    }
  }
  static bool Read(Stream* s, std::vector<T>* v) {
    uint64_t n;
    if (!compat_detail::ReadCount(s, &n)) return false;
    v->resize(static_cast<size_t>(n));
    if constexpr (kRaw) {
      size_t bytes = v->size() * sizeof(T);
      return bytes == 0 || s->Read(static_cast<void*>(v->data()), bytes) == bytes;
    } else {
      for (auto& x : *v) {
        if (!Serializer<T>::Read(s, &x)) return false;
      }
      return true;
    }
  }
};

template <typename A, typename B>
struct Serializer<std::pair<A, B>> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const std::pair<A, B>& v) {
    Serializer<A>::Write(s, v.first);
    Serializer<B>::Write(s, v.second);
  }
  static bool Read(Stream* s, std::pair<A, B>* v) {
    return Serializer<A>::Read(s, &v->first) && Serializer<B>::Read(s, &v->second);
  }
};

// Associative containers travel as a vector of (key, value) pairs.
template <typename M>
struct CompatMapSerializer {
  static constexpr bool enabled = true;
  using K = typename M::key_type;
  using V = typename M::mapped_type;
  static void Write(Stream* s, const M& m) {
    std::vector<std::pair<K, V>> items(m.begin(), m.end());
    Serializer<std::vector<std::pair<K, V>>>::Write(s, items);
  }
  static bool Read(Stream* s, M* m) {
    std::vector<std::pair<K, V>> items;
    if (!Serializer<std::vector<std::pair<K, V>>>::Read(s, &items)) return false;
    m->clear();
    for (auto& kv : items) m->emplace(std::move(kv.first), std::move(kv.second));
    return true;
  }
};
template <typename K, typename V>
struct Serializer<std::unordered_map<K, V>> : CompatMapSerializer<std::unordered_map<K, V>> {};
template <typename K, typename V>
struct Serializer<std::map<K, V>> : CompatMapSerializer<std::map<K, V>> {};

template <typename T>
struct Serializer<ffi::Array<T>> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const ffi::Array<T>& v) {
    compat_detail::WriteCount(s, v.size());
    for (const auto& x : v) Serializer<T>::Write(s, x);
  }
  static bool Read(Stream* s, ffi::Array<T>* v) {
    uint64_t n;
    if (!compat_detail::ReadCount(s, &n)) return false;
    ffi::Array<T> out;
    for (uint64_t i = 0; i < n; ++i) {
      T x;
      if (!Serializer<T>::Read(s, &x)) return false;
      out.push_back(std::move(x));
    }
    *v = std::move(out);
    return true;
  }
};

template <typename K, typename V>
struct Serializer<ffi::Map<K, V>> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const ffi::Map<K, V>& m) {
    compat_detail::WriteCount(s, m.size());
    for (const auto& kv : m) {
      Serializer<K>::Write(s, kv.first);
      Serializer<V>::Write(s, kv.second);
    }
  }
  static bool Read(Stream* s, ffi::Map<K, V>* m) {
    uint64_t n;
    if (!compat_detail::ReadCount(s, &n)) return false;
    ffi::Map<K, V> out;
    for (uint64_t i = 0; i < n; ++i) {
      K k;
      V v;
      if (!Serializer<K>::Read(s, &k) || !Serializer<V>::Read(s, &v)) return false;
      out.Set(std::move(k), std::move(v));
    }
    *m = std::move(out);
    return true;
  }
};

template <>
struct Serializer<DLDataType> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const DLDataType& t) {
    Serializer<uint8_t>::Write(s, t.code);
    Serializer<uint8_t>::Write(s, t.bits);
    Serializer<uint16_t>::Write(s, t.lanes);
  }
  static bool Read(Stream* s, DLDataType* t) {
    return Serializer<uint8_t>::Read(s, &t->code) && Serializer<uint8_t>::Read(s, &t->bits) &&
           Serializer<uint16_t>::Read(s, &t->lanes);
  }
};

template <>
struct Serializer<DLDevice> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const DLDevice& d) {
    Serializer<int32_t>::Write(s, static_cast<int32_t>(d.device_type));
    Serializer<int32_t>::Write(s, d.device_id);
  }
  static bool Read(Stream* s, DLDevice* d) {
    int32_t type = 0;
    if (!Serializer<int32_t>::Read(s, &type) || !Serializer<int32_t>::Read(s, &d->device_id)) {
      return false;
    }
    d->device_type = static_cast<DLDeviceType>(type);
    return true;
  }
};

namespace compat_detail {
inline bool ReadCount(Stream* s, uint64_t* n) { return Serializer<uint64_t>::Read(s, n); }
inline void WriteCount(Stream* s, uint64_t n) { Serializer<uint64_t>::Write(s, n); }
}  // namespace compat_detail

}  // namespace support
}  // namespace tvm

#endif  // BLOCKFORGE_COMPAT_TVM_SUPPORT_SERIALIZER_H_
