// The MLP-shaped seed models of PyTorch's composability tests (docs/scenarios.md
// M1-M3, M5-M8) with their exact shapes and fully-qualified names.
#include <cmath>

#include "models/layers.h"
#include "models/model_decl.h"

namespace composer::models {
namespace {

using nn::Linear;
using nn::ReLU;

std::shared_ptr<Linear> make_linear(int64_t in, int64_t out, bool bias = true) {
  return std::make_shared<Linear>(in, out, bias);
}

// M1/M3: net1=Linear(dim, hidden), relu, net2=Linear(hidden, dim).
class MLPModule : public Model {
 public:
  MLPModule(int64_t dim, int64_t hidden, bool kaiming) : Model("MLPModule"), dim_(dim) {
    net1 = add("net1", make_linear(dim, hidden));
    relu = add("relu", std::make_shared<ReLU>());
    net2 = add("net2", make_linear(hidden, dim));
    if (kaiming) {  // test_composability.py: kaiming_uniform_(fan_in, relu) on both weights
      auto kaiming = [](torch::Tensor& w) { torch::nn::init::kaiming_uniform_(w, 0, torch::kFanIn, torch::kReLU); };
      nn::init_param(net1->weight, kaiming);
      nn::init_param(net2->weight, kaiming);
    }
  }
  torch::Tensor forward(torch::Tensor x) override { return (*net2)((*relu)((*net1)(x))); }
  InputSpec input_spec() const override { return {false, dim_}; }
  std::shared_ptr<Linear> net1, net2;
  std::shared_ptr<ReLU> relu;

 private:
  int64_t dim_;
};

// M2: relu(net1) -> relu(net2) -> relu(net3), net3 doubles the width.
class MLPModuleEven : public Model {
 public:
  explicit MLPModuleEven(int64_t d) : Model("MLPModuleEven"), dim_(d) {
    net1 = add("net1", make_linear(d, d));
    net2 = add("net2", make_linear(d, d));
    net3 = add("net3", make_linear(d, 2 * d));
  }
  torch::Tensor forward(torch::Tensor x) override {
    return torch::relu((*net3)(torch::relu((*net2)(torch::relu((*net1)(x))))));
  }
  InputSpec input_spec() const override { return {false, dim_}; }
  std::shared_ptr<Linear> net1, net2, net3;

 private:
  int64_t dim_;
};

// M5: relu(out_proj(relu(in_proj(x)))).
class MLP : public Model {
 public:
  MLP(int64_t dim, bool bias, int64_t multiplier) : Model("MLP"), dim_(dim) {
    in_proj = add("in_proj", make_linear(dim, multiplier * dim, bias));
    out_proj = add("out_proj", make_linear(multiplier * dim, dim, bias));
  }
  torch::Tensor forward(torch::Tensor x) override {
    return torch::relu((*out_proj)(torch::relu((*in_proj)(x))));
  }
  InputSpec input_spec() const override { return {false, dim_}; }
  std::shared_ptr<Linear> in_proj, out_proj;

 private:
  int64_t dim_;
};

// nn.Sequential as a model: children "0", "1", ... applied in order (MLPStack).
class SequentialModel : public Model {
 public:
  SequentialModel(const std::string& type, std::vector<std::pair<std::string, nn::ModulePtr>> children,
          int64_t features)
      : Model(type), features_(features) {
    for (auto& [name, child] : children) items_.push_back(add(name, child));
  }
  torch::Tensor forward(torch::Tensor x) override {
    for (auto& m : items_) x = (*m)(x);
    return x;
  }
  InputSpec input_spec() const override { return {false, features_}; }
  // Each child is one piece.
  std::vector<PipelinePiece> pieces() {
    std::vector<PipelinePiece> out;
    for (size_t i = 0; i < items_.size(); ++i) {
      auto m = items_[i];
      out.push_back({std::to_string(i), {std::to_string(i)}, true, [m](torch::Tensor x) { return (*m)(x); }});
    }
    return out;
  }

