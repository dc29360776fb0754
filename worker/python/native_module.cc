// pstrain._native: the Python bindings, all in this file. The logic lives in
// C++ (PsClient, the cluster description, the data readers); this file only
// converts arguments, releases the GIL around every call that may block, and
// lets Ctrl-C interrupt it. pstrain/__init__.py and pstrain/torch.py build
// the user-facing API on top.
//
// Tensors are passed as objects with the buffer protocol (numpy arrays, and
// torch CPU tensors through .numpy(), which shares their memory): a pull
// writes into their memory and a push reads from it, with no copy here.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cluster_spec.h"
#include "common/connection_check.h"
#include "common/partition.h"
#include "glog/logging.h"
#include "google/protobuf/util/json_util.h"
#include "proto/ps.pb.h"
#include "worker/client_config.h"
#include "worker/ctr_data.h"
#include "worker/data.h"
#include "worker/idx_data.h"
#include "worker/ps_client.h"

namespace py = pybind11;

namespace pstrain {
namespace {

// pstrain.Error: a failure the servers, the network or the C++ client
// reported, with the status code's name in `.code` ("UNAVAILABLE",
// "FAILED_PRECONDITION"...). Arguments refused before anything is sent are
// TypeError or ValueError.
PyObject* error_type = nullptr;

[[noreturn]] void Raise(const absl::Status& status) {
  const std::string code = absl::StatusCodeToString(status.code());
  py::object error = py::reinterpret_borrow<py::object>(error_type)(
      absl::StrCat(code, ": ", status.message()));
  error.attr("code") = code;
  PyErr_SetObject(error_type, error.ptr());
  throw py::error_already_set();
}

template <typename T>
T ValueOrRaise(absl::StatusOr<T> result) {
  if (!result.ok()) Raise(result.status());
  return *std::move(result);
}

void OkOrRaise(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

// Runs a client's blocking calls on a thread of its own. Python runs signal
// handlers only on its main thread, between bytecodes: the thread that asked
// waits here in slices of 100 ms, checking for a pending signal, and on one
// (Ctrl-C: KeyboardInterrupt) interrupts the call, which returns within about
// a second (PsClient::Interrupt), then raises what the handler raised.
class CallRunner {
 public:
  CallRunner() : thread_([this] { Loop(); }) {}
  ~CallRunner() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  // Called with the GIL held; runs `task` with it released.
  void Run(PsClient* client, std::function<void()> task) {
    bool signalled = false;
    {
      py::gil_scoped_release release;
      // One call at a time per client (PsClient is not thread-safe).
      std::lock_guard<std::mutex> one_call(call_mu_);
      std::unique_lock<std::mutex> lock(mu_);
      task_ = std::move(task);
      done_ = false;
      wake_.notify_all();
      while (!done_) {
        if (finished_.wait_for(lock, std::chrono::milliseconds(100),
                               [this] { return done_; })) {
          break;
        }
        if (signalled) continue;
        lock.unlock();
        {
          py::gil_scoped_acquire acquire;
          signalled = PyErr_CheckSignals() != 0;
          // The handler's exception stays set in this thread's state.
        }
        if (signalled && client != nullptr) client->Interrupt();
        lock.lock();
      }
    }
    if (signalled) throw py::error_already_set();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      wake_.wait(lock, [this] { return stop_ || task_ != nullptr; });
      if (task_ == nullptr) return;  // stop_, nothing pending
      std::function<void()> task = std::move(task_);
      task_ = nullptr;
      lock.unlock();
      task();
      lock.lock();
      done_ = true;
      finished_.notify_all();
    }
  }

  std::mutex call_mu_;
  std::mutex mu_;
  std::condition_variable wake_, finished_;
  std::function<void()> task_;
  bool done_ = true;
  bool stop_ = false;
  std::thread thread_;
};

// A float32 buffer of exactly `elements` contiguous elements, or a
// ValueError naming `what`.
struct FloatView {
  py::buffer_info info;
  float* data() const { return static_cast<float*>(info.ptr); }
};

FloatView RequireFloats(const py::handle& object, int64_t elements,
                        bool writable, const std::string& what) {
  if (!py::isinstance<py::buffer>(object)) {
    throw py::type_error(absl::StrCat(
        what, ": expected a float32 numpy array or CPU tensor's .numpy(), got ",
        std::string(py::str(object.get_type()))));
  }
  py::buffer_info info;
  try {
    info = object.cast<py::buffer>().request(writable);
  } catch (const py::error_already_set&) {
    throw py::value_error(
        absl::StrCat(what, ": a read-only array where values are written"));
  }
  if (info.format != py::format_descriptor<float>::format() ||
      info.itemsize != 4) {
    throw py::type_error(absl::StrCat(what, ": dtype must be float32, got '",
                                      info.format, "' of ", info.itemsize,
                                      " bytes"));
  }
  int64_t expected_stride = 4;
  for (int d = static_cast<int>(info.ndim) - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != expected_stride) {
      throw py::value_error(absl::StrCat(
          what, ": must be contiguous (C order); call .contiguous() first"));
    }
    expected_stride *= info.shape[d];
  }
  if (info.size != elements) {
    throw py::value_error(absl::StrCat(what, ": has ", info.size,
                                       " elements, the model's tensor has ",
                                       elements));
  }
  return FloatView{std::move(info)};
}

template <typename T>
T* RequireArray(const py::handle& object, int64_t elements, bool writable,
                const std::string& what) {
  if (!py::isinstance<py::buffer>(object)) {
    throw py::type_error(absl::StrCat(what, ": expected a numpy array"));
  }
  py::buffer_info info = object.cast<py::buffer>().request(writable);
  // numpy says "l" for int64 where pybind11 says "q": same size, same kind.
  static_assert(sizeof(T) == 8, "64-bit integers only");
  const char* kinds = std::is_signed_v<T> ? "lq" : "LQ";
  if (info.format.size() != 1 ||
      std::strchr(kinds, info.format[0]) == nullptr ||
      info.itemsize != sizeof(T)) {
    throw py::type_error(absl::StrCat(what, ": dtype must be ",
                                      std::is_signed_v<T> ? "int64" : "uint64",
                                      ", got '", info.format, "'"));
  }
  if (info.size != elements ||
      (info.ndim > 0 && info.strides[info.ndim - 1] != sizeof(T) &&
       info.size > 1)) {
    throw py::value_error(absl::StrCat(what, ": expected ", elements,
                                       " contiguous elements, got ",
                                       info.size));
  }
  return static_cast<T*>(info.ptr);
}

// The Python face of one PsClient (see worker/ps_client.h for every call's
// contract).
class Client {
 public:
  // The options are a ClientConfig's (worker/client_config.h), whose
  // defaults and checks are the worker binary's flags'.
  explicit Client(const py::dict& options) {
    ClientConfig config;
    for (const auto& [key, value] : options) {
      const std::string name = py::str(key);
      if (name == "hosts") {
        config.hosts = value.cast<std::vector<std::string>>();
      } else if (name == "rpc_timeout_s") {
        config.rpc_timeout_s = value.cast<double>();
      } else if (name == "connect_timeout_s") {
        config.connect_timeout_s = value.cast<double>();
      } else if (name == "retry_window_s") {
        config.retry_window_s = value.cast<double>();
      } else if (name == "heartbeat_interval_s") {
        config.heartbeat_interval_s = value.cast<double>();
      } else if (name == "data_plane") {
        config.data_plane = value.cast<bool>();
      } else if (name == "connections_per_shard") {
        config.connections_per_shard = value.cast<int>();
      } else if (name == "data_requests_in_flight") {
        config.data_requests_in_flight = value.cast<int>();
      } else if (name == "tls_ca") {
        config.tls.ca = value.cast<std::string>();
      } else if (name == "tls_cert") {
        config.tls.cert = value.cast<std::string>();
      } else if (name == "tls_key") {
        config.tls.key = value.cast<std::string>();
      } else if (name == "tls_server_name") {
        config.tls.server_name = value.cast<std::string>();
      } else if (name == "auth_token_file") {
        config.auth_token_file = value.cast<std::string>();
      } else if (name == "gradient_wire_type") {
        config.gradient_wire_type = value.cast<std::string>();
      } else {
        throw py::value_error(
            absl::StrCat("unknown client option '", name, "'"));
      }
    }
    if (config.hosts.empty()) {
      throw py::value_error(
          "hosts: the servers' host:port, every shard in order, is required");
    }
    // TLS credentials, and the data plane's TLS as the worker binary has it.
    const PsClientOptions o = ValueOrRaise(MakePsClientOptions(config));
    hosts_ = o.hosts;
    tls_ = o.credentials != nullptr;
    client_ = ValueOrRaise(PsClient::Create(o));
  }

