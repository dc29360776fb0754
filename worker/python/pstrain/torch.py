"""Train a ``torch.nn.Module`` on pstrain's parameter servers.

A single-process script becomes a pstrain worker with three lines::

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # as before
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, ...)
    ps = pstrain.torch.ParameterServer(model, optimizer=optimizer,
                                       scheduler=scheduler)
    ...
        loss.backward()
        ps.step()              # instead of optimizer.step() and zero_grad()
        scheduler.step()       # as before
    ...
    ps.finish()                # the job's final model is now in `model`

The user's optimizer runs on the servers, with torch.optim's formulas and
defaults, per param group: SGD (momentum, dampening, nesterov,
weight_decay), Adam, AdamW, Adagrad (lr_decay, initial_accumulator_value)
and RMSprop (alpha, momentum, centered). A scheduler edits the groups' lr as
usual; every ps.step() carries the current rates to the servers, so the
schedule takes effect from the next step, in every mode. Other optimizers
(LAMB, a class of one's own) and options the servers cannot honour
(amsgrad, maximize, ...) are refused, naming them. Without ``optimizer``,
the servers' own (``ps_server --optimizer``) runs. The consistency mode is
the servers': in sync mode W workers with batch b train exactly like one
process with batch W*b; async and ssp as the servers say.

What the servers hold, by the names ``model.named_parameters()`` and
``named_buffers()`` give (so ``pstrain_export`` writes a safetensors file that
``model.load_state_dict`` takes with no renaming):

- parameters: trained from the gradients every worker pushes. Their initial
  values are worker 0's (DDP's rule): worker 0 sends its model's values when
  it starts, every other worker's first pull waits for them, and a worker
  (re)starting later gets the job's current values.
- buffers (BatchNorm's running statistics) and parameters with
  ``requires_grad=False``: state, not trained. Each worker updates its own
  copy during its forward passes; every step the servers set them to the
  mean over the workers (sync) or to the last worker's (async), and every
  worker pulls that back. So all workers share the same buffers after each
  step, as with DDP's broadcast of buffers, averaged instead of rank 0's.
- ``pstrain.torch.Embedding`` / ``EmbeddingBag`` tables: rows live on the
  servers (sharded, created on first use), and only a batch's rows travel.
  For async tables, ``EmbeddingBagCollection.prefetch(next_bags)`` pulls
  the next batch's rows while this one trains, and ``step()`` then pushes
  the rows while the dense exchange runs (both on one thread of their own)::

      for i, (dense, bags, labels) in enumerate(batches):
          if i + 1 < len(batches):
              tables.prefetch(batches[i + 1][1])  # before this forward
          loss_fn(model(dense, bags), labels).backward()
          ps.step()

A pipelined step (``pipeline=``) starts the exchange during ``backward()``,
each gradient leaving as it is made, and ``step()`` waits for the rest. A job
that changes its gradients after backward (clipping, accumulation over
several backward passes) is seen on the first step and keeps plain steps;
see _Pipeline.

Tensors must be float32 (buffers of other types are converted), contiguous,
on the CPU or on a CUDA device (copied through pinned host memory on a stream
of their own). Per step, float32 CPU parameters, gradients and buffers are
read and written in place: no copy in Python, none in the binding.
"""

import concurrent.futures
import sys
import time
import warnings

import numpy as np
import torch

import pstrain
from pstrain import _core

__all__ = ["Embedding", "EmbeddingBag", "EmbeddingBagCollection",
           "ParameterServer"]

# One block of a dense tensor, the unit of transfer, locking and sharding;
# 0: picked from the model's size as the C++ worker's default does (8192 to
# 131072 elements, about 16 blocks: common/partition.h).
DEFAULT_BLOCK_ELEMENTS = 0


class _Tensor:
    """One registered dense tensor and the memory its pulls and pushes use."""

    def __init__(self, name, tensor, state):
        self.name = name
        self.tensor = tensor  # the Parameter or buffer
        self.state = state    # True: values are pushed, not gradients
        self.numel = tensor.numel()
        self.shape = list(tensor.shape) or [1]
        self.cuda = tensor.is_cuda
        self.device = tensor.device
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"'{name}' is on device {tensor.device}: "
                             "pstrain.torch takes CPU and CUDA tensors")
        if tensor.dtype != torch.float32 and not state:
            raise TypeError(
                f"parameter '{name}' is {tensor.dtype}: the servers hold float32 "
                "(model.float() first)")
        if not tensor.is_contiguous():
            raise ValueError(f"'{name}' is not contiguous")
        # Host float32 memory the client reads and writes: the tensor's own
        # when it is a float32 CPU tensor, else a mirror (pinned for CUDA).
        self.direct = tensor.dtype == torch.float32 and not self.cuda
        if self.direct:
            self.host = tensor.data
        else:
            self.host = torch.empty(tensor.shape, dtype=torch.float32,
                                    pin_memory=self.cuda)
            self.host.copy_(tensor.data)
        self.values_view = self.host.numpy().reshape(-1)
        self._grad_key = None
        self._grad_view = None
        self._zeros = None
        self._grad_host = None
        # The pipelined step's (_Pipeline): the gradient's memory, fixed for
        # the whole job (the exchange is set up before backward makes it),
        # and where pulled values land while backward may still read the
        # tensor's own.
        self._stream_grad = None
        self._landing = None
        self._landing_tensor = None  # the same memory, as a tensor

    def spec(self):
        return {"name": self.name, "shape": self.shape,
                "init": {"kind": "PROVIDED"},
                "role": "STATE" if self.state else "PARAMETER"}

    def check_unchanged(self):
        """The tensor is still the one registered: same shape, and a direct
        tensor's memory still the one pulls write (a new tensor of the same
        shape is taken as it is)."""
        data = self.tensor.data
        if data.device != self.device:
            raise ValueError(
                f"'{self.name}' moved from {self.device} to {data.device} "
                "after registration: move the model before "
                "ParameterServer(model), where it will train")
        if list(data.shape or [1]) != self.shape or data.dtype != (
                torch.float32 if self.direct else data.dtype):
            raise ValueError(
                f"'{self.name}' changed after registration: now "
                f"{list(data.shape)} {data.dtype}, registered {self.shape}; "
                "the servers hold the model as it was registered")
        if self.direct and data.data_ptr() != self.host.data_ptr():
            self.host = data
            self.values_view = data.numpy().reshape(-1)

    def values(self):
        """The host memory of the values (a pull writes here)."""
        if not self.direct:
            self.host.copy_(self.tensor.data)
        return self.values_view

    def push_source(self):
        """What a push sends: the values of state, the gradient of a parameter
        (zeros where backward left none, so that every block's step completes)."""
        if self.state:
            if not self.direct:
                self.host.copy_(self.tensor.data)
            return self.values_view
        grad = self.tensor.grad
        if grad is None:
            if self._zeros is None:
                self._zeros = np.zeros(self.numel, dtype=np.float32)
            return self._zeros
        if self.cuda:
            if self._grad_host is None:
                self._grad_host = torch.empty(self.tensor.shape,
                                              dtype=torch.float32,
                                              pin_memory=True)
            self._grad_host.copy_(grad, non_blocking=True)
            return self._grad_host.numpy().reshape(-1)
        if grad.dtype != torch.float32 or not grad.is_contiguous():
            grad = grad.to(torch.float32).contiguous()
            return grad.numpy().reshape(-1)
        key = (grad.data_ptr(), grad.numel())
        if key != self._grad_key:  # a new gradient tensor: a new view
            self._grad_key = key
            self._grad_view = grad.numpy().reshape(-1)
        return self._grad_view

    def stream_gradient(self):
        """The pipelined step's gradient memory: pinned host memory the
        gradient is copied into (CUDA), or a tensor of our own installed as
        the parameter's ``.grad``, into which backward accumulates in place
        (CPU). Zeros until backward makes the gradient."""
        if self._stream_grad is None:
            self._stream_grad = torch.zeros(self.tensor.shape,
                                            dtype=torch.float32,
                                            pin_memory=self.cuda)
        return self._stream_grad

    def stream_landing(self):
        """Where the pipelined step's pulled values land: the host mirror
        of a CUDA or non-float32 tensor, else a mirror of a CPU tensor's
        own memory (backward may still read that while values land)."""
        if not self.direct:
            return self.values_view
        if self._landing is None:
            self._landing = np.empty(self.numel, dtype=np.float32)
            self._landing_tensor = torch.from_numpy(self._landing).view(
                self.tensor.shape)
        return self._landing

    def snapshot_state(self):
        """The pipelined step's copy of a CPU state tensor's values, which
        it sends (its landing array)."""
        landing = self.stream_landing()
        if self.direct:
            np.copyto(landing, self.values_view)
        else:
            self.host.copy_(self.tensor.data)

    def take_gradient(self):
        """After backward made the gradient (CPU): it is in the stream's
        memory (copied there when backward made a tensor of its own)."""
        grad = self.tensor.grad
        mine = self.stream_gradient()
        if grad is not None and grad.data_ptr() != mine.data_ptr():
            mine.copy_(grad)

    def after_stream(self, stream):
        """After a pipelined step: the landed values into the tensor, the
        gradient zeroed and (CPU) our memory the parameter's ``.grad``."""
        if self.direct:
            self.tensor.data.copy_(self._landing_tensor)
        else:
            self.after_pull(stream)
        if self.state:
            return
        grad = self.tensor.grad
        if self.cuda:
            if grad is not None:
                grad.zero_()
            return
        mine = self.stream_gradient()
        mine.zero_()
        if grad is None or grad.data_ptr() != mine.data_ptr():
            self.tensor.grad = mine

    def after_pull(self, stream):
        """Brings pulled host values into a tensor that is not host float32."""
        if self.direct:
            return
        if self.cuda:
            with torch.cuda.stream(stream):
                self.tensor.data.copy_(self.host, non_blocking=True)
        else:
            self.tensor.data.copy_(self.host)


