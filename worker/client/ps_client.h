// PsClient: the one client of pstrain's parameter servers. The C++ worker
// (worker/trainer.cc, worker/ctr_main.cc) and the Python package
// (worker/python/c_api.cc) both train through it; this header is its whole
// API, each call's contract written above it.
//
// A worker's life, in order:
//   Create(options)            connect to every shard (nothing is sent yet)
//   Register(schema, W, id)    declare the model; learn the mode and the step
//                              to start from (a rejoining worker starts late)
//   Assign(values)             optional: the model's own initial values, for
//                              tensors declared PROVIDED (a framework's init)
//   AwaitJobStart()            sync/ssp: until every expected worker has
//                              registered (--startup_timeout_s bounds it)
//   Pull / Push / PushPull     one training step each; sync pulls of step s
//   PullSparse / PushSparse    wait until every member has pushed step s-1
//   Leave()                    so that nobody waits for this worker
// Interrupt() (any thread, e.g. a signal) ends the call in progress with
// CANCELLED within about a second.
//
// How the bytes move: one logical model spread over every shard, moved
// block by block. Blocks are grouped into RPCs of about one block's bytes,
// spread over several connections per shard, and all of a call's RPCs are
// in flight at once, over the plain-TCP data plane where a shard offers it
// (ps_client_data_plane.cc) and gRPC otherwise (ps_client_calls.cc).
// Gradient memory is sent as is and pulled payloads are decoded straight
// into the destination tensors (ps_client_tensors.cc). Every RPC carries a
// deadline, so no call blocks forever.
//
// Not thread-safe: one PsClient per worker thread (Interrupt excepted), with
// one exception: after Register, sparse calls (PullSparse, PushSparse) may
// run on one other thread while the dense calls run on theirs (the CTR
// worker's table lane), never two sparse calls at once. They share only
// what registration fixed and state kept atomic or under a lock (replica,
// server lives, data ports, interrupts); the row cache is the sparse
// calls' alone.
//
// The class over its files:
//   ps_client.cc             its life and the job's: connect, register, the
//                            start wait, heartbeats, leave, stats
//   ps_client_calls.cc       running a call on every shard at once (RunAll),
//                            gRPC streams, retries, deadlines
//   ps_client_data_plane.cc  which shards offer the data plane, its links
//   ps_client_tensors.cc     dense and sparse pulls and pushes by blocks
//   ps_client_internal.h     what those files share
#ifndef PSTRAIN_WORKER_CLIENT_PS_CLIENT_H_
#define PSTRAIN_WORKER_CLIENT_PS_CLIENT_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/consistency_mode.h"
#include "common/partition.h"
#include "common/protocol.h"
#include "common/transport/data_link.h"
#include "common/transport/grpc_tuning.h"
#include "common/transport/tls_stream.h"
#include "common/transport/wire.h"
#include "proto/ps.grpc.pb.h"
#include "worker/client/sparse_row_cache.h"