  // Registers `schema_json` (a ModelSchema in protobuf's JSON mapping).
  py::dict Register(const std::string& schema_json, int num_workers,
                    int worker_id) {
    ModelSchema schema;
    google::protobuf::util::JsonParseOptions strict;
    if (auto s = google::protobuf::util::JsonStringToMessage(schema_json,
                                                             &schema, strict);
        !s.ok()) {
      throw py::value_error(absl::StrCat("schema: ", std::string(s.message())));
    }
    OkOrRaise(ValidateSchema(schema));
    Registration registration;
    Call([&] {
      registration =
          ValueOrRaiseLater(client_->Register(schema, num_workers, worker_id));
      // Waiting for servers, gRPC reports any cause as the deadline passing:
      // say what the likely one is, as the worker binary does. (A refused
      // transport fails fast with its cause already: PsClient::Register.)
      if (absl::IsDeadlineExceeded(status_)) {
        std::vector<std::string> causes;
        for (const std::string& host : hosts_) {
          const std::string cause =
              DiagnoseConnection(host, tls_, absl::Seconds(2));
          if (!cause.empty()) causes.push_back(cause);
        }
        if (!causes.empty()) {
          status_ = absl::Status(
              status_.code(),
              absl::StrCat(status_.message(),
                           "; likely cause: ", absl::StrJoin(causes, "; ")));
        }
      }
    });
    schema_ = schema;
    py::dict out;
    out["mode"] = registration.mode;
    out["start_step"] = registration.start_step;
    return out;
  }

