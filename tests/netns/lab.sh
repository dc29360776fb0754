# Hosts on one machine (source it): each ps_server and worker runs in its own
# network namespace with its own shaped link, so link speed, loss and
# partitions act on the job the way they would between real hosts.
#
#   source tests/netns/lab.sh
#   lab_require || exit 0        # prints why and returns 1 where not allowed
#   lab_create 4                 # hosts 0..3, addresses lab_addr 0..3
#   lab_exec 0 ps_server ...     # run a command on host 0 (in its namespace)
#   lab_rate 1 1gbit             # host 1's link, both directions
#   lab_loss 2 5                 # host 2 drops 5% of its packets, each way
#   lab_partition 0 1            # 0 and 1 cannot reach each other
#   lab_partition 0 1 oneway     # packets from 0 to 1 are dropped, 1 to 0 pass
#   lab_heal                     # every partition and loss rule removed
#   lab_link 3 down|up           # host 3's cable pulled / plugged back
#   lab_drop_port 0 7001         # host 0 drops what arrives for its port 7001
#
# Topology: a router namespace with a bridge; host k's veth pair has eth0 in
# host k (LAB_NET.(10+k)/24) and "hk" on the bridge. The router itself is
# LAB_NET.1 and runs what observes the job (lab_exec r ...). Shaping is a tbf
# on both ends of a host's veth: eth0's egress is the host's upload, hk's is
# its download, so each host has a full-duplex link of the set rate.
# Partitions and loss are nftables rules inside the hosts' namespaces.
#
# LAB_PREFIX must be "pstlab<pid of the run>-..." (default pstlab$$): the
# sweep below reads the pid from it.
#
# Safety (shared/DESIGN.md, "Hosts on one machine"): only namespaces this run
# creates, named LAB_PREFIX-*, with no route out (no default route, no link to
# the host's namespace); nothing touches the host's own interfaces, routes or
# firewall. lab_create installs a trap that removes every namespace and kills
# every process in them on exit, Ctrl-C or failure, and first removes what a
# run killed with -9 left behind (a prefix whose pid is gone).

LAB_NET=${LAB_NET:-10.231.7}
LAB_PREFIX=${LAB_PREFIX:-pstlab$$}
LAB_HOSTS=0

# Why the lab cannot run here, or nothing. Returns 1 (after printing the
# reason) when it cannot.
lab_require() {
  local why=""
  if [[ $(id -u) != 0 ]]; then
    why="needs root (network namespaces)"
  else
    local tool
    for tool in ip tc nft; do
      command -v "$tool" >/dev/null || why="$why${why:+; }no '$tool' (deploy/setup.sh installs iproute2 and nftables)"
    done
    if [[ -z $why ]]; then
      local probe="${LAB_PREFIX}-probe"
      if ! ip netns add "$probe" 2>/dev/null; then
        why="this machine does not allow network namespaces (ip netns add failed)"
      else
        ip netns del "$probe"
      fi
    fi
  fi
  if [[ -n $why ]]; then
    echo "SKIP: netns lab: $why"
    return 1
  fi
}

lab_ns() {  # namespace of host $1 ("r" for the router)
  if [[ $1 == r ]]; then echo "${LAB_PREFIX}-r"; else echo "${LAB_PREFIX}-h$1"; fi
}

lab_addr() {  # address of host $1 ("r" for the router)
  if [[ $1 == r ]]; then echo "$LAB_NET.1"; else echo "$LAB_NET.$((10 + $1))"; fi
}

lab_exec() {  # lab_exec HOST COMMAND...: run COMMAND on HOST
  local host=$1
  shift
  ip netns exec "$(lab_ns "$host")" "$@"
}

# Removes namespaces of lab runs whose process is gone (killed with -9).
lab_sweep_stale() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^pstlab[0-9]+-' || true); do
    pid=$(sed 's/^pstlab\([0-9]*\).*/\1/' <<<"$ns")
    if ! kill -0 "$pid" 2>/dev/null; then
      lab_remove_ns "$ns"
    fi
  done
}

lab_remove_ns() {
  local pids
  pids=$(ip netns pids "$1" 2>/dev/null || true)
  [[ -n $pids ]] && kill -9 $pids 2>/dev/null
  ip netns del "$1" 2>/dev/null || true
}