class _Pipeline:
    """The pipelined step (``ParameterServer(pipeline=...)``): the exchange
    starts during backward. A hook on each parameter's gradient accumulator
    says when its gradient is final; the first one starts the step's
    exchange on the library's thread (Client.start_stream), with the
    buffers' values (final once forward is done) and the rates; each
    gradient's blocks leave as it is made, the last layers' first, and
    their new values come back while backward goes on, into mirrors (a
    parameter's own memory may still be read by backward). ``step()`` then
    waits for the rest and copies the values in.

    What cannot be pipelined is a gradient changed after backward made it:
    a clip, a second backward into the same gradients (accumulation), an
    edit between ``backward()`` and ``step()``; likewise a buffer changed
    after backward began, or a call to the servers before ``step()`` (the
    exchange has the client). The first step runs plain and watches for
    these (version counters, backward passes, clip and client calls); a job
    that does any of them keeps plain steps. A pipelined step that meets one
    raises, since its gradients had left."""

    def __init__(self, ps):
        self._ps = ps
        # The first step runs plain and is watched (end_step).
        self.on = False
        self.learning = True
        self.steps = 0  # pipelined steps so far
        self._stream = None
        self._memory = None  # the stream's arrays (Client.stream_memory)
        self._hook_calls = [0] * len(ps._tensors)
        self._passes = 0            # backward passes in this step
        self._callback_queued = False
        self._backward_open = False
        self._versions = None       # the gradients' after the last backward
        self._state_versions = None  # the state's at the first hook
        self._calls_at_backward = None  # the client's calls then
        self._problem = None
        self.groups_streamed = 0  # calls that left as gradients were made
        self._copy_stream = None
        self._copier = None
        self._handles = []
        for i, t in enumerate(ps._tensors):
            if t.state or not t.tensor.requires_grad:
                continue
            p = t.tensor
            if hasattr(p, "register_post_accumulate_grad_hook"):  # torch 2.1
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda _, i=i: self._on_gradient(i)))
            else:
                # torch 1.13: the accumulator's own hook runs after it has
                # accumulated (DDP's way); it lives as long as we hold it.
                with torch.enable_grad():
                    accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                self._handles.append((accumulator, accumulator.register_hook(
                    lambda *_, i=i: self._on_gradient(i))))

    def close(self):
        for handle in self._handles:
            (handle[1] if isinstance(handle, tuple) else handle).remove()
        self._handles = []
        if self._stream is not None:
            # The copies' waiter says nothing more to a stream given up.
            if self._copier is not None:
                self._copier.drain(raise_error=False)
            self._stream.cancel()
            self._stream = None
        self.on = self.learning = False

    # ----- on backward's thread -----

    def _on_gradient(self, i):
        ps = self._ps
        if ps._finished:
            return
        self._hook_calls[i] += 1
        try:
            if not self._callback_queued:
                self._callback_queued = True
                self._backward_open = True
                self._passes += 1
                torch.autograd.Variable._execution_engine.queue_callback(
                    self._on_backward_end)
                if self._passes == 1:
                    # A pipelined step sends the state as it is now, and
                    # its exchange takes the client until step().
                    self._state_versions = self._state_version_list()
                    if self.on and self._stream is None:
                        self._begin()
                    self._calls_at_backward = self._ps.client._core.calls
            if self._stream is not None and self._hook_calls[i] == 1:
                self._send(i)
        except BaseException:
            # Backward stops here and runs no callback: it stays open, so
            # that step() refuses a pipelined step whose gradients were not
            # all made.
            self._callback_queued = False
            raise

    def _begin(self):
        ps = self._ps
        for t in ps._tensors:
            t.check_unchanged()
        ps._send_rates()
        ps.client.set_gradient_clip(0.0)
        if self._memory is None:
            # Our own arrays, the same every step. State leaves from its
            # landing array, a copy taken now (its values land there after
            # they left, and go into the tensor in step()).
            landings = [t.stream_landing() for t in ps._tensors]
            grads = [landings[i] if t.state
                     else t.stream_gradient().numpy().reshape(-1)
                     for i, t in enumerate(ps._tensors)]
            self._memory = ps.client._core.stream_memory(grads, landings)
        self._stream = ps.client._core.start_stream(ps._step, ps._step + 1,
                                                    self._memory)
        # State is final once forward is done: it leaves first (its groups
        # lead every link).
        for i, t in enumerate(ps._tensors):
            if t.state:
                if t.cuda:
                    self._copy_out(i, t.tensor.data, t.host)
                else:
                    t.snapshot_state()
                    self._stream.ready(i, t.numel)

    def _send(self, i):
        t = self._ps._tensors[i]
        if t.cuda:
            self._copy_out(i, t.tensor.grad, t.stream_gradient())
        else:
            t.take_gradient()
            self._stream.ready(i, t.numel)

    def _copy_out(self, i, source, host):
        """Device to pinned host on a stream of its own, after what the
        current stream queued; ready once the copy is done (the copier
        thread waits for its event)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=source.device)
            self._copier = _CudaCopier()
        made = torch.cuda.Event()
        made.record()
        self._copy_stream.wait_event(made)
        with torch.cuda.stream(self._copy_stream):
            host.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        # Memory freed before the copy ran (a .grad set to None) must not
        # be handed to work on another stream meanwhile.
        source.record_stream(self._copy_stream)
        self._copier.submit(done, self._stream, i, host.numel())

    def _on_backward_end(self):
        self._callback_queued = False
        self._backward_open = False
        ps = self._ps
        if self._stream is not None and self._passes == 1:
            # Parameters backward did not reach push zeros, as in a plain
            # step.
            for i, t in enumerate(ps._tensors):
                if not t.state and self._hook_calls[i] == 0:
                    t.stream_gradient().zero_()
                    self._stream.ready(i, t.numel)
        self._versions = self._gradient_versions()

    def _state_version_list(self):
        return [(t.tensor.data_ptr(), t.tensor._version) if t.state else None
                for t in self._ps._tensors]

    def _gradient_versions(self):
        return [None if t.state or t.tensor.grad is None
                else (id(t.tensor.grad), t.tensor.grad._version)
                for t in self._ps._tensors]

    # ----- on the training thread -----

    def note_clip(self):
        """ps.clip_grad_norm_ was called: a pipelined step's gradients had
        left already."""
        if self._stream is not None:
            raise RuntimeError(
                "clip_grad_norm_ after a pipelined backward: this step's "
                "gradients had already left. The pipeline watches the "
                "first step for clipping; a job that starts clipping later "
                "needs ParameterServer(..., pipeline=False)")
        self._problem = self._problem or "clip_grad_norm_"

    def check_step(self):
        """At step(): what changed the gradients after backward made them
        (None: nothing)."""
        if self._backward_open:
            return "backward did not finish (it raised, or step() ran inside it)"
        problem = self._problem
        if problem is None and self._passes > 1:
            problem = f"{self._passes} backward passes into one step's gradients"
        if (problem is None and self._calls_at_backward is not None
                and self._calls_at_backward != self._ps.client._core.calls):
            problem = "a call to the servers between backward() and step()"
        if problem is None and self._state_versions is not None and (
                self._state_versions != self._state_version_list()):
            names = [t.name for t, a, b in zip(
                self._ps._tensors, self._state_versions,
                self._state_version_list()) if a != b]
            problem = ("the buffer " + ", ".join(names[:3]) + " changed "
                       "between the start of backward and step()")
        if problem is None and self._versions is not None and (
                self._versions != self._gradient_versions()):
            names = [t.name for t, a, b in zip(
                self._ps._tensors, self._versions, self._gradient_versions())
                if a != b]
            problem = ("the gradient of " + ", ".join(names[:3])
                       + " changed between backward() and step()")
        return problem

    def running(self):
        return self._stream is not None

    def finish(self):
        """Ends a pipelined step: every tensor's exchange done. On an error
        (Ctrl-C, servers gone past the deadlines) the step is given up with
        the gradients left as backward made them: step() again sends them
        as a plain step (the blocks that were in count as duplicates)."""
        stream, self._stream = self._stream, None
        try:
            if self._copier is not None:
                self._copier.drain()
            result = stream.finish()
        except BaseException:
            stream.cancel()
            self.end_step(None)
            raise
        self.steps += 1
        self.groups_streamed += result[3]
        return result

    def end_step(self, problem):
        """After step(): learn from a plain step (auto), reset the counts."""
        if self.learning and self._passes > 0:
            self.learning = False
            self.on = problem is None
            if not self.on:
                self.close()
        self._hook_calls = [0] * len(self._hook_calls)
        self._passes = 0
        self._versions = None
        self._state_versions = None
        self._calls_at_backward = None
        self._problem = None
        # A backward that failed ran no callback.
        self._callback_queued = self._backward_open = False


class _CudaCopier:
    """A thread that says a gradient is ready once its copy to the host is
    done (waits on the copy's event, with the GIL let go)."""

    def __init__(self):
        import queue
        import threading
        self._queue = queue.Queue()
        self._error = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                         name="pstrain-copier")
        self._thread.start()

    def submit(self, event, stream, tensor, end):
        self._queue.put((event, stream, tensor, end))

    def _run(self):
        while True:
            event, stream, tensor, end = self._queue.get()
            try:
                if self._error is None:
                    event.synchronize()
                    stream.ready(tensor, end)
            except BaseException as e:  # raised on the training thread
                self._error = e
            finally:
                self._queue.task_done()

    def drain(self, raise_error=True):
        self._queue.join()
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error


