#!/usr/bin/env bash
# Buffers in checkpoints follow their placement as parameters do: the routers'
# expert bias of moe_llama_balance.yaml (bias_update_rate > 0, so it moves
# every step) under a pipeline with expert_parallel, expert_parallel,
# tensor_parallel, context_parallel and fully_shard. Under each plan a run
# saves step 3 (the bias returns to zero at even steps of this run); a new process resumes from it and ends bit for bit as the
# uninterrupted run; and `composer export` of that checkpoint holds every
# block's bias as one device trained it, including the blocks rank 0 does not
# hold.
# Usage: checkpoint_buffers.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
. "$(dirname "$0")/checkpoint_common.sh"

cfg=configs/parity/moe_llama_balance.yaml
# Without the load-balancing loss, which context_parallel refuses; the bias moves all the same.
steps=(--set train.steps=5 --set checkpoint.interval=3 --set checkpoint.keep_latest_k=3 --set model.args.aux_loss_coeff=0.0)
# plan NAME: the --set arguments of plan NAME, in the array `args`.
plan() {
  local shape names transforms
  case $1 in
    pp2_ep2) shape='[2, 2]' names='[pp, ep]'
      transforms='[{pipeline: {mesh_dim: pp, schedule: 1f1b, microbatches: 2}}, {expert_parallel: {mesh_dim: ep}}]' ;;
    ep2) shape='[2]' names='[ep]' transforms='[{expert_parallel: {mesh_dim: ep}}]' ;;
    tp2) shape='[2]' names='[tp]' transforms='[{tensor_parallel: {mesh_dim: tp}}]' ;;
    cp2) shape='[2]' names='[cp]' transforms='[{context_parallel: {mesh_dim: cp}}]' ;;
    fsdp2) shape='[2]' names='[dp]' transforms='[{fully_shard: {mesh_dim: dp}}]' ;;
  esac
  args=(--set "mesh.shape=$shape" --set "mesh.names=$names" --set "parallelize=$transforms")
}

# export_bias NAME: the step-3 checkpoint of run NAME exported; prints nothing, fails on error.
export_bias() {
  "$composer" export --config "$cfg" "${steps[@]}" --checkpoint "$work/$1/checkpoints/step-000003" --out "$work/$1.step3.safetensors" \
    >"$work/$1.export.log" 2>&1 || fail "export of $1 step 3: $(tail -3 "$work/$1.export.log")"
}

run "$work/single" "$cfg" "${steps[@]}"
export_bias single
for name in pp2_ep2 ep2 tp2 cp2 fsdp2; do
  plan "$name"
  run "$work/$name" "$cfg" "${steps[@]}" "${args[@]}"
  run "$work/$name.resumed" "$cfg" "${steps[@]}" "${args[@]}" \
    --set checkpoint.resume="$work/$name/checkpoints/step-000003"
  grep -q "resuming from $work/$name/checkpoints/step-000003" "$work/$name.resumed.log" || fail "$name did not resume"
  same_run "$work/$name" "$work/$name.resumed" 4
  echo "ok: $name resumed from step 3 ends bit for bit as the uninterrupted run"
  export_bias "$name"
  /usr/bin/python3 - "$work/single.step3.safetensors" "$work/$name.step3.safetensors" <<'PY' || fail "$name's saved expert bias differs from one device's"
import json, struct, sys
def tensors(p):
    raw = open(p, "rb").read(); n = struct.unpack("<Q", raw[:8])[0]; h = json.loads(raw[8:8 + n]); d = raw[8 + n:]
    return {k: struct.unpack("<%df" % ((v["data_offsets"][1] - v["data_offsets"][0]) // 4), d[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in h.items() if k.endswith("expert_bias")}
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
assert len(a) == 2 and a.keys() == b.keys(), (sorted(a), sorted(b))
assert all(any(x != 0 for x in v) for v in a.values()), "one device's bias did not move by step 3"
worst = max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))
print("%s: max expert bias difference from one device %.3g" % (sys.argv[2], worst))
sys.exit(0 if worst <= 1e-6 else 1)
PY
  echo "ok: $name's step-3 checkpoint holds every block's expert bias as one device's"
done