namespace pstrain {

// With connections by host (connections_per_shard = 0, the default): the
// connections to a shard on this host. A shard on another host gets one
// data-plane connection, since several let one worker's requests run ahead
// of the other workers' on a link that binds (a sync step then waits for the
// slowest; bench/results/netns_link_speed.txt, section 7). gRPC calls keep
// all of them.
inline constexpr int kConnectionsOnThisHost = 4;

struct PsClientOptions {
  // host:port of every shard, in shard order. A replicated shard
  // (ps_server --replicas) is its replicas' addresses joined by '|', in
  // replica order ("h1:7000|h2:7000"); every shard has as many. Calls go to
  // the replica that answered last, and to the next one when it is gone or
  // says it is not the primary.
  std::vector<std::string> hosts;
  // Deadline of each Pull/Push RPC (a sync pull includes waiting for the
  // slowest worker's gradient).
  absl::Duration rpc_timeout = absl::Seconds(120);
  // How long Register waits for servers that are not up yet.
  absl::Duration connect_timeout = absl::Seconds(60);
  int max_message_bytes = 512 << 20;
  // TCP connections to each shard; a shard's RPCs are spread over them.
  // 0: by host, kConnectionsOnThisHost to a shard on this host and one
  // data-plane connection to a shard elsewhere (see kConnectionsOnThisHost).
  int connections_per_shard = 0;
  // HTTP/2 and socket settings of every connection
  // (common/transport/grpc_tuning.h).
  GrpcTuning grpc_tuning;
  // A Push or Pull that goes to one shard as a single RPC (a small model,
  // or one shard) travels on a long-lived PushStream/PullStream of its
  // connection instead of as a unary call; a broken stream is replaced on
  // the next call. False: always unary.
  bool call_streams = true;
  // Element type of pushed gradients on the wire (servers decode to fp32).
  DataType gradient_wire_type = FLOAT32;
  // Element type of pulled parameters on the wire: FLOAT32, or BFLOAT16 /
  // FLOAT16 (the servers round their fp32 values per pull; STATE tensors
  // still come exact; servers too old to round answer FLOAT32, said once
  // in the log). Float32 destinations are decoded after the read; 16-bit
  // ones (PullTensors) take the bytes as they land.
  DataType parameter_wire_type = FLOAT32;
  // TOPK_FLOAT32: the fraction of each block's elements sent per push (the
  // largest magnitudes; the rest is kept and added to the next push).
  double gradient_topk_fraction = 0.01;
  // How often a registered worker renews its lease on every shard (well
  // under the servers' --worker_lease_s). Zero: no heartbeats.
  absl::Duration heartbeat_interval = absl::Seconds(2);
  // How long a failed pull or push (server down or restarting, a step that
  // timed out waiting for peers) is retried, with exponential backoff,
  // before the error is returned. Retries are safe: a repeated push is
  // acknowledged as a duplicate, never applied twice.
  absl::Duration retry_window = absl::Seconds(120);
  // Push and Pull travel on the servers' tensor data plane (framed TCP,
  // common/transport/data_plane.h) where they announce one, and over gRPC
  // otherwise. With `credentials`, only a data port announced as TLS is used,
  // and only with `data_plane_tls`; without them, only a plaintext one. A data
  // port that cannot be reached (or whose handshake fails) is used no more
  // until the server announces another one or 30 s pass; gRPC carries its calls
  // meanwhile.
  bool data_plane = true;
  // Requests a data-plane connection sends ahead of their answers. 0 (by
  // host): all of them to a server on this host, where only the CPU binds,
  // and one to a server elsewhere, which keeps every worker's pushes in
  // step as a sync step on a link that binds needs (see RunExchanges).
  int data_requests_in_flight = 0;
  // Sync, with shards of two replicas, on the data plane: a PushPull reads
  // the values of every other shard (by worker id) from the shard's backup,
  // which answers once it applied the step's record, while the primary
  // answers the push without them; the primary's link then carries the
  // records to its backup and half the pulls instead of all of them
  // (bench/results/replication_link_speed.txt). A step whose reads fail
  // goes again as a plain PushPull (its pushes are duplicates there), and
  // that shard's reads stay on its primary for 30 s, doubled after each
  // failure in a row (up to 16 min).
  //   kByHost: only for a shard whose primary is on another host (known
  //     once a data-plane link to it is open), where its link may bind; on
  //     one host nothing but the CPU binds, and a third request a step per
  //     shard cost a loopback job 12%;
  //   kAlways / kNever: for every shard / none.
  enum class BackupReads { kByHost, kAlways, kNever };
  BackupReads pulls_from_backups = BackupReads::kByHost;
  // Channel security (TLS / mutual TLS); null means plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // The data plane's TLS (TlsContext::ForClient from the same files as
  // `credentials`). Null with `credentials`: tensors go over gRPC, as
  // clients before TLS on the data plane did.
  std::shared_ptr<const TlsContext> data_plane_tls;
  // Sent as "authorization: Bearer <token>" on every call when not empty.
  std::string auth_token;
  // Fault injection for exactly-once tests: after a successful push RPC,
  // send it again with this probability, as a client whose response was
  // lost would.
  double inject_duplicate_push_probability = 0;
  // Fault injection for reproducibility tests: every Push, PushPull and
  // PushSparse first sleeps a uniformly random time in [0, this], so the
  // workers' gradients reach the servers in a different order each run.
  absl::Duration inject_push_jitter = absl::ZeroDuration();
  // Sparse rows a pull got are reused by this worker's pulls of the next
  // this-many steps instead of being pulled again (0: every pull goes to
  // the servers); bounded by sparse_row_cache_bytes. See
  // worker/client/sparse_row_cache.h for what the bound means.
  int64_t sparse_row_cache_steps = 0;
  int64_t sparse_row_cache_bytes = int64_t{256} << 20;
  // Called (on the calling thread) each time a failed call is about to be
  // retried, with the line that is also logged: the shard, its address,
  // the last error and the time left in the retry window. A progress bar
  // shows it.
  std::function<void(const std::string& line)> on_retry;
};

// Every problem PsClient::Create refuses `options` for, in its words (it
// returns the first): a host that is not host:port, connections_per_shard
// out of [0, 64], an unsupported wire type, a top-k fraction out of (0, 1].
// (No hosts at all is Create's own refusal.)
std::vector<absl::Status> PsClientOptionsProblems(
    const PsClientOptions& options);

struct Registration {
  ConsistencyMode mode = ConsistencyMode::kSync;  // the servers'
  int64_t start_step = 0;  // where a (re)joining worker starts
  // sync: it starts there in the place of an earlier process of its id,
  // whose pushes of every step before are in (RegisterModelResponse).
  bool resumes_in_place = false;
  // The dense optimizer shard 0 applies and its learning rate in effect
  // (empty / 0: a server from before they were told).
  std::string optimizer;
  double learning_rate = 0;
};

// The servers' copy of a job's final model, as a worker ending the job
// finds it (PsClient::SecureFinalState).
struct FinalState {
  // "durable": every shard's newest checkpoint holds its state at the final
  // version. "in_memory": some shard has no --checkpoint_dir or its
  // checkpoint failed: the servers hold the model until they stop (SIGTERM
  // then tries a last checkpoint). "behind": some shard's state is older
  // than the final model (killed after the job's last steps and restored
  // from an older checkpoint): those steps are not in the servers' model,
  // nor in an export of it. "unknown": a ps_server older than this client
  // cannot say.
  std::string summary = "unknown";
  std::vector<int> shards_behind;
  // One line per shard whose state is not durable, saying why.
  std::vector<std::string> problems;
};

class PsClient {
 public:
  static absl::StatusOr<std::unique_ptr<PsClient>> Create(
      const PsClientOptions& options);
  // A client registered as an observer (worker id -1) of `schema`: it pulls
  // without joining the job, e.g. async/ssp's final model after the
  // worker itself has left (a pull as that worker would rejoin).
  static absl::StatusOr<std::unique_ptr<PsClient>> CreateObserver(
      const PsClientOptions& options, const ModelSchema& schema,
      int num_workers);
  // What reads the final model at the end of a job in `mode`, made before
  // training starts (so a missing server shows at once, not after the last
  // step): nullptr in sync, where the last PushPull returns the model; an
  // observer in async/ssp, where this worker leaves first and a pull as
  // that worker would rejoin the job.
  static absl::StatusOr<std::unique_ptr<PsClient>> CreateFinalModelReader(
      ConsistencyMode mode, const PsClientOptions& options,
      const ModelSchema& schema, int num_workers);
  ~PsClient();