  void AwaitJobStart(const py::object& on_waiting) {
    PsClient::StartWaitReport report;
    if (!on_waiting.is_none()) {
      // Called on the runner's thread: the callback takes the GIL itself.
      report = [on_waiting](const JobStart& waiting) {
        py::gil_scoped_acquire acquire;
        py::dict d;
        d["missing_workers"] = std::vector<int>(
            waiting.missing_workers().begin(), waiting.missing_workers().end());
        d["num_workers"] = waiting.num_workers();
        d["waited_s"] = waiting.waited_s();
        d["startup_timeout_s"] = waiting.startup_timeout_s();
        try {
          on_waiting(d);
        } catch (py::error_already_set& e) {
          e.discard_as_unraisable("pstrain: the waiting callback");
        }
      };
    }
    Call([&] { status_ = client_->AwaitJobStart(report); });
  }

  int64_t Pull(int64_t step, const py::list& tensors) {
    std::vector<FloatView> views = Floats(tensors, /*writable=*/true, "pull");
    std::vector<float*> out;
    for (FloatView& v : views) out.push_back(v.data());
    int64_t pulled = 0;
    Call([&] { pulled = ValueOrRaiseLater(client_->Pull(step, out)); });
    return pulled;
  }

  py::tuple Push(int64_t step, const py::list& gradients,
                 const std::vector<int>& only) {
    std::vector<FloatView> views =
        Floats(gradients, /*writable=*/false, "push", only);
    std::vector<const float*> in = Pointers(views);
    PsClient::PushResult result;
    Call([&] { result = ValueOrRaiseLater(client_->Push(step, in, only)); });
    return py::make_tuple(result.blocks_duplicate, result.blocks_late);
  }

  py::tuple PushPull(int64_t push_step, const py::list& gradients,
                     int64_t pull_step, const py::list& tensors) {
    std::vector<FloatView> grads = Floats(gradients, false, "push");
    std::vector<FloatView> values = Floats(tensors, true, "pull");
    std::vector<const float*> in = Pointers(grads);
    std::vector<float*> out;
    for (FloatView& v : values) out.push_back(v.data());
    PsClient::PushPullResult result;
    Call([&] {
      result =
          ValueOrRaiseLater(client_->PushPull(push_step, in, pull_step, out));
    });
    return py::make_tuple(result.pushed.blocks_duplicate,
                          result.pushed.blocks_late, result.pulled_step);
  }

  py::tuple Assign(const py::list& values, const std::vector<int>& only) {
    std::vector<FloatView> views =
        Floats(values, /*writable=*/false, "assign", only);
    std::vector<const float*> in = Pointers(views);
    PsClient::PushResult result;
    Call([&] { result = ValueOrRaiseLater(client_->Assign(in, only)); });
    return py::make_tuple(result.blocks_duplicate, result.blocks_late);
  }