# torch.optim's classes the servers run, by their rule's name; and the
# options each takes, with the value the servers need for the ones they do
# not run (anything else is refused, naming it).
_RULES = [("adamw", "AdamW"), ("adam", "Adam"), ("sgd", "SGD"),
          ("adagrad", "Adagrad"), ("rmsprop", "RMSprop")]
_UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False,
                "differentiable": False}
# Implementation choices with the same formulas: ignored.
_IGNORED = {"foreach", "fused", "params", "initial_lr", "max_lr", "min_lr",
            "base_lr", "base_momentum", "max_momentum"}


def _rule_name(optimizer):
    for name, class_name in _RULES:
        cls = getattr(torch.optim, class_name, None)
        if cls is not None and type(optimizer) is cls:
            return name
    supported = ", ".join(f"torch.optim.{c}" for _, c in _RULES)
    module = type(optimizer).__module__
    if module.startswith("torch.optim"):
        module = "torch.optim"
    raise ValueError(
        f"{module}.{type(optimizer).__name__} is not an optimizer the servers "
        f"run ({supported}); use one of those")


def _number(group, key):
    value = group[key]
    return float(value.item() if torch.is_tensor(value) else value)


def _momentum(group):
    """The group's momentum as the servers' rule reads it: Adam's betas[0],
    SGD's and RMSprop's momentum (0 for Adagrad, which has none)."""
    if "betas" in group:
        return float(group["betas"][0])
    return _number(group, "momentum") if "momentum" in group else 0.0


def _torch_rule(name, group, index):
    """The TorchOptimizer (proto/ps.proto) of param group `index`."""
    for option, needed in _UNSUPPORTED.items():
        if option in group and bool(group[option]) != needed:
            raise ValueError(
                f"param group {index}: {option}={group[option]!r}: the servers "
                f"do not run it (torch.optim's {option}={needed!r} only)")
    if group.get("decoupled_weight_decay"):
        name = "adamw"
    rule = {"name": name, "lr": _number(group, "lr"),
            "weight_decay": _number(group, "weight_decay"), "group": index}
    if name == "sgd":
        rule.update(momentum=_number(group, "momentum"),
                    dampening=_number(group, "dampening"),
                    nesterov=bool(group["nesterov"]))
    elif name in ("adam", "adamw"):
        rule.update(beta1=float(group["betas"][0]),
                    beta2=float(group["betas"][1]), eps=_number(group, "eps"))
    elif name == "adagrad":
        rule.update(lr_decay=_number(group, "lr_decay"),
                    initial_accumulator_value=_number(
                        group, "initial_accumulator_value"),
                    eps=_number(group, "eps"))
    else:  # rmsprop
        rule.update(alpha=_number(group, "alpha"), eps=_number(group, "eps"),
                    momentum=_number(group, "momentum"),
                    centered=bool(group["centered"]))
    known = set(rule) | set(_UNSUPPORTED) | _IGNORED | {
        "betas", "decoupled_weight_decay"}
    for option in group:
        if option not in known:
            raise ValueError(f"param group {index}: option '{option}' of "
                             f"torch.optim's {name} is not one the servers "
                             "know; it would be ignored")
    return rule


def _group_rules(optimizer, tensors):
    """{id(parameter): TorchOptimizer} for `optimizer`'s groups, checked to
    cover every trained tensor of the model once, and nothing else."""
    name = _rule_name(optimizer)
    by_id = {id(t.tensor): t for t in tensors}
    rules = {}
    for index, group in enumerate(optimizer.param_groups):
        rule = _torch_rule(name, group, index)
        for p in group["params"]:
            t = by_id.get(id(p))
            if t is None:
                raise ValueError(
                    f"param group {index} holds a tensor of shape "
                    f"{list(p.shape)} that is not a parameter of the model")
            if id(p) in rules:
                raise ValueError(f"'{t.name}' is in more than one param group")
            rules[id(p)] = rule
    missing = [t.name for t in tensors
               if not t.state and id(t.tensor) not in rules]
    if missing:
        raise ValueError(
            f"the optimizer's param groups leave out {', '.join(missing)}: "
            "every trained parameter needs its group (the servers would "
            "not know its rule)")
    return rules


