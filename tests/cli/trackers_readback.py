#!/usr/bin/env python3
"""A run's wandb and MLflow logs, read back with the libraries themselves, against its metrics.jsonl.

    trackers_readback.py RUN_DIR [--wandb] [--mlflow URI] [--status STATUS]

Every number of every RUN_DIR/metrics.jsonl line, by its TensorBoard tag (trackers_feed.py's
scalars_of: key, key/name, key/index), must be the tracker's value of that tag at that step (equal
after the JSON round trip, or within 1e-12 of it), and the tracker may hold no other tag or step.

--wandb: the offline run RUN_DIR/wandb/offline-run-* (the newest when there are several). Its
run-*.wandb transaction log is read twice: record by record here (the log's framing, every
record's CRC checked, each parsed as wandb's own wandb_internal_pb2.Record; the Python DataStore
reader older wandb releases had is gone) and by wandb's own reader, `wandb leet inspect --json`.
Both must give the same history. The run's config record must hold the resolved config's name and
composer_resumed_at, and the exit record exit code 0 for STATUS FINISHED (1 otherwise).

--mlflow URI: the newest run of the experiment named as the config, through MlflowClient(URI):
get_metric_history for every tag, the param train.steps equal to the config's, and the run's status
STATUS (FINISHED unless told).

Prints what it compared and exits 1 naming the first mismatches or missing values.
"""
import argparse
import glob
import json
import os
import struct
import subprocess
import sys
import urllib.parse
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trackers_feed import scalars_of  # noqa: E402 -- the one definition of the tags

problems = []


def equal(got, want):
    try:
        got = float(got)
    except (TypeError, ValueError):
        return False
    return got == want or abs(got - want) <= 1e-12 * abs(want)


def compare(source, got, want):
    """got, want: {step: {tag: value}}. Records each difference; prints the count compared."""
    wrong, missing, extra, n = [], [], [], 0
    for step, tags in want.items():
        have = got.get(step, {})
        for tag, value in tags.items():
            n += 1
            if tag not in have:
                missing.append((step, tag))
            elif not equal(have[tag], value):
                wrong.append((step, tag, have[tag], value))
        extra += [(step, tag) for tag in have if tag not in tags]
    extra += [(step, "*") for step in got if step not in want]
    print(f"{source}: {len(want)} steps, {n} values compared; {len(wrong)} differ, {len(missing)} missing, "
          f"{len(extra)} not in metrics.jsonl")
    for kind, items in (("differ (step, tag, tracker, metrics.jsonl)", wrong), ("missing (step, tag)", missing),
                        ("not in metrics.jsonl (step, tag)", extra)):
        if items:
            problems.append(f"{source}: {len(items)} values {kind}, first {items[:5]}")


LOG_HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
BLOCK, FULL, FIRST, MIDDLE, LAST = 32768, 1, 2, 3, 4


