# Two hosts made of network namespaces on this machine (root and iproute2's `ip`),
# sourced by the multi-host benches: `make_hosts NS` makes NS-h0 and NS-h1, each with
# its own loopback and an eth0 (10.77.0.1 and 10.77.0.2) on a bridge in NS-sw, and
# deletes them when the script exits.
make_hosts() {
  local ns="$1" i
  trap "for n in h0 h1 sw; do ip netns del \"$ns-\$n\" 2>/dev/null || true; done" EXIT
  ip netns add "$ns-sw"
  ip -n "$ns-sw" link add br0 type bridge
  ip -n "$ns-sw" link set br0 up
  for i in 0 1; do
    ip netns add "$ns-h$i"
    ip -n "$ns-h$i" link set lo up
    ip -n "$ns-h$i" link add eth0 type veth peer name "p$i" netns "$ns-sw"
    ip -n "$ns-sw" link set "p$i" master br0
    ip -n "$ns-sw" link set "p$i" up
    ip -n "$ns-h$i" addr add "10.77.0.$((i + 1))/24" dev eth0
    ip -n "$ns-h$i" link set eth0 up
  done
}
