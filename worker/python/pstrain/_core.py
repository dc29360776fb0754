"""pstrain's C++ core through its C ABI (worker/python/c_api.h), with ctypes.

The library, ``_lib/libpstrain.so``, is the same for every CPython 3 and
every torch: nothing here is compiled for an interpreter. This module only
converts arguments, checks tensors before their memory is handed over, and
makes blocking calls interruptible. ctypes releases the GIL for each call,
which runs on the caller's thread; Python's signal wakeup fd goes to the
library, which interrupts the calls in progress on SIGINT and SIGTERM, so
Ctrl-C ends a call waiting for the servers within about a second and Python
raises KeyboardInterrupt. Where a program already uses the wakeup fd
(asyncio), calls on the main thread run on a helper thread instead, which
costs ~70 us a call.
"""

import atexit
import concurrent.futures
import ctypes
import json
import os
import platform
import sys
import threading
import weakref

_LIB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib",
                         "libpstrain.so")
_API_VERSION = 8

# absl::StatusCode names, by value.
_CODES = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
          "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED",
          "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
          "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE",
          "DATA_LOSS", "UNAUTHENTICATED"]


class Error(RuntimeError):
    """A failure the servers, the network or the C++ client reported; ``code``
    is the status name ("UNAVAILABLE", "FAILED_PRECONDITION", ...)."""

    def __init__(self, message, code="UNKNOWN"):
        super().__init__(message)
        self.code = code


Error.__module__ = "pstrain"


def _load():
    try:
        lib = ctypes.CDLL(_LIB_PATH)
    except OSError as e:
        glibc = platform.libc_ver()[1] or "unknown"
        raise ImportError(
            f"pstrain cannot load its C++ core {_LIB_PATH}: {e}. It was built "
            f"on Debian 12 (glibc 2.36, libstdc++ of GCC 12) for x86-64 Linux; "
            f"this host has glibc {glibc} on {platform.machine()}. Install a "
            "wheel built for this host: worker/python/build_wheel.sh on a "
            "machine like it, then pip install the wheel.") from None
    lib.pstrain_api_version.restype = ctypes.c_int
    if lib.pstrain_api_version() != _API_VERSION:
        raise ImportError(
            f"{_LIB_PATH} has C API version {lib.pstrain_api_version()}, this "
            f"package expects {_API_VERSION}: reinstall pstrain")
    return lib


_lib = _load()
# The same library through a handle whose calls keep the GIL: for calls that
# return at once. Through _lib a call lets the GIL go, and with another
# thread of the process running Python (the table lane) getting it back
# took up to a switch interval (5 ms), for a call of a microsecond.
_quick_lib = ctypes.PyDLL(_LIB_PATH)

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_err = ctypes.POINTER(ctypes.c_void_p)
_WAITING_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)


def _declare(name, *argtypes, restype=ctypes.c_int, lib=_lib):
    fn = getattr(lib, name)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


def _declare_quick(name, *argtypes, restype=ctypes.c_int):
    """A call that returns at once (no I/O, no wait): it keeps the GIL."""
    return _declare(name, *argtypes, restype=restype, lib=_quick_lib)


_lib.pstrain_free.argtypes = [ctypes.c_void_p]
_lib.pstrain_free.restype = None
_declare("pstrain_client_parse_options", ctypes.c_char_p, _err)
_declare("pstrain_client_create", ctypes.c_char_p, ctypes.POINTER(_p), _err)
_declare("pstrain_client_destroy", _p, restype=None)
_declare("pstrain_client_interrupt", _p, restype=None)
_declare_quick("pstrain_client_num_shards", _p)
_declare("pstrain_client_register", _p, ctypes.c_char_p, ctypes.c_int,
         ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), _err)
_declare("pstrain_client_await_job_start", _p, _WAITING_FN, _p, _err)
_declare("pstrain_client_pull", _p, _i64, _p, ctypes.c_int,
         ctypes.POINTER(_i64), _err)
_declare("pstrain_client_push", _p, _i64, _p, ctypes.c_int, _p, ctypes.c_int,
         _p, _err)
_declare("pstrain_client_push_pull", _p, _i64, _p, _i64, _p, ctypes.c_int, _p,
         _err)
_declare("pstrain_client_assign", _p, _p, ctypes.c_int, _p, ctypes.c_int, _p,
         _err)
_declare("pstrain_stream_start", _p, _i64, _p, _i64, _p, ctypes.c_int,
         ctypes.POINTER(_p), _err)
_declare_quick("pstrain_stream_ready", _p, ctypes.c_int, _i64)
_declare_quick("pstrain_client_some_shard_on_another_host", _p)
_declare("pstrain_stream_finish", _p, _p, _err)
_declare("pstrain_stream_cancel", _p, restype=None)
_declare("pstrain_client_pull_sparse", _p, ctypes.c_int, _i64, _p, _i64, _p,
         _err)