  // Registers the schema on every shard (idempotent) and fixes the block
  // layout used by Pull and Push. With worker_id >= 0 this process joins
  // the job as that worker (heartbeats start); -1 is an observer that may
  // only pull. A schema's block_elements kBlockElementsByModel becomes
  // ResolvedBlockElements's, or, where the servers already hold this model
  // in other blocks (restored from a checkpoint), theirs.
  absl::StatusOr<Registration> Register(const ModelSchema& schema,
                                        int num_workers, int worker_id);

  // After Register, sync and ssp: returns once the job has started on every
  // shard, i.e. every worker in [0, num_workers) has registered (or the
  // servers' --startup_timeout_s passed with --min_workers of them).
  // `on_waiting`, if set, is called about once a second meanwhile with who
  // is missing (the union over shards). FAILED_PRECONDITION naming the
  // missing ids when the job did not start in time; CANCELLED on
  // Interrupt, or within a second of `*stop` turning true (a worker's
  // SIGTERM). Returns at once in async mode, for an observer, and
  // against servers from before the start rule. Steps are correct without
  // it (servers hold the first step for every worker), but a pull's
  // deadline would have to cover the whole wait.
  using StartWaitReport = std::function<void(const JobStart& waiting)>;
  absl::Status AwaitJobStart(const StartWaitReport& on_waiting = nullptr,
                             const std::atomic<bool>* stop = nullptr);

  // Fills tensors[i] (host memory of schema.dense(i)'s element count) with
  // the model at `step` (sync: after `step` updates; async/ssp: the current
  // one) and remembers each block's version for the next Push. Returns the
  // step the pulled model is at: `step`, or in sync mode a later one when
  // this worker fell behind (its gradient for `step` would be dropped).
  absl::StatusOr<int64_t> Pull(int64_t step,
                               const std::vector<float*>& tensors);

  // A dense tensor's host memory as Pull, Push and PushPull read or write
  // it: float32 elements, or elements already in the tensor's wire type
  // (FLOAT16 / BFLOAT16 bits, two bytes each), for a caller that converts
  // on its own device: a GPU worker casts its gradients before the
  // device-to-host copy and widens the pulled parameters after the copy
  // back, so the host moves half the bytes and converts nothing. The wire
  // type of tensor i is PushWireType(i) for a push and PullWireType(i) for
  // a pull; a TensorRef of any other dtype is InvalidArgument.
  struct TensorRef {
    DataType dtype = FLOAT32;
    void* data = nullptr;
  };
  struct ConstTensorRef {
    DataType dtype = FLOAT32;
    const void* data = nullptr;
  };
  // gradient_wire_type for a PARAMETER tensor, FLOAT32 for a STATE one
  // (its pushes are values). After Register.
  DataType PushWireType(int tensor) const;
  // parameter_wire_type for a PARAMETER tensor, FLOAT32 for a STATE one
  // (the servers send those exactly). After Register.
  DataType PullWireType(int tensor) const;
  // Pull, Push and PushPull with tensors given by element type.
  absl::StatusOr<int64_t> PullTensors(int64_t step,
                                      const std::vector<TensorRef>& tensors);

  // Sends the gradient of every tensor, or with `only` non-empty of just
  // those tensors (indices into the schema's dense tensors; the others'
  // entries in `gradients` are not read): a worker may push a step's
  // tensors in several calls, as backward produces them, since the servers
  // complete each block on its own. The memory must stay unchanged until
  // Push returns.
  struct PushResult {
    int64_t blocks_duplicate = 0;  // already received, not applied again
    int64_t blocks_late = 0;       // sync: the step had completed without it
  };
  absl::StatusOr<PushResult> Push(int64_t step,
                                  const std::vector<const float*>& gradients,
                                  absl::Span<const int> only = {});
  absl::StatusOr<PushResult> PushTensors(
      int64_t step, const std::vector<ConstTensorRef>& gradients,
      absl::Span<const int> only = {});

  // Sets the values of the tensors whose init is PROVIDED (all, or with
  // `only` the listed ones), once: the servers keep the first values they
  // get and acknowledge later ones as duplicates (blocks_duplicate), so a
  // retry, or a restarted worker 0, changes nothing. Until a tensor's
  // values are in, every pull of it waits. Always float32, over gRPC.
  absl::StatusOr<PushResult> Assign(const std::vector<const float*>& values,
                                    absl::Span<const int> only = {});

  // Push(push_step, gradients) and then Pull(pull_step, tensors), with
  // the same contracts, where each connection carries both in one round
  // trip (ps-lite's ZPushPull) on the data plane; over gRPC they are the
  // two calls. A worker ends a step with it: the pull of the next step is
  // what a sync server answers once the step completed anyway. Retrying is
  // safe, as for Push; a retry after the pull half failed reports the
  // applied push's blocks as duplicates. Shards that do not announce
  // PushPull (older servers) get the two calls. Several groups on one
  // connection go back to back without waiting for answers, and the
  // server answers each as its step completes, so one group's pull comes
  // back while the next one's push is still going out (see PushPull).
  struct PushPullResult {
    PushResult pushed;
    int64_t pulled_step = 0;  // as Pull returns
  };
  absl::StatusOr<PushPullResult> PushPull(
      int64_t push_step, const std::vector<const float*>& gradients,
      int64_t pull_step, const std::vector<float*>& tensors);
  absl::StatusOr<PushPullResult> PushPullTensors(
      int64_t push_step, const std::vector<ConstTensorRef>& gradients,
      int64_t pull_step, const std::vector<TensorRef>& tensors);

  // Whether some shard's data-plane link (to its primary) goes to another
  // host, as far as the links opened so far tell: where a link may bind
  // rather than the CPU (--pipeline_step=by_host).
  bool SomeShardOnAnotherHost() const;
  // Whether a sync PushPull of this client may read some shard's values
  // from its backup (BackupToReadFrom's fixed conditions), which the
  // pipelined step does not do.
  bool MayReadFromBackups() const;
  // Whether the pipelined step can stream this client's exchange of
  // `gradients` (else it runs the plain PushPull once backward is done):
  // plaintext, no clipping, and each gradient handed over in its wire type
  // (float32 on a float32 wire, or 16-bit elements a device cast), so that
  // nothing is converted when the calls are made, before the gradients are
  // (PushPullStreamed says why, and checks each shard besides).
  bool StepsCanStream(const std::vector<ConstTensorRef>& gradients) const;

