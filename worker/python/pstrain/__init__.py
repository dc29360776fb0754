"""pstrain from Python: the parameter servers' C++ client, through its C ABI.

There is one client, the C++ ``PsClient`` (worker/client/ps_client.h): the data plane,
PushPull, retries, heartbeats, exactly-once pushes, TLS, the bearer token and
the cluster description all come with it. This package adds argument checks
and Python types; ``pstrain.torch`` trains a ``torch.nn.Module`` on the servers
and ``pstrain.data`` reads the data sets the C++ worker reads, in its order.

Every call that talks to the servers releases the GIL, and Ctrl-C interrupts
one that waits (within about a second) with ``KeyboardInterrupt``. Failures the
servers or the network report raise ``pstrain.Error`` (its ``.code`` is the
status name, e.g. ``"UNAVAILABLE"``); arguments refused before anything is sent
raise ``TypeError`` or ``ValueError`` naming the tensor or option.

Tensors go in and out as contiguous float32 host memory with exactly the
registered tensor's element count: numpy arrays, CPU ``torch.Tensor`` s, or
writable buffers (``array.array("f")``), passed by address with no copy: a
pull writes the parameters into them, a push reads gradients from them.
numpy and torch are the user's own (the package needs neither to import).
"""

import json
import os

from pstrain import _core

Error = _core.Error

__all__ = ["Client", "ClusterSpec", "Error", "client_option_names",
           "cluster_spec"]


def _version():
    try:
        from importlib import metadata
        return metadata.version("pstrain")
    except Exception:  # not installed: the build tree
        return "dev"


__version__ = _version()


class ClusterSpec:
    """Where this process's job is: servers, worker count, this worker's id.

    From the C++ cluster description (common/cluster_spec.h): the file
    ``path``, else ``$PSTRAIN_CLUSTER`` (JSON, as ``deploy/local/launch.sh``
    sets it for a Python worker), else ``$TF_CONFIG``. ``RANK`` and
    ``WORLD_SIZE`` (torchrun's names) fill in the worker id and count where the
    description leaves them out.
    """

    def __init__(self, ps, num_workers, worker_id, mode="", client_options=None):
        self.ps = list(ps)
        self.num_workers = int(num_workers)
        self.worker_id = int(worker_id)
        self.mode = mode
        self.client_options = dict(client_options or {})

    def __repr__(self):
        return (f"ClusterSpec(ps={self.ps}, num_workers={self.num_workers}, "
                f"worker_id={self.worker_id})")


def cluster_spec(path=""):
    """The ClusterSpec of this process, or a ValueError saying what is missing."""
    spec = _core.load_cluster_spec(path)
    if spec is None:
        raise ValueError(
            "no cluster description: set PSTRAIN_CLUSTER (deploy/local/launch.sh "
            "--python does), TF_CONFIG, or pass the servers' host:port list")
    workers = spec["workers"] or int(os.environ.get("WORLD_SIZE", "0"))
    if spec["task_type"] == "worker":
        worker_id = spec["task_index"]
    elif "RANK" in os.environ:
        worker_id = int(os.environ["RANK"])
    else:
        raise ValueError(f"{spec['source']}: no task index and no $RANK: which "
                         "worker is this process?")
    if workers < 1:
        raise ValueError(f"{spec['source']}: no worker count (\"workers\") and "
                         "no $WORLD_SIZE")
    # The worker flags that configure the client (worker/client/
    # client_options.h), typed by the C++ side; model flags are left out.
    return ClusterSpec(spec["ps"], workers, worker_id, spec["mode"],
                       spec["client_options"])


def client_option_names():
    """The names Client and ParameterServer take as options: the worker
    binary's client flags (worker/client/client_options.h), sorted.
    ``deploy/local/launch.sh --python`` routes these flags to a Python
    worker's client and the others to its script."""
    return _core.client_option_names()


