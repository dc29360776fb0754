#!/usr/bin/env python3
"""Prints N distinct loopback ports that are free now, one a line:

  free_ports.py N

For processes that must be told each other's ports before they start
(launch.sh --replicas, the replication benchmarks). Picked below the
kernel's ephemeral range (32768-60999 by default), so that no port a process
binds to port 0 (a data port) and no outgoing connection takes one between
this pick and the server's bind."""

import random
import socket
import sys

held = []
while len(held) < int(sys.argv[1]):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", random.randrange(20000, 32000)))
    except OSError:
        s.close()
        continue
    held.append(s)
for s in held:
    print(s.getsockname()[1])
