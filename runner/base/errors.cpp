#include "runner/base/errors.h"

#include <algorithm>
#include <sstream>
#include <vector>

namespace composer {

std::string SourceRef::where() const {
  std::ostringstream os;
  if (!override.empty()) {
    os << "--set " << override;
  } else {
    os << (file.empty() ? "<config>" : file);
    if (line > 0) os << ":" << line << ":" << col;
  }
  if (!path.empty()) os << ": " << path;
  return os.str();
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace composer