  // The pipelined step (--pipeline_step): what a PushPull running on a
  // network thread shares with the compute thread. The compute thread says
  // which gradient elements are final (SetReady: a group is sent once all
  // its blocks are) and waits for the pulled values it needs (WaitPulled:
  // a group's values are in once its answer is). PsClient is otherwise not
  // thread-safe: the compute thread makes no call while one runs.
  class StepStream {
   public:
    // After Register: the partition's blocks.
    StepStream(const Partition& partition, int num_tensors);
    ~StepStream();
    // Between steps (no PushPull running): nothing ready, nothing pulled.
    void BeginStep();
    // The compute thread: elements [0, end) of tensor t's gradient are
    // final.
    void SetReady(int tensor, int64_t end);
    // The compute thread: waits until elements [0, end) of tensor t hold
    // the pulled values, the PushPull failed, or the deadline. ABORTED:
    // the PushPull's first attempt failed and every value is pulled again;
    // stop reading them (Settle, then start the forward again).
    absl::Status WaitPulled(int tensor, int64_t end, absl::Time deadline);
    // The compute thread: it reads no pulled value until the PushPull in
    // flight ends (it is about to wait for that).
    void StopReading();
    // The network thread, after a failed first attempt: once every
    // gradient is final and the compute thread reads no pulled value, the
    // values may be pulled again (the plain PushPull). False by the
    // deadline.
    bool AwaitRefetch(absl::Time deadline);
    // The compute thread, after AwaitRefetch released the network thread:
    // whether the values were pulled again since BeginStep (a forward
    // that read the first ones must start over). Clears it.
    bool TakeRefetched();
    // The compute thread gave up on the step: AwaitRefetch returns false.
    void Cancel();
    // Whether the PushPull ended with an error (MarkAllPulled).
    bool failed();
    // Every value is in (a plain Pull left them), or the PushPull ended
    // with `status`.
    void MarkAllPulled(const absl::Status& status);

    bool BlocksReady(const std::vector<int>& blocks) const;
    void MarkPulled(const std::vector<int>& blocks);
    // Elements [0, end) of `tensor` whose values have landed in the host
    // arrays, and how many groups have landed since the stream was made:
    // the compute thread stages in what landed while it waits for the
    // part it needs (AwaitLanding: until that count passes `seen`, the
    // PushPull failed, or the deadline).
    int64_t PulledEnd(int tensor);
    int64_t landings();
    // False: the PushPull failed, its values are pulled again, or the
    // deadline passed.
    bool AwaitLanding(int64_t seen, absl::Time deadline);

    // --trace_steps: what happened when, kept until TakeTrace while
    // SetTracing(true). `what`: r a gradient final up to `end`, s a group's
    // call free to leave (its blocks final, those ahead of it on its link too),
    // p its values landed (tensor and end of its last block); the trainer
    // adds its own (trainer.cc, StepTrace).
    struct TraceEvent {
      absl::Time at;
      char what;
      int tensor;
      int64_t end;
    };
    void SetTracing(bool on) { tracing_.store(on, std::memory_order_relaxed); }
    void Trace(char what, int tensor, int64_t end);
    void TraceGroup(char what, const std::vector<int>& blocks);
    std::vector<TraceEvent> TakeTrace();
    int wake_fd() const { return wake_fd_; }
    // Elements in the first block of `tensor` (the chunk to read and write
    // it by).
    int64_t FirstBlockElements(int tensor) const;

   private:
    const Partition& partition_;
    std::vector<std::vector<int>> blocks_of_tensor_;
    std::unique_ptr<std::atomic<int64_t>[]> ready_end_;
    int num_tensors_;
    int wake_fd_ = -1;
    bool AllReady() const;

    absl::Mutex mu_;
    std::vector<char> pulled_ ABSL_GUARDED_BY(mu_);
    absl::Status failed_ ABSL_GUARDED_BY(mu_);
    // A failed first attempt: the values are pulled again once the compute
    // thread stopped reading them.
    bool refetch_ ABSL_GUARDED_BY(mu_) = false;
    bool refetched_ ABSL_GUARDED_BY(mu_) = false;
    bool not_reading_ ABSL_GUARDED_BY(mu_) = false;
    bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
    int64_t landings_ ABSL_GUARDED_BY(mu_) = 0;

    std::atomic<bool> tracing_{false};
    absl::Mutex trace_mu_;
    std::vector<TraceEvent> trace_ ABSL_GUARDED_BY(trace_mu_);
  };
  std::unique_ptr<StepStream> MakeStepStream() const;
  // PushPullTensors whose groups each leave once `stream` says their
  // gradients are final and report their answers to it: the first
  // layer's groups last (see the .cc). On the data plane, float32, no
  // clip; otherwise, and after any failure, the plain PushPull once every
  // gradient is final and the compute thread stopped reading (its pushes
  // are duplicates, the values pulled again). Ends with MarkAllPulled.
  absl::StatusOr<PushPullResult> PushPullStreamed(
      int64_t push_step, const std::vector<ConstTensorRef>& gradients,
      int64_t pull_step, const std::vector<TensorRef>& tensors,
      StepStream& stream);

