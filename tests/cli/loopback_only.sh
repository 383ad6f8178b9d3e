#!/usr/bin/env bash
# A single-node job uses loopback only: while the quickstart trains, every TCP
# socket of the launcher and its ranks (from /proc/net/tcp and tcp6, matched
# by socket inode), listening or connected, is bound to 127.0.0.1 (the ranks
# meet through a file store; Gloo connects on loopback). A job given
# --master-port hosts a TCP rendezvous store on --master-addr only, so it too
# stays on loopback. The same check on a job given --master-addr 0.0.0.0 (a
# store on every address) finds the store, so the check can fail.
# Usage: loopback_only.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"

# Prints "STATE ADDRESS:PORT" (hex, as /proc shows them; state 0A = listening) of each TCP socket of
# the process tree under $1.
listening() {
  local inodes="" pid
  for pid in $1 $(pgrep -P "$1"); do
    inodes+=" $(ls -l /proc/$pid/fd 2>/dev/null | sed -n 's/.*socket:\[\([0-9]*\)\].*/\1/p' | tr '\n' ' ')"
  done
  for f in /proc/net/tcp /proc/net/tcp6; do
    awk -v want="$inodes" 'BEGIN { n = split(want, a, " "); for (i = 1; i <= n; i++) ino[a[i]] = 1 }
      NR > 1 && ($10 in ino) { print $4, $2 }' "$f"
  done
}

probe() {  # $1: name, rest: extra args; leaves the addresses in $work/$1.addrs
  local name=$1
  shift
  "$composer" run --config configs/quickstart.yaml --out "$work/$name" --set train.steps=100000 \
    --set train.log_every=1 "$@" >"$work/$name.log" 2>&1 &
  local launcher=$!
  for _ in $(seq 600); do grep -q "step 3" "$work/$name.log" && break; sleep 0.1; done
  grep -q "step 3" "$work/$name.log" || { kill -9 "$launcher"; echo "FAIL: $name never reached step 3"; cat "$work/$name.log"; exit 1; }
  listening "$launcher" >"$work/$name.addrs"
  kill -INT "$launcher"
  wait "$launcher"
}

# 127.0.0.1, as IPv4 or as IPv4-mapped IPv6 (::ffff:127.0.0.1, a v6 socket's view of it).
loopback=' \(0100007F\|0000000000000000FFFF00000100007F\):'

only_loopback() {  # $1: name
  [ -s "$work/$1.addrs" ] || { echo "FAIL: $1: found no socket at all (the ranks talk over Gloo)"; exit 1; }
  if grep -v "$loopback" "$work/$1.addrs" | grep -q .; then
    echo "FAIL: $1: a single-node job binds beyond loopback:"; cat "$work/$1.addrs"; exit 1
  fi
}

probe local
only_loopback local
echo "ok: $(wc -l <"$work/local.addrs") sockets ($(grep -c '^0A ' "$work/local.addrs") listening), all on 127.0.0.1"

port=$(/usr/bin/python3 "$(dirname "$0")/free_port.py")
probe tcp --master-port "$port"
hexport=$(printf '%04X' "$port")
grep -q "^0A 0100007F:$hexport\$" "$work/tcp.addrs" || { echo "FAIL: did not see the store listen on 127.0.0.1:$port"; cat "$work/tcp.addrs"; exit 1; }
only_loopback tcp
echo "ok: with --master-port $port: $(wc -l <"$work/tcp.addrs") sockets, the store's included, all on 127.0.0.1"

port=$(/usr/bin/python3 "$(dirname "$0")/free_port.py")
probe any --master-port "$port" --master-addr 0.0.0.0
hexport=$(printf '%04X' "$port")
store=$(grep "^0A .*:$hexport\$" "$work/any.addrs" | head -1)
[ -n "$store" ] || { echo "FAIL: did not see the store listen on port $port"; cat "$work/any.addrs"; exit 1; }
grep -v "$loopback" "$work/any.addrs" | grep -q . || { echo "FAIL: the check saw nothing beyond loopback: it cannot fail"; exit 1; }
echo "ok: with --master-addr 0.0.0.0 the store listens on ${store#0A } (not loopback), and the check sees it"