_declare("pstrain_client_push_sparse", _p, ctypes.c_int, _i64, _p, _i64, _p, _p,
         _err)
_declare("pstrain_client_pull_sparse_tables", _p, _i64, ctypes.c_int, _p, _p,
         _p, _p, _err)
_declare("pstrain_client_push_sparse_tables", _p, _i64, ctypes.c_int, _p, _p,
         _p, _p, _p, _err)
_declare("pstrain_client_leave", _p, _err)
_declare("pstrain_client_leave_stopping", _p, ctypes.c_double, _err)
_declare_quick("pstrain_stop_gracefully", ctypes.c_uint64, _i64,
               restype=None)
_declare_quick("pstrain_stop_requested")
_declare_quick("pstrain_stop_quiet", restype=None)
_declare_quick("pstrain_client_set_gradient_clip", _p, ctypes.c_double,
               restype=None)
_declare_quick("pstrain_client_last_clip_norm", _p, restype=ctypes.c_double)
_declare_quick("pstrain_client_set_group_rates", _p, _p, _p, ctypes.c_int,
               restype=None)
_declare("pstrain_client_stats", _p, ctypes.POINTER(ctypes.c_void_p), _err)
_declare("pstrain_client_steps_short", _p, ctypes.POINTER(_i64), _err)
_declare("pstrain_client_await_final_model", _p, _i64, ctypes.c_double,
         ctypes.POINTER(ctypes.c_void_p), _err)
_declare("pstrain_client_secure_final_state", _p, _i64,
         ctypes.POINTER(ctypes.c_void_p), _err)
_declare("pstrain_load_cluster_spec", ctypes.c_char_p,
         ctypes.POINTER(ctypes.c_void_p), _err)
_declare("pstrain_client_option_names", ctypes.POINTER(ctypes.c_void_p), _err)
_declare("pstrain_open_idx", ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(_p),
         _err)
_declare("pstrain_synthetic", _i64, _i64, _i64, _i64, ctypes.c_double,
         ctypes.c_uint64, ctypes.POINTER(_p), _err)
_declare("pstrain_examples_destroy", _p, restype=None)
_declare("pstrain_examples_shape", _p, _p, restype=None)
_declare("pstrain_examples_gather", _p, _p, _i64, _p, _p, _err)
_declare("pstrain_synthetic_ctr", _i64, _i64, ctypes.c_int, ctypes.c_int, _i64,
         _p, ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(_p), _err)
_declare("pstrain_ctr_data_sizes", _p, _p, restype=None)
_declare_quick("pstrain_ctr_gather_bags", _p, _i64, _p, ctypes.c_int, _p, _i64,
               _p, _i64, _p, _p, _err)
_declare_quick("pstrain_unique_ids", ctypes.c_int, _p, _p, _p, _p, _p, _p)
_declare("pstrain_criteo_kaggle_cardinalities", _p, restype=ctypes.c_int)
_declare_quick("pstrain_ctr_data_arrays", _p, _p, restype=None)
_declare("pstrain_ctr_data_destroy", _p, restype=None)
_declare("pstrain_epoch_plan_create", _i64, _i64, ctypes.c_int, ctypes.c_int,
         ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(_p), _err)
_declare("pstrain_epoch_plan_destroy", _p, restype=None)
_declare("pstrain_epoch_plan_steps_per_epoch", _p, restype=_i64)
_declare("pstrain_epoch_plan_global_batch", _p, restype=_i64)
_declare("pstrain_epoch_plan_worker_indices", _p, _i64, _p, restype=_i64)


_declare("pstrain_watch_signals", ctypes.c_int, restype=None)


def _watch_signals():
    """Hands the library Python's signal wakeup fd (see the module's
    docstring); False where it cannot have it."""
    if threading.current_thread() is not threading.main_thread():
        return False
    import signal
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write)
    except ValueError:
        previous = None
    if previous != -1:  # someone else's, or none to be had
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return False
    _lib.pstrain_watch_signals(read)
    return True


_SIGNALS_WATCHED = _watch_signals()