class _TableLane:
    """A thread beside training for the tables' calls to the servers, so
    that the next batch's rows (``EmbeddingBagCollection.prefetch``) are
    pulled while this one trains. Once it exists every table call of the
    training client runs on it, in the order given: the client takes its
    table calls from one thread beside its dense calls."""

    def __init__(self, client):
        self._client = client
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pstrain-tables")
        self._last = None  # the future of the latest call submitted
        # Rows pulled ahead, oldest first: [collection, bags, the bags'
        # _versions, _PulledRows, the pull's future] each.
        self.prefetched = []
        self.busy_s = 0.0    # time the lane spent in calls
        self.waited_s = 0.0  # time training waited for the lane

    def submit(self, fn, *args):
        def timed():
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.busy_s += time.perf_counter() - start
        self._last = self._executor.submit(timed)
        return self._last

    def wait(self, future):
        """future's result (its error raised here); Ctrl-C while waiting
        interrupts the call and waits for it to end."""
        start = time.perf_counter()
        try:
            return self._client._core.await_future(future)
        finally:
            self.waited_s += time.perf_counter() - start

    def run(self, fn, *args):
        return self.wait(self.submit(fn, *args))

    def drain(self):
        """Waits for every call submitted; their errors are not raised here
        (whoever submitted a call waits for it and sees them)."""
        if self._last is not None:
            try:
                self.wait(self._last)
            except pstrain.Error:
                pass

    def close(self):
        self.prefetched = []
        self.drain()
        self._executor.shutdown(wait=True)