 private:
  std::vector<nn::ModulePtr> items_;
  int64_t features_;
};

// M7 / M8: a chain of Linear layers with relu after all but (optionally) the last.
class LinearChain : public Model {
 public:
  LinearChain(const std::string& type, const std::vector<int64_t>& widths, bool relu_last)
      : Model(type), features_(widths.front()), relu_last_(relu_last) {
    for (size_t i = 0; i + 1 < widths.size(); ++i) {
      layers_.push_back(add("net" + std::to_string(i + 1), make_linear(widths[i], widths[i + 1])));
    }
  }
  torch::Tensor forward(torch::Tensor x) override {
    for (size_t i = 0; i < layers_.size(); ++i) {
      x = (*layers_[i])(x);
      if (i + 1 < layers_.size() || relu_last_) x = torch::relu(x);
    }
    return x;
  }
  InputSpec input_spec() const override { return {false, features_}; }

 private:
  std::vector<std::shared_ptr<Linear>> layers_;
  int64_t features_;
  bool relu_last_;
};

// n_layers x MLPModule(dim) in "layers" (the pipeline tests' stack of MLPModules).
class MLPModuleLayers : public Model {
 public:
  MLPModuleLayers(int64_t n, int64_t dim, bool kaiming) : Model("MLPModuleLayers"), dim_(dim) {
    layers = add("layers", std::make_shared<nn::ModuleList>());
    for (int64_t i = 0; i < n; ++i) layers->push_back(std::make_shared<MLPModule>(dim, dim, kaiming));
  }
  torch::Tensor forward(torch::Tensor x) override {
    for (size_t i = 0; i < layers->size(); ++i) x = (*layers->at(i))(x);
    return x;
  }
  InputSpec input_spec() const override { return {false, dim_}; }
  std::vector<PipelinePiece> pieces() { return layer_pieces("layers", *layers); }
  std::shared_ptr<nn::ModuleList> layers;