class _GracefulStop:
    """SIGTERM (a launcher's stop, scancel, a deleted pod) or a first
    Ctrl-C while a worker trains: the step in hand finishes, its push
    whole, and the worker then leaves as stopping, as the C++ worker does
    (README, "Stopping"). A process dying mid-push would leave the blocks
    its gradient reached a step ahead of the others, and that step would be
    lost on resume. Where the program has handlers of its own, or the
    library cannot watch the signals (see the module's docstring), nothing
    changes. A second Ctrl-C stops at once."""

    def __init__(self):
        self._owners = weakref.WeakSet()
        self._ours = {}  # signal number -> the handler it replaced
        self._pid = None
        self._step_work_s = None  # the first step's is not known yet

    def activate(self, owner):
        """`owner` trains from now until deactivate()."""
        import signal
        if not _SIGNALS_WATCHED or (threading.current_thread()
                                    is not threading.main_thread()):
            return
        self._owners.add(owner)
        if self._ours:
            return
        defaults = {signal.SIGINT: signal.default_int_handler,
                    signal.SIGTERM: signal.SIG_DFL}
        numbers = [number for number, default in defaults.items()
                   if signal.getsignal(number) is default]
        # All set before a handler can run: a new job, whose first step's
        # time is not known, and which an earlier job's stop (a caught
        # KeyboardInterrupt) does not stop; the library watches before
        # the handlers say a stop is graceful.
        self._pid = os.getpid()
        self._step_work_s = None
        self._seen = False
        self._tell_library(numbers)
        for number in numbers:
            self._ours[number] = signal.signal(number, self._on_signal)

    def deactivate(self, owner):
        import signal
        self._owners.discard(owner)
        if self._owners or not self._ours:
            return
        if threading.current_thread() is threading.main_thread():
            for number, previous in self._ours.items():
                if signal.getsignal(number) == self._on_signal:
                    signal.signal(number, previous)
            self._ours = {}
        _lib.pstrain_stop_gracefully(0, 0)

    def set_step_work(self, seconds):
        """The time the last step took (data, forward, backward, exchange),
        told once it is done. The step in hand may take twice that to end by
        itself before its waits are cut, 0.4 s to 5 s, and 5 s until the
        first step has told it (the library's rule, the C++ worker's too; a
        launcher SIGKILLs 10 s after SIGTERM)."""
        self._step_work_s = seconds
        if self._ours:
            self._tell_library(self._ours)

    def _tell_library(self, numbers):
        mask = sum(1 << int(number) for number in numbers)
        work_ms = (-1 if self._step_work_s is None
                   else int(self._step_work_s * 1000))
        _lib.pstrain_stop_gracefully(mask, work_ms)

    @staticmethod
    def requested():
        """The number of the signal that asked the workers to stop, or 0."""
        return _lib.pstrain_stop_requested()

    def _on_signal(self, number, frame):
        import signal
        if os.getpid() != self._pid or not self._owners:
            # A forked child (a DataLoader's worker), or none training.
            if number == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + number)
        seen_before, self._seen = self._seen, True
        if seen_before:
            if number == signal.SIGINT:
                raise KeyboardInterrupt  # Ctrl-C again: now
            return
        name = signal.Signals(number).name
        print(f"pstrain: {name}: finishing the step in hand, then leaving "
              "the job (Ctrl-C again stops at once)", file=sys.stderr,
              flush=True)

    _seen = False  # a graceful signal came


graceful_stop = _GracefulStop()


def _check(code, error):
    """Raises pstrain.Error for a failed C call (code != 0); `error` is the
    c_void_p the call set to its message."""
    if code == 0:
        return
    message = ""
    if error.value:
        message = ctypes.string_at(error.value).decode(errors="replace")
        _lib.pstrain_free(error)
    name = _CODES[code] if 0 <= code < len(_CODES) else f"CODE_{code}"
    raise Error(f"{name}: {message}", name)


def _take_string(pointer):
    """The C string the library returned, freed."""
    try:
        return ctypes.string_at(pointer.value).decode()
    finally:
        _lib.pstrain_free(pointer)


def _address(obj, count, writable, what, typestr="<f4", kind="float32"):
    """The address of `count` contiguous elements of `kind` in `obj`: a numpy
    array (or anything with the array interface), a CPU torch.Tensor, or a
    writable buffer (array.array, bytearray views), after checking it is
    what the C++ side will read or write."""
    interface = getattr(obj, "__array_interface__", None)
    if interface is not None:
        if interface["typestr"] != typestr:
            raise TypeError(f"{what}: dtype must be {kind}, got "
                            f"{getattr(obj, 'dtype', interface['typestr'])}")
        strides = interface.get("strides")
        if strides is not None:
            expected = int(typestr[2:])
            for extent, stride in zip(reversed(interface["shape"]),
                                      reversed(strides)):
                if extent != 1 and stride != expected:
                    raise ValueError(f"{what}: must be contiguous (C order); "
                                     "call .contiguous() first")
                expected *= extent
        address, read_only = interface["data"]
        size = 1
        for extent in interface["shape"]:
            size *= extent
    elif hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):
        if str(obj.dtype) != "torch." + kind:
            raise TypeError(f"{what}: dtype must be {kind}, got {obj.dtype}")
        if obj.device.type != "cpu":
            raise ValueError(f"{what}: must be in host memory, is on "
                             f"{obj.device}")
        if not obj.is_contiguous():
            raise ValueError(f"{what}: must be contiguous; call "
                             ".contiguous() first")
        address, read_only, size = obj.data_ptr(), False, obj.numel()
    else:
        try:
            view = memoryview(obj)
        except TypeError:
            raise TypeError(f"{what}: expected a {kind} numpy array, torch "
                            f"tensor or buffer, got {type(obj)}") from None
        formats = {"float32": ("f",), "int64": ("q", "l"),
                   "uint64": ("Q", "L")}[kind]
        if view.itemsize != int(typestr[2:]) or view.format not in formats:
            raise TypeError(f"{what}: dtype must be {kind}, got format "
                            f"'{view.format}'")
        if not view.c_contiguous:
            raise ValueError(f"{what}: must be contiguous")
        if view.readonly:
            raise ValueError(f"{what}: a read-only buffer: pass a numpy array")
        size = view.nbytes // view.itemsize
        read_only = False
        address = ctypes.addressof(ctypes.c_char.from_buffer(view)) \
            if size else 0
    if writable and read_only:
        raise ValueError(f"{what}: a read-only array where values are written")
    if size != count:
        raise ValueError(f"{what}: has {size} elements, the model's tensor "
                         f"has {count}")
    return address


