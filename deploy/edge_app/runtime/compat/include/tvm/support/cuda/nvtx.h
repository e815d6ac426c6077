// blockforge edge_app: stand-in for <tvm/support/cuda/nvtx.h> (not in the wheel).
// The CPU-only runtime has no NVTX: ranges are no-ops.
#ifndef BLOCKFORGE_COMPAT_TVM_SUPPORT_CUDA_NVTX_H_
#define BLOCKFORGE_COMPAT_TVM_SUPPORT_CUDA_NVTX_H_

#include <string>

namespace tvm {
namespace support {

class NVTXScopedRange {
 public:
  explicit NVTXScopedRange(const char*) {}
  explicit NVTXScopedRange(const std::string&) {}
  NVTXScopedRange(const NVTXScopedRange&) = delete;
  NVTXScopedRange& operator=(const NVTXScopedRange&) = delete;
};

}  // namespace support
}  // namespace tvm

#endif  // BLOCKFORGE_COMPAT_TVM_SUPPORT_CUDA_NVTX_H_