class ParameterServer:
    """Binds ``model`` to the parameter servers as this process's worker.

    Construction registers the model (refused, naming the first difference,
    if the servers hold a different one), sends worker 0's initial values,
    waits until every worker of the job has registered (sync and ssp), and
    pulls the job's current values into the model.

    Where the job is comes from ``spec`` (a ``pstrain.ClusterSpec``), else
    from ``hosts``/``worker_id``/``num_workers``, else from the cluster
    description in the environment (``pstrain.cluster_spec()``: what
    ``deploy/local/launch.sh --python`` sets). ``client_options`` are
    ``pstrain.Client``'s (timeouts, TLS, token...).

    ``pipeline``: True starts each step's exchange during backward from
    the second step on, unless the first step changed its gradients after
    backward (clip, accumulation); False sends everything in ``step()``;
    "auto" (the default) is True for a CPU model without tables whose
    servers are on other hosts (on one host the exchange takes the cores
    backward needs), else False; a CUDA model pipelines with True only
    until the pipeline has been measured on a GPU."""

    def __init__(self, model, *, optimizer=None, scheduler=None, spec=None,
                 hosts=None, worker_id=None, num_workers=None,
                 block_elements=DEFAULT_BLOCK_ELEMENTS, on_waiting=None,
                 pipeline="auto", **client_options):
        if spec is None and hosts is None:
            spec = pstrain.cluster_spec()
        if spec is not None:
            hosts = spec.ps if hosts is None else hosts
            worker_id = spec.worker_id if worker_id is None else worker_id
            num_workers = spec.num_workers if num_workers is None else num_workers
            client_options = dict(spec.client_options, **client_options)
        if worker_id is None or num_workers is None:
            raise ValueError("worker_id and num_workers are needed with hosts")
        if pipeline not in ("auto", True, False):
            raise ValueError(
                f"pipeline must be 'auto', True or False, got {pipeline!r}")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id must be in [0, {num_workers}), "
                             f"got {worker_id}")
        self.model = model
        self.worker_id = worker_id
        self.num_workers = num_workers
        self._hosts = hosts
        self._client_options = client_options
        self._tensors = []
        names = set()
        for name, p in model.named_parameters():
            self._tensors.append(_Tensor(name, p, state=not p.requires_grad))
            names.add(name)
        for name, b in model.named_buffers():
            if b is None or name in names:
                continue
            self._tensors.append(_Tensor(name, b, state=True))
        self._tables = []
        for name, module in model.named_modules():
            if isinstance(module, _ServerTable):
                module._bind(self, len(self._tables), f"{name}.weight")
                self._tables.append(module)
        if not self._tensors:
            raise ValueError("the model has no parameters or buffers to train")
        first = self._tensors[0]
        for t in self._tensors:
            if t.device != first.device:
                # One worker, one device: its copies run on one stream.
                raise ValueError(
                    f"the model is split over devices: '{first.name}' is on "
                    f"{first.device}, '{t.name}' on {t.device}; pstrain.torch "
                    "trains a model on one device (run one worker per GPU)")
        self._stream = None
        if any(t.cuda for t in self._tensors):
            self._stream = torch.cuda.Stream(device=first.device)
        if scheduler is not None and optimizer is None:
            raise ValueError("a scheduler needs its optimizer (optimizer=)")
        if scheduler is not None and getattr(scheduler, "optimizer",
                                             optimizer) is not optimizer:
            raise ValueError("the scheduler steps another optimizer than "
                             "the one given")
        self.optimizer = optimizer
        self.scheduler = scheduler
        rules = {} if optimizer is None else _group_rules(optimizer,
                                                          self._tensors)
        specs = []
        for t in self._tensors:
            spec = t.spec()
            if id(t.tensor) in rules:
                spec["optimizer"] = rules[id(t.tensor)]
            specs.append(spec)
        self.schema = {
            "dense": specs,
            "sparse": [m._spec() for m in self._tables],
            "seed": "0",
            "block_elements": str(block_elements),
        }
        self.client = pstrain.Client(hosts, **client_options)
        self.mode = self.client.register(self.schema, num_workers, worker_id)
        if worker_id == 0:
            # The job's initial values are worker 0's; a worker 0 that
            # restarts finds them set and changes nothing (duplicates).
            self.client.assign([t.values() for t in self._tensors])
        self.client.await_job_start(on_waiting)
        self.start_step = self.client.start_step
        self._step = self.start_step
        self._observer = None
        self._finished = False
        self._lane = None  # a _TableLane, made by the first prefetch
        self._lane_times = (0.0, 0.0)  # a closed lane's (busy_s, waited_s)
        self._lane_push = None  # the future of the rows pushed on the lane
        # After finish(): the servers' copy of the final model
        # (Client.secure_final_state); None until then, or when unknown.
        self.final_state = None
        self._clip_max_norm = 0.0
        self._own_grad_norm = 0.0  # async/ssp: last_grad_norm
        # The gradients as the last step left them (_gradient_marks), to
        # tell a step that no backward reached.
        self._cleared_gradients = None
        self._warned_no_gradient = False
        self._fast_forward_scheduler()
        self._pull(self._step)
        # "auto" pipelines where the link binds, as the C++ worker's
        # --pipeline_step=by_host does: on one host the exchange takes the
        # cores backward needs (bench/results/pstrain_torch_pipeline.txt).
        # A CUDA model's first measurement on a GPU is still to come
        # (pipeline=True asks for it).
        if pipeline == "auto" and (
                self._stream is not None or self._tables
                or not self.client._core.some_shard_on_another_host()):
            pipeline = False
        if pipeline is True and self._tables:
            raise ValueError("pipeline=True: a model with pstrain.torch "
                             "embedding tables steps plain")
        self._pipeline = _Pipeline(self) if pipeline else None
        # From here a SIGTERM or a first Ctrl-C ends the step in hand first
        # (_core._GracefulStop); step() then leaves and raises.
        self._step_ended = time.monotonic()
        _core.graceful_stop.activate(self)

    @property
    def step_count(self):
        """Steps this worker has completed (the job's step in sync mode)."""
        return self._step

    @property
    def pipelined_steps(self):
        """Steps whose exchange started during backward (``pipeline``)."""
        return 0 if self._pipeline is None else self._pipeline.steps

    @property
    def pipelined_calls(self):
        """Calls to a shard of the pipelined steps answered as they were
        streamed: 0 where every exchange fell back to the plain PushPull
        after backward (TLS, a 16-bit wire, a failed attempt)."""
        return 0 if self._pipeline is None else self._pipeline.groups_streamed

    def step(self):
        """Ends the step: pushes every gradient (and the buffers' values) and
        pulls the model after it into ``model`` in one round trip, then zeroes
        the gradients. Sync: returns once every worker's step is in. A
        pipelined step started that exchange during backward and waits here
        for what is left of it.

        After SIGTERM, or a first Ctrl-C, the step still goes in whole; the
        worker then leaves the job as stopped and this raises SystemExit
        (128 + 15) or KeyboardInterrupt. A sync job so stopped keeps its
        step on every shard, and resumed from the servers' checkpoints it
        trains as the undisturbed job would."""
        if self._finished:
            raise RuntimeError("step() after finish()")
        try:
            self._exchange()
        except pstrain.Error:
            # Interrupted once the grace was over (CANCELLED): a wait for
            # workers that stopped. The stop below raises outside this
            # block, so that Ctrl-C shows one traceback, not the call's too.
            if not _core.graceful_stop.requested():
                raise
        # The next step in hand gets twice this one's time (data, forward,
        # backward, exchange) to end by itself before its waits are cut. Not
        # once stopping: what this step still sends (a lane's rows) keeps
        # the grace it had.
        now = time.monotonic()
        if not _core.graceful_stop.requested():
            _core.graceful_stop.set_step_work(now - self._step_ended)
        self._step_ended = now
        if _core.graceful_stop.requested():
            self._stop_on_signal()

    def _stop_on_signal(self):
        """Leaves as stopped after a graceful signal, and raises."""
        import signal
        number = _core.graceful_stop.requested()
        _core._lib.pstrain_stop_quiet()
        self._finished = True
        self._how = "stopped"
        try:
            if self._pipeline is not None:
                self._pipeline.close()
            try:
                self._await_lane_push()
            finally:
                self._close_lane()
        except Exception:  # an interrupted push: the servers count it
            pass
        try:
            self.client.leave_stopping(0.3)
        except pstrain.Error as e:
            print(f"pstrain: leaving the job: {e}", file=sys.stderr)
        _core.graceful_stop.deactivate(self)
        name = signal.Signals(number).name
        message = (f"pstrain: worker {self.worker_id} stopped by {name} at "
                   f"step {self._step} and left the job")
        if self.mode == "sync":
            message += "; the servers hold that step for a resume"
        print(message, file=sys.stderr, flush=True)
        if number == signal.SIGINT:
            raise KeyboardInterrupt(message)
        raise SystemExit(128 + number)

    def _exchange(self):
        self._step_the_optimizer()
        pipeline = self._pipeline
        if pipeline is None:
            return self._plain_step()
        problem = pipeline.check_step()
        if not pipeline.running():
            self._plain_step()
            pipeline.end_step(problem)
            return
        if problem is not None:
            pipeline.close()
            self._pipeline = None
            raise RuntimeError(
                f"pipelined step {self._step}: {problem}, after the gradients "
                "had left during backward. The pipeline watches the first "
                "step for such changes; a job that starts them later needs "
                "ParameterServer(..., pipeline=False)")
        step = self._step
        pipeline.finish()
        if self._stream is not None:
            # Kernels queued after the last gradient may still read the
            # parameters the copies overwrite.
            self._stream.wait_stream(torch.cuda.current_stream())
        for t in self._tensors:
            t.after_stream(self._stream)
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        pipeline.end_step(None)
        self._note_cleared_gradients()
        self._step = step + 1

    def _step_the_optimizer(self):
        """The servers run the optimizer's step: a scheduler checks that
        one ran before its own step (torch 1.13: the optimizer's step count;
        2.x: _opt_called) and would warn "lr_scheduler.step() before
        optimizer.step()" on every job."""
        if self.optimizer is not None:
            self.optimizer._step_count = getattr(self.optimizer,
                                                 "_step_count", 0) + 1
            self.optimizer._opt_called = True

    def _send_rates(self):
        if self.optimizer is not None:
            # What the scheduler left in the groups: this step's rates (and
            # momentums: OneCycleLR cycles them).
            groups = self.optimizer.param_groups
            self.client.set_group_rates(
                [_number(g, "lr") for g in groups],
                [_momentum(g) for g in groups])

    def _gradient_marks(self):
        """Each trained tensor's gradient: which tensor, at which version
        (in-place accumulation moves it), or None."""
        return [None if t.state or t.tensor.grad is None
                else (id(t.tensor.grad), t.tensor.grad._version)
                for t in self._tensors]

    def _note_cleared_gradients(self):
        """At a step's end, until the warning below was given (then no
        step pays for it)."""
        if not self._warned_no_gradient:
            self._cleared_gradients = self._gradient_marks()

    def _only_zeroed_since_cleared(self, marks):
        """Whether every gradient that moved since the last step moved by
        one in-place change and holds zeros: optimizer.zero_grad() without
        set_to_none (torch 1.x's default) and no backward. A backward into
        a zeroed gradient moves it twice; one into the gradient the last
        step left (zeros, no zero_grad) once, and leaves values."""
        cleared = self._cleared_gradients or [None] * len(marks)
        for t, mark, before in zip(self._tensors, marks, cleared):
            if mark == before or mark is None:
                continue
            if (before is None or mark[0] != before[0]
                    or mark[1] != before[1] + 1 or bool(t.tensor.grad.any())):
                return False  # a gradient backward made or added to
        return True

    def _warn_if_no_gradient(self):
        """A step that no backward reached pushes zeros, and the servers'
        optimizer still steps (weight decay, momentum), where torch's
        optimizer.step() skips parameters without a gradient. Said once:
        a worker with no batch for a step may mean it (sync needs its
        push)."""
        if self._warned_no_gradient or all(t.state for t in self._tensors):
            return  # (a model of tables only: their forwards say it)
        if any(leaf.grad is not None for table in self._tables
               for _, leaf, _ in table._pending):
            return  # backward reached a table's rows
        marks = self._gradient_marks()
        if any(m is not None for m in marks) and (
                marks != self._cleared_gradients) and (
                not self._only_zeroed_since_cleared(marks)):
            return
        self._warned_no_gradient = True
        warnings.warn(
            f"ps.step() at step {self._step} with no gradient since the last "
            "step (no backward() reached a parameter): zeros are pushed, and "
            "the servers' optimizer still steps (weight decay, momentum), "
            "unlike torch's optimizer.step(), which skips parameters "
            "without a gradient", RuntimeWarning, stacklevel=5)

    def _plain_step(self):
        step = self._step
        for t in self._tensors:
            t.check_unchanged()
        self._warn_if_no_gradient()
        self._await_lane_push()
        if self._tables:  # every table's rows in one round trip
            parts = [table._take_pending() for table in self._tables]
            if self._lane is not None:
                # After prefetch(): the rows go on the lane while the dense
                # exchange runs (finish() waits for every worker's).
                self._lane_push = self._lane.submit(
                    _push_rows, self.client, step, parts)
            else:
                _push_rows(self.client, step, parts)
        grads = [t.push_source() for t in self._tensors]
        if self._stream is not None:
            # Backward, then the gradients' copies into pinned memory, which
            # run on the stream after the host has queued them: the client
            # reads that memory as soon as push_pull is called.
            torch.cuda.current_stream().synchronize()
        values = [t.values_view for t in self._tensors]
        self._send_rates()
        # A clip asked for this step (clip_grad_norm_), and none after it.
        self.client.set_gradient_clip(self._clip_max_norm)
        self._clip_max_norm = 0.0
        self.client.push_pull(step, grads, step + 1, values)
        for t in self._tensors:
            t.after_pull(self._stream)
            if not t.state and t.tensor.grad is not None:
                t.tensor.grad.zero_()
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        self._note_cleared_gradients()
        self._step = step + 1

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """In place of ``torch.nn.utils.clip_grad_norm_(model.parameters(),
        max_norm)``, before ``step()``. Sync: clips the job's gradient, the
        mean of every worker's, by its 2-norm over every dense parameter,
        as one process with the whole batch would (the servers apply the
        step once a worker has gathered the norm: one more round trip);
        ``last_grad_norm`` then holds that norm. Async and ssp: each update
        is one worker's gradient, so this clips this worker's own, exactly
        torch's call. Returns this worker's gradient norm before clipping
        (what torch's call returns for one process)."""
        if self._pipeline is not None:
            self._pipeline.note_clip()
        params = [t.tensor for t in self._tensors
                  if not t.state and t.tensor.grad is not None]
        if self.mode != "sync":
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
            self._own_grad_norm = float(norm)
            return norm
        if float(norm_type) != 2.0:
            raise ValueError(
                f"norm_type={norm_type}: a sync job clips the 2-norm of its "
                "gradient only")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self._clip_max_norm = float(max_norm)
        if not params:
            return torch.tensor(0.0)
        return torch.norm(torch.stack([torch.norm(p.grad.detach(), 2.0)
                                       for p in params]), 2.0)

    @property
    def last_grad_norm(self):
        """The gradient norm (before clipping) of the last step clipped with
        clip_grad_norm_, 0.0 before one: sync, the job's, on every worker;
        async and ssp, this worker's own."""
        if self.mode != "sync":
            return self._own_grad_norm
        return self.client.last_clip_norm()

    def finish(self, timeout_s=120.0):
        """Leaves the job and puts its final model into ``model``: sync, the
        model after the last step; async/ssp, the servers' model once every
        worker is done (waiting up to ``timeout_s`` for the others).
        Embedding tables then read the final rows. Returns how the wait
        ended ("sync_step", "all_done", "quiet" or "timeout")."""
        if self._finished:
            return self._how
        self._finished = True
        _core.graceful_stop.deactivate(self)
        if self._pipeline is not None:
            self._pipeline.close()
        # This worker's last rows in (rows pulled ahead for a step never
        # run are dropped).
        pushed_on_lane = self._lane is not None
        try:
            self._await_lane_push()
        finally:
            self._close_lane()
        if self.scheduler is not None:
            def refuse(*args, **kwargs):
                raise RuntimeError(
                    "scheduler.step() after ParameterServer.finish(): the job "
                    "is over, and its rates go nowhere")
            self.scheduler.step = refuse
        if self.mode == "sync" and not pushed_on_lane:
            if self._step > 0:
                self._secure_final_state(self.client, self._step)
            self.client.leave()
            self._how = "sync_step"
            return self._how
        self.client.leave()
        # A pull as this worker would rejoin the job: an observer reads.
        self._observer = pstrain.Client(self._hosts, **self._client_options)
        self._observer.register(self.schema, self.num_workers, -1)
        if self.mode == "sync":
            # The dense model is the last step's, but another worker's last
            # rows went beside its dense gradient and may still be on their
            # way: every worker leaves once its rows are in, so the tables
            # are final when no worker is left.
            how = self._observer.await_final_model(self._step, timeout_s)
            self._how = "sync_step" if how == "all_done" else how
            if self._step > 0 and how == "all_done":
                self._secure_final_state(self._observer, self._step)
            return self._how
        self._how = self._observer.await_final_model(
            self.num_workers * self._step, timeout_s)
        self._pull(self._step, self._observer)
        if self._how == "all_done":
            self._secure_final_state(self._observer,
                                     self.num_workers * self._step)
        return self._how

    def _secure_final_state(self, client, final_version):
        """The servers' copy of the final model this worker holds: durable
        (checkpointed), in memory, or behind (a shard restored after the
        last step without it). Kept in ``final_state``; behind warns."""
        self.final_state = client.secure_final_state(final_version)
        if self.final_state["summary"] == "behind":
            import warnings
            warnings.warn(
                "the servers' model is not the job's final model: "
                + "; ".join(self.final_state["problems"]), RuntimeWarning)

    def _fast_forward_scheduler(self):
        """A worker that starts at step s > 0 (a job resumed from its
        checkpoint, a worker restarted or joining late) takes the schedule
        where the job is: the scheduler steps s times here, as it would have
        in this worker's earlier steps, so the rates it sets are the job's
        (exact for every schedule that depends on the step count alone)."""
        if self.scheduler is None or self._step == 0:
            return
        if isinstance(self.scheduler,
                      torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                "ReduceLROnPlateau steps on a metric, which a worker starting "
                f"at step {self._step} cannot replay: its rates would restart")
        import warnings
        with warnings.catch_warnings():
            # "lr_scheduler.step() before optimizer.step()": nothing to do.
            warnings.simplefilter("ignore")
            for _ in range(self._step):
                self.scheduler.step()

    def stats(self):
        return self.client.stats()

    def steps_short(self):
        """sync: steps the job completed with fewer gradients than workers."""
        return self.client.steps_short()

    def _pull(self, step, client=None):
        (client or self.client).pull(step, [t.values_view for t in self._tensors])
        for t in self._tensors:
            t.after_pull(self._stream)
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def _reader(self):
        return self._observer if self._observer is not None else self.client

    def _table_call(self, fn, *args):
        """fn(*args), a table call of the training client: on the lane once
        there is one (after the prefetches before it), else here."""
        if self._lane is None:
            return fn(*args)
        return self._lane.run(fn, *args)

    def _await_lane_push(self):
        """The last step's rows pushed on the lane are in (its error, if it
        failed, raised here)."""
        if self._lane_push is not None:
            push, self._lane_push = self._lane_push, None
            self._lane.wait(push)

    def _table_lane(self):
        if self._lane is None:
            self._lane = _TableLane(self.client)
        return self._lane

    def _close_lane(self):
        """The lane's calls done (a prefetch nobody used included) and its
        thread ended."""
        if self._lane is not None:
            self._lane.close()
            self._lane_times = (self._lane.busy_s, self._lane.waited_s)
            self._lane = None

    def table_lane_seconds(self):
        """(time the table lane spent in calls, time training waited for
        it); zeros without prefetches."""
        if self._lane is None:
            return self._lane_times
        return self._lane.busy_s, self._lane.waited_s