def _float_pointers(arrays, sizes, writable, call, names, only=None):
    """The address of each float32 tensor (None for tensors a call leaves
    out, with `only`), checked by _address."""
    if len(arrays) != len(sizes):
        raise ValueError(f"{call}: {len(arrays)} tensors, the model has "
                         f"{len(sizes)}")
    pointers = (ctypes.c_void_p * len(arrays))()
    for t, array in enumerate(arrays):
        if only is not None and t not in only:
            continue
        pointers[t] = _address(array, sizes[t], writable, f"'{names[t]}'")
    return pointers


def _ids_pointer(ids, what):
    return _address(ids, len(ids), False, f"{what}: ids", "<u8", "uint64")


def _address_arrays(tables, ids, counts, rows):
    """The C arrays of pull_sparse_addresses' numpy arrays, their types and
    lengths checked."""
    for array, dtype in ((tables, "int32"), (ids, "uint64"), (counts, "int64"),
                         (rows, "uint64")):
        if (array.dtype != dtype or array.ndim != 1
                or len(array) != len(tables)
                or not array.flags["C_CONTIGUOUS"]):
            raise ValueError(f"sparse parts by address: expected {len(tables)} "
                             f"contiguous {dtype}, got {array.dtype} "
                             f"{array.shape}")
    return (tables.ctypes.data, ids.ctypes.data, counts.ctypes.data,
            rows.ctypes.data)


