/* libpstrain: the C++ client (worker/client/ps_client.h) and the data readers
 * the Python package uses, behind a plain C ABI.
 *
 * Why C: one build of this library serves every CPython (3.9 to 3.12 and
 * later) and every torch, loaded with ctypes (pstrain/_native.py), instead
 * of an extension module compiled per interpreter. The wheel carries it with
 * the shared libraries it needs beside it (worker/python/build_wheel.sh), so
 * a host needs nothing of ours but glibc >= the build host's and a
 * libstdc++ as new.
 *
 * Conventions. Every call that can fail returns 0 (OK) or an absl status
 * code (3 INVALID_ARGUMENT, 14 UNAVAILABLE, ...) and then sets *error to a
 * message the caller frees with pstrain_free. Text in and out is UTF-8 JSON
 * where the values are structured (options, schemas, stats); strings the
 * library returns are freed with pstrain_free too. Tensors are float32
 * host memory the caller owns: a pull writes into it, a push reads it, with
 * no copy here. A client is used by one thread at a time, except
 * pstrain_client_interrupt, which any thread may call: the call in
 * progress then returns CANCELLED (1) within about a second.
 */
#ifndef PSTRAIN_WORKER_PYTHON_C_API_H_
#define PSTRAIN_WORKER_PYTHON_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a signature here changes; pstrain/_native.py checks it. */
#define PSTRAIN_C_API_VERSION 8
int pstrain_api_version(void);

void pstrain_free(void* p);

/* ----- Client (worker/client/ps_client.h has each call's contract) ----- */

typedef struct pstrain_client pstrain_client;

/* options_json: {"hosts": ["h:p", ...], "rpc_timeout_s": 120, ...}, the
 * options of worker/client/client_config.h by their flag names.
 * pstrain_client_parse_options only checks their names and types (an
 * unknown name, a value of the wrong type, no hosts: INVALID_ARGUMENT);
 * pstrain_client_create also their values and files, and connects. */
int pstrain_client_parse_options(const char* options_json, char** error);
int pstrain_client_create(const char* options_json, pstrain_client** out,
                          char** error);
void pstrain_client_destroy(pstrain_client* client);
void pstrain_client_interrupt(pstrain_client* client);
int pstrain_client_num_shards(const pstrain_client* client);

/* schema_json: a ModelSchema in protobuf's JSON mapping. *result_json:
 * {"mode": "sync", "start_step": 0}. */
int pstrain_client_register(pstrain_client* client, const char* schema_json,
                            int num_workers, int worker_id, char** result_json,
                            char** error);

/* Called about once a second while waiting, with
 * {"missing_workers": [...], "num_workers": N, "waited_s": x,
 *  "startup_timeout_s": y}. */
typedef void (*pstrain_waiting_fn)(void* context, const char* waiting_json);
int pstrain_client_await_job_start(pstrain_client* client,
                                   pstrain_waiting_fn on_waiting, void* context,
                                   char** error);

/* tensors[i]: the schema's dense tensor i (its element count), in order. */
int pstrain_client_pull(pstrain_client* client, int64_t step,
                        float* const* tensors, int num_tensors,
                        int64_t* pulled_step, char** error);
/* only: indices of the tensors to push (NULL / 0: all; the others'
 * pointers may be NULL). result: {blocks_duplicate, blocks_late}. */
int pstrain_client_push(pstrain_client* client, int64_t step,
                        const float* const* gradients, int num_tensors,
                        const int* only, int num_only, int64_t result[2],
                        char** error);
/* result: {blocks_duplicate, blocks_late, pulled_step}. */
int pstrain_client_push_pull(pstrain_client* client, int64_t push_step,
                             const float* const* gradients, int64_t pull_step,
                             float* const* tensors, int num_tensors,
                             int64_t result[3], char** error);
/* 1 when some shard's data-plane link goes to another host, as far as the
 * links opened so far tell (PsClient::SomeShardOnAnotherHost): where a step
 * is bound by the link rather than by this host's CPU. */
