#include "executor.h"

#include <executorch/runtime/core/exec_aten/util/scalar_type_util.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/platform/log.h>

#include <chrono>
#include <mutex>
#include <string>

#include "input_spec.h"

namespace offgraph_kv {

using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::EValue;
using executorch::runtime::Span;

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Pairs prepare_step with commit or abort on every exit of a step.
class StepGuard {
 public:
  explicit StepGuard(KVStore& store) : store_(store) {}
  ~StepGuard() {
    if (!committed_) store_.abort_step();
  }
  void commit() {
    store_.commit_step();
    committed_ = true;
  }

 private:
  KVStore& store_;
  bool committed_ = false;
};

// Resize output `index` to the compiled shape, then `fetch(host, bytes)` its values into it.
template <typename Fetch>
Status copy_output(size_t index, const OutputView& out, EValue* value, Fetch fetch) {
  if (!value->isTensor()) return Status(Error::InvalidArgument, "output " + std::to_string(index) + " is not a tensor");
  Tensor t = value->toTensor();
  if (static_cast<int32_t>(t.scalar_type()) != out.dtype)
    return Status(Error::InvalidArgument, "output " + std::to_string(index) + ": compiled dtype " +
                                              std::to_string(out.dtype) + " differs from the method's " +
                                              std::to_string(int(t.scalar_type())));
  std::vector<SizesType> sizes(out.sizes.begin(), out.sizes.end());
  if (executorch::runtime::resize_tensor(t, {sizes.data(), sizes.size()}) != Error::Ok)
    return Status(Error::InvalidArgument, "output " + std::to_string(index) + " cannot take the compiled shape");
  return fetch(t.mutable_data_ptr(), t.nbytes());
}

// Bytes of a dense compiled output.
size_t output_bytes(const OutputView& out) {
  size_t n = executorch::runtime::elementSize(static_cast<executorch::aten::ScalarType>(out.dtype));
  for (int64_t d : out.sizes) n *= d < 0 ? 0 : size_t(d);
  return n;
}

std::unique_ptr<StepIO> io_for(DeviceKind device, Status* status) {
  if (device == DeviceKind::CPU) return host_step_io();
  return cuda_step_io(status);
}

}  // namespace

std::unique_ptr<StepExecutor> StepExecutor::create(const ManifestInfo& manifest, StepWidthLocator width_at,
                                                   std::unique_ptr<CompiledProgram> program,
                                                   const GrowthPolicy& policy, Status* status) {
  std::unique_ptr<StepExecutor> ex(new StepExecutor());
  ex->manifest_ = manifest;
  ex->width_at_ = width_at;
  ex->program_ = std::move(program);
  ex->threads_ = std::make_unique<StepThreads>(ex->program_->library());
  ex->num_threads_ = policy.num_threads;
  ex->io_ = io_for(manifest.device, status);
  if (!ex->io_) return nullptr;
  std::unique_ptr<KVStore> store = KVStore::create(manifest.tensors, policy, manifest.max_write, ex->io_->memory(), status);
  if (!store) return nullptr;
  ex->store_ = std::move(store);
  // A saved context fits only the same compiled code with the same tensors.
  std::string identity = manifest.compiled_code_key + ";max_write=" + std::to_string(manifest.max_write);
  for (const TensorSpec& t : manifest.tensors)
    identity += ";" + std::to_string(t.layer) + (t.role == TensorRole::Key ? "k" : "v") +
                (t.kind == LayerKind::Ring ? "ring" + std::to_string(t.window) : "flat") + ":" +
                std::to_string(t.num_heads) + "x" + std::to_string(t.head_dim) + dtype_name(t.dtype);
  ex->store_->set_identity(identity);
  ex->graphs_ = policy.cuda_graphs && manifest.device == DeviceKind::CUDA && manifest.code.lengths_from_device &&
                ex->program_->capturable() && step_graphs_available();
  ex->inputs_.resize(manifest.num_compiled_inputs());
  // Dtype, heads and head dim of every private tensor never change: describe
  // them once; a step only rebinds the pointer and the row count.
  for (const TensorSpec& t : ex->store_->tensors()) {
    TensorDesc& d = ex->inputs_[t.compiled_input];
    d.dtype = aoti_dtype(t.dtype);
    d.sizes = {1, 0, int64_t(t.num_heads), int64_t(t.head_dim)};
    d.strides = {0, int64_t(t.num_heads) * t.head_dim, int64_t(t.head_dim), 1};
  }
  *status = Status::ok_status();
  return ex;
}