class Client:
    """One PsClient (worker/client/ps_client.h has every call's contract)."""

    def __init__(self, options):
        text = json.dumps(options).encode()
        error = ctypes.c_void_p()
        try:
            _check(_lib.pstrain_client_parse_options(text, ctypes.byref(error)),
                   error)
        except Error as e:  # a wrong name or type: the caller's argument
            raise ValueError(str(e).split(": ", 1)[1]) from None
        handle = _p()
        _check(_lib.pstrain_client_create(text,
                                          ctypes.byref(handle),
                                          ctypes.byref(error)), error)
        self._handle = handle
        self._sizes = []
        self._names = []
        self._tables = []  # (name, dim)
        self._executor = None  # made on first use (see _call)
        self._stream = None  # the StepStream running, if any
        self.calls = 0  # blocking calls made (the pipeline watches them)

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle:
            stream = getattr(self, "_stream", None)
            if stream is not None:
                # Before the client goes (a collector may take both at once,
                # in any order): the stream's thread uses it.
                stream.cancel()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            _lib.pstrain_client_destroy(handle)
            self._handle = None

    def _call(self, fn, *args):
        """fn(handle, *args, error), interruptible by Ctrl-C: directly where
        the library watches the signals (or off the main thread, which
        signals never reach), else through the helper thread."""
        self._call_on(self._handle, fn, *args)

    def _call_on(self, handle, fn, *args):
        """_call with another handle than the client's (a stream's)."""
        if self._stream is not None:
            # PsClient takes no other call while the exchange runs (a
            # stream's own finish has taken it off first).
            raise RuntimeError(
                "pstrain: a call to the servers while a pipelined step's "
                "exchange runs (between backward() and step()): make it "
                "after step(), or pass ParameterServer(..., pipeline=False)")
        self.calls += 1
        error = ctypes.c_void_p()
        if _SIGNALS_WATCHED or (threading.current_thread()
                                is not threading.main_thread()):
            _check(fn(handle, *args, ctypes.byref(error)), error)
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="pstrain-call")
        future = self._executor.submit(fn, handle, *args, ctypes.byref(error))
        _check(self.await_future(future), error)

    def await_future(self, future):
        """The result of `future`, a call of this client running on another
        thread; Ctrl-C while waiting interrupts the call and waits for it to
        end."""
        try:
            return future.result()
        except KeyboardInterrupt:
            _lib.pstrain_client_interrupt(self._handle)
            concurrent.futures.wait([future])
            raise

    @property
    def num_shards(self):
        return _quick_lib.pstrain_client_num_shards(self._handle)

    def register(self, schema_json, num_workers, worker_id):
        schema = json.loads(schema_json)
        result = ctypes.c_void_p()
        self._call(_lib.pstrain_client_register, schema_json.encode(),
                   num_workers, worker_id, ctypes.byref(result))
        dense = schema.get("dense", [])
        self._names = [d["name"] for d in dense]
        self._sizes = [_product(d.get("shape", [])) for d in dense]
        self._tables = [(t["name"], int(t["dim"]))
                        for t in schema.get("sparse", [])]
        return json.loads(_take_string(result))

    def await_job_start(self, on_waiting):
        def report(_, text):
            try:
                on_waiting(json.loads(text))
            except Exception as e:  # never into C
                print(f"pstrain: the waiting callback raised {e!r}")
        callback = _WAITING_FN(report) if on_waiting is not None else \
            ctypes.cast(None, _WAITING_FN)
        self._call(_lib.pstrain_client_await_job_start, callback, None)

    def _dense(self, arrays, writable, call, only=None):
        if not self._sizes:
            raise ValueError("register the model first")
        return _float_pointers(arrays, self._sizes, writable, call,
                               self._names, only)

    @staticmethod
    def _only(only):
        only = list(only)
        return (ctypes.c_int * len(only))(*only), len(only)

    def pull(self, step, tensors):
        pointers = self._dense(tensors, True, "pull")
        pulled = _i64()
        self._call(_lib.pstrain_client_pull, step, pointers, len(tensors),
                   ctypes.byref(pulled))
        return pulled.value

    def push(self, step, gradients, only=()):
        pointers = self._dense(gradients, False, "push", set(only) or None)
        only_array, num_only = self._only(only)
        result = (_i64 * 2)()
        self._call(_lib.pstrain_client_push, step, pointers, len(gradients),
                   only_array, num_only, result)
        return result[0], result[1]

    def push_pull(self, push_step, gradients, pull_step, tensors):
        grads = self._dense(gradients, False, "push")
        values = self._dense(tensors, True, "pull")
        result = (_i64 * 3)()
        self._call(_lib.pstrain_client_push_pull, push_step, grads, pull_step,
                   values, len(tensors), result)
        return result[0], result[1], result[2]

    def some_shard_on_another_host(self):
        """Whether a link to some shard leaves this host (as far as the
        links opened so far tell)."""
        return bool(
            _quick_lib.pstrain_client_some_shard_on_another_host(self._handle))

    def stream_memory(self, gradients, tensors):
        """The arrays a pipelined step pushes from and pulls into, checked
        once: a job's steps stream through the same memory."""
        return StreamMemory(self._dense(gradients, False, "push"),
                            self._dense(tensors, True, "pull"),
                            (gradients, tensors))

    def start_stream(self, push_step, pull_step, memory):
        """The pipelined step (c_api.h, pstrain_stream_start): push_pull's
        exchange on the library's thread while the gradients are made, in
        `memory` (stream_memory); each tensor leaves once ``ready`` says its
        gradient is final. The arrays must stay as they are until the
        stream's finish() or cancel(); the client takes no other call
        meanwhile."""
        handle = _p()
        self._call(_lib.pstrain_stream_start, push_step, memory.gradients,
                   pull_step, memory.tensors, len(memory.tensors),
                   ctypes.byref(handle))
        self._stream = StepStream(self, handle, memory)
        _LIVE_CLIENTS.add(self)
        return self._stream

    def assign(self, values, only=()):
        pointers = self._dense(values, False, "assign", set(only) or None)
        only_array, num_only = self._only(only)
        result = (_i64 * 2)()
        self._call(_lib.pstrain_client_assign, pointers, len(values),
                   only_array, num_only, result)
        return result[0], result[1]

    def _table(self, table):
        if not 0 <= table < len(self._tables):
            raise ValueError(f"sparse table {table} is not in the schema (it "
                             f"has {len(self._tables)})")
        return self._tables[table]

    def pull_sparse(self, table, step, ids, out):
        name, dim = self._table(table)
        ids_pointer = _ids_pointer(ids, name)
        rows = _float_pointers([out], [len(ids) * dim], True, "pull_sparse",
                               [name + " rows"])
        self._call(_lib.pstrain_client_pull_sparse, table, step, ids_pointer,
                   len(ids), rows[0])

    def push_sparse(self, table, step, ids, gradients):
        name, dim = self._table(table)
        ids_pointer = _ids_pointer(ids, name)
        rows = _float_pointers([gradients], [len(ids) * dim], False,
                               "push_sparse", [name + " gradients"])
        result = (_i64 * 2)()
        self._call(_lib.pstrain_client_push_sparse, table, step, ids_pointer,
                   len(ids), rows[0], result)
        return result[0], result[1]

    def _sparse_parts(self, parts, writable, call):
        """(tables, ids, counts, rows) C arrays of [(table, ids, rows), ...]."""
        n = len(parts)
        tables = (ctypes.c_int * n)()
        ids = (ctypes.c_void_p * n)()
        counts = (_i64 * n)()
        rows = (ctypes.c_void_p * n)()
        for i, (table, part_ids, part_rows) in enumerate(parts):
            name, dim = self._table(table)
            tables[i] = table
            ids[i] = _ids_pointer(part_ids, name)
            counts[i] = len(part_ids)
            rows[i] = _float_pointers([part_rows], [len(part_ids) * dim],
                                      writable, call, [name + " rows"])[0]
        return tables, ids, counts, rows

    def pull_sparse_tables(self, step, parts):
        """parts: (table, ids, out) each, pulled in one round trip."""
        self._call(_lib.pstrain_client_pull_sparse_tables, step, len(parts),
                   *self._sparse_parts(parts, True, "pull_sparse_tables"))

    def push_sparse_tables(self, step, parts):
        """parts: (table, ids, gradients) each, pushed in one round trip."""
        result = (_i64 * 2)()
        self._call(_lib.pstrain_client_push_sparse_tables, step, len(parts),
                   *self._sparse_parts(parts, False, "push_sparse_tables"),
                   result)
        return result[0], result[1]

    def pull_sparse_addresses(self, step, tables, ids, counts, rows):
        """pull_sparse_tables with the parts given by address, as numpy
        arrays of one entry a part: tables (int32), ids and rows (uint64
        addresses of the part's uint64 ids and float32 rows) and counts
        (int64). Nothing here can check that memory: for callers that made
        it themselves (pstrain.torch lays a pull's tables out in one buffer
        of ids and one of rows), and keep it until the call returns."""
        self._call(_lib.pstrain_client_pull_sparse_tables, step, len(tables),
                   *_address_arrays(tables, ids, counts, rows))

    def push_sparse_addresses(self, step, tables, ids, counts, gradients):
        """push_sparse_tables with the parts given by address, as
        pull_sparse_addresses."""
        result = (_i64 * 2)()
        self._call(_lib.pstrain_client_push_sparse_tables, step, len(tables),
                   *_address_arrays(tables, ids, counts, gradients), result)
        return result[0], result[1]

    def set_group_rates(self, rates, momentums=None):
        """Every later push carries these rates (and momentums), one per
        param group."""
        rates = list(rates)
        array = (ctypes.c_double * len(rates))(*rates)
        momentum_array = None
        if momentums is not None:
            momentums = list(momentums)
            if len(momentums) != len(rates):
                raise ValueError(f"{len(rates)} rates and {len(momentums)} "
                                 "momentums: one of each per group")
            momentum_array = (ctypes.c_double * len(momentums))(*momentums)
        _quick_lib.pstrain_client_set_group_rates(self._handle, array,
                                                  momentum_array, len(rates))

    def set_gradient_clip(self, max_norm):
        """sync: clip each later step's mean gradient to this 2-norm (0:
        none)."""
        _quick_lib.pstrain_client_set_gradient_clip(self._handle,
                                                    float(max_norm))

    def last_clip_norm(self):
        """The job's gradient norm of the last clipped step."""
        return _quick_lib.pstrain_client_last_clip_norm(self._handle)

    def leave(self):
        self._call(_lib.pstrain_client_leave)

    def leave_stopping(self, timeout_s):
        """Leaves as a worker stopped by a signal (a sync job holds its step
        while no other worker trains), giving up after timeout_s."""
        self._call(_lib.pstrain_client_leave_stopping, float(timeout_s))

    def stats(self):
        """Every shard's StatsResponse, as dicts (proto field names)."""
        out = ctypes.c_void_p()
        self._call(_lib.pstrain_client_stats, ctypes.byref(out))
        return json.loads(_take_string(out))

    def steps_short(self):
        steps = _i64()
        self._call(_lib.pstrain_client_steps_short, ctypes.byref(steps))
        return steps.value

    def await_final_model(self, expected_version, timeout_s):
        how = ctypes.c_void_p()
        self._call(_lib.pstrain_client_await_final_model, expected_version,
                   float(timeout_s), ctypes.byref(how))
        return _take_string(how)

    def secure_final_state(self, final_version):
        state = ctypes.c_void_p()
        self._call(_lib.pstrain_client_secure_final_state, final_version,
                   ctypes.byref(state))
        return json.loads(_take_string(state))

    def interrupt(self):
        _lib.pstrain_client_interrupt(self._handle)


