#!/usr/bin/env bash
# Proves that CONFIG's golden check can fail: with each injected training error
# (debug.inject: grad_x2, a factor-2 gradient scale; microbatch_off_by_one, one
# microbatch of the global batch read from the wrong index) `composer check`
# must exit 1, and both of its checks must see it: the per-step losses and
# gradient norms, and the final parameters. The same check without injection
# passing is golden.<name>, this test's fixture, which also makes GOLDEN when
# the config's golden is made at test time. FAULTS, when given, replace the two
# (packed documents' plans also take no_document_mask: the mask dropped).
# Usage: fault_injection.sh COMPOSER CONFIG WORK_DIR [GOLDEN|-] [FAULTS...]  (-: the config's own golden)
set -u
composer=$1 cfg=$2 work=$3 golden=${4:-}
if [ "$golden" = - ]; then golden=; fi
faults=(grad_x2 microbatch_off_by_one)
if [ $# -gt 4 ]; then faults=("${@:5}"); fi
sets=()
if [ -n "$golden" ]; then sets=(--set "check.golden=$golden"); fi
status=0
for fault in "${faults[@]}"; do
  out=$("$composer" check --config "$cfg" --out "$work/$fault" --set "debug.inject=$fault" "${sets[@]}" 2>&1)
  code=$?
  failed=$(echo "$out" | grep -o 'check failed with .*' | head -1)
  # ... and the message ends with the composer diff command that localises it.
  if [ "$code" -eq 1 ] && echo "$failed" | grep -Eq '\([1-9][0-9]* in per-step.*, [1-9][0-9]* in final' &&
     echo "$failed" | grep -Fq "composer diff --config $cfg --set debug.inject=$fault"; then
    echo "ok: $fault: $failed"
  else
    echo "FAIL: $fault: exit $code; expected 1 with mismatches in both the per-step values and the parameters, and the composer diff command"
    echo "$out" | tail -5
    status=1
  fi
done
exit $status