  // Sparse table `table` (index into the schema's sparse tables): fills
  // out[i * dim ..] with the rows of `ids` (unique), asking each shard for
  // the rows it holds, all at once. Sync: the rows after `step` updates.
  absl::Status PullSparse(int table, int64_t step,
                          absl::Span<const uint64_t> ids, float* out);
  // Sends one gradient row per id (ids unique, grads [ids, dim]). In sync
  // mode every shard gets a push, empty where the batch touched none of its
  // rows, so the table's step completes everywhere (an async table's empty
  // pushes are not sent).
  absl::StatusOr<PushResult> PushSparse(int table, int64_t step,
                                        absl::Span<const uint64_t> ids,
                                        const float* grads);
  // Several tables' rows in one round trip (every table's requests to
  // every shard in flight together): a model with many tables (CTR, DLRM)
  // pays one network wait a step for its pulls, and one for its pushes,
  // not one per table. Each part as in the single-table calls above.
  struct SparsePullPart {
    int table = 0;
    absl::Span<const uint64_t> ids;
    float* out = nullptr;
  };
  absl::Status PullSparse(int64_t step, absl::Span<const SparsePullPart> parts);
  struct SparsePushPart {
    int table = 0;
    absl::Span<const uint64_t> ids;
    const float* grads = nullptr;
  };
  absl::StatusOr<PushResult> PushSparse(int64_t step,
                                        absl::Span<const SparsePushPart> parts);

  // The current learning rate of each param group (a torch scheduler's,
  // TorchOptimizer.group indexes them), and its momentum where a scheduler
  // cycles it (empty otherwise): every later push carries them, and its
  // updates use them (sync: the step's). Empty (the default): each
  // tensor's registered rate, or the servers' --learning_rate.
  void SetGroupRates(std::vector<double> rates,
                     std::vector<double> momentums = {}) {
    group_rates_ = std::move(rates);
    group_momentums_ = std::move(momentums);
  }

  // sync: clip each later step's mean gradient to this 2-norm, as torch's
  // clip_grad_norm_ clips one process's gradient (the norm over every
  // dense parameter of the job, all shards); 0 (the default): no clipping.
  // Push (and PushPull) then finish each clipped step themselves: they
  // gather the shards' shares of the norm and send every shard the
  // coefficient (one more round trip), so the next pull finds it applied.
  // The norm of the last clipped step: last_clip_norm().
  void SetGradientClip(double max_norm) { clip_max_norm_ = max_norm; }
  double last_clip_norm() const { return last_clip_norm_; }

  // Tells every shard this worker is done; later steps stop waiting for it.
  // Stops the heartbeats, and drops the sparse row cache: what a worker
  // reads after training (its final evaluation) is the servers' model.
  // `stopping` (sync): it stops because it was told to (a signal), not
  // because its steps are done: the step under way waits for it while no
  // other worker trains, so that a whole job stopped at once completes no
  // step short (LeaveRequest.stopping); `stopping_grace`, the grace the
  // stop gave this worker's step (GracefulStop::grace()), lengthens that
  // hold, as the others' steps may take as long to end.
  absl::Status Leave(bool stopping = false,
                     absl::Duration stopping_grace = absl::ZeroDuration());
  // A stopping Leave, given up after `within` (Interrupt, from another
  // thread): a worker stopping on a signal must not be held by a shard it
  // cannot reach.
  absl::Status LeaveStoppingWithin(absl::Duration stopping_grace,
                                   absl::Duration within);
  // The sparse row cache's counts (all 0 when it is off), read on the
  // thread that makes the sparse calls.
  SparseRowCacheStats sparse_row_cache_stats() const;
  // Forgets every cached row (a sync worker about to evaluate the final
  // model: the rows must be the servers').
  void DropSparseRowCache();

  // Every shard's Stats; a replicated shard's from its primary (a call
  // that reaches another replica moves on, within the retry window).
  absl::StatusOr<std::vector<StatsResponse>> Stats();
  // async/ssp, on a client that does not train (an observer, or a worker
  // that left): waits until the servers' model is final, that is no worker
  // is a member any more and the smallest block version reached
  // `expected_version` (num_workers * steps: every push applied); or no
  // member is left and the model has not changed for 10 s (a worker
  // stopped early); or `timeout` passed. Returns how the wait ended:
  // "all_done", "quiet", "timeout" or "interrupted" (Interrupt).
  std::string AwaitFinalModel(int64_t expected_version, absl::Duration timeout);

  // Once this client holds the job's final model, at `final_version` (sync:
  // the step the job ended at; async/ssp: num_workers * steps), asks every
  // shard to make its state durable (a checkpoint, where the shard has a
  // --checkpoint_dir) and to say its version, so that a job is not reported
  // finished while a shard's copy is behind the model the workers report.
  // Retries, like every call, while a shard restarts; an error when a shard
  // does not answer within the retry window.
  absl::StatusOr<FinalState> SecureFinalState(int64_t final_version);

  // sync: the most steps a shard completed with fewer than num_workers
  // gradients (StatsResponse.steps_short): how often sync was weakened.
  absl::StatusOr<int64_t> StepsShort();

  // Thread-safe, from any thread (one that handles signals, say): every
  // call in progress on this client returns CANCELLED within about a
  // second: its RPCs are cancelled, its data-plane exchanges cut (those
  // connections are reopened by later calls), its retry waits and
  // AwaitJobStart end. A push cut this way may or may not have been
  // applied; repeating it is safe, as after any failure. Calls started
  // afterwards run normally.
  void Interrupt();

  // Pushes resent by inject_duplicate_push_probability.
  int64_t injected_duplicate_pushes() const { return injected_duplicates_; }

  int num_shards() const { return static_cast<int>(options_.hosts.size()); }

 private:
  // One RPC's share of the model: some blocks of one shard.
  struct Group {
    int shard = 0;
    int connection = 0;
    std::vector<int> blocks;   // global block indices
    int64_t elements = 0;      // over its blocks
    std::string pull_request;  // serialized PullRequest, step filled per call
  };
  struct Call;
  struct CallStream;
  struct DataSlot;

  explicit PsClient(const PsClientOptions& options);