int pstrain_client_some_shard_on_another_host(const pstrain_client* client);

/* The pipelined step (PsClient::PushPullStreamed): push_step's gradients
 * and pull_step's values exchanged as pstrain_client_push_pull does, on a
 * thread of the library's own, while the caller's backward still makes the
 * gradients: each group of blocks leaves once pstrain_stream_ready has said
 * that its elements are final, and its pulled values are written when its
 * answer comes. The memory is read and written until pstrain_stream_finish
 * or pstrain_stream_cancel, which free the stream; until then the client
 * takes no other call but pstrain_client_interrupt. One stream a client at
 * a time (FAILED_PRECONDITION). Where the step cannot stream (TLS, a clip,
 * a wire type other than float32, gRPC only) or its first attempt failed,
 * the plain PushPull runs once every gradient is ready. The exchange runs
 * on the client's own thread, made by the first stream. */
typedef struct pstrain_step_stream pstrain_step_stream;
int pstrain_stream_start(pstrain_client* client, int64_t push_step,
                         const float* const* gradients, int64_t pull_step,
                         float* const* tensors, int num_tensors,
                         pstrain_step_stream** out, char** error);
/* Any thread: elements [0, end) of tensor `tensor`'s gradient are final.
 * 3 (INVALID_ARGUMENT): no such tensor, or end out of [0, its size]. */
int pstrain_stream_ready(pstrain_step_stream* stream, int tensor, int64_t end);
/* Waits for the exchange to end (every tensor must have been made ready, or
 * the exchange waits out the RPC deadline); result as push_pull's, then
 * the calls answered as they were streamed (0 where the step ran as the
 * plain PushPull). */
int pstrain_stream_finish(pstrain_step_stream* stream, int64_t result[4],
                          char** error);
/* Gives the step up (backward failed): the exchange stops within about a
 * second; whatever groups had left stay pushed (exactly once). */
void pstrain_stream_cancel(pstrain_step_stream* stream);
int pstrain_client_assign(pstrain_client* client, const float* const* values,
                          int num_tensors, const int* only, int num_only,
                          int64_t result[2], char** error);
/* out: [num_ids, dim] rows of sparse table `table`. */
int pstrain_client_pull_sparse(pstrain_client* client, int table, int64_t step,
                               const uint64_t* ids, int64_t num_ids, float* out,
                               char** error);
int pstrain_client_push_sparse(pstrain_client* client, int table, int64_t step,
                               const uint64_t* ids, int64_t num_ids,
                               const float* gradients, int64_t result[2],
                               char** error);
/* Several tables' rows in one round trip (PsClient::PullSparse with parts):
 * part i fills outs[i] ([num_ids[i], dim]) with the rows of table tables[i]
 * for ids[i], as pstrain_client_pull_sparse does. */
int pstrain_client_pull_sparse_tables(pstrain_client* client, int64_t step,
                                      int num_parts, const int* tables,
                                      const uint64_t* const* ids,
                                      const int64_t* num_ids,
                                      float* const* outs, char** error);
/* Several tables' rows in one round trip (PsClient::PushSparse with parts):
 * part i pushes num_ids[i] rows of table tables[i], ids[i] and gradients[i]
 * ([num_ids[i], dim]) as pstrain_client_push_sparse does. */
int pstrain_client_push_sparse_tables(pstrain_client* client, int64_t step,
                                      int num_parts, const int* tables,
                                      const uint64_t* const* ids,
                                      const int64_t* num_ids,
                                      const float* const* gradients,
                                      int64_t result[2], char** error);
/* The current learning rate of each param group, and its momentum (NULL:
 * none carried), carried by every later push (PsClient::SetGroupRates). */
void pstrain_client_set_group_rates(pstrain_client* client, const double* rates,
                                    const double* momentums, int num_groups);
/* sync: clip each later step's mean gradient to this 2-norm (0: none);
 * the norm of the last clipped step (PsClient::SetGradientClip). */