Status StepExecutor::check_inputs(Span<EValue*> args, size_t* width) const {
  const ManifestInfo& m = manifest_;
  if (args.size() != size_t(m.num_user_inputs) + m.num_outputs)
    return Status(Error::InvalidArgument, "expected " + std::to_string(m.num_user_inputs) + " inputs and " +
                                              std::to_string(m.num_outputs) + " outputs, got " +
                                              std::to_string(args.size()) + " values");
  // The width is the extent of the input the compile spec names: shape only.
  const StepWidthLocator& at = width_at_;
  if (!args[at.input_index]->isTensor())
    return Status(Error::InvalidArgument, "step_width input " + std::to_string(at.input_index) + " is not a tensor");
  const Tensor width_input = args[at.input_index]->toTensor();
  if (at.dim >= size_t(width_input.dim()))
    return Status(Error::InvalidArgument, "step_width names dim " + std::to_string(at.dim) + " of input " +
                                              std::to_string(at.input_index) + ", which has " +
                                              std::to_string(width_input.dim()) + " dims");
  *width = size_t(width_input.size(at.dim));
  if (*width < 1 || *width > m.max_write)
    return Status(Error::InvalidArgument, "step width " + std::to_string(*width) + " (input " +
                                              std::to_string(at.input_index) + " dim " + std::to_string(at.dim) +
                                              ") outside [1, max_write=" + std::to_string(m.max_write) + "]");
  // Every input as compiled, before anything grows or is bound: the compiled
  // code trusts the shapes it is handed.
  for (size_t i = 0; i < m.num_user_inputs; ++i) {
    if (!args[i]->isTensor()) return Status(Error::InvalidArgument, "input " + std::to_string(i) + " is not a tensor");
    const Tensor t = args[i]->toTensor();
    Status c = check_input(i, m.inputs[i], int(t.scalar_type()), t.sizes().data(), size_t(t.dim()), *width);
    if (!c.ok()) return c;
  }
  return Status::ok_status();
}

Status StepExecutor::run_prepared(Span<EValue*> args, size_t width, int64_t* run_ns,
                                  std::shared_lock<std::shared_mutex>* turn) {
  const ManifestInfo& m = manifest_;
  const bool captured = graphs_ && width == 1;
  Status s;
  for (size_t i = 0; i < m.num_user_inputs; ++i) {
    const Tensor t = args[i]->toTensor();
    s = captured ? io_->stage_input_fixed(i, t, &inputs_[i]) : io_->stage_input(i, t, &inputs_[i]);
    if (!s.ok()) return s;
  }
  const auto& tensors = store_->tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    // A captured step binds views that stay put as the context grows (the code reads the length instead).
    const Binding b = captured ? store_->fixed_binding(i) : store_->binding(i);
    TensorDesc& d = inputs_[tensors[i].compiled_input];
    d.data = b.data;
    d.sizes[1] = b.rows;
    d.strides[0] = b.rows * d.strides[1];
  }
  if (m.has_length_input && !(s = io_->stage_length(int64_t(store_->length()), &inputs_[m.length_input])).ok())
    return s;
  // The load-time option, else the measured default (step_threads.h): one
  // thread for decode (`num_threads` n: its linears with n - 1 helpers), the
  // free cores for wider steps. Always set (with MKL's own count), never left
  // to the process: see StepThreads::Scope.
  StepThreads::Scope threads(*threads_, num_threads_ ? num_threads_ : threads_->automatic(width),
                             threads_->helpers(width, num_threads_));
  const int64_t start = now_ns();
  s = captured ? run_captured(args, turn) : run_uncaptured(args, false);
  *run_ns = now_ns() - start;
  return s;
}

