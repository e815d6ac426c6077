// blockforge edge_app: stand-in for tvm/src/support/utils.h (not in the wheel),
// reduced to what the runtime files built for the edge app use.
#ifndef BLOCKFORGE_COMPAT_SUPPORT_UTILS_H_
#define BLOCKFORGE_COMPAT_SUPPORT_UTILS_H_

#include <cctype>
#include <string>

namespace tvm {
namespace support {

// True for a non-empty string of decimal digits.
inline bool IsNumber(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace support
}  // namespace tvm

#endif  // BLOCKFORGE_COMPAT_SUPPORT_UTILS_H_