void pstrain_client_set_gradient_clip(pstrain_client* client, double max_norm);
double pstrain_client_last_clip_norm(const pstrain_client* client);
int pstrain_client_leave(pstrain_client* client, char** error);
/* Leaves as a worker stopped by a signal (LeaveRequest.stopping: a sync
 * job holds its step while no other worker trains), giving up after
 * timeout_s. */
int pstrain_client_leave_stopping(pstrain_client* client, double timeout_s,
                                  char** error);
/* *stats_json: a JSON array of every shard's StatsResponse (proto names). */
int pstrain_client_stats(pstrain_client* client, char** stats_json,
                         char** error);
int pstrain_client_steps_short(pstrain_client* client, int64_t* steps,
                               char** error);
/* *how: "all_done", "quiet", "timeout" or "interrupted". */
int pstrain_client_await_final_model(pstrain_client* client,
                                     int64_t expected_version, double timeout_s,
                                     char** how, char** error);

/* Once the client holds the job's final model at `final_version`
 * (PsClient::SecureFinalState): *state_json is
 * {"summary":"durable"|"in_memory"|"behind","shards_behind":[...],
 *  "problems":["..."]}. */
int pstrain_client_secure_final_state(pstrain_client* client,
                                      int64_t final_version, char** state_json,
                                      char** error);

/* The cluster description of this process (common/cluster_spec.h) as JSON,
 * or "null" when there is none. */
int pstrain_load_cluster_spec(const char* path, char** spec_json, char** error);

/* The client options' names (worker/client/client_options.h: the worker
 * flags a client takes) as a JSON list of strings, sorted. */
int pstrain_client_option_names(char** names_json, char** error);

/* Interrupts every live client's call in progress (as
 * pstrain_client_interrupt) whenever SIGINT's or SIGTERM's number can be
 * read from `fd`: the read end of a pipe whose write end Python's
 * signal.set_wakeup_fd was given. So a caller blocked in a call on its
 * main thread (ctypes released the GIL) gets it back within about a second
 * of Ctrl-C, and Python raises KeyboardInterrupt, with no thread hop per
 * call. Starts one watcher thread, once; later calls are ignored. */
void pstrain_watch_signals(int fd);

/* For the signals in `signals` (bit n: signal number n; 0: none, as
 * before), the first one read from the watched fd no longer interrupts at
 * once: pstrain_stop_requested() returns its number, and the calls still
 * in progress after a grace are interrupted, and again every 100 ms, until
 * pstrain_stop_quiet() (the caller finished its step and leaves). The
 * grace is twice the longer of the last two `step_work_ms` told, each the
 * time the caller's last step took (data, forward, backward, exchange),
 * 0.4 s to 5 s; negative: a new job's first step is under way, its time
 * unknown (5 s until told), and an earlier job's stop is forgotten (its
 * caller handled it). A step that tells its time while the grace runs
 * moves the deadline. The C++ worker's rule (worker/client/graceful_stop.h).
 * A second SIGINT interrupts at once; a second SIGTERM changes nothing. */
void pstrain_stop_gracefully(uint64_t signals, int64_t step_work_ms);
int pstrain_stop_requested(void);
void pstrain_stop_quiet(void);

/* ----- Data: the C++ worker's readers, in its order ----- */

typedef struct pstrain_examples pstrain_examples;
int pstrain_open_idx(const char* dir, int train, pstrain_examples** out,
                     char** error);
int pstrain_synthetic(int64_t count, int64_t first_index, int64_t num_features,
                      int64_t num_classes, double label_noise, uint64_t seed,
                      pstrain_examples** out, char** error);
void pstrain_examples_destroy(pstrain_examples* examples);
/* shape: {size, num_features, num_classes}. */
void pstrain_examples_shape(const pstrain_examples* examples, int64_t shape[3]);
/* features: [n, num_features]; labels: [n]. */
int pstrain_examples_gather(pstrain_examples* examples, const int64_t* rows,
                            int64_t n, float* features, int64_t* labels,
                            char** error);