  // Runs the calls in `which` that can go on the data plane (Push and Pull
  // to a shard with a reachable data port and a free connection) and
  // returns the others, for gRPC.
  std::vector<size_t> RunOnDataPlane(const std::string& short_name,
                                     std::vector<Call>& calls,
                                     const std::vector<size_t>& which,
                                     absl::Duration timeout);
  // The slot's link to `shard`, opened if need be; null when the shard has
  // no usable data port. The caller holds slot.mu.
  DataLink* LinkFor(int shard, DataSlot& slot, absl::Time deadline);
  // The data port to use for `shard`, or 0 for gRPC (none announced, TLS
  // mismatch, or it failed less than 30 s ago).
  int DataPortToUse(int shard);
  // Opens the links `which` calls need and lack (OpenLinks).
  void OpenMissingLinks(const std::vector<Call>& calls,
                        const std::vector<size_t>& which, absl::Time deadline);
  // Opens the slots' links, a shard per thread when there are several: a
  // data port that drops packets then costs the connect bound (5 s) once,
  // not once for every shard in turn.
  void OpenLinks(const std::map<int, std::vector<DataSlot*>>& by_shard,
                 absl::Time deadline);
  // Whether `shard` announced PushPull on its data plane.
  bool DataPushPullOffered(int shard);
  // A data-plane link to `port` on the host of `grpc_address` (a
  // replica's gRPC host:port), with this client's token and TLS.
  absl::StatusOr<std::unique_ptr<DataLink>> OpenDataLink(
      const std::string& grpc_address, int port, absl::Time deadline) const;
  // pulls_from_backups: the replica (a backup) whose values this worker
  // reads for `shard` this step, or -1 (the primary's, with the push).
  int BackupToReadFrom(int shard);
  // A backup's data-plane link in `slot` (the slot of that replica), or
  // null when it cannot be reached (its reads then stop for a while).
  DataLink* BackupLinkFor(int shard, int replica, DataSlot& slot,
                          absl::Time deadline);
  void StopBackupReads(int shard, const absl::Status& why);
  // One PushPull call per group: its push (answered into `responses`) and
  // its pull.
  absl::StatusOr<std::vector<Call>> PushPullCalls(
      int64_t push_step, const std::vector<ConstTensorRef>& gradients,
      int64_t pull_step, const std::vector<TensorRef>& tensors,
      std::vector<PushResponse>& responses,
      size_t inline_below_bytes = kInlineBelowBytes);
  // PushPullTensors with pulls_from_backups, in one attempt, reading shard
  // s from replica read_from[s] where that is not -1: an error means the
  // step goes again as a plain PushPull.
  absl::StatusOr<PushPullResult> PushPullReadingBackups(
      int64_t push_step, const std::vector<ConstTensorRef>& gradients,
      int64_t pull_step, const std::vector<TensorRef>& tensors,
      const std::vector<int>& read_from);
  // Whether this client may use any data port (see data_plane_tls).
  bool DataPlaneAllowed() const;
  // After a data port failed: registers again (once) to learn whether the
  // server announces another one, by `deadline` and within a few seconds.
  void MaybeRefreshDataPorts(absl::Time deadline);
  // The calls of a Pull and of a Push (nothing sent yet); `responses` gets
  // each group's PushResponse. Push calls skip groups with no selected
  // tensor.
  absl::Status CheckPullArguments(const std::vector<TensorRef>& tensors) const;
  std::vector<Call> PullCalls(int64_t step,
                              const std::vector<TensorRef>& tensors);
  absl::StatusOr<std::vector<Call>> PushCalls(
      int64_t step, const std::vector<ConstTensorRef>& gradients,
      absl::Span<const int> only, std::vector<PushResponse>& responses,
      bool exact_values = false, size_t inline_below_bytes = kInlineBelowBytes);
  static PushResult SumPushResponses(
      const std::vector<PushResponse>& responses);
  // What Pull returns once the pull of `step` is in (see Pull); also kept
  // as the furthest step pulled (NoteFurthestPulled).
  int64_t RecordPulledStep(int64_t step);
  // RecordPulledStep of a plain read into `tensors` (not the pipelined
  // step's). sync: blocks of two steps in one read mean that a shard went
  // on without this worker (its lease ran out there, not on the others).
  // Rather than compute a gradient from both, the worker skips to the
  // later step on every shard: the shards still waiting for its gradient
  // of the earlier one count it as lost (HeartbeatRequest.skip_to_step),
  // and the read is made again at the later step.
  absl::StatusOr<int64_t> FinishPlainRead(
      int64_t step, const std::vector<TensorRef>& tensors);
  // An observer's (worker id -1): it reads again at the step after the
  // furthest one it found (FinishObserverRead in ps_client_tensors.cc).
  absl::StatusOr<int64_t> FinishObserverRead(
      int64_t step, const std::vector<TensorRef>& tensors);
  // sync: the blocks of the last read are not all at one step. The
  // pipelined step then goes again as a plain PushPull, which skips.
  bool PulledBlocksDisagree() const;
  // Whether the servers run this table in the sync step.
  bool IsSyncTable(const SparseTableSpec& spec) const;
  // Raises the furthest step pulled, which the heartbeats carry, to `step`.
  void NoteFurthestPulled(int64_t step);
  // sync, a clipped step: the norm from every shard's share, then the
  // coefficient to every shard (nothing when a worker already sent it).
  absl::Status FinishClippedStep(int64_t step);
  // Sends `pushed` again, each with inject_duplicate_push_probability.
  absl::Status InjectDuplicatePushes(const std::vector<Call>& pushed);
  // Sleeps up to inject_push_jitter (see PsClientOptions).
  void InjectPushJitter();
  // A PushPull call's data-plane request and answer handling
  // (common/transport/data_plane.h).
  static void PreparePushPull(Call& call, DataExchange& exchange);
  // PushPull calls that cannot take the data plane: their pushes over gRPC,
  // then the pulls of those whose push succeeded.
  void PushPullOverGrpc(std::vector<Call>& calls,
                        const std::vector<size_t>& which,
                        absl::Duration timeout);
  // Starts `calls` of `method` ("Pull") at once and waits for all of them;
  // with `retry`, calls that failed for a transient reason are started
  // again with backoff until the retry window closes. Returns the first
  // failure left, naming the shard.
  absl::Status RunAll(const char* method, std::vector<Call>& calls,
                      absl::Duration timeout, bool retry = false);
  // Sync, with replicas: keeps the pushes of a PushPull that was answered
  // (`calls`, their requests copied) in the place of the ones before. A
  // replicated primary answers the pulls of step s once its backups hold
  // step s - 2, before they hold s - 1 (ParameterServerService's record
  // window): a backup that takes over may lack step s - 1, and these
  // pushes, sent again, make it there as they made it on the primary.
  // `answered`: the PushPull of `step` succeeded, and these replace what
  // was kept; otherwise they are kept beside the last answered step's.
  void RetainPushes(const std::vector<Call>& calls, int64_t step,
                    bool answered);
  // Sends the kept pushes of `shards` again, moving through their replicas
  // as RunAll does, until each shard's current replica took them (as new
  // or as duplicates), for at most kResendWindow or until `give_up`.
  void ResendRetainedPushes(const std::vector<int>& shards, absl::Time give_up);
  // ResendRetainedPushes for the shards whose calls moved to another
  // replica (on any thread) since it took the kept pushes: RunAll calls it
  // before each round of a step's or the job end's calls, so that a new
  // primary has this worker's last step before its next push.
  void ResendIfReplicaMoved(absl::Time give_up);
  static constexpr absl::Duration kResendWindow = absl::Seconds(10);
  // One round of RunAll over calls[i] for i in `which`.
  void StartAndWait(const std::string& method, std::vector<Call>& calls,
                    const std::vector<size_t>& which, absl::Duration timeout);
  // A fresh context (deadline, wait-for-ready, credentials) and request.
  void PrepareCall(std::chrono::system_clock::time_point deadline,
                   Call& call) const;
  // Runs `call` as one message on its connection's stream for `method`;
  // false (and nothing sent) when the stream is busy on another thread.
  bool CallOnStream(const std::string& method, absl::Duration timeout,
                    const std::string& short_name, Call& call);
  // Sets call.status from the RPC's and, if that is OK, on_response's.
  static void FinishCall(const grpc::Status& status,
                         const std::string& short_name, Call& call);
  // One call of `request` (serialized) to every shard, shard s's answer
  // parsed into (*responses)[s], which it sizes.
  template <typename Response>
  std::vector<Call> CallsToEveryShard(const std::string& request,
                                      std::vector<Response>* responses) const;
  // Registers schema_ as worker_id_ on every shard (again after a restart),
  // waiting for servers not up yet until the connect timeout or `give_up`,
  // whichever comes first. With `wait_out_dying_servers` (a worker's first
  // registration), a call cut by a server going away is made again within
  // that time; without (inside RunAll's retries, which have their own
  // window), the first failure is returned.
  absl::StatusOr<std::vector<RegisterModelResponse>> RegisterCalls(
      bool wait_out_dying_servers, absl::Time give_up = absl::InfiniteFuture());
  absl::Status RegisterOnShards(absl::Time give_up);
  // Register with the block size settled.
  absl::StatusOr<Registration> RegisterResolved(const ModelSchema& schema,
                                                int num_workers, int worker_id);
  // The block_elements of the model a shard holds when it is `schema` in
  // other blocks; NOT_FOUND otherwise.
  absl::StatusOr<int64_t> HeldBlockElements(const ModelSchema& schema);
  // Whether the shards that hold a restarted worker's place (sync) all do,
  // at one step; or none does.
  static bool ResumesInPlaceEverywhere(
      const std::vector<RegisterModelResponse>& responses);
  // Before the first registration: fails fast, naming TLS and the likely
  // cause, where a shard accepts TCP but refuses this client's transport.
  absl::Status CheckTransports();
  // Opens the data-plane connections the model's groups use (those that
  // are not open yet), so that the first step does not.
  void OpenDataLinks();
  void HeartbeatLoop();
  void StopHeartbeats();
  // Where shard `shard`'s connection `connection` to its current replica
  // sits in channels_, stubs_, the streams and data_slots_.
  size_t SlotOf(int shard, int connection) const {
    return SlotOfReplica(shard, current_replica_[shard].load(), connection);
  }
  size_t SlotOfReplica(int shard, int replica, int connection) const {
    return (static_cast<size_t>(shard) * replicas_ + replica) * connections_ +
           connection;
  }
  // The data-plane connection that carries a call made on `connection` to
  // `shard`: with connections by host, connection 0 where the shard's
  // primary is on another host (or not known yet).
  int DataConnectionOf(int shard, int connection) const;
  // The address of shard `shard`'s current replica.
  const std::string& HostOf(int shard) const {
    return replica_hosts_[shard][current_replica_[shard].load()];
  }
  // A call to `shard` failed as one to a replica that is gone or not the
  // primary: its calls go to the next replica (unless another call moved
  // them on from `from` already), which is registered with again.
  void NextReplica(int shard, int from);
  grpc::GenericStub& Connection(int shard, int connection) {
    return *stubs_[SlotOf(shard, connection)];
  }
  absl::Status StoreBlocks(const Group& group, const WirePullResponse& response,
                           const std::vector<TensorRef>& tensors);
  // DataLoss unless `wire` is global block g.
  absl::Status CheckReturnedBlock(const WireBlock& wire, int g) const;
  // Where a data-plane pull's payloads go (its blocks in the tensors), from
  // the answer's metadata; records the blocks' versions.
  absl::StatusOr<std::vector<absl::Span<char>>> PlacePayloads(
      const Group& group, absl::string_view meta,
      const std::vector<TensorRef>& tensors);