 private:
  int64_t dim_;
};

// Tensor-parallel plans: colwise then rowwise, so each MLP block issues one
// all-reduce in forward (the rowwise output) and one in backward (the colwise
// input's gradient). None has a sequence-parallel variant.

ModelSpec mlp_module() {
  return ModelDecl<MLPModule>("mlp_module", "MLPModule: net1=Linear(dim,hidden), relu, net2=Linear(hidden,dim)")
      .args({int_arg("dim", 10, "input and output width"),
             int_arg("hidden", 0, "net1 output width; 0 means dim (16 for the 10-16-10 model)"),
             bool_arg("kaiming_init", false, "kaiming_uniform_(fan_in, relu) on both weights")})
      .check([](const ModelArgs& a) {
        require_arg_positive(a, "dim");
        if (a.i("hidden") < 0) throw ArgError("hidden", "hidden must be 0 or positive");
      })
      .build([](const ModelArgs& a) {
        int64_t h = a.i("hidden") ? a.i("hidden") : a.i("dim");
        return std::make_shared<MLPModule>(a.i("dim"), h, a.b("kaiming_init"));
      })
      .tp_plan({colwise("net1"), rowwise("net2")});
}

ModelSpec mlp_module_even() {
  return ModelDecl<MLPModuleEven>("mlp_module_even",
                                  "MLPModuleEven: relu(net1) -> relu(net2) -> relu(net3), net3 to 2*dim")
      .args({int_arg("dim", 8, "input width")})
      .check([](const ModelArgs& a) { require_arg_positive(a, "dim"); })
      .build([](const ModelArgs& a) { return std::make_shared<MLPModuleEven>(a.i("dim")); })
      .tp_plan({colwise("net1"), rowwise("net2"), colwise("net3", Layout::replicate(), Layout::replicate())});
}

ModelSpec mlp_module_layers() {
  return ModelDecl<MLPModuleLayers>("mlp_module_layers", "n_layers x MLPModule(dim) in layers.0 .. layers.<n-1>")
      .args({int_arg("n_layers", 8, "number of MLPModule layers"), int_arg("dim", 10, "width"),
             bool_arg("kaiming_init", false, "kaiming_uniform_(fan_in, relu) on the weights")})
      .check([](const ModelArgs& a) {
        require_arg_positive(a, "n_layers");
        require_arg_positive(a, "dim");
      })
      .build([](const ModelArgs& a) {
        return std::make_shared<MLPModuleLayers>(a.i("n_layers"), a.i("dim"), a.b("kaiming_init"));
      })
      .pipeline(&MLPModuleLayers::pieces)
      .tp_plan({colwise("layers.*.net1"), rowwise("layers.*.net2")});
}

ModelSpec mlp() {
  return ModelDecl<MLP>("mlp", "MLP: relu(out_proj(relu(in_proj(x)))), in_proj to dim_multiplier*dim")
      .args({int_arg("dim", 8, "input width"), bool_arg("bias", true, "linear biases"),
             int_arg("dim_multiplier", 4, "hidden width multiplier")})
      .check([](const ModelArgs& a) {
        require_arg_positive(a, "dim");
        require_arg_positive(a, "dim_multiplier");
      })
      .build([](const ModelArgs& a) { return std::make_shared<MLP>(a.i("dim"), a.b("bias"), a.i("dim_multiplier")); })
      .tp_plan({colwise("in_proj"), rowwise("out_proj")});
}

ModelSpec mlp_stack() {
  return ModelDecl<SequentialModel>("mlp_stack",
                                    "MLPStack: MLP(d, x3), MLP(d, x4), MLP(d, x3) [, LayerNorm(d, no bias)]")
      .args({int_arg("mlp_dim", 16, "model width"),
             bool_arg("with_seq_parallel", false, "append LayerNorm(mlp_dim, bias=False) as child 3")})
      .check([](const ModelArgs& a) { require_arg_positive(a, "mlp_dim"); })
      .build([](const ModelArgs& a) {
        int64_t d = a.i("mlp_dim");
        std::vector<std::pair<std::string, nn::ModulePtr>> kids = {{"0", std::make_shared<MLP>(d, true, 3)},
                                                                   {"1", std::make_shared<MLP>(d, true, 4)},
                                                                   {"2", std::make_shared<MLP>(d, true, 3)}};
        if (a.b("with_seq_parallel")) kids.push_back({"3", std::make_shared<nn::LayerNorm>(d, 1e-5, false)});
        return std::make_shared<SequentialModel>("MLPStack", kids, d);
      })
      .pipeline(&SequentialModel::pieces)
      .tp_plan({colwise("*.in_proj"), rowwise("*.out_proj")});
}

// No built-in tensor-parallel plan (plan: custom gives one).
ModelSpec mlp_seq() {
  return ModelDecl<SequentialModel>(
             "mlp_seq", "Sequential(n_mlps x MLP(dim, bias, dim_multiplier)): the all-gather extension model")
      .args({int_arg("n_mlps", 3, "number of MLPs"), int_arg("dim", 8, "width"),
             bool_arg("bias", false, "linear biases"), int_arg("dim_multiplier", 4, "hidden width multiplier")})
      .check([](const ModelArgs& a) {
        require_arg_positive(a, "n_mlps");
        require_arg_positive(a, "dim");
        require_arg_positive(a, "dim_multiplier");
      })
      .build([](const ModelArgs& a) {
        std::vector<std::pair<std::string, nn::ModulePtr>> kids;
        for (int64_t i = 0; i < a.i("n_mlps"); ++i) {
          kids.push_back({std::to_string(i), std::make_shared<MLP>(a.i("dim"), a.b("bias"), a.i("dim_multiplier"))});
        }
        return std::make_shared<SequentialModel>("MLPSeq", kids, a.i("dim"));
      })
      .pipeline(&SequentialModel::pieces);
}

ModelSpec simple_model() {
  return ModelDecl<LinearChain>("simple_model", "SimpleModel: Linear(5,8), Linear(8,4), Linear(4,12), relu after each")
      .build([](const ModelArgs&) {
        return std::make_shared<LinearChain>("SimpleModel", std::vector<int64_t>{5, 8, 4, 12}, true);
      })
      .tp_plan({colwise("net1"), rowwise("net2"), colwise("net3", Layout::replicate(), Layout::replicate())});
}

ModelSpec simple_model_uneven() {
  return ModelDecl<LinearChain>("simple_model_uneven",
                                "SimpleModelUneven: Linear(5,10), (10,15), (15,30), (30,5), relu after the first three")
      .build([](const ModelArgs&) {
        return std::make_shared<LinearChain>("SimpleModelUneven", std::vector<int64_t>{5, 10, 15, 30, 5}, false);
      })
      .tp_plan({colwise("net1"), rowwise("net2"), colwise("net3"), rowwise("net4")});
}

}  // namespace

// In registration order: the order of the registry and of the names in messages.
std::vector<ModelSpec> mlp_specs() {
  return {mlp_module(), mlp_module_even(), mlp_module_layers(), mlp(),
          mlp_stack(),  mlp_seq(),         simple_model(),      simple_model_uneven()};
}

}  // namespace composer::models