  void PullSparse(int table, int64_t step, const py::handle& ids,
                  const py::handle& out) {
    const SparseTableSpec& spec = Table(table);
    const int64_t n = py::len(ids);
    const uint64_t* id_data =
        RequireArray<uint64_t>(ids, n, false, spec.name() + " ids");
    float* rows =
        RequireFloats(out, n * spec.dim(), true, spec.name() + " rows").data();
    Call([&] {
      status_ = client_->PullSparse(table, step,
                                    absl::MakeConstSpan(id_data, n), rows);
    });
  }

  py::tuple PushSparse(int table, int64_t step, const py::handle& ids,
                       const py::handle& grads) {
    const SparseTableSpec& spec = Table(table);
    const int64_t n = py::len(ids);
    const uint64_t* id_data =
        RequireArray<uint64_t>(ids, n, false, spec.name() + " ids");
    const float* rows =
        RequireFloats(grads, n * spec.dim(), false, spec.name() + " gradients")
            .data();
    PsClient::PushResult result;
    Call([&] {
      result = ValueOrRaiseLater(client_->PushSparse(
          table, step, absl::MakeConstSpan(id_data, n), rows));
    });
    return py::make_tuple(result.blocks_duplicate, result.blocks_late);
  }

  void Leave() {
    Call([&] { status_ = client_->Leave(); });
  }

  // Every shard's StatsResponse, in protobuf's JSON mapping.
  std::vector<std::string> Stats() {
    std::vector<StatsResponse> stats;
    Call([&] { stats = ValueOrRaiseLater(client_->Stats()); });
    std::vector<std::string> out;
    google::protobuf::util::JsonPrintOptions options;
    options.always_print_primitive_fields = true;
    options.preserve_proto_field_names = true;
    for (const StatsResponse& shard : stats) {
      std::string json;
      // Cannot fail for a message this binary parsed.
      (void)google::protobuf::util::MessageToJsonString(shard, &json, options);
      out.push_back(std::move(json));
    }
    return out;
  }

  int64_t StepsShort() {
    int64_t steps = 0;
    Call([&] { steps = ValueOrRaiseLater(client_->StepsShort()); });
    return steps;
  }

  std::string AwaitFinalModel(int64_t expected_version, double timeout_s) {
    std::string how;
    Call([&] {
      how =
          client_->AwaitFinalModel(expected_version, absl::Seconds(timeout_s));
    });
    return how;
  }

  void Interrupt() { client_->Interrupt(); }
  int num_shards() const { return client_->num_shards(); }

 private:
  // Runs `task` on the runner with the GIL released; a status it left in
  // status_ is raised here, with the GIL held again.
  void Call(const std::function<void()>& task) {
    status_ = absl::OkStatus();
    runner_.Run(client_.get(), task);
    absl::Status status = std::move(status_);
    status_ = absl::OkStatus();
    OkOrRaise(status);
  }

  // On the runner's thread (no Python there): keep the error for Call.
  template <typename T>
  T ValueOrRaiseLater(absl::StatusOr<T> result) {
    if (!result.ok()) {
      status_ = result.status();
      return T();
    }
    return *std::move(result);
  }

  const ModelSchema& Schema() const {
    if (schema_.dense_size() == 0) {
      throw py::value_error("register the model first");
    }
    return schema_;
  }

  const SparseTableSpec& Table(int table) const {
    if (table < 0 || table >= Schema().sparse_size()) {
      throw py::value_error(absl::StrCat("sparse table ", table,
                                         " is not in the schema (it has ",
                                         Schema().sparse_size(), ")"));
    }
    return schema_.sparse(table);
  }

  // One view per dense tensor of the schema; with `only`, entries not in it
  // may be None.
  std::vector<FloatView> Floats(const py::list& tensors, bool writable,
                                const char* call,
                                const std::vector<int>& only = {}) {
    const ModelSchema& schema = Schema();
    if (static_cast<int>(py::len(tensors)) != schema.dense_size()) {
      throw py::value_error(absl::StrCat(call, ": ", py::len(tensors),
                                         " tensors, the model has ",
                                         schema.dense_size()));
    }
    std::vector<bool> wanted(schema.dense_size(), only.empty());
    for (int t : only) {
      if (t < 0 || t >= schema.dense_size()) {
        throw py::value_error(
            absl::StrCat(call, ": tensor index ", t, " out of range"));
      }
      wanted[t] = true;
    }
    std::vector<FloatView> views(schema.dense_size());
    for (int t = 0; t < schema.dense_size(); ++t) {
      if (!wanted[t]) continue;
      const DenseTensorSpec& spec = schema.dense(t);
      views[t] = RequireFloats(tensors[t], NumElements(spec), writable,
                               absl::StrCat("'", spec.name(), "'"));
    }
    return views;
  }