  PsClientOptions options_;
  // What pulled parameters travel as: options_.parameter_wire_type, or
  // FLOAT32 where a shard cannot round them (set by Register).
  DataType pull_wire_type_ = FLOAT32;
  // Every shard takes several tables in one SparsePull (set by Register).
  bool sparse_pull_tables_ = false;
  // ... and in one SparsePush.
  bool sparse_push_tables_ = false;
  const uint64_t incarnation_;
  // Connections to each replica (options_.connections_per_shard, or
  // kConnectionsOnThisHost when that is 0: by host).
  const int connections_;
  int worker_id_ = -1;
  int num_workers_ = 0;
  ConsistencyMode mode_ = ConsistencyMode::kSync;
  // Each shard's replicas' addresses (options_.hosts split at '|'), as
  // many for every shard, and the replica each shard's calls go to.
  std::vector<std::vector<std::string>> replica_hosts_;
  int replicas_ = 1;
  std::unique_ptr<std::atomic<int>[]> current_replica_;
  // [shard][replica][conn]
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;  // on channels_
  // [shard][conn], opened on first use: the PushStream and PullStream.
  std::vector<std::unique_ptr<CallStream>> push_streams_, pull_streams_;
  std::vector<std::unique_ptr<ParameterServer::Stub>> control_;  // per shard
  // [shard][conn]: the data-plane connections, opened on first use.
  std::vector<std::unique_ptr<DataSlot>> data_slots_;
  absl::Mutex data_ports_mu_;
  // Per shard: the data port its registration announced (0: none), the one
  // that could not be reached (0: none) and when, and whether to ask again.
  std::vector<int> data_ports_ ABSL_GUARDED_BY(data_ports_mu_);
  std::vector<int> data_failed_ports_ ABSL_GUARDED_BY(data_ports_mu_);
  std::vector<absl::Time> data_failed_at_ ABSL_GUARDED_BY(data_ports_mu_);
  bool refresh_data_ports_ ABSL_GUARDED_BY(data_ports_mu_) = false;
  // Per shard: whether its data plane takes PushPull.
  std::vector<bool> data_push_pull_ ABSL_GUARDED_BY(data_ports_mu_);
  // Whether each shard's data port speaks TLS (RegisterModelResponse).
  std::vector<bool> data_port_tls_ ABSL_GUARDED_BY(data_ports_mu_);
  // Per shard: each replica's data port (RegisterModelResponse), and until
  // when its backup is not read from (pulls_from_backups).
  std::vector<std::vector<int>> replica_data_ports_
      ABSL_GUARDED_BY(data_ports_mu_);
  std::vector<absl::Time> backup_reads_off_until_
      ABSL_GUARDED_BY(data_ports_mu_);
  // Per shard: whether the last data-plane link opened to its primary
  // connects to this host (1), another host (0), or none was opened (-1).
  // Atomic: every data-plane call reads it (DataConnectionOf).
  std::unique_ptr<std::atomic<int>[]> primary_on_this_host_;
  // Per shard: backup reads that failed since the last that did not; each
  // doubles the pause (a backup out of reach may cost a read its deadline).
  std::vector<int> backup_read_failures_ ABSL_GUARDED_BY(data_ports_mu_);
  // Interrupt: how many there were, and what calls in progress use that it
  // must cut. A call compares the count with its own (Call::epoch).
  uint64_t interrupts() const;
  // Registers (or, at once, cancels, when an Interrupt came after `epoch`)
  // what a call uses, for the call's duration.
  void Track(grpc::ClientContext* context, uint64_t epoch);
  void Untrack(grpc::ClientContext* context);
  void Track(const DataLink* link, uint64_t epoch);
  void Untrack(const DataLink* link);
  // Sleeps `duration`, or less when an Interrupt comes; false then.
  bool SleepUnlessInterrupted(absl::Duration duration, uint64_t epoch) const;
  mutable absl::Mutex interrupt_mu_;
  uint64_t interrupts_ ABSL_GUARDED_BY(interrupt_mu_) = 0;
  std::set<grpc::ClientContext*> active_contexts_
      ABSL_GUARDED_BY(interrupt_mu_);
  std::set<const DataLink*> active_links_ ABSL_GUARDED_BY(interrupt_mu_);