/* The synthetic CTR data (worker/ctr_data.h); field_vocab: num_fields
 * vocabularies, one per field, or NULL for vocab_per_field in every field.
 * sizes: {examples, ids}; pstrain_ctr_data_arrays gives where the data's
 * own arrays are, valid until pstrain_ctr_data_destroy: labels (float, n),
 * dense (float, n * num_dense), offsets (int64_t, n * num_fields + 1), ids
 * (uint64_t, ids) and the hidden true click probabilities (double, n). A
 * caller may write to them (nothing else reads them). */
typedef struct pstrain_ctr_data pstrain_ctr_data;
/* Writes the 26 Criteo Kaggle field cardinalities into out (room for 64)
 * and returns how many. */
int pstrain_criteo_kaggle_cardinalities(int64_t* out);
int pstrain_synthetic_ctr(int64_t count, int64_t first_index, int num_dense,
                          int num_fields, int64_t vocab_per_field,
                          const int64_t* field_vocab, int max_bag,
                          uint64_t seed, pstrain_ctr_data** out, char** error);
void pstrain_ctr_data_sizes(const pstrain_ctr_data* data, int64_t sizes[2]);
void pstrain_ctr_data_arrays(pstrain_ctr_data* data, void* arrays[5]);
void pstrain_ctr_data_destroy(pstrain_ctr_data* data);
/* The bags of examples rows[0..num_rows) of CSR data (offsets
 * [num_examples * num_fields + 1] into ids) field by field, as
 * GatherFieldBags (worker/ctr_data.h) writes them: ids_out (room for `room`
 * ids), bag_offsets [num_fields * num_rows], field_ids [num_fields + 1]. */
int pstrain_ctr_gather_bags(const int64_t* offsets, int64_t num_examples,
                            const uint64_t* ids, int num_fields,
                            const int64_t* rows, int64_t num_rows,
                            uint64_t* ids_out, int64_t room,
                            int64_t* bag_offsets, int64_t* field_ids,
                            char** error);

/* `count` arrays of ids, one after another in `ids` (lengths[a] each), each
 * made unique (worker/unique_ids.h) as an embedding table's pull needs them:
 * array a's distinct ids, in order of first occurrence, go to the start of
 * its own stretch of `keys` (the same positions its ids have in `ids`),
 * unique_counts[a] of them, and index[j] is the position of ids[j] among its
 * array's distinct ids. bounds[a] >= 0: every id of array a must lie in
 * [0, bounds[a]); < 0: any id. Returns -1 when every array was done, else
 * the first array with an id out of its bounds (it and those after it are
 * left unset). */
int pstrain_unique_ids(int count, const int64_t* ids, const int64_t* lengths,
                       const int64_t* bounds, uint64_t* keys, int64_t* index,
                       int64_t* unique_counts);

/* The epoch plan (worker/data.h). */
typedef struct pstrain_epoch_plan pstrain_epoch_plan;
int pstrain_epoch_plan_create(int64_t num_examples, int64_t worker_batch,
                              int num_workers, int worker_index, int shuffle,
                              uint64_t seed, pstrain_epoch_plan** out,
                              char** error);
void pstrain_epoch_plan_destroy(pstrain_epoch_plan* plan);
int64_t pstrain_epoch_plan_steps_per_epoch(const pstrain_epoch_plan* plan);
int64_t pstrain_epoch_plan_global_batch(const pstrain_epoch_plan* plan);
/* Writes the worker's example indices of `step` (worker_batch of them) to
 * rows; returns how many. */
int64_t pstrain_epoch_plan_worker_indices(pstrain_epoch_plan* plan,
                                          int64_t step, int64_t* rows);

#ifdef __cplusplus
}
#endif

#endif /* PSTRAIN_WORKER_PYTHON_C_API_H_ */
