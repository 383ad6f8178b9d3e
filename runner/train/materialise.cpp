#include "runner/train/materialise.h"

#include <ATen/CPUGeneratorImpl.h>

#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>

#include "runner/base/errors.h"
#include "runner/base/safetensors.h"

namespace composer {
namespace {

// Points parameter `p` (a meta tensor, perhaps reshaped by the transforms) at
// `value`'s storage, keeping p's TensorImpl, which the transforms' records,
// the layers and autograd know it by. set_data would refuse: a meta and a CPU
// tensor are not shallow-copy compatible, but nothing has computed with p yet.
void take_values(const torch::Tensor& p, const torch::Tensor& value) {
  TORCH_INTERNAL_ASSERT(value.sizes() == p.sizes(), "a parameter of shape ", p.sizes(), " got a value of shape ",
                        value.sizes());
  p.unsafeGetTensorImpl()->shallow_copy_from(value.getIntrusivePtr());
}

// A model's parameters, the recorded initialisations that set them, and where their values go.
struct Materialising {
  // Refuses an initialisation of no parameter, and a parameter without one.
  Materialising(models::Model& model, const std::vector<nn::DeferInit::Step>& steps, const MaterialiseOptions& o)
      : steps(steps), o(o), params(nn::unique_named_parameters(model)), last(params.size(), -1), shapes(params.size()) {
    for (size_t i = 0; i < params.size(); ++i) index.emplace(params[i].second.unsafeGetTensorImpl(), i);
    for (size_t s = 0; s < steps.size(); ++s) {
      auto it = index.find(steps[s].param);
      TORCH_INTERNAL_ASSERT(it != index.end(), "an initialisation was recorded for no parameter of ", model.type());
      last[it->second] = static_cast<int64_t>(s);
      shapes[it->second] = steps[s].shape;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK(last[i] >= 0, "parameter ", params[i].first, " of ", model.type(),
                  " was given no initial values (models set them through nn::new_param or nn::init_param)");
    }
  }

  // Parameter i gets `value` (the rank's piece, on the CPU) where it lives.
  void place(size_t i, torch::Tensor value) const {
    const torch::Tensor& p = params[i].second;
    const c10::Device device = o.device_of ? o.device_of(p) : c10::Device(c10::kCPU);
    value = value.reshape(p.sizes()).clone(at::MemoryFormat::Contiguous);
    if (!device.is_cpu()) value = value.to(device);
    else if (o.pin_host) value = value.pin_memory();
    take_values(p, value);
  }

  // Whether parameter i is one of the rank's own (per-rank) parameters.
  bool own(size_t i) const { return o.own && o.own->count(params[i].second.unsafeGetTensorImpl()); }

  // Every draw runs, so the generator stream is a single-device build's; a
  // value a later step overwrites is dropped at once. `use` gets each
  // parameter's last initialisation.
  void replay(const std::function<void(size_t, torch::Tensor)>& use) const {
    for (size_t s = 0; s < steps.size(); ++s) {
      const size_t i = index.at(steps[s].param);
      torch::Tensor full = torch::empty(steps[s].shape, torch::kFloat);
      steps[s].fill(full);
      if (last[i] == static_cast<int64_t>(s)) use(i, full);
    }
  }

  const std::vector<nn::DeferInit::Step>& steps;
  const MaterialiseOptions& o;
  const std::vector<std::pair<std::string, torch::Tensor>> params;
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  std::vector<int64_t> last;  // each parameter's last initialisation sets its values
  std::vector<std::vector<int64_t>> shapes;
};

// The initial weights of every parameter, by the name `source` stores it under.
class InitFile {
 public:
  InitFile(const WeightSource& source, models::Model& model, const WeightSource::ShapeOf& full_shape,
           const std::function<bool(const std::string&)>& drawn)
      : source_(source), key_(source.match(model, full_shape, drawn)) {}

  bool holds(const torch::Tensor& p) const { return key_.count(p.unsafeGetTensorImpl()) > 0; }

  torch::Tensor read(const torch::Tensor& p) const {
    torch::Tensor t = source_.read(key_.at(p.unsafeGetTensorImpl()));
    return t.to(torch::kFloat);  // what copying it into the float32 parameter gives
  }
  // The weight buffers the file holds.
  void load_buffers(models::Model& model) const { load_weight_buffers(model, source_, key_); }
  // Box `b` of parameter p's full value (a 0-dim parameter's box is its one element).
  torch::Tensor read_box(const torch::Tensor& p, const parallel::Box& b) const {
    const std::string& name = key_.at(p.unsafeGetTensorImpl());
    if (b.size.size() != source_.shape(name).size()) return source_.read(name).reshape(b.size);
    return source_.read_box(name, b.offset, b.size);
  }