  // Null for the tensors a call leaves out (`only`).
  static std::vector<const float*> Pointers(
      const std::vector<FloatView>& views) {
    std::vector<const float*> out(views.size(), nullptr);
    for (size_t t = 0; t < views.size(); ++t) {
      if (views[t].info.ptr != nullptr) out[t] = views[t].data();
    }
    return out;
  }

  std::unique_ptr<PsClient> client_;
  std::vector<std::string> hosts_;
  bool tls_ = false;
  ModelSchema schema_;
  absl::Status status_;
  CallRunner runner_;
};

// The cluster description of this process (common/cluster_spec.h): the
// file `path`, else $PSTRAIN_CLUSTER, else $TF_CONFIG; None when none.
py::object LoadSpec(const std::string& path) {
  std::optional<ClusterSpec> spec = ValueOrRaise(LoadClusterSpec(path));
  if (!spec.has_value()) return py::none();
  py::dict d;
  d["ps"] = spec->ps;
  d["workers"] = spec->workers;
  d["max_workers"] = spec->max_workers;
  d["mode"] = spec->mode;
  d["task_type"] = spec->task_type;
  d["task_index"] = spec->task_index;
  py::dict flags;
  for (const auto& [name, value] : spec->worker_flags)
    flags[py::str(name)] = value;
  d["worker_flags"] = flags;
  d["source"] = spec->source;
  return d;
}

// A labelled data set read by the C++ worker's readers: the same examples,
// scaled the same way ([0, 1] pixels for IDX).
class Examples {
 public:
  explicit Examples(std::unique_ptr<ExampleSource> source)
      : source_(std::move(source)) {}
  int64_t size() const { return source_->size(); }
  int64_t num_features() const { return source_->num_features(); }
  int64_t num_classes() const { return source_->num_classes(); }
  // Rows `indices` into `features` [n, num_features] and `labels` [n]
  // (int64, as torch's losses take them).
  void Gather(const py::handle& indices, const py::handle& features,
              const py::handle& labels) {
    const int64_t n = py::len(indices);
    const int64_t* rows = RequireArray<int64_t>(indices, n, false, "indices");
    float* x =
        RequireFloats(features, n * num_features(), true, "features").data();
    int64_t* y = RequireArray<int64_t>(labels, n, true, "labels");
    for (int64_t i = 0; i < n; ++i) {
      if (rows[i] < 0 || rows[i] >= size()) {
        throw py::value_error(
            absl::StrCat("index ", rows[i], " out of [0, ", size(), ")"));
      }
    }
    std::vector<int32_t> narrow(n);
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = source_->Gather(absl::MakeConstSpan(rows, n), x, narrow.data());
    }
    OkOrRaise(status);
    for (int64_t i = 0; i < n; ++i) y[i] = narrow[i];
  }

 private:
  std::unique_ptr<ExampleSource> source_;
};

}  // namespace
}  // namespace pstrain