class Client:
    """One worker's (or an observer's) connection to every shard.

    Options (all optional but ``hosts``) are the worker binary's client
    flags, by the same names: one list, worker/client/client_options.h
    (rpc_timeout_s, connect_timeout_s, tls_*, auth_token_file,
    gradient_wire_type, data_plane, ...); their defaults and checks are
    ClientConfig's (worker/client/client_config.h). An unknown name is a
    ValueError listing the known ones.
    """

    def __init__(self, hosts, **options):
        if isinstance(hosts, str):
            hosts = hosts.split(",")
        self._core = _core.Client(dict(options, hosts=list(hosts)))
        self.mode = None
        self.start_step = 0

    def register(self, schema, num_workers, worker_id):
        """Registers ``schema`` (a ModelSchema as a dict in protobuf's JSON
        names) on every shard; worker_id -1 is an observer. Returns the mode and
        sets ``mode`` and ``start_step`` (where a (re)joining worker starts)."""
        answer = self._core.register(json.dumps(schema), num_workers,
                                       worker_id)
        self.mode = answer["mode"]
        self.start_step = answer["start_step"]
        return self.mode

    def await_job_start(self, on_waiting=None):
        """Sync/ssp: returns once every expected worker has registered.
        ``on_waiting(info)`` is called about once a second meanwhile."""
        self._core.await_job_start(on_waiting)

    def pull(self, step, tensors):
        return self._core.pull(step, tensors)

    def push(self, step, gradients, only=()):
        return self._core.push(step, gradients, list(only))

    def push_pull(self, push_step, gradients, pull_step, tensors):
        return self._core.push_pull(push_step, gradients, pull_step, tensors)

    def assign(self, values, only=()):
        return self._core.assign(values, list(only))

    def pull_sparse(self, table, step, ids, out):
        self._core.pull_sparse(table, step, ids, out)

    def push_sparse(self, table, step, ids, gradients):
        return self._core.push_sparse(table, step, ids, gradients)

    def pull_sparse_tables(self, step, parts):
        """[(table, ids, out), ...] in one round trip."""
        self._core.pull_sparse_tables(step, parts)

    def push_sparse_tables(self, step, parts):
        """[(table, ids, gradients), ...] in one round trip."""
        return self._core.push_sparse_tables(step, parts)

    def set_group_rates(self, rates, momentums=None):
        """The current learning rate of each param group (a scheduler's), and
        the momentum where a scheduler cycles it: every later push carries
        them, and its update uses them."""
        self._core.set_group_rates(rates, momentums)

    def set_gradient_clip(self, max_norm):
        """sync: clip each later step's mean gradient (the job's, over every
        shard) to this 2-norm, as torch's clip_grad_norm_; 0: none."""
        self._core.set_gradient_clip(max_norm)

    def last_clip_norm(self):
        """The job's gradient norm of the last clipped step (before it was
        clipped)."""
        return self._core.last_clip_norm()

    def leave(self):
        self._core.leave()

    def leave_stopping(self, timeout_s=0.3):
        """Leaves as a worker stopped by a signal: a sync job holds the step
        it stopped at while no other worker trains (once one has trained 2 s
        beyond this worker's stop grace, it completes without this worker),
        so that a job stopped whole resumes at that step with nothing
        short."""
        self._core.leave_stopping(timeout_s)

    def stats(self):
        """Every shard's Stats, as dicts (proto field names)."""
        return self._core.stats()

    def steps_short(self):
        return self._core.steps_short()

    def await_final_model(self, expected_version, timeout_s=120.0):
        return self._core.await_final_model(expected_version, timeout_s)

    def secure_final_state(self, final_version):
        """Once this client holds the job's final model at ``final_version``
        (sync: the last step; async/ssp: num_workers * steps), asks every
        shard to make its state durable (a checkpoint, where it has a
        --checkpoint_dir) and returns {"summary": "durable" | "in_memory" |
        "behind", "shards_behind": [...], "problems": [...]}: "behind" names
        shards restored after the last step without it."""
        return self._core.secure_final_state(final_version)

    def interrupt(self):
        self._core.interrupt()

    @property
    def num_shards(self):
        return self._core.num_shards


def print_final(**fields):
    """Prints a worker's last line as the C++ worker does: one JSON object
    with "event": "final" (deploy/local/launch.sh collects these, and says
    whether every worker evaluated the same final model)."""
    print(json.dumps(dict({"event": "final"}, **fields), separators=(",", ":")),
          flush=True)