class _ServerTable(torch.nn.Module):
    """An embedding table that lives on the servers (see Embedding)."""

    def __init__(self, num_embeddings, embedding_dim, optimizer, lr,
                 init_std, initial_accumulator, betas, eps, max_bytes,
                 consistency):
        super().__init__()
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim}")
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError("max_bytes must be an int >= 0 (bytes per "
                             f"server; 0: no budget), got {max_bytes!r}")
        self.max_bytes = max_bytes
        if consistency not in (None, "sync", "async", "ssp"):
            raise ValueError("consistency must be None (the servers' --mode), "
                             f"'async', 'sync' or 'ssp', got {consistency!r}")
        self.consistency = consistency
        if optimizer not in ("sgd", "adagrad", "adam", "ftrl"):
            raise ValueError("optimizer must be sgd, adagrad, adam or ftrl, "
                             f"got '{optimizer}'")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        if eps is None:  # torch.optim's defaults
            eps = 1e-10 if optimizer == "adagrad" else 1e-8
        self._optimizer = {
            "name": optimizer, "learning_rate": lr,
            "initial_accumulator": initial_accumulator,
            "beta1": betas[0], "beta2": betas[1], "epsilon": eps,
            "ftrl_alpha": lr, "ftrl_beta": 1.0, "ftrl_l1": 0.0, "ftrl_l2": 0.0,
        }
        self._init_std = init_std
        self._ps = None
        # (unique ids, leaf, the ids' first row in it) of this step's forwards
        self._pending = []

    def _bind(self, ps, index, name):
        self._ps = ps
        self._index = index
        self.table_name = name

    def _spec(self):
        return {"name": self.table_name, "dim": str(self.embedding_dim),
                "init": {"kind": "NORMAL", "scale": self._init_std},
                "optimizer": self._optimizer,
                "max_bytes": str(self.max_bytes),
                "mode": self.consistency or ""}

    def _training(self):
        return self.training and torch.is_grad_enabled()

    def _pulls_never_wait(self):
        """Whether the servers answer this table's pulls at once (async)."""
        return (self.consistency or self._ps.mode) == "async"

    def _client(self, training):
        return self._ps.client if training else self._ps._reader()

    def _rows(self, ids):
        """(rows of the batch's unique ids, the index of each id among them)."""
        pulled = _PulledRows([self], [ids])
        training = self._training()
        self._ps._table_call(pulled.pull, self._client(training),
                             self._ps._step)
        leaf = pulled.leaves(training, fused=False)[0]
        return leaf, pulled.index_of(0, ids)

    def _take_pending(self):
        """(table index, unique ids, summed gradient rows as a contiguous
        float32 tensor) of this step's forwards, for ParameterServer.step's
        push. Every shard hears from every worker each sync step, even with
        no rows (PushSparse sends the empty ones): the table's step
        completes."""
        if not self._pending:
            keys = np.zeros(0, dtype=np.uint64)
            grads = torch.zeros((0, self.embedding_dim), dtype=torch.float32)
        elif len(self._pending) == 1:
            # One forward this step (the usual case): its keys are unique
            # already (each pull asks for an id once), so its rows' gradient
            # is the push as it is.
            keys, leaf, first = self._pending[0]
            grads = _grad_rows(leaf, first, len(keys))
        else:
            all_keys = np.concatenate([k for k, _, _ in self._pending])
            all_grads = torch.cat([_grad_rows(leaf, first, len(k))
                                   for k, leaf, first in self._pending])
            keys, where = np.unique(all_keys, return_inverse=True)
            # index_add_, not np.add.at: the latter took 14% of a CTR step.
            grads = torch.zeros((len(keys), self.embedding_dim),
                                dtype=torch.float32)
            grads.index_add_(0, torch.from_numpy(where.astype(np.int64)),
                             all_grads)
        self._pending = []
        return self._index, keys, grads


