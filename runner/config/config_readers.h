// The section readers config.cpp and config_parallelize.cpp share; internal
// to runner/config.
#pragma once
#include <string>
#include <vector>

#include "runner/config/config.h"
#include "runner/config/yaml_reader.h"

namespace composer {

// Reads a dtype-valued key (float32, float64, bfloat16, float16) into `out` when present.
void read_dtype(YamlMap& m, const std::string& key, DType& out);

// The parallelize section: its transforms in the order written.
std::vector<TransformConfig> read_parallelize(YamlMap& root);

}  // namespace composer
