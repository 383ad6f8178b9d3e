#include "parallelisms/config_fields.h"

#include <algorithm>

namespace composer {

c10::ScalarType scalar_type_of(DType d) {
  switch (d) {
    case DType::kFloat64: return c10::kDouble;
    case DType::kBFloat16: return c10::kBFloat16;
    case DType::kFloat16: return c10::kHalf;
    case DType::kFloat32: break;
  }
  return c10::kFloat;
}

std::vector<std::string> flat_dims(const std::vector<std::string>& entries) {
  std::vector<std::string> out;
  for (const auto& e : entries) {
    for (size_t at = 0; at <= e.size();) {
      const size_t end = std::min(e.find('+', at), e.size());
      out.push_back(e.substr(at, end - at));
      at = end + 1;
    }
  }
  return out;
}

}  // namespace composer
