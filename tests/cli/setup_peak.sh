#!/usr/bin/env bash
# Ranks build only what they hold: on a fully_shard dp 4 run and a 4-stage
# pipeline run, every rank's counted tensor peak at setup (memory.rank<r>.json's
# setup_peak_bytes: building the model, the transforms, init weights) stays
# well below the whole model's bytes, and init.safetensors is byte for byte
# the single-device run's.
# Usage: setup_peak.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
run() {  # NAME CONFIG [--set ...]
  local name=$1 cfg=$2
  shift 2
  "$composer" run --config "$cfg" --set train.steps=1 --set checkpoint.resume=never "$@" --out "$work/$name" \
    >"$work/$name.log" 2>&1 || { cat "$work/$name.log"; echo "FAIL: $name failed"; exit 1; }
}
for cfg in fsdp_dp4 pp4_1f1b; do
  run "$cfg" "configs/bench/$cfg.yaml"
  # The same experiment on one device: the config without its mesh and parallelize sections.
  sed -e '/^mesh:/d' -e '/^parallelize:/,/^train:/{/^train:/!d}' -e '/^  microbatches:/d' \
    "configs/bench/$cfg.yaml" >"$work/${cfg}_single.yaml"
  run "${cfg}_single" "$work/${cfg}_single.yaml"
  cmp "$work/$cfg/init.safetensors" "$work/${cfg}_single/init.safetensors" ||
    { echo "FAIL: $cfg: init.safetensors differs from the single-device run's"; exit 1; }
done
exec /usr/bin/python3 - "$work" <<'PY'
import glob, json, os, sys
work, failed = sys.argv[1], False
for cfg in ("fsdp_dp4", "pp4_1f1b"):
    model = os.path.getsize(f"{work}/{cfg}/init.safetensors")  # float32 weights (and a short header)
    files = sorted(glob.glob(f"{work}/{cfg}/memory.rank*.json"))
    if len(files) != 4:
        print(f"FAIL: {cfg}: {len(files)} memory.rank*.json files, not 4"); failed = True
    for f in files:
        m = json.load(open(f))
        ok = m["setup_peak_bytes"] < model / 2
        failed = failed or not ok
        print("%s: %s rank %d: setup peak %.1f MiB counted (%.1f MiB RSS) of a %.1f MiB model" %
              ("ok" if ok else "FAIL", cfg, m["rank"], m["setup_peak_bytes"] / 2**20, m["setup_peak_rss_mb"],
               model / 2**20))
sys.exit(1 if failed else 0)
PY
