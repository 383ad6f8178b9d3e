// The data sets: synthetic samples, a safetensors file of samples, and token
// files (data.source: tokens): one file or a blend of several (data.sources),
// each sample a window of seq_len + 1 ids, and with data.documents the packed
// documents' starts and the loss's boundaries.
#pragma once
#include <memory>
#include <string>

#include "runner/train/data.h"

namespace composer {

// The data set of c.data; throws FileError or ConfigError.
std::unique_ptr<DataSet> make_dataset(const ExperimentConfig& c, const DataPlan& plan);

}  // namespace composer
