#!/usr/bin/env bash
# Runs a command and checks its exit code and that its stderr matches a regex
# (one clear message: no stack trace, no abort). Usage:
#   expect.sh EXIT_CODE REGEX command args...
set -u
want=$1 regex=$2
shift 2
err=$(mktemp)
"$@" >/dev/null 2>"$err"
code=$?
msg=$(cat "$err")
rm -f "$err"
fail() { echo "FAIL: $*"; echo "stderr was:"; echo "$msg"; exit 1; }
[ "$code" -eq "$want" ] || fail "exit code $code, expected $want"
echo "$msg" | grep -Eq -- "$regex" || fail "stderr does not match /$regex/"
echo "$msg" | grep -Eq 'terminate called|Exception raised from|frame #[0-9]' && fail "stderr shows a crash or stack trace"
[ "$(echo "$msg" | grep -c .)" -le 3 ] || fail "more than three lines of error output"
echo "ok: exit $code: $msg"