class Embedding(_ServerTable):
    """``torch.nn.Embedding`` whose table lives on the servers.

    Forward pulls only the batch's unique ids (sync: the rows after the
    current step); ``ParameterServer.step()`` pushes their gradients, and the
    table's optimizer (sgd, adagrad, adam, ftrl; ``lr``) runs on the servers,
    with torch.optim's defaults: Adagrad's accumulator starts at
    ``initial_accumulator=0`` with ``eps=1e-10`` (Adam's eps: 1e-8), as
    ``torch.optim.Adagrad`` on an ``nn.Embedding(sparse=True)`` does.
    Rows are created on first use, drawn from N(0, init_std^2) as
    ``nn.Embedding`` does, so the table is bounded by the servers' memory,
    not the worker's. ``num_embeddings=None``: any int64 id, taken as its
    64 bits (hashed feature ids: the table's keys are uint64).
    ``max_bytes``: the most memory the table may hold on each server (rows,
    optimizer state and bookkeeping); at it, least recently used rows are
    evicted (and start again from their initial values when seen again).
    Registration refuses a budget below one row, or tables that with the
    dense model exceed a server's ``--max_shard_memory_gb``. 0: no budget.
    ``consistency``: how the servers apply the table's pushes. None: as the
    servers' ``--mode``; ``"async"`` under any mode: each worker's rows are
    applied on arrival and pulls never wait for the step, so sync dense
    layers with async tables (PERSIA's split) keep the dense step exact while
    the tables skip its barrier. Registration refuses a mode the servers do
    not run (``"sync"`` under ``--mode=async``).
    """

    def __init__(self, num_embeddings, embedding_dim, *, optimizer="adagrad",
                 lr=0.01, init_std=1.0, initial_accumulator=0.0,
                 betas=(0.9, 0.999), eps=None, max_bytes=0, consistency=None):
        super().__init__(num_embeddings, embedding_dim, optimizer, lr,
                         init_std, initial_accumulator, betas, eps, max_bytes,
                         consistency)

    def forward(self, ids):
        rows, index = self._rows(ids)
        return torch.nn.functional.embedding(index, rows)


class EmbeddingBag(_ServerTable):
    """``torch.nn.EmbeddingBag`` (mode "sum" or "mean") on a server table, as
    ``Embedding``: ``forward(ids, offsets)`` with 1-D ids and offsets, or 2-D
    ids of equal bags."""

    def __init__(self, num_embeddings, embedding_dim, *, mode="mean",
                 optimizer="adagrad", lr=0.01, init_std=1.0,
                 initial_accumulator=0.0, betas=(0.9, 0.999), eps=None,
                 max_bytes=0, consistency=None):
        super().__init__(num_embeddings, embedding_dim, optimizer, lr,
                         init_std, initial_accumulator, betas, eps, max_bytes,
                         consistency)
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be sum or mean, got '{mode}'")
        self.mode = mode

    def forward(self, ids, offsets=None):
        rows, index = self._rows(ids)
        return torch.nn.functional.embedding_bag(index, rows, offsets,
                                                 mode=self.mode)


class EmbeddingBagCollection(torch.nn.Module):
    """Several ``EmbeddingBag`` tables (one per categorical field, as DLRM's,
    or TorchRec's ``EmbeddingBagCollection``) whose rows one forward pulls
    from every server in one round trip: a model with 26 tables waits for
    the network once a step, not 26 times (their gradients go back in one
    round trip too, as every table's do in ``ParameterServer.step``).

    ``forward(bags)``: one ``(ids, offsets)`` per table (``offsets`` None for
    2-D ids of equal bags), in the tables' order; returns the list of pooled
    ``[bags, embedding_dim]`` tensors, each what its table's own forward
    would return.
    """

    def __init__(self, tables):
        super().__init__()
        tables = list(tables)
        for table in tables:
            if not isinstance(table, EmbeddingBag):
                raise TypeError("EmbeddingBagCollection holds "
                                "pstrain.torch.EmbeddingBag tables, got "
                                f"{type(table).__name__}")
        self.tables = torch.nn.ModuleList(tables)

    def _check_bags(self, bags):
        bags = list(bags)
        if len(bags) != len(self.tables):
            raise ValueError(f"{len(bags)} (ids, offsets) pairs for "
                             f"{len(self.tables)} tables")
        return bags

    def prefetch(self, bags):
        """Starts pulling the rows of ``bags`` (the next batch's, in
        ``forward``'s form) on a thread beside training; the ``forward``
        given these same bags (the same tensors, unchanged) then takes them
        instead of waiting for its pull. Call it for the next batch before
        this batch's forward: the pull overlaps this step's compute and
        exchange.

        For tables whose pulls never wait for the step (consistency
        "async", or servers in async mode), whose rows may be a step old:
        rows pulled ahead hold this worker's updates through the step
        before the one that pulled them, one step fewer than a forward's
        own pull. Training forwards take them (an eval forward pulls its
        own). At most two batches ahead a collection; rows never used are
        dropped, with a warning, when a later batch's are taken or the bags
        were written to since, and by ``finish()``."""
        bags = self._check_bags(bags)
        if not bags:
            return
        first = self.tables[0]
        if first._ps is None:
            _unique_ids([first], [bags[0][0]])  # raises: not bound
        ps = first._ps
        if ps._finished:
            raise RuntimeError("prefetch() after finish()")
        for t in self.tables:
            if not t._pulls_never_wait():
                raise ValueError(
                    f"prefetch(): table '{t.table_name}' is "
                    f"{t.consistency or ps.mode}, and its pulls wait for the "
                    "step; rows pulled ahead are for async tables "
                    "(consistency='async')")
        lane = ps._table_lane()
        if sum(p[0] is self for p in lane.prefetched) >= 2:
            raise RuntimeError(
                "prefetch(): two batches are pulled ahead already and no "
                "forward took them (at most two ahead)")
        pulled = _PulledRows(self.tables, [ids for ids, _ in bags])
        future = lane.submit(pulled.pull, ps.client, ps._step + 1)
        lane.prefetched.append([self, bags, _versions(bags), pulled, future])

    def _take_prefetched(self, bags):
        """The _PulledRows a prefetch pulled for exactly these bags, or None;
        rows pulled ahead for other bags before them are dropped."""
        ps = self.tables[0]._ps
        lane = None if ps is None else ps._lane
        if lane is None:
            return None
        mine = [p for p in lane.prefetched if p[0] is self]
        for i, entry in enumerate(mine):
            _, ahead, versions, pulled, future = entry
            if not _same_tensors(ahead, bags):
                continue
            # Those before it were skipped; it, if its ids changed since.
            fresh = _versions(bags) == versions
            dropped = mine[:i] if fresh else mine[:i + 1]
            for old in mine[:i + 1]:
                lane.prefetched.remove(old)
            if dropped:
                warnings.warn(
                    f"{len(dropped)} batch(es) of rows pulled ahead were not "
                    "used: forward was given other bags than prefetch(), or "
                    "bags written to since", RuntimeWarning)
            if not fresh:
                return None
            lane.wait(future)
            return pulled
        return None

    def forward(self, bags):
        bags = self._check_bags(bags)
        if not bags:
            return []
        first = self.tables[0]
        training = first._training()
        pulled = self._take_prefetched(bags) if training else None
        if pulled is None:
            pulled = _PulledRows(self.tables, [ids for ids, _ in bags])
            first._ps._table_call(pulled.pull, first._client(training),
                                  first._ps._step)
        fused = self._fused_bags(bags)
        if fused is None:
            return [torch.nn.functional.embedding_bag(
                        pulled.index_of(i, ids), leaf, offsets, mode=t.mode)
                    for i, (t, leaf, (ids, offsets)) in enumerate(zip(
                        self.tables, pulled.leaves(training, fused=False),
                        bags))]
        offsets, bag_counts = fused
        # Every table's bags in one embedding_bag, and so one backward: for
        # DLRM's 26 tables, ~0.5 ms a step less than a call each.
        leaf = pulled.leaves(training, fused=True)[0]
        pooled = torch.nn.functional.embedding_bag(
            pulled.fused_index(), leaf, offsets, mode=self.tables[0].mode)
        return list(pooled.split(bag_counts))

    def _fused_bags(self, bags):
        """(every table's bag offsets into the tables' ids one after another,
        each table's number of bags) when one embedding_bag can pool every
        table (one dim, one mode, offsets torch takes), else None."""
        first = self.tables[0]
        if any(t.embedding_dim != first.embedding_dim or t.mode != first.mode
               for t in self.tables):
            return None
        parts, bag_counts, start = [], [], 0
        for ids, offsets in bags:
            n = ids.numel()
            if offsets is None:
                if ids.dim() != 2 or ids.shape[1] == 0:
                    return None  # torch's own call says what is wrong
                part = np.arange(0, n, ids.shape[1], dtype=np.int64)
            else:
                if (ids.dim() != 1 or offsets.dim() != 1 or len(offsets) == 0
                        or offsets.device.type != "cpu"):
                    return None
                part = offsets.numpy().astype(np.int64, copy=False)
                if part[0] != 0 or part[-1] > n:
                    return None
            parts.append(part + start)
            bag_counts.append(len(part))
            start += n
        return torch.from_numpy(np.concatenate(parts)), bag_counts