lab_destroy() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${LAB_PREFIX}-" || true); do
    lab_remove_ns "$ns"
  done
}

# lab_create N [RATE]: the router and hosts 0..N-1, linked, optionally shaped.
lab_create() {
  local n=$1 rate=${2:-}
  lab_sweep_stale
  trap 'lab_destroy' EXIT
  trap 'lab_destroy; exit 130' INT
  trap 'lab_destroy; exit 143' TERM
  local r
  r=$(lab_ns r)
  ip netns add "$r"
  ip -n "$r" link set lo up
  ip -n "$r" link add br0 type bridge
  ip -n "$r" addr add "$(lab_addr r)/24" dev br0
  ip -n "$r" link set br0 up
  local k ns
  for ((k = 0; k < n; ++k)); do
    ns=$(lab_ns "$k")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # Created inside the router namespace, so no interface ever appears in
    # the host's own namespace.
    ip -n "$r" link add "h$k" type veth peer name eth0 netns "$ns"
    ip -n "$r" link set "h$k" master br0 up
    ip -n "$ns" addr add "$(lab_addr "$k")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip netns exec "$ns" nft -f - <<EOF
table inet lab {
  chain out { type filter hook output priority 0; policy accept; }
  chain in { type filter hook input priority 0; policy accept; }
}
EOF
  done
  LAB_HOSTS=$n
  [[ -n $rate ]] && for ((k = 0; k < n; ++k)); do lab_rate "$k" "$rate"; done
  return 0
}

# lab_rate HOST RATE (tc syntax, e.g. 1gbit): both directions of HOST's link.
# The bucket holds 1 ms at the rate (at least 64 KiB), enough for TSO bursts
# without letting a burst run far above the rate.
lab_rate() {
  local host=$1 rate=$2 bits burst
  bits=$(tc_rate_bits "$rate")
  burst=$((bits / 8 / 1000))
  ((burst < 65536)) && burst=65536
  tc -n "$(lab_ns "$host")" qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 20ms
  tc -n "$(lab_ns r)" qdisc replace dev "h$host" root tbf rate "$rate" burst "$burst" latency 20ms
}

tc_rate_bits() {  # 1gbit -> 1000000000, 100mbit -> 100000000
  local v=${1%bit} mult=1
  case $v in
    *g) mult=1000000000 v=${v%g} ;;
    *m) mult=1000000 v=${v%m} ;;
    *k) mult=1000 v=${v%k} ;;
  esac
  echo $((v * mult))
}

# lab_loss HOST PERCENT: HOST drops PERCENT% of the packets it sends and of
# those it receives, at random.
lab_loss() {
  local ns
  ns=$(lab_ns "$1")
  ip netns exec "$ns" nft add rule inet lab out oifname eth0 numgen random mod 100 '<' "$2" drop
  ip netns exec "$ns" nft add rule inet lab in iifname eth0 numgen random mod 100 '<' "$2" drop
}

# lab_partition A B [oneway]: packets from A to B are dropped (and from B to
# A unless oneway). Dropped, not refused: the peers see silence, as with a
# failed switch, not a reset.
lab_partition() {
  local a=$1 b=$2 mode=${3:-both}
  ip netns exec "$(lab_ns "$a")" nft add rule inet lab out ip daddr "$(lab_addr "$b")" drop
  if [[ $mode != oneway ]]; then
    ip netns exec "$(lab_ns "$b")" nft add rule inet lab out ip daddr "$(lab_addr "$a")" drop
  fi
}

# lab_drop_port HOST PORT: HOST silently drops TCP packets to its PORT (a
# firewall that lets one port of a server through and not the other).
lab_drop_port() {
  ip netns exec "$(lab_ns "$1")" nft add rule inet lab in tcp dport "$2" drop
}

lab_heal() {
  local k ns
  for ((k = 0; k < LAB_HOSTS; ++k)); do
    ns=$(lab_ns "$k")
    ip netns exec "$ns" nft flush chain inet lab out
    ip netns exec "$ns" nft flush chain inet lab in
  done
}

lab_link() {  # lab_link HOST down|up
  ip -n "$(lab_ns "$1")" link set eth0 "$2"
}
