"""Real ps_server processes for the Python tests, and Python workers as real
processes: the servers come from the test's runfiles, listen on ports they
pick themselves (reported through port files), and every process a test
starts is killed when its Cluster closes. Every wait has a deadline."""

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def runfile(path):
    return os.path.join(os.environ["TEST_SRCDIR"], "pstrain", path)


def _run_with_the_installed_package():
    """The suite tests the package as users get it: the wheel, pip-installed
    into a fresh virtual environment that sees Debian's torch, never the
    build tree. The first import of this module re-runs the test under that
    environment's interpreter (every process a test starts uses it too)."""
    if os.environ.get("PSTRAIN_TEST_VENV"):
        return
    wheels = glob.glob(runfile("worker/python/pstrain-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in the runfiles: {wheels}"
    venv = os.path.join(os.environ["TEST_TMPDIR"], "venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages",
                    venv], check=True)
    python = os.path.join(venv, "bin", "python")
    subprocess.run([python, "-m", "pip", "install", "--no-index", "--no-deps",
                    "--ignore-installed",
                    "--quiet", "--disable-pip-version-check", wheels[0]],
                   check=True)
    os.execve(python, [python] + sys.argv,
              dict(os.environ, PSTRAIN_TEST_VENV=venv))


_run_with_the_installed_package()

import pstrain  # noqa: E402 (the installed one, after the re-run above)

assert os.environ["PSTRAIN_TEST_VENV"] in pstrain.__file__, pstrain.__file__
# Where `import pstrain` finds the installed package: a worker process run by
# another interpreter gets it on its PYTHONPATH.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pstrain.__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))


def read(path):
    with open(path) as f:
        return f.read()


def wait_for(condition, timeout_s, what):
    """Polls `condition` (a condition, not a clock) until it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class Cluster:
    """num_shards ps_server processes; use as a context manager."""

    def __init__(self, num_shards=2, num_workers=2, mode="sync", flags=(),
                 checkpoint=False):
        self.num_shards = num_shards
        self.num_workers = num_workers
        self.mode = mode
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        self.flags = list(flags)
        if checkpoint:  # SIGTERM writes a last one; a restart restores it
            self.flags.append(f"--checkpoint_dir={self.dir}/ckpt")
        self.servers = []
        self.workers = []
        self.ports = []
        for shard in range(num_shards):
            self.servers.append(self._start_server(shard, port=0))
        for shard in range(num_shards):
            self.ports.append(self._wait_for_port(shard))
        self.hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _wait_for_port(self, shard):
        path = os.path.join(self.dir, f"ps{shard}.port")
        return int(wait_for(lambda: os.path.exists(path) and read(path).strip(),
                            30, f"ps_server {shard}'s port"))

    def restart_all_servers(self):
        """Stops every server (SIGTERM: with checkpoint=True each writes a
        last checkpoint) and starts it again on its port, from it."""
        for server in self.servers:
            server.send_signal(signal.SIGTERM)
        for shard, server in enumerate(self.servers):
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"ps_server {shard} ignored SIGTERM:\n"
                                     + self.server_log(shard)[-3000:])
        self.servers = [self._start_server(shard, port)
                        for shard, port in enumerate(self.ports)]
        for shard in range(self.num_shards):
            self._wait_for_port(shard)

    def _start_server(self, shard, port):
        path = os.path.join(self.dir, f"ps{shard}.port")
        if os.path.exists(path):
            os.remove(path)
        argv = [runfile("ps_server/ps_server"), "--host=127.0.0.1",
                f"--port={port}", f"--port_file={path}", f"--shard_id={shard}",
                f"--num_shards={self.num_shards}",
                f"--num_workers={self.num_workers}", f"--mode={self.mode}",
                "--shutdown_grace_s=1"] + self.flags
        with open(os.path.join(self.dir, f"ps{shard}.log"), "ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=log)

    def server_log(self, shard=0):
        return read(os.path.join(self.dir, f"ps{shard}.log"))

    def cluster_env(self, worker_id, num_workers=None):
        """The environment deploy/local/launch.sh --python gives a worker."""
        num_workers = num_workers or self.num_workers
        spec = {"ps": self.hosts.split(","), "workers": num_workers,
                "mode": self.mode,
                "task": {"type": "worker", "index": worker_id}}
        # pstrain is the installed one (sys.executable's); the tests'
        # helper modules (tests.python.*) come from the runfiles.
        env = dict(os.environ, PSTRAIN_CLUSTER=json.dumps(spec),
                   RANK=str(worker_id), WORLD_SIZE=str(num_workers),
                   PYTHONPATH=runfile(""), OMP_NUM_THREADS="1")
        return env

    def start_worker(self, script, worker_id, args=(), num_workers=None,
                     name=None):
        """Runs `script` (a path) as worker `worker_id`; its stdout and
        stderr go to files in the cluster's directory."""
        name = name or f"worker{worker_id}_{len(self.workers)}"
        with open(os.path.join(self.dir, f"{name}.out"), "wb") as out, \
                open(os.path.join(self.dir, f"{name}.log"), "wb") as err:
            process = subprocess.Popen(
                [sys.executable, "-u", script] + list(args),
                env=self.cluster_env(worker_id, num_workers), stdout=out,
                stderr=err, cwd=self.dir)
        process.name = name
        self.workers.append(process)
        return process

    def output(self, process):
        return read(os.path.join(self.dir, f"{process.name}.out"))

    def errors(self, process):
        return read(os.path.join(self.dir, f"{process.name}.log"))

    def wait(self, process, timeout_s=180):
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            raise AssertionError(
                f"{process.name} still running after {timeout_s} s:\n"
                + self.errors(process)[-3000:])

    def run_workers(self, script, args_of, timeout_s=300):
        """Starts every worker (args_of(worker_id) are its arguments), waits
        for all, and returns each one's final JSON line as a dict."""
        processes = [self.start_worker(script, k, args_of(k))
                     for k in range(self.num_workers)]
        finals = []
        deadline = time.monotonic() + timeout_s
        for p in processes:
            code = self.wait(p, max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise AssertionError(f"{p.name} exited {code}:\n"
                                     + self.errors(p)[-3000:])
            finals.append(final_line(self.output(p)))
        return finals

    def kill_server(self, shard):
        self.servers[shard].kill()
        self.servers[shard].wait()

    def observer(self):
        return pstrain.Client(self.hosts, rpc_timeout_s=20, retry_window_s=0)

    def stats(self):
        return self.observer().stats()

    def close(self):
        for p in self.workers + self.servers:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def final_line(output):
    for line in reversed(output.splitlines()):
        if line.startswith('{"event":"final"'):
            return json.loads(line)
    raise AssertionError("no final JSON line in:\n" + output[-2000:])


def main():
    """unittest.main, also writing each test case's outcome where bazel
    asks (XML_OUTPUT_FILE), so tests/run.sh counts cases, not targets."""
    import unittest
    import xml.sax.saxutils as saxutils

    class Result(unittest.TextTestResult):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.cases = []

        def addSuccess(self, test):
            super().addSuccess(test)
            self.cases.append((test.id(), ""))

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self.cases.append((test.id(), "<failure message=\"failed\"/>"))

        def addError(self, test, err):
            super().addError(test, err)
            self.cases.append((test.id(), "<error message=\"error\"/>"))

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            self.cases.append((test.id(), None))

    program = unittest.main(
        testRunner=unittest.TextTestRunner(resultclass=Result, verbosity=2),
        exit=False)
    result = program.result
    path = os.environ.get("XML_OUTPUT_FILE")
    if path:
        lines = [f'<testsuites tests="{result.testsRun}" '
                 f'failures="{len(result.failures)}" '
                 f'errors="{len(result.errors)}" disabled="0">',
                 '<testsuite name="python">']
        for name, body in result.cases:
            name = saxutils.quoteattr(name)
            if body is None:
                lines.append(f'<testcase name={name} result="skipped"/>')
            else:
                lines.append(f'<testcase name={name}>{body}</testcase>')
        lines += ["</testsuite>", "</testsuites>"]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    sys.exit(0 if result.wasSuccessful() else 1)
