#!/usr/bin/env bash
# composer and PyTorch Distributed Checkpoints (DCP), both ways (docs/checkpoints.md#pytorch-dcp):
#  - composer -> DCP: a checkpoint saved under tp 2 x fully_shard dp 2 (dcp_llama_tp2_fsdp2.yaml)
#    loads with torch.distributed.checkpoint.load and HuggingFaceStorageReader into the PyTorch
#    reference Llama and torch.optim.AdamW on 1 and on 3 processes (dcp_load.py): the parameters
#    equal `composer export`'s bit for bit, the AdamW moments and step the checkpoint's.
#  - DCP -> composer: PyTorch trains dcp_llama_fsdp2.yaml under FSDP2 over 2 ranks
#    (tools/reference/peer.py) and saves step 3 with dcp.save in torchtitan's layout; composer
#    resumes it under pp 2 x tp 2 (checkpoint.resume_from_dcp) and steps 4-6 give PyTorch's
#    losses and final parameters within the config's float32 tolerances; what torchtitan holds and
#    composer does not take is named; a folder that is not a DCP checkpoint is refused (exit 2).
# Usage: dcp.sh COMPOSER PYTHON WORK_DIR
set -u
composer=$1 python=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
rm -rf "$work" && mkdir -p "$work"
cd "$root"
fail() { echo "FAIL: $*"; exit 1; }

# composer -> DCP
c=$work/composer_tp2_fsdp2
"$composer" run --config tests/cli/dcp_llama_tp2_fsdp2.yaml --out "$c" --set checkpoint.resume=never >"$c.log" 2>&1 ||
  fail "the tp2 x fully_shard run: $(tail -3 "$c.log")"
step=$c/checkpoints/step-000005
"$composer" export --config tests/cli/dcp_llama_tp2_fsdp2.yaml --checkpoint "$step" --out "$c/export.safetensors" \
  >"$c.export.log" 2>&1 || fail "composer export: $(tail -3 "$c.export.log")"
for procs in 1 3; do
  "$python" "$here/dcp_load.py" --run-dir "$c" --step-dir "$step" --export "$c/export.safetensors" --procs $procs \
    2>"$work/dcp_load_$procs.err" | tail -1 | tee "$work/dcp_load_$procs.out"
  grep -q "^ok:" "$work/dcp_load_$procs.out" || fail "dcp.load on $procs process(es): $(tail -5 "$work/dcp_load_$procs.err")"
done

# DCP -> composer
a=$work/pytorch_fsdp2
"$composer" run --config tests/cli/dcp_llama_fsdp2.yaml --out "$a" --set checkpoint.resume=never >"$a.log" 2>&1 ||
  fail "the run that gives PyTorch its initial weights: $(tail -3 "$a.log")"
"$python" tools/reference/peer.py --run-dir "$a" --golden "$work/pytorch.json" --dcp-save "3:$work/torchtitan/step-3" \
  >"$work/peer.log" 2>&1 || fail "PyTorch's FSDP2 training: $(tail -5 "$work/peer.log")"
[ -f "$work/torchtitan/step-3/.metadata" ] || fail "dcp.save wrote no .metadata"
b=$work/composer_pp2_tp2
"$composer" run --config tests/cli/dcp_llama_pp2_tp2.yaml --out "$b" \
  --set checkpoint.resume_from_dcp="$work/torchtitan/step-3" >"$b.log" 2>&1 || fail "the resume: $(tail -3 "$b.log")"
for said in "is now $b/checkpoints/step-000003" "not taken: dataloader.dp_rank_0, dataloader.dp_rank_1" \
            "28 tensors renamed from torchtitan's names" \
            "not taken: lr_scheduler (last_epoch 3)" "not taken: optimizer.param_groups" "resuming from"; do
  grep -qF "$said" "$b.log" || fail "the resume's log does not say '$said'"
done
"$python" - "$work/pytorch.json" "$b" <<'PY' || fail "composer's resumed steps differ from PyTorch's"
import base64, json, struct, sys
import torch
from safetensors.torch import load_file
golden, run = json.load(open(sys.argv[1])), sys.argv[2]
chk = json.load(open(run + "/config.resolved.json"))["check"]
want = {r["step"]: r["loss"] for r in golden["steps"]}
got = {r["step"]: r["loss"] for r in map(json.loads, open(run + "/metrics.jsonl"))}
assert sorted(got) == [4, 5, 6], f"composer trained steps {sorted(got)}, not 4-6 after the imported step 3"
worst_loss = max(abs(got[s] - want[s]) / (chk["loss_atol"] + chk["loss_rtol"] * abs(want[s])) for s in got)
final, worst = load_file(run + "/final.safetensors"), 0.0
for p in golden["params"]:
    ref = torch.tensor(struct.unpack("<%dd" % (len(base64.b64decode(p["float64_base64"])) // 8),
                                     base64.b64decode(p["float64_base64"])), dtype=torch.float64)
    mine = final[p["name"]].double().flatten()
    if p["sampled"]:
        mine = mine[torch.arange(ref.numel()) * mine.numel() // ref.numel()]
    worst = max(worst, ((mine - ref).abs() / (chk["param_atol"] + chk["param_rtol"] * ref.abs())).max().item())
print("ok: composer under pp2 x tp2 from PyTorch's dcp.save of step 3: steps 4-6 losses %s (PyTorch %s), worst "
      "loss at %.3g%% and worst parameter at %.3g%% of the tolerances" %
      ([round(got[s], 6) for s in (4, 5, 6)], [round(want[s], 6) for s in (4, 5, 6)], 100 * worst_loss, 100 * worst))
sys.exit(0 if worst_loss <= 1 and worst <= 1 else 1)
PY

# A folder without .metadata: refused before any rank starts, naming the key.
"$composer" run --config tests/cli/dcp_llama_pp2_tp2.yaml --out "$work/refused" \
  --set checkpoint.resume_from_dcp="$c" >"$work/refused.log" 2>&1
rc=$?
[ $rc = 2 ] || fail "a folder that is not a DCP checkpoint exits $rc, not 2"
grep -q "checkpoint.resume_from_dcp.*not a PyTorch Distributed Checkpoint folder" "$work/refused.log" ||
  fail "the refusal does not name the key: $(cat "$work/refused.log")"
echo "ok: a folder without .metadata is refused (exit 2)"
