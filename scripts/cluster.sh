#!/usr/bin/env bash
# A cluster of hosts inside this machine, for the multi-host tests (tests/cluster/):
# each host is a network namespace with one veth link to a bridge, its own IPv4
# and IPv6 address, a default route out of that link, its own host name and,
# optionally, its own disk. Every host resolves every other host's name to its
# addresses, and its own name to 127.0.1.1, as Debian's /etc/hosts does (through
# /etc/netns/<host>/hosts). Needs root.
#
#   scripts/cluster.sh can                     exit 0 when this machine can make hosts; else print
#                                              why and exit 77 (the tests' "skipped")
#   scripts/cluster.sh up N HOSTS              make cluster N (1..250) of HOSTS hosts (1..16); a
#                                              leftover cluster N is removed first
#   scripts/cluster.sh down N                  kill every process on its hosts, remove hosts, bridge
#                                              and files; quiet and successful when nothing is left
#   scripts/cluster.sh addr N I [-6]           host I's address (IPv4, or IPv6 with -6)
#   scripts/cluster.sh name N I                host I's host name
#   scripts/cluster.sh exec N I [--disk DIR:PATH]... -- CMD...
#                                              run CMD on host I, with DIR mounted at PATH (a disk of
#                                              its own at a path every host shares the name of)
#   scripts/cluster.sh shape N I RATE|off      host I's link limited to RATE in each direction
#                                              (tc tbf; RATE as tc reads it: 1gbit, 10mbit)
#   scripts/cluster.sh cut N I                 partition host I: its link goes down (nothing is sent,
#                                              nothing is refused: peers see silence)
#   scripts/cluster.sh heal N I                bring host I's link back
#   scripts/cluster.sh kill N I                host I dies: cut, then SIGKILL to every process on it
#   scripts/cluster.sh pids N I                the processes running on host I
#
# Cluster N uses 10.213.N.0/24 and fd7a:5a:0:N::/64 (host I is .I+1 / ::I+1) and
# the names zsN (bridge), zsN-hI (namespace and host name), zsN-vI (bridge side
# of host I's link; inside the host the link is eth0). Nothing else on this
# machine is touched. Latency and loss are not modelled: this kernel has no netem.
set -euo pipefail

die() { echo "cluster.sh: $*" >&2; exit 2; }

check_number() {  # NAME VALUE MIN MAX
  [[ "$2" =~ ^[0-9]+$ ]] && (( $2 >= $3 && $2 <= $4 )) || die "$1 '$2' must be a number in $3..$4"
}