def transaction_records(path):
    """The records of a .wandb file: 32 KiB blocks of chunks (crc32 of type and data, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    if data[:7] != LOG_HEADER:
        raise ValueError(f"{path}: not a wandb transaction log (header {data[:7]!r})")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0 and crc == 0:  # zeros: the end of what was written
            break
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"{path}: bad chunk at byte {pos} (crc or length)")
        pos += 7 + length
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_check(run_dir, config, want, status):
    runs = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*")))
    if not runs:
        problems.append(f"wandb: no offline-run-* folder under {run_dir}/wandb")
        return
    logs = glob.glob(os.path.join(runs[-1], "run-*.wandb"))
    if len(logs) != 1:
        problems.append(f"wandb: {runs[-1]} holds {len(logs)} run-*.wandb files, not 1")
        return
    print(f"wandb: {logs[0]}" + (f" (the newest of {len(runs)} runs)" if len(runs) > 1 else ""))
    history, run_config, exit_codes, counts = {}, {}, [], {}
    try:
        records = list(transaction_records(logs[0]))
    except Exception as e:  # noqa: BLE001 -- a damaged log, named as a mismatch
        problems.append(f"wandb: {type(e).__name__}: {e}")
        records = []
    for record in records:
        kind = record.WhichOneof("record_type")
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[items.pop("_step", record.history.step.num)] = {
                k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "run":
            run_config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run_config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "exit":
            exit_codes.append(record.exit.exit_code)
    print(f"wandb: records {dict(sorted(counts.items()))}")
    compare("wandb (records parsed here)", history, want)
    if run_config.get("name") != config.get("name"):
        problems.append(f"wandb: config name {run_config.get('name')!r}, the config's {config.get('name')!r}")
    if "composer_resumed_at" not in run_config:
        problems.append("wandb: no composer_resumed_at in the run's config")
    print(f"wandb: config name {run_config.get('name')!r}, composer_resumed_at "
          f"{run_config.get('composer_resumed_at')!r}, {len(run_config)} top-level config keys; "
          f"exit codes {exit_codes}")
    if exit_codes != [0 if status == "FINISHED" else 1]:
        problems.append(f"wandb: exit records {exit_codes}, expected one exit code for {status}")

    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    out = subprocess.run([wandb_cli, "leet", "inspect", "--json", logs[0]], capture_output=True, text=True,
                         timeout=120)
    if out.returncode:
        problems.append(f"wandb leet inspect: exit {out.returncode}: {out.stderr.strip()[-500:]}")
        return
    theirs = {}
    for line in out.stdout.splitlines():
        r = json.loads(line)
        if r.get("type") == "history":
            item = r["history"]["item"]
            theirs[item.pop("_step")] = {k: v for k, v in item.items() if not k.startswith("_")}
    compare("wandb (wandb leet inspect)", theirs, want)


def mlflow_check(uri, config, want, status):
    if urllib.parse.urlparse(uri).scheme in ("", "file"):
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(config["name"])
    if experiment is None:
        problems.append(f"mlflow: no experiment {config['name']!r} at {uri}")
        return
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])
    if not runs:
        problems.append(f"mlflow: experiment {config['name']!r} has no runs")
        return
    run = runs[0]
    print(f"mlflow: run {run.info.run_id} ({run.info.run_name}, the newest of {len(runs)}) in experiment "
          f"{experiment.name} at {uri}; status {run.info.status}; {len(run.data.params)} params")
    tags = {tag for tags in want.values() for tag in tags} | set(run.data.metrics)
    got = {}
    for tag in sorted(tags):
        for m in client.get_metric_history(run.info.run_id, tag):
            if m.step in got and tag in got[m.step]:
                problems.append(f"mlflow: {tag} logged twice at step {m.step}")
            got.setdefault(m.step, {})[tag] = m.value
    compare("mlflow", got, want)
    steps = run.data.params.get("train.steps")
    if steps != json.dumps(config["train"]["steps"]):
        problems.append(f"mlflow: param train.steps {steps!r}, the config's {config['train']['steps']!r}")
    print(f"mlflow: param train.steps {steps!r} (config {config['train']['steps']!r}); "
          f"tag composer_resumed_at {run.data.tags.get('composer_resumed_at')!r}")
    if run.data.tags.get("composer_resumed_at") is None:
        problems.append("mlflow: no tag composer_resumed_at")
    if run.info.status != status:
        problems.append(f"mlflow: status {run.info.status}, expected {status}")
    artifacts = [f.path for f in client.list_artifacts(run.info.run_id)]
    if "config.resolved.json" not in artifacts:
        problems.append(f"mlflow: artifacts {artifacts}, no config.resolved.json")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--wandb", action="store_true")
    p.add_argument("--mlflow", metavar="URI")
    p.add_argument("--status", default="FINISHED")
    args = p.parse_args()
    lines = [json.loads(l) for l in open(os.path.join(args.run_dir, "metrics.jsonl")) if l.strip()]
    config = json.load(open(os.path.join(args.run_dir, "config.resolved.json")))
    want = {}
    for line in lines:
        want[line["step"]] = dict(scalars_of(line))
    print(f"metrics.jsonl: {len(lines)} steps, {sum(len(v) for v in want.values())} numbers")
    if not (args.wandb or args.mlflow):
        problems.append("nothing to check: give --wandb, --mlflow URI or both")
    if args.wandb:
        wandb_check(args.run_dir, config, want, args.status)
    if args.mlflow:
        mlflow_check(args.mlflow, config, want, args.status)
    for line in problems:
        print(f"MISMATCH {line}")
    print("trackers readback: " + ("FAILED" if problems else "ok"))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
