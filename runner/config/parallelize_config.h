// The parallelize section of the experiment config: each entry is one of the
// transforms parallelisms/transforms.h registers, read by walking its
// Config's field list (parallelisms/config_fields.h): its YAML key is the
// Config's kKey and its fields are its YAML keys (and --set paths,
// parallelize[i].KEY.FIELD).
#pragma once
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>
#include <vector>

#include "parallelisms/transforms.h"
#include "runner/base/errors.h"
#include "runner/config/yaml_reader.h"

namespace composer {

// The transforms' configs, by the names the runner uses.
using PipelineConfig = parallel::PipelineConfig;
using TensorParallelConfig = parallel::TensorParallelConfig;
using ContextParallelConfig = parallel::ContextParallelConfig;
using ExpertParallelConfig = parallel::ExpertParallelConfig;
using ActivationCheckpointingConfig = parallel::ActivationCheckpointingConfig;
using FullyShardConfig = parallel::FullyShardConfig;
using ReplicateConfig = parallel::ReplicateConfig;
using Schedule = parallel::ScheduleKind;
using ShardPlacement = parallel::ShardPlacement;
using AllGather = parallel::AllGather;
using Offload = parallel::Offload;
const char* name_of(models::TpStyle v);

// One entry of `parallelize`: its options and where it and each of its keys were written.
struct TransformConfig {
  parallel::Transform options;
  SourceRef ref;                          // the transform's key
  std::map<std::string, SourceRef> refs;  // each key given
  const char* name() const { return parallel::name_of(options); }
  std::vector<std::string> mesh_dim() const;  // the dims it spans, "a+b" entries split ([] without mesh_dim)
  std::vector<std::string> mesh_dim_entries() const;  // its mesh_dim as written ([] without one)
  // Where `key` was written, else where the transform was.
  const SourceRef& ref_of(const std::string& key) const;
  // Its options, when it is a T.
  template <class T>
  const T* get() const {
    return std::get_if<T>(&options);
  }
};

// The YAML keys of the transforms, in the order parallelisms/transforms.h registers them.
std::vector<std::string> transform_names();

// {KEY: {field: value, ...}} as the resolved config writes an entry: every
// field, enums by name, an unset dtype as "".
nlohmann::json to_json(const parallel::Transform& t);

// Every registered transform with its default options, as to_json writes them (the docs' key table is checked against it).
std::vector<parallel::Transform> default_transforms();

}  // namespace composer