cluster_args() {  # N [I]: sets n, hosts (from the cluster's state), i
  check_number "cluster" "${1:-}" 1 250
  n=$1
  state=/run/zeroshard-cluster/$n
  hosts=$( [[ -f $state/hosts ]] && cat "$state/hosts" || echo 0 )
  if (( $# > 1 )); then
    (( hosts > 0 )) || die "cluster $n is not up (scripts/cluster.sh up $n HOSTS)"
    check_number "host" "$2" 0 $((hosts - 1))
    i=$2
  fi
}

ns() { echo "zs$1-h$2"; }
ipv4() { echo "10.213.$1.$(($2 + 1))"; }
ipv6() { echo "fd7a:5a:0:$1::$(($2 + 1))"; }

cmd_can() {
  local why=""
  if (( EUID != 0 )); then
    why="not root (network namespaces, veth links and tc need root)"
  elif ! command -v ip > /dev/null || ! command -v tc > /dev/null; then
    why="ip or tc is missing (Debian package iproute2)"
  elif ! ip netns add zs-probe-$$ 2> /dev/null; then
    why="'ip netns add' failed (no permission to make network namespaces here)"
  else
    if ! ip link add zs-probe-$$ type bridge 2> /dev/null; then
      why="'ip link add ... type bridge' failed (no bridge support in this kernel)"
    elif ! ip link add zs-pv$$ type veth peer name eth0 netns zs-probe-$$ 2> /dev/null; then
      why="'ip link add ... type veth' into a namespace failed (no veth support here)"
    elif ! tc -n zs-probe-$$ qdisc add dev eth0 root tbf rate 1gbit burst 64kb latency 100ms 2> /dev/null; then
      why="'tc qdisc add ... tbf' failed (no sch_tbf in this kernel)"
    elif ! unshare --mount --uts --propagation private true 2> /dev/null; then
      why="'unshare --mount --uts' failed (no mount or UTS namespaces here)"
    fi
    ip link del zs-pv$$ 2> /dev/null || true
    ip link del zs-probe-$$ 2> /dev/null || true
    ip netns del zs-probe-$$
  fi
  [[ -z $why ]] && return 0
  echo "the cluster cannot be made here: $why" >&2
  exit 77
}

cmd_down() {
  cluster_args "$@"
  local h
  # Every namespace of cluster N, also hosts a failed `up` left without state.
  for h in $(ip netns list 2> /dev/null | awk '{print $1}' | grep -E "^zs$n-h[0-9]+$" || true); do
    ip netns pids "$h" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
    ip netns del "$h" 2> /dev/null || true
    rm -rf "/etc/netns/$h"
  done
  for h in $(ip -o link show 2> /dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^zs$n(-v[0-9]+)?$" || true); do
    ip link del "$h" 2> /dev/null || true
  done
  rm -rf "$state"
}

cmd_up() {
  (( $# == 2 )) || die "usage: up N HOSTS"
  check_number "hosts" "$2" 1 16
  cmd_can
  cmd_down "$1"
  cluster_args "$1"
  local count=$2 h other
  mkdir -p "$state"
  echo "$count" > "$state/hosts"
  ip link add "zs$n" type bridge
  ip link set "zs$n" up
  for ((h = 0; h < count; h++)); do
    local host=$(ns "$n" "$h")
    ip netns add "$host"
    mkdir -p "/etc/netns/$host"
    {
      printf '127.0.0.1 localhost\n127.0.1.1 %s\n::1 localhost\n' "$host"
      for ((other = 0; other < count; other++)); do
        (( other == h )) && continue
        printf '%s %s\n%s %s\n' "$(ipv4 "$n" "$other")" "$(ns "$n" "$other")" "$(ipv6 "$n" "$other")" "$(ns "$n" "$other")"
      done
    } > "/etc/netns/$host/hosts"
    # No name server: a lookup of an address without a name (the TCPStore logs its
    # clients' names) fails at once instead of waiting for an unreachable server.
    echo "nameserver 127.0.0.1" > "/etc/netns/$host/resolv.conf"
    ip link add "zs$n-v$h" type veth peer name eth0 netns "$host"
    ip link set "zs$n-v$h" master "zs$n" up
    ip -n "$host" link set lo up
    ip -n "$host" addr add "$(ipv4 "$n" "$h")/24" dev eth0
    ip -n "$host" addr add "$(ipv6 "$n" "$h")/64" dev eth0 nodad
    ip -n "$host" link set eth0 up
    ip -n "$host" route add default dev eth0
    ip -n "$host" -6 route add default dev eth0
  done
}

cmd_exec() {
  cluster_args "${1:-}" "${2:-}"
  shift 2
  local mounts=()
  while (( $# > 0 )) && [[ $1 != -- ]]; do
    [[ $1 == --disk && $# -ge 2 && $2 == *:* ]] || die "exec: expected --disk DIR:PATH or --, got '$1'"
    mounts+=("$2")
    shift 2
  done
  (( $# > 1 )) || die "usage: exec N I [--disk DIR:PATH]... -- CMD..."
  shift
  # A mount and UTS namespace of its own: the host's name, and its disks over the shared paths.
  local setup="hostname $(ns "$n" "$i")" m
  for m in ${mounts[@]+"${mounts[@]}"}; do
    setup+="; mkdir -p '${m#*:}' && mount --bind '${m%%:*}' '${m#*:}'"
  done
  exec ip netns exec "$(ns "$n" "$i")" unshare --mount --uts --propagation private \
    sh -c "$setup"' && exec "$@"' sh "$@"
}

cmd_shape() {
  (( $# == 3 )) || die "usage: shape N I RATE|off"
  cluster_args "$1" "$2"
  local host=$(ns "$n" "$i") link="zs$n-v$i" rate=$3
  tc qdisc del dev "$link" root 2> /dev/null || true
  tc -n "$host" qdisc del dev eth0 root 2> /dev/null || true
  [[ $rate == off ]] && return 0
  # A bucket of 10 ms at the rate (at least 64 KiB), a queue of at most 100 ms.
  local bits
  bits=$(tc_rate_bits "$rate")
  local burst=$(( bits / 8 / 100 > 65536 ? bits / 8 / 100 : 65536 ))
  tc qdisc add dev "$link" root tbf rate "$rate" burst "$burst" latency 100ms
  tc -n "$host" qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 100ms
}

tc_rate_bits() {  # 10mbit, 1gbit, 500kbit -> bits per second
  [[ $1 =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || die "shape: rate '$1' must read like 500kbit, 10mbit or 1gbit"
  local scale=1000
  [[ ${BASH_REMATCH[2]} == mbit ]] && scale=1000000
  [[ ${BASH_REMATCH[2]} == gbit ]] && scale=1000000000
  echo $(( BASH_REMATCH[1] * scale ))
}

cmd_link() {  # N I up|down
  cluster_args "$1" "$2"
  ip link set "zs$n-v$i" "$3"
}

cmd_kill() {
  cluster_args "$1" "$2"
  # The link first: a host that loses power sends nothing, not even the FIN or RST
  # its kernel would send for the processes killed next.
  ip link set "zs$n-v$i" down
  ip netns pids "$(ns "$n" "$i")" | xargs -r kill -9 2> /dev/null || true
}

case "${1:-}" in
  can) cmd_can ;;
  up) shift; cmd_up "$@" ;;
  down) shift; (( $# == 1 )) || die "usage: down N"; cmd_down "$1" ;;
  addr) shift; cluster_args "${1:-}" "${2:-}"; [[ ${3:-} == -6 ]] && ipv6 "$n" "$i" || ipv4 "$n" "$i" ;;
  name) shift; cluster_args "${1:-}" "${2:-}"; ns "$n" "$i" ;;
  exec) shift; cmd_exec "$@" ;;
  shape) shift; cmd_shape "$@" ;;
  cut) shift; cmd_link "${1:-}" "${2:-}" down ;;
  heal) shift; cmd_link "${1:-}" "${2:-}" up ;;
  kill) shift; cmd_kill "${1:-}" "${2:-}" ;;
  pids) shift; cluster_args "${1:-}" "${2:-}"; ip netns pids "$(ns "$n" "$i")" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