class StreamMemory:
    """Client.stream_memory: the C pointer arrays, and the arrays they
    point into (kept alive with them)."""

    def __init__(self, gradients, tensors, arrays):
        self.gradients = gradients
        self.tensors = tensors
        self._arrays = arrays


class StepStream:
    """One pipelined step running (Client.start_stream)."""

    def __init__(self, client, handle, memory):
        self._client = client
        self._handle = handle
        self._memory = memory  # alive while the library reads and writes it
        # ready() may come from another thread (a CUDA copy's waiter) while
        # the training thread finishes or cancels the stream.
        self._lock = threading.Lock()

    def ready(self, tensor, end):
        """Elements [0, end) of tensor `tensor`'s gradient are final (any
        thread)."""
        with self._lock:
            if self._handle is None:
                raise RuntimeError("stream ready: the step was finished or "
                                   "cancelled")
            code = _quick_lib.pstrain_stream_ready(self._handle, tensor, end)
        if code != 0:
            raise ValueError(f"stream ready: tensor {tensor} end {end} is out "
                             "of the model")

    def finish(self):
        """Waits for the exchange (every tensor made ready first); returns
        push_pull's (blocks_duplicate, blocks_late, pulled_step) and the
        calls answered as they were streamed (0: the plain PushPull ran)."""
        handle = self._take_handle()
        if handle is None:
            raise ValueError("the stream was finished or cancelled already")
        result = (_i64 * 4)()
        self._client._call_on(handle, _lib.pstrain_stream_finish, result)
        return result[0], result[1], result[2], result[3]

    def cancel(self):
        """Gives the step up: the exchange stops within about a second."""
        handle = self._take_handle()
        if handle is not None:
            _lib.pstrain_stream_cancel(handle)

    def _take_handle(self):
        with self._lock:
            handle, self._handle = self._handle, None
        if self._client._stream is self:
            self._client._stream = None
        return handle

    def __del__(self):
        if getattr(self, "_handle", None):
            self.cancel()