PYBIND11_MODULE(_native, m) {
  using namespace pstrain;
  m.doc() = "pstrain's C++ core; use the pstrain package, not this module";
  if (!google::IsGoogleLoggingInitialized()) {
    google::InitGoogleLogging("pstrain");
  }
  FLAGS_logtostderr = true;

  static py::exception<std::runtime_error> error(m, "Error");
  error.attr("__module__") = "pstrain";  // users see pstrain.Error
  error_type = error.ptr();

  py::class_<Client>(m, "Client")
      .def(py::init<const py::dict&>())
      .def("register", &Client::Register)
      .def("await_job_start", &Client::AwaitJobStart)
      .def("pull", &Client::Pull)
      .def("push", &Client::Push)
      .def("push_pull", &Client::PushPull)
      .def("assign", &Client::Assign)
      .def("pull_sparse", &Client::PullSparse)
      .def("push_sparse", &Client::PushSparse)
      .def("leave", &Client::Leave)
      .def("stats", &Client::Stats)
      .def("steps_short", &Client::StepsShort)
      .def("await_final_model", &Client::AwaitFinalModel)
      .def("interrupt", &Client::Interrupt)
      .def_property_readonly("num_shards", &Client::num_shards);

  m.def("load_cluster_spec", &LoadSpec, py::arg("path") = "");

  py::class_<Examples>(m, "Examples")
      .def_property_readonly("size", &Examples::size)
      .def_property_readonly("num_features", &Examples::num_features)
      .def_property_readonly("num_classes", &Examples::num_classes)
      .def("gather", &Examples::Gather);
  m.def(
      "open_idx",
      [](const std::string& dir, bool train) {
        IdxDataset files = ValueOrRaise(FindIdxDataset(dir));
        return Examples(ValueOrRaise(
            train ? OpenIdx(files.train_images, files.train_labels, 0)
                  : OpenIdx(files.test_images, files.test_labels, 0)));
      },
      py::arg("dir"), py::arg("train"));
  m.def(
      "synthetic",
      [](int64_t count, int64_t first_index, int64_t num_features,
         int64_t num_classes, double label_noise, uint64_t seed) {
        SyntheticOptions o;
        o.num_features = num_features;
        o.num_classes = num_classes;
        o.label_noise = label_noise;
        o.seed = seed;
        return Examples(std::make_unique<InMemorySource>(ValueOrRaise(
            MakeSyntheticClassification(o, first_index, count, {0, 1}))));
      },
      py::arg("count"), py::arg("first_index"), py::arg("num_features"),
      py::arg("num_classes"), py::arg("label_noise"), py::arg("seed"));

  // The C++ CTR worker's synthetic data (worker/ctr_data.h) as numpy
  // arrays: labels [n], dense [n, num_dense], bags in CSR form (offsets
  // [n * num_fields + 1] into ids), and the hidden true click probabilities.
  m.def(
      "synthetic_ctr",
      [](int64_t count, int64_t first_index, int num_dense, int num_fields,
         int64_t vocab_per_field, int max_bag, uint64_t seed) {
        SyntheticCtrOptions o;
        o.num_dense = num_dense;
        o.num_fields = num_fields;
        o.vocab_per_field = vocab_per_field;
        o.max_bag = max_bag;
        o.seed = seed;
        CtrDataset data =
            ValueOrRaise(MakeSyntheticCtr(o, first_index, count, {0, 1}));
        std::vector<double> truth =
            ValueOrRaise(SyntheticCtrTrueProbabilities(o, data));
        auto array = [](const auto& v) {
          using T = typename std::decay_t<decltype(v)>::value_type;
          return py::array_t<T>(v.size(), v.data());
        };
        py::dict d;
        d["labels"] = array(data.labels);
        d["dense"] = array(data.dense)
                         .reshape(std::vector<int64_t>{data.size(), num_dense});
        d["offsets"] = array(data.offsets);
        d["ids"] = array(data.ids);
        d["true_probabilities"] = array(truth);
        return d;
      },
      py::arg("count"), py::arg("first_index"), py::arg("num_dense"),
      py::arg("num_fields"), py::arg("vocab_per_field"), py::arg("max_bag"),
      py::arg("seed"));

  m.def(
      "epoch_plan",
      [](int64_t num_examples, int64_t worker_batch, int num_workers,
         int worker_index, bool shuffle, uint64_t seed) {
        EpochPlan::Options o;
        o.num_examples = num_examples;
        o.worker_batch = worker_batch;
        o.num_workers = num_workers;
        o.worker_index = worker_index;
        o.shuffle = shuffle;
        o.seed = seed;
        return std::make_shared<EpochPlan>(ValueOrRaise(EpochPlan::Create(o)));
      },
      py::arg("num_examples"), py::arg("worker_batch"), py::arg("num_workers"),
      py::arg("worker_index"), py::arg("shuffle"), py::arg("seed"));
  py::class_<EpochPlan, std::shared_ptr<EpochPlan>>(m, "EpochPlan")
      .def_property_readonly("steps_per_epoch", &EpochPlan::steps_per_epoch)
      .def_property_readonly("global_batch", &EpochPlan::global_batch)
      .def("worker_indices", [](EpochPlan& plan, int64_t step) {
        absl::Span<const int64_t> rows = plan.WorkerIndices(step);
        return py::array_t<int64_t>(rows.size(), rows.data());
      });
}
