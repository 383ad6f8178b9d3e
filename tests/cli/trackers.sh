#!/usr/bin/env bash
# metrics.wandb and metrics.mlflow (docs/debugging.md#weights--biases-and-mlflow):
#  - a run under fully_shard dp 2 logs to an offline wandb run and an MLflow file store; the
#    wandb library and mlflow's client read back every step's scalars equal to metrics.jsonl's,
#    and the resolved config as the run's config (tests/cli/trackers_readback.py);
#  - with no network (wandb online without a key against an unreachable server, an MLflow server
#    that refuses connections) training finishes, exit 0, metrics.jsonl whole, and each tracker
#    warns once.
# Usage: trackers.sh COMPOSER PYTHON WORK_DIR
set -u
composer=$1 python=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
rm -rf "$work" && mkdir -p "$work"
cd "$root"
fail() { echo "FAIL: $*"; exit 1; }
cfg=configs/parity/fsdp_transformer_dp2.yaml

run=$work/offline
"$composer" run --config $cfg --out "$run" --set checkpoint.enabled=false --set 'metrics.wandb={mode: offline}' \
  --set "metrics.mlflow={tracking_uri: file://$run/mlruns}" >"$run.log" 2>&1 || fail "the run: $(tail -3 "$run.log")"
"$python" "$here/trackers_readback.py" "$run" --wandb --mlflow "file://$run/mlruns" --status FINISHED | tee "$run.readback" |
  tail -1
grep -q "^trackers readback: ok" "$run.readback" || fail "read back: $(tail -5 "$run.readback")"

run=$work/no_network
env -u WANDB_API_KEY WANDB_BASE_URL=http://127.0.0.1:9 HOME="$work" "$composer" run --config $cfg --out "$run" \
  --set checkpoint.enabled=false --set 'metrics.wandb={mode: online}' \
  --set 'metrics.mlflow={tracking_uri: "http://127.0.0.1:9"}' >"$run.log" 2>&1 ||
  fail "a run whose trackers have no network failed: $(tail -3 "$run.log")"
steps=$("$python" -c "import yaml,sys; print(yaml.safe_load(open('$cfg'))['train']['steps'])")
[ "$(wc -l <"$run/metrics.jsonl")" = "$steps" ] || fail "metrics.jsonl has not every step"
for t in wandb mlflow; do
  n=$(grep -c "composer-track: $t: .*no more logging to $t, training goes on" "$run.log")
  [ "$n" = 1 ] || fail "$t warned $n times without a network, not once: $(grep "composer-track: $t" "$run.log")"
done
echo "ok: without a network training finished ($steps steps) and each tracker warned once"