def _cancel_running_streams():
    """At exit: a stream's thread must not outlive the library's statics."""
    for client in list(_LIVE_CLIENTS):
        stream = client._stream
        if stream is not None:
            stream.cancel()


_LIVE_CLIENTS = weakref.WeakSet()
atexit.register(_cancel_running_streams)


def _product(shape):
    size = 1
    for extent in shape:
        size *= int(extent)
    return size


def load_cluster_spec(path=""):
    """The cluster description of this process as a dict, or None."""
    out = ctypes.c_void_p()
    error = ctypes.c_void_p()
    _check(_lib.pstrain_load_cluster_spec(path.encode(), ctypes.byref(out),
                                          ctypes.byref(error)), error)
    return json.loads(_take_string(out))


def client_option_names():
    """The client options' names (the worker flags a client takes), sorted."""
    out = ctypes.c_void_p()
    error = ctypes.c_void_p()
    _check(_lib.pstrain_client_option_names(ctypes.byref(out),
                                            ctypes.byref(error)), error)
    return json.loads(_take_string(out))


class Examples:
    """A labelled data set read by the C++ worker's readers: the same
    examples, scaled the same way ([0, 1] pixels for IDX)."""

    def __init__(self, handle):
        self._handle = handle
        shape = (_i64 * 3)()
        _lib.pstrain_examples_shape(handle, shape)
        self.size, self.num_features, self.num_classes = shape

    def __del__(self):
        if getattr(self, "_handle", None):
            _lib.pstrain_examples_destroy(self._handle)
            self._handle = None

    def gather(self, indices, features, labels):
        """Rows `indices` (int64) into `features` [n, num_features] (float32)
        and `labels` [n] (int64, as torch's losses take them)."""
        n = len(indices)
        rows = _address(indices, n, False, "indices", "<i8", "int64")
        y = _address(labels, n, True, "labels", "<i8", "int64")
        x = _address(features, n * self.num_features, True, "features")
        error = ctypes.c_void_p()
        _check(_lib.pstrain_examples_gather(self._handle, rows, n, x, y,
                                            ctypes.byref(error)), error)


def _made(fn, *args):
    handle = _p()
    error = ctypes.c_void_p()
    _check(fn(*args, ctypes.byref(handle), ctypes.byref(error)), error)
    return handle


def open_idx(dir, train):
    return Examples(_made(_lib.pstrain_open_idx, dir.encode(), int(train)))


def synthetic(count, first_index, num_features, num_classes, label_noise,
              seed):
    return Examples(_made(_lib.pstrain_synthetic, count, first_index,
                          num_features, num_classes, float(label_noise), seed))


def criteo_kaggle_cardinalities():
    """The values of each of Criteo Kaggle's 26 fields (worker/ctr_data.h)."""
    out = (_i64 * 64)()
    n = _lib.pstrain_criteo_kaggle_cardinalities(out)
    return [out[i] for i in range(n)]


