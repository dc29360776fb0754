"""What a model with many embedding tables pays per table: the same rows
pulled from, and pushed to, 2 real ps_server processes as T tables of N ids
each (2T calls with one call per table and shard; 2 where the servers take
every table in one call, SparsePullRequest.more and SparsePushRequest.more)
and as one table of the T*N ids (2 calls), in the same run, rounds
interleaved.

    bazel build //ps_server && worker/python/install.sh
    /usr/bin/python3 bench/sparse/table_calls.py --ps_server=bazel-bin/ps_server/ps_server \
        [--tables=8] [--ids=400] [--repeats=200] [--rounds=3]

Prints the median over rounds of the ms per pull and per push of each form,
and their ratio (issue 40: the CTR/DLRM step's table traffic).
"""

import argparse
import os
import subprocess
import tempfile
import time

import numpy as np

import pstrain


def start_servers(ps_server, count, scratch):
    procs, hosts = [], []
    for shard in range(count):
        port_file = os.path.join(scratch, f"port{shard}")
        log = open(os.path.join(scratch, f"ps{shard}.log"), "w")
        procs.append(subprocess.Popen(
            [ps_server, "--port=0", f"--port_file={port_file}",
             f"--shard_id={shard}", f"--num_shards={count}", "--num_workers=1",
             "--mode=async"], stdout=subprocess.DEVNULL, stderr=log))
        deadline = time.monotonic() + 30
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                raise RuntimeError(f"ps_server {shard} did not start: see {log.name}")
            time.sleep(0.05)
        hosts.append("127.0.0.1:" + open(port_file).read().strip())
    return procs, hosts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ps_server", required=True)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--ids", type=int, default=400, help="ids drawn per table")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    scratch = tempfile.mkdtemp(prefix="table_calls.")
    procs, hosts = start_servers(args.ps_server, 2, scratch)
    try:
        def table(name):
            return {"name": name, "dim": "16",
                    "init": {"kind": "NORMAL", "scale": 0.01},
                    "optimizer": {"name": "sgd", "learning_rate": 0.01}}
        schema = {"seed": "1",
                  "dense": [{"name": "w", "shape": ["4"], "init": {"kind": "ZEROS"}}],
                  "sparse": [table(f"t{i}") for i in range(args.tables)] + [table("all")]}
        client = pstrain.Client(hosts)
        client.register(schema, 1, 0)
        rng = np.random.default_rng(0)
        ids = [np.unique(rng.integers(0, 100000, args.ids)).astype(np.uint64)
               for _ in range(args.tables)]
        rows = [np.empty((len(k), 16), np.float32) for k in ids]
        # The same ids, kept apart per table, in one table.
        all_ids = np.concatenate([k + np.uint64(t << 32) for t, k in enumerate(ids)])
        all_rows = np.empty((len(all_ids), 16), np.float32)
        # Zero gradients: the pushes cost what any push does and change nothing.
        grads = [np.zeros_like(r) for r in rows]
        all_grads = np.zeros_like(all_rows)
        step = [0]

        def push(parts):
            step[0] += 1  # async: each push is a step of its own
            client.push_sparse_tables(step[0], parts)

        forms = {
            f"{args.tables} tables pull": lambda: client.pull_sparse_tables(
                0, [(t, ids[t], rows[t]) for t in range(args.tables)]),
            "1 table pull": lambda: client.pull_sparse_tables(
                0, [(args.tables, all_ids, all_rows)]),
            f"{args.tables} tables push": lambda: push(
                [(t, ids[t], grads[t]) for t in range(args.tables)]),
            "1 table push": lambda: push([(args.tables, all_ids, all_grads)]),
        }
        for pull in forms.values():  # rows created, connections warm
            for _ in range(30):
                pull()
        times = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, pull in forms.items():
                start = time.perf_counter()
                for _ in range(args.repeats):
                    pull()
                times[name].append((time.perf_counter() - start) / args.repeats * 1e3)
        print(f"table_calls: 2 servers, {len(all_ids)} rows of dim 16 a call, "
              f"{args.repeats} calls x {args.rounds} rounds")
        medians = {}
        for name, values in times.items():
            medians[name] = sorted(values)[len(values) // 2]
            print(f"  {name:16s} {medians[name]:.3f} ms a call "
                  f"(rounds: {', '.join(f'{v:.3f}' for v in values)})")
        for op in ("pull", "push"):
            many = medians[f"{args.tables} tables {op}"]
            one = medians[f"1 table {op}"]
            print(f"  {op}: ratio {many / one:.2f}x, "
                  f"{(many - one) / (2 * args.tables - 2) * 1e3:.0f} us "
                  "for each call beyond the 2 of one table (were they separate)")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