class _PulledRows:
    """One pull's rows for some tables (a collection's, or one table's):
    the tables' unique ids in one uint64 array and their rows in one float32
    buffer, so that the pull, the forward and the push each take a few calls
    whatever the number of tables (a part's checks and ctypes arrays cost
    ~3 us a table each way, on the lane's thread, which then holds the GIL
    training needs)."""

    def __init__(self, tables, id_tensors):
        self.tables = tables
        self.keys, self._index, self.counts, self.lengths = _unique_ids(
            tables, id_tensors)
        self.id_starts = _starts(self.lengths)
        dims = np.array([t.embedding_dim for t in tables], np.int64)
        floats = self.counts * dims
        float_starts = _starts(floats)
        self.buffer = torch.empty(int(floats.sum()), dtype=torch.float32)
        self._float_starts, self._dims = float_starts, dims
        self.addresses = (
            np.array([t._index for t in tables], np.int32),
            (self.keys.ctypes.data + 8 * self.id_starts).astype(np.uint64),
            self.counts,
            (self.buffer.data_ptr() + 4 * float_starts).astype(np.uint64))

    def pull(self, client, step):
        """Fills the rows from the servers in one round trip (a bound method
        of this object: whoever runs it holds the memory it writes)."""
        client._core.pull_sparse_addresses(step, *self.addresses)

    def rows(self):
        """Each table's rows, [unique ids, dim], in the buffer."""
        return [self.buffer[s:s + n * d].view(n, d) for s, n, d in zip(
            self._float_starts.tolist(), self.counts.tolist(),
            self._dims.tolist())]

    def keys_of(self, i):
        start = int(self.id_starts[i])
        return self.keys[start:start + int(self.counts[i])]

    def index_of(self, i, ids):
        """Table i's index of each id among its pulled rows, shaped as its
        ids."""
        start = int(self.id_starts[i])
        return torch.from_numpy(
            self._index[start:start + int(self.lengths[i])]).reshape(ids.shape)

    def fused_index(self):
        """Every id's row in the buffer as one [rows, dim] tensor (one dim)."""
        return torch.from_numpy(self._index +
                                np.repeat(_starts(self.counts), self.lengths))

    def leaves(self, training, fused):
        """The rows as tensors the forward pools: one per table, or
        (fused) one of every table's rows. Training: leaves whose gradients
        step() pushes, each table's noted in its pending list."""
        if fused:
            dim = self.tables[0].embedding_dim
            whole = self.buffer.view(-1, dim)
            if not training:
                return [whole]
            leaf = whole.detach().requires_grad_(True)
            first = 0
            for i, t in enumerate(self.tables):
                t._pending.append((self.keys_of(i), leaf, first))
                first += int(self.counts[i])
            return [leaf]
        if not training:
            return self.rows()
        leaves = []
        for i, (t, rows) in enumerate(zip(self.tables, self.rows())):
            leaf = rows.detach().requires_grad_(True)
            t._pending.append((self.keys_of(i), leaf, 0))
            leaves.append(leaf)
        return leaves


def _starts(sizes):
    """Where each of consecutive parts of these sizes starts."""
    return np.cumsum(sizes) - sizes


def _grad_rows(leaf, first, count):
    """Rows [first, first + count) of leaf's gradient (zeros where the loss
    did not reach it), contiguous."""
    if leaf.grad is None:
        return torch.zeros((count, leaf.shape[1]), dtype=torch.float32)
    return leaf.grad[first:first + count].contiguous()


def _push_rows(client, step, parts):
    """Pushes _take_pending's parts in one round trip (the parts are held
    until it returns: the call reads their memory)."""
    client._core.push_sparse_addresses(
        step, np.array([table for table, _, _ in parts], np.int32),
        np.array([keys.ctypes.data for _, keys, _ in parts], np.uint64),
        np.array([len(keys) for _, keys, _ in parts], np.int64),
        np.array([grads.data_ptr() for _, _, grads in parts], np.uint64))


def _unique_ids(tables, id_tensors):
    """Each table's ids, checked and made unique in one C call (numpy's
    unique took ~40 us a table): (keys, index, counts, lengths). Table i's
    ids are the lengths[i] after those of the tables before it; its
    counts[i] unique ids, as the table's uint64 keys, start at the same
    place in keys, and index gives each id's position among them."""
    flats = []
    for table, ids in zip(tables, id_tensors):
        if table._ps is None:
            raise RuntimeError(
                f"{type(table).__name__} is not bound to a ParameterServer: "
                "create pstrain.torch.ParameterServer(model) first")
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"'{table.table_name}': ids must be int64 or "
                            f"int32, got {ids.dtype}")
        # Contiguous: the C call reads the ids as one array.
        flats.append(ids.reshape(-1).to(torch.int64).cpu().contiguous())
    lengths = np.array([len(f) for f in flats], np.int64)
    bounds = np.array([-1 if t.num_embeddings is None else t.num_embeddings
                       for t in tables], np.int64)
    all_ids = flats[0] if len(flats) == 1 else torch.cat(flats)
    keys, index, counts, bad = _core.unique_ids(
        all_ids.numpy(), lengths, bounds)
    if bad >= 0:
        flat = flats[bad]
        raise ValueError(
            f"'{tables[bad].table_name}': ids must be in [0, "
            f"{tables[bad].num_embeddings}), got {int(flat.min())}.."
            f"{int(flat.max())}")
    return keys, index, counts, lengths


def _versions(bags):
    """torch's counts of in-place writes to the bags' tensors."""
    return [(ids._version, None if offsets is None else offsets._version)
            for ids, offsets in bags]


def _same_tensors(a, b):
    """b holds the very tensors of a."""
    return len(a) == len(b) and all(
        ids_a is ids_b and offsets_a is offsets_b
        for (ids_a, offsets_a), (ids_b, offsets_b) in zip(a, b))
