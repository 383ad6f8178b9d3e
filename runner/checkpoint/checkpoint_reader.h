// Reading a distributed checkpoint (runner/checkpoint.h) by the bytes a
// reader needs: the index, then per rank file its safetensors header and only
// the rows of the stored chunks that overlap the box asked for, each hash
// block of them checked against index.json. Shared by resuming (each rank
// reads its pieces under the current plan) and `composer export` (one process
// reads whole tensors, one at a time).
#pragma once
#include <torch/torch.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "parallelisms/placement.h"
#include "runner/checkpoint/checkpoint_index.h"

namespace composer {

class CheckpointReader {
 public:
  // Reads and validates `folder`/index.json (a FileError when it is missing or malformed).
  explicit CheckpointReader(std::string folder);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const CheckpointIndex& index() const { return index_; }
  const std::string& folder() const { return folder_; }
  const std::string& index_path() const { return index_path_; }

  // Fills `dst`, shaped as `box` of tensor `key`, from every saved chunk that
  // overlaps the box. Errors name the tensor when it is missing, mis-shaped
  // (`global` is the shape the model has) or not fully covered, and the file
  // when its bytes differ from the hashes index.json records.
  void read_box(const std::string& key, const std::vector<int64_t>& global, const parallel::Box& box,
                torch::Tensor dst);
  // The RNG state a rank file holds.
  torch::Tensor read_rng(const std::string& file);
  // Payload bytes read so far (headers and tensor rows).
  int64_t bytes_read() const { return bytes_read_; }

 private:
  struct File {
    int fd = -1;
    std::string path;
    uint64_t data_start = 0;
    nlohmann::json header;
  };
  File& open(const std::string& name);
  // Bytes [begin, end) of tensor `name` of `f` (`hashes`: its blocks), read
  // as the covering hash blocks, each checked.
  std::string read_range(File& f, const std::string& name, uint64_t begin, uint64_t end,
                         const std::vector<std::string>& hashes);

  std::string folder_, index_path_;
  CheckpointIndex index_;
  std::map<std::string, File> files_;
  int64_t bytes_read_ = 0;
};

}  // namespace composer