Status StepExecutor::run_uncaptured(Span<EValue*> args, bool decode) {
  Status s = io_->upload();
  if (!s.ok()) return s;
  const size_t first_output = manifest_.num_user_inputs;
  if (decode) decode_output_bytes_.assign(manifest_.num_outputs, 0);
  return program_->run(
      inputs_, io_->stream(),
      [&](size_t i, const OutputView& out) {
        if (decode && i < decode_output_bytes_.size()) decode_output_bytes_[i] = output_bytes(out);
        return copy_output(i, out, args[first_output + i],
                           [&](void* host, size_t bytes) { return io_->fetch_output(out, host, bytes); });
      },
      [&]() { return io_->finish(); });
}

Status StepExecutor::run_captured(Span<EValue*> args, std::shared_lock<std::shared_mutex>* turn) {
  if (!graph_ || inputs_ != captured_inputs_) {
    if (decode_steps_seen_++ == 0) return run_uncaptured(args, true);
    const Status c = capture(turn);
    if (!c.ok()) {
      ET_LOG(Info, "OffGraphKVBackend: decode steps of this method run uncaptured from now on: %s",
             c.message().c_str());
      graphs_ = false;
      return run_uncaptured(args, true);  // the bindings above are right for it too
    }
  }
  // The graph uploads the staged inputs and the length, runs the code and
  // downloads the outputs: one launch and one wait per token.
  Status s = graph_->replay(io_->stream());
  const Status settled = io_->finish();
  if (s.ok()) s = settled;
  for (size_t i = 0; s.ok() && i < graph_outputs_.size(); ++i)
    s = copy_output(i, graph_outputs_[i], args[manifest_.num_user_inputs + i],
                    [&](void* host, size_t bytes) { return io_->read_fixed(i, host, bytes); });
  if (s.ok()) store_->record_graph_replay();
  return s;
}

Status StepExecutor::capture(std::shared_lock<std::shared_mutex>* turn) {
  Status s;
  if (!graph_ && !(graph_ = make_step_graph(&s))) return s;
  // Host memory for the outputs, sized by the first (uncaptured) decode step: a capture may not allocate it.
  if (!(s = io_->reserve_fixed_outputs(decode_output_bytes_)).ok()) return s;
  // A capture records everything enqueued on its stream: no other step may enqueue meanwhile.
  turn->unlock();
  {
    std::unique_lock<std::shared_mutex> alone(*io_->turns());
    s = graph_->capture(io_->stream(), [&]() {
      Status c = io_->upload();
      if (c.ok()) c = program_->launch(inputs_, io_->stream(), &graph_outputs_);
      for (size_t i = 0; c.ok() && i < graph_outputs_.size(); ++i)
        c = io_->download_fixed(i, graph_outputs_[i], output_bytes(graph_outputs_[i]));
      return c;
    });
  }
  turn->lock();
  if (!s.ok()) {
    graph_.reset();
    return s;
  }
  captured_inputs_ = inputs_;
  store_->record_graph_capture();
  return s;
}

Status StepExecutor::execute(Span<EValue*> args) {
  size_t width = 0;
  Status s = check_inputs(args, &width);
  if (!s.ok()) return s;
  // The store is this step's until it ends (KVStore::access); then the stream:
  // steps share a CUDA stream with other sessions, a capture holds it alone (StepIO::turns).
  const std::lock_guard<std::mutex> held(store_->access());
  std::shared_lock<std::shared_mutex> turn;
  if (std::shared_mutex* turns = io_->turns()) turn = std::shared_lock<std::shared_mutex>(*turns);
  const int64_t start = now_ns();
  KVStore& store = *store_;
  if (!(s = store.prepare_step(width)).ok()) return s;
  StepGuard step(store);
  int64_t run_ns = 0;
  if (!(s = run_prepared(args, width, &run_ns, &turn)).ok()) return s;
  step.commit();
  // Host work of the step (prepare, stage, bind, commit), apart from the compiled code and its output copy.
  store.record_host_time(uint64_t(now_ns() - start - run_ns));
  return Status::ok_status();
}

}  // namespace offgraph_kv