 private:
  const WeightSource& source_;
  std::unordered_map<const c10::TensorImpl*, std::string> key_;
};

// The file write_init names, ready for every parameter's full float32 value
// and then each weight buffer's; null when it names none.
std::unique_ptr<SafetensorsWriter> init_writer(const Materialising& m, const NamedTensors& buffers) {
  if (m.o.write_init.empty()) return nullptr;
  std::vector<SafetensorsWriter::Entry> entries;
  for (size_t i = 0; i < m.params.size(); ++i) entries.push_back({m.params[i].first, torch::kFloat, m.shapes[i]});
  for (const auto& [name, b] : buffers) entries.push_back({name, b.scalar_type(), b.sizes().vec()});
  return std::make_unique<SafetensorsWriter>(m.o.write_init, entries,
                                             std::map<std::string, std::string>{{"format", "pt"}});
}

// Per-rank parameters with their own seed: this rank's draw of the whole
// model's initialisation under it, of which only they are kept (as a
// whole build under that seed gives them); the generator is left as it was.
std::map<size_t, torch::Tensor> draw_own_values(const Materialising& m) {
  std::map<size_t, torch::Tensor> own_values;
  auto gen = at::detail::getDefaultCPUGenerator();
  const auto state = gen.get_state();
  torch::manual_seed(static_cast<uint64_t>(m.o.own_seed));
  m.replay([&](size_t i, torch::Tensor full) {
    if (!m.own(i)) return;
    own_values[i] = full;
    m.place(i, full.to(m.o.dtype));
  });
  gen.set_state(state);
  return own_values;
}

}  // namespace

bool fully_recorded(models::Model& model, const std::vector<nn::DeferInit::Step>& steps) {
  std::unordered_map<const c10::TensorImpl*, bool> set;
  for (const auto& s : steps) set[s.param] = true;
  for (auto& [name, p] : nn::unique_named_parameters(model)) {
    if (!set.count(p.unsafeGetTensorImpl())) return false;
  }
  for (const auto& b : model.buffers(/*recurse=*/true)) {
    if (b.is_meta()) return false;
  }
  return true;
}

void materialise(models::Model& model, const std::vector<nn::DeferInit::Step>& steps, const MaterialiseOptions& o) {
  torch::NoGradGuard no_grad;
  const Materialising m(model, steps, o);
  std::unique_ptr<InitFile> file;
  if (o.init) {
    file = std::make_unique<InitFile>(*o.init, model, [&m](const torch::Tensor& p) {
      return m.shapes.at(m.index.at(p.unsafeGetTensorImpl()));
    }, o.drawn);
  }
  // Buffers are made whole on every rank (never on meta): the file's values, if it holds them, replace them.
  if (file) file->load_buffers(model);
  const NamedTensors buffers = nn::named_weight_buffers(model);
  std::unique_ptr<SafetensorsWriter> init = init_writer(m, buffers);
  const bool seeded = o.own && o.own_seed >= 0;
  std::map<size_t, torch::Tensor> own_values;
  if (seeded) own_values = draw_own_values(m);
  m.replay([&](size_t i, torch::Tensor full) {
    const torch::Tensor& p = m.params[i].second;
    const parallel::ShardSpec* spec = o.placements ? o.placements->find(p) : nullptr;
    // Under init_from or from_hf the file's values replace the drawn ones. A
    // rank that writes no init file reads only its piece's bytes (nothing for
    // a tensor it does not hold); the one that writes it reads every tensor.
    const bool from_file = file && file->holds(p);
    if (from_file && !init && !m.own(i) && spec) {
      if (!spec->held()) {
        take_values(p, torch::empty(p.sizes(), torch::dtype(o.dtype).device(o.device_of ? o.device_of(p) : c10::kCPU)));
      } else {
        m.place(i, file->read_box(p, spec->box()).to(torch::kFloat).to(o.dtype));
      }
      return;
    }
    if (from_file) {
      torch::Tensor given = file->read(p);
      if (o.replaced) o.replaced(m.params[i].first, full, given);
      full = given;
    }
    if (init) init->write(i, seeded && m.own(i) ? own_values.at(i) : full);
    if (m.own(i)) {  // the rank's own values, whole (not cut to the stacked placement)
      if (!seeded) m.place(i, full.to(o.dtype));
      return;
    }
    if (spec && !spec->held()) {
      take_values(p, torch::empty(p.sizes(), torch::dtype(o.dtype).device(o.device_of ? o.device_of(p) : c10::kCPU)));
      return;
    }
    torch::Tensor value = full.to(o.dtype);
    m.place(i, spec ? parallel::local_piece(*spec, value) : value);
  });
  if (init) {
    for (size_t j = 0; j < buffers.size(); ++j) init->write(m.params.size() + j, buffers[j].second.detach().cpu());
    init->finish();
  }
}

}  // namespace composer
