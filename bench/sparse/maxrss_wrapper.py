#!/usr/bin/python3
"""Runs a program (argv[1:]) as a child and, when it exits, writes its peak
resident memory in KiB (getrusage's ru_maxrss) to <its --port_file>.maxrss,
or to $MAXRSS_FILE. SIGTERM and SIGINT are passed on, so launch.sh can stop
it as it stops a ps_server. bench/sparse/table_budget.sh puts it in front of
ps_server through a --bin_dir."""

import ctypes
import os
import resource
import signal
import subprocess
import sys

out = os.environ.get("MAXRSS_FILE", "")
for arg in sys.argv[2:]:
    if arg.startswith("--port_file="):
        out = out or arg[len("--port_file="):] + ".maxrss"


def die_with_this_process():
    # A SIGKILL of the wrapper (launch.sh's last resort) must not leave the
    # server running: PR_SET_PDEATHSIG (1) with SIGKILL.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


child = subprocess.Popen(sys.argv[1:], preexec_fn=die_with_this_process)
for number in (signal.SIGTERM, signal.SIGINT):
    signal.signal(number, lambda n, _: child.send_signal(n))
code = child.wait()
if out:
    with open(out, "w") as f:
        f.write(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\n")
sys.exit(code if code >= 0 else 128 - code)
