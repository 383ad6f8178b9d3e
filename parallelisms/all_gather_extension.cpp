// Shard geometry (torch.chunk pieces padded to the largest) and the
// all-gather extensions fully_shard applies to each parameter's shard.
#include <optional>

#include "parallelisms/fully_shard.h"

namespace composer::parallel {

namespace {

// One tensor per parameter: the padded shard, cast for the wire to `wire`
// (or to the compute dtype), and back to the compute dtype after.
class CastGather : public AllGatherExtension {
 public:
  CastGather(std::string name, std::optional<c10::ScalarType> wire) : name_(std::move(name)), wire_(wire) {}
  std::string name() const override { return name_; }
  std::vector<torch::Tensor> pre_all_gather(const torch::Tensor& shard, const ShardInfo& info,
                                            c10::ScalarType param_dtype) const override {
    return {pad_shard(shard, info).to(wire_.value_or(param_dtype))};
  }
  torch::Tensor post_all_gather(const std::vector<torch::Tensor>& gathered, const ShardInfo& info,
                                c10::ScalarType param_dtype, const torch::Tensor& out) const override {
    return unpad_cat(gathered[0], info, param_dtype, out);
  }
  bool writes_alone() const override { return true; }
  void write_alone(const torch::Tensor& shard, const ShardInfo& info, c10::ScalarType,
                   const torch::Tensor& out) const override {
    auto whole = shard.reshape(info.full_shape);
    const_cast<torch::Tensor&>(out).copy_(wire_ ? whole.to(*wire_) : whole);  // the wire's rounding, as gathered
  }

 private:
  std::string name_;
  std::optional<c10::ScalarType> wire_;
};

class SplitBfloat16Gather : public AllGatherExtension {
 public:
  std::string name() const override { return "split_bfloat16"; }
  std::vector<torch::Tensor> pre_all_gather(const torch::Tensor& shard, const ShardInfo& info,
                                            c10::ScalarType) const override {
    auto x = pad_shard(shard, info).to(torch::kFloat);
    auto hi = x.to(torch::kBFloat16);
    return {hi, x - hi.to(torch::kFloat)};  // the remainder is exact in float32
  }
  torch::Tensor post_all_gather(const std::vector<torch::Tensor>& gathered, const ShardInfo& info,
                                c10::ScalarType param_dtype, const torch::Tensor& out) const override {
    auto sum = unpad_cat(gathered[0], info, torch::kFloat, {}) + unpad_cat(gathered[1], info, torch::kFloat, {});
    if (!out.defined()) return sum.to(param_dtype);
    out.copy_(sum);
    return out;
  }
};

}  // namespace

int64_t ShardInfo::offset(int r) const {
  int64_t o = 0;
  for (int i = 0; i < r; ++i) o += sizes[i];
  return o;
}

std::vector<int64_t> ShardInfo::shard_shape(int r) const {
  auto s = full_shape;
  s[dim] = sizes[r];
  return s;
}

std::vector<int64_t> ShardInfo::padded_shape() const { return shard_shape(0); }  // torch.chunk: rank 0's is largest

torch::Tensor pad_shard(const torch::Tensor& shard, const ShardInfo& info) {
  const auto padded = info.padded_shape();
  if (shard.sizes().vec() == padded) return shard;
  auto out = torch::zeros(padded, shard.options());
  out.narrow(info.dim, 0, shard.size(info.dim)).copy_(shard);
  return out;
}

torch::Tensor unpad_cat(const torch::Tensor& gathered, const ShardInfo& info, c10::ScalarType dtype,
                        const torch::Tensor& out) {
  std::vector<torch::Tensor> pieces;
  for (int r = 0; r < info.world; ++r) {
    if (info.sizes[r]) pieces.push_back(gathered[r].narrow(info.dim, 0, info.sizes[r]));
  }
  if (pieces.empty()) pieces.push_back(gathered[0].narrow(info.dim, 0, 0));
  if (out.defined()) {
    if (gathered.scalar_type() == out.scalar_type()) {
      at::cat_out(const_cast<torch::Tensor&>(out), pieces, info.dim);
    } else {
      out.copy_(torch::cat(pieces, info.dim));
    }
    return out;
  }
  return torch::cat(pieces, info.dim).to(dtype);
}

std::shared_ptr<AllGatherExtension> make_all_gather_extension(const std::string& name) {
  if (name == "bfloat16") return std::make_shared<CastGather>("bfloat16", torch::kBFloat16);
  if (name == "split_bfloat16") return std::make_shared<SplitBfloat16Gather>();
  return nullptr;
}

std::vector<std::string> all_gather_extension_names() { return {"bfloat16", "split_bfloat16"}; }

const AllGatherExtension& default_all_gather() {
  static CastGather d("default", std::nullopt);
  return d;
}

}  // namespace composer::parallel
