// Built without CUDA: the CUDA executors do not exist.
#include "copy/engine_base.h"

namespace kvtier::copy_detail {

Result<std::unique_ptr<CopyEngine>> create_cuda_copy_engine(Device&, const CopyEngineOptions&) {
  return NotSupported("kvtier was built without CUDA (KVTIER_CUDA=OFF): no CUDA copy engine");
}

}  // namespace kvtier::copy_detail
