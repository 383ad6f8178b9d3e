// The data sets: synthetic samples, a safetensors file of samples, and token
// files (data.source: tokens): one file or a blend of several (data.sources),
// each sample a window of seq_len + 1 ids, and with data.documents the packed
// documents' starts and the loss's boundaries.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "runner/train/data.h"

namespace composer {

// The data set of c.data; throws FileError or ConfigError.
std::unique_ptr<DataSet> make_dataset(const ExperimentConfig& c, const DataPlan& plan);

// A token file read whole as its documents: the ids, each document's end
// (PATH.docs, which must exist) and, when PATH.mask exists, each token's
// loss-mask byte (1: scored as a target); FileErrors as training's.
struct Documents {
  std::vector<int64_t> tokens;
  std::vector<int64_t> ends;  // document d is tokens [ends[d-1] (0 for d = 0), ends[d])
  std::vector<uint8_t> mask;  // empty: every target counts
  bool counted(int64_t token) const { return mask.empty() || mask[static_cast<size_t>(token)] != 0; }
};
Documents read_documents(const std::string& path, TokenDType dtype);

}  // namespace composer