def synthetic_ctr(count, first_index, num_dense, num_fields, vocab_per_field,
                  max_bag, seed, field_vocab=None):
    """The C++ CTR worker's synthetic data (worker/ctr_data.h) as numpy
    arrays: labels [n], dense [n, num_dense], bags in CSR form (offsets
    [n * num_fields + 1] into ids), and the hidden true click probabilities.
    field_vocab: one vocabulary per field (None: vocab_per_field for all)."""
    import numpy as np
    vocab = None
    if field_vocab is not None:
        field_vocab = list(field_vocab)
        if len(field_vocab) != num_fields:
            raise ValueError(f"field_vocab has {len(field_vocab)} entries for "
                             f"{num_fields} fields")
        vocab = (_i64 * num_fields)(*field_vocab)
    handle = _made(_lib.pstrain_synthetic_ctr, count, first_index, num_dense,
                   num_fields, vocab_per_field, vocab, max_bag, seed)
    # The arrays are the C++ data's own (no copy of what may be gigabytes);
    # it is freed when the last of them is.
    owner = _CtrDataOwner(handle)
    sizes = (_i64 * 2)()
    _lib.pstrain_ctr_data_sizes(handle, sizes)
    n, num_ids = sizes
    pointers = (ctypes.c_void_p * 5)()
    _quick_lib.pstrain_ctr_data_arrays(handle, pointers)

    def array(pointer, ctype, length, dtype):
        # An empty vector's data() may be null: nothing to point at then.
        memory = ((ctype * length).from_address(pointer) if length
                  else (ctype * 0)())
        memory.owner = owner
        return np.frombuffer(memory, dtype)

    return {"labels": array(pointers[0], ctypes.c_float, n, np.float32),
            "dense": array(pointers[1], ctypes.c_float, n * num_dense,
                           np.float32).reshape(n, num_dense),
            "offsets": array(pointers[2], ctypes.c_int64,
                             n * num_fields + 1, np.int64),
            "ids": array(pointers[3], ctypes.c_uint64, num_ids, np.uint64),
            "true_probabilities": array(pointers[4], ctypes.c_double, n,
                                        np.float64)}


class _CtrDataOwner:
    """Frees a pstrain_ctr_data when no array of it is left."""

    def __init__(self, handle):
        self._handle = handle

    def __del__(self):
        _lib.pstrain_ctr_data_destroy(self._handle)


def unique_ids(ids, lengths, bounds):
    """Several arrays of int64 ids, one after another in ``ids`` (contiguous,
    ``lengths`` numpy int64, one each), each made unique: (keys, index,
    counts, bad). Array a's distinct ids, in order of first occurrence, are
    ``keys[start:start + counts[a]]`` (uint64; ``start`` where its ids
    start), and ``index[start:start + lengths[a]]`` is each id's position
    among them. ``bounds`` (numpy int64, one each): ids of array a must lie in
    [0, bounds[a]) unless it is negative; ``bad`` is the first array with an
    id outside (the results then unset from it on), else -1."""
    import numpy as np
    keys = np.empty(len(ids), np.uint64)
    index = np.empty(len(ids), np.int64)
    counts = np.empty(len(lengths), np.int64)
    bad = _quick_lib.pstrain_unique_ids(
        len(lengths), ids.ctypes.data, lengths.ctypes.data, bounds.ctypes.data,
        keys.ctypes.data, index.ctypes.data, counts.ctypes.data)
    return keys, index, counts, bad


def ctr_gather_bags(offsets, ids, num_fields, rows, room):
    """The bags of examples ``rows`` (contiguous int64) of CSR data
    (``offsets``, ``ids``: int64 numpy arrays) field by field: (ids,
    bag_offsets [num_fields, len(rows)], field_ids [num_fields + 1]); field
    f's ids are ``ids[field_ids[f]:field_ids[f + 1]]``. ``room``: at least
    the rows' number of ids."""
    import numpy as np
    out = np.empty(room, np.int64)
    bag_offsets = np.empty((num_fields, len(rows)), np.int64)
    field_ids = np.empty(num_fields + 1, np.int64)
    error = ctypes.c_void_p()
    _check(_quick_lib.pstrain_ctr_gather_bags(
        offsets.ctypes.data, (len(offsets) - 1) // num_fields, ids.ctypes.data,
        num_fields, rows.ctypes.data, len(rows), out.ctypes.data, room,
        bag_offsets.ctypes.data, field_ids.ctypes.data, ctypes.byref(error)),
        error)
    return out, bag_offsets, field_ids


class EpochPlan:
    """Which examples each worker takes at each step (worker/data.h)."""

    def __init__(self, handle, worker_batch):
        self._handle = handle
        self._worker_batch = worker_batch
        self.steps_per_epoch = _lib.pstrain_epoch_plan_steps_per_epoch(handle)
        self.global_batch = _lib.pstrain_epoch_plan_global_batch(handle)

    def __del__(self):
        if getattr(self, "_handle", None):
            _lib.pstrain_epoch_plan_destroy(self._handle)
            self._handle = None

    def worker_indices(self, step):
        import numpy as np
        rows = np.empty(self._worker_batch, np.int64)
        n = _lib.pstrain_epoch_plan_worker_indices(self._handle, step,
                                                   rows.ctypes.data)
        return rows[:n]


def epoch_plan(num_examples, worker_batch, num_workers, worker_index, shuffle,
               seed):
    return EpochPlan(_made(_lib.pstrain_epoch_plan_create, num_examples,
                           worker_batch, num_workers, worker_index,
                           int(bool(shuffle)), seed), worker_batch)