  std::unique_ptr<Partition> partition_;
  ModelSchema schema_;
  std::vector<Group> groups_;
  std::vector<int64_t> block_versions_;  // per global block, from Pull
  // Read by the heartbeat thread (HeartbeatRequest.step).
  std::atomic<int64_t> furthest_pulled_step_{0};
  // Per shard, the server_life of its newest push answer (0: none yet).
  std::vector<std::atomic<uint64_t>> server_lives_;
  // Reused across steps: encoded gradients when the wire type is not fp32.
  std::vector<std::string> encoded_;
  // TOPK_FLOAT32: per global block, the gradient not sent yet.
  std::vector<std::vector<float>> topk_residual_;
  int64_t injected_duplicates_ = 0;
  // RetainPushes: a shard's connection and a push request, flat.
  struct RetainedPush {
    int shard = 0;
    int connection = 0;
    int64_t step = 0;
    // The replica that has it (or refused it for good): sent again when the
    // shard's calls go to another.
    int replica = 0;
    std::string request;
  };
  absl::Mutex retained_mu_;
  std::vector<RetainedPush> retained_pushes_ ABSL_GUARDED_BY(retained_mu_);
  // The ones before, their memory reused by the next RetainPushes.
  std::vector<RetainedPush> retained_spare_ ABSL_GUARDED_BY(retained_mu_);
  std::unique_ptr<SparseRowCache> row_cache_;  // null: off
  absl::BitGen random_;
  std::vector<double> group_rates_, group_momentums_;  // SetGroupRates
  double clip_max_norm_ = 0;                           // SetGradientClip
  double last_clip_norm_ = 0;

  absl::Notification stop_heartbeats_;
  std::thread heartbeat_thread_;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CLIENT_PS_CLIENT_H_
