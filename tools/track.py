#!/usr/bin/env python3
"""Weights & Biases and MLflow logging for a composer run: the sidecar rank 0 starts.

    track.py --out-dir OUT --config OUT/config.resolved.json [--wandb JSON] [--mlflow JSON]
             [--resumed-at N]

composer starts this program when the config sets metrics.wandb or metrics.mlflow, and writes to
its stdin the scalars it gives TensorBoard, one JSON object a line:

    {"step": 12, "scalars": [["loss", 1.23], ["comm_bytes_by_group/dp", 776.0], ...]}

The tags are TensorBoard's: the keys of the step's metrics.jsonl line, a numeric object's members as
key/name and a numeric array's elements as key/index. A null value (how a JSON writer spells a
non-finite double) is logged as NaN. A last line {"end": "FINISHED"} or {"end": "FAILED"} may come
before the end of input; without it the run is FINISHED if any step came, otherwise it was KILLED
(MLflow's status; wandb's run finishes with exit code 1).

--wandb {"project", "entity", "name", "mode"}: wandb.init(project, entity (wandb's default when
""), name (the config's "name" when ""), mode ("online", "offline" or "disabled"), dir=OUT,
config=the resolved config), without console capture or wandb's own terminal output and with a
30 s init_timeout; then run.log(scalars, step=N) for each line and run.finish at the end. An
offline run is the folder OUT/wandb/offline-run-*, which `wandb sync` uploads later.

--mlflow {"tracking_uri", "experiment"}: MlflowClient(tracking_uri, or file://OUT/mlruns when ""),
the experiment (the config's "name" when "") made when it is missing, and one run named after the
config's "name". The run's params are the resolved config flattened to dotted keys
(train.optimizer.lr), each value as the config file spells it (a list as JSON); a value longer than
MLflow allows is cut and says so. The file itself is the run's artifact config.resolved.json. The
metrics go out with log_batch at each line's step, timestamped when the line arrived (several lines
to a call once MLflow has fallen behind), and the run's status is set at the end. A file: (or plain
path) tracking URI sets MLFLOW_ALLOW_FILE_STORE=true, which MLflow 3.13 and later need for the file
store. Unless the environment says otherwise, HTTP requests time out after 10 s and are retried
twice. mlflow-skinny has no database stores (sqlite:): use a file: URI or a tracking server.
A config key or a tag MLflow refuses as a name, and a failed artifact upload, are each named in a
note on stderr and left out; the rest goes on.

--resumed-at N (the run resumed after step N; 0 for a fresh run) is the wandb config entry and the
MLflow tag composer_resumed_at.

Training never waits for, or fails because of, a tracker. stdin is read on its own thread into a
queue for each tracker, so the writer's pipe is drained however slow a tracker is (wandb.init
retrying an unreachable server, an MLflow server that does not answer); fd 0 is then /dev/null, so
no library can read the stream. A tracker that fails (no network, a bad URI, an exception anywhere
in the library) prints one line on stderr,

    composer-track: wandb: <the error>; no more logging to wandb, training goes on

and is dropped while the other goes on; the program still reads its input to the end and exits 0.
At the start it prints on stdout where each tracker logs, and at the end how many steps each
logged. After the end of input the trackers have 50 s to finish and the libraries' exit handlers
5 s more (composer waits 60 s for this program to exit); past that the program says so and exits 0,
leaving what they had not sent (wandb keeps its local copy in OUT/wandb for `wandb sync`). SIGINT
is ignored: a Ctrl-C reaches composer too, which ends the input. WANDB_ERROR_REPORTING defaults to
false here: wandb's own error telemetry, sent at exit, would hold the exit up to 10 s more when
its server is unreachable.
"""
import argparse
import atexit
import json
import os
import queue
import signal
import sys
import threading
import time
import urllib.parse

FINISH_WAIT_S = 50.0  # after the end of input; composer waits 60 s for the exit
EXIT_WAIT_S = 5.0     # after that, for the libraries' exit handlers
WANDB_INIT_TIMEOUT_S = 30.0
MLFLOW_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                   "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
_import_lock = threading.Lock()  # the libraries import one at a time, whichever thread asks first
_print_lock = threading.Lock()


def say(line, stream=None):
    """One line on stdout (or stream), never raising: a closed pipe must not stop the logging."""
    with _print_lock:
        try:
            print(line, file=stream or sys.stdout, flush=True)
        except (OSError, ValueError):
            pass


def one_line(e):
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= 600 else text[:600] + " ..."


class Tracker(threading.Thread):
    """One tracker's thread: start, log each queued step, finish; its first failure ends it."""

    label = ""

    def __init__(self, opts, ctx):
        super().__init__(name=f"composer-track-{self.label}", daemon=True)
        self.opts, self.ctx = opts, ctx
        self.inbox = queue.Queue()
        self.failed = self.disabled = False
        self.logged = 0
        self.status = None

    def fail(self, e):
        if not self.failed:
            self.failed = True
            say(f"composer-track: {self.label}: {one_line(e)}; no more logging to {self.label}, "
                f"training goes on", sys.stderr)

    def run(self):
        try:
            self.begin()
        except BaseException as e:  # noqa: BLE001 -- any failure of the library only ends this tracker
            self.fail(e)
        while True:
            batch = [self.inbox.get()]
            while batch[-1][0] == "step" and not self.inbox.empty() and len(batch) < self.batch_steps():
                batch.append(self.inbox.get())
            steps = [item for item in batch if item[0] == "step"]
            if steps and not self.failed:
                try:
                    self.log(steps)
                    self.logged += len(steps)
                except BaseException as e:  # noqa: BLE001
                    self.fail(e)
            if batch[-1][0] == "end":
                self.status = batch[-1][1]
                break
        if not self.failed:
            try:
                self.end(self.status)
            except BaseException as e:  # noqa: BLE001
                self.fail(e)
        if self.disabled:
            say(f"composer-track: {self.label}: disabled, {self.logged} steps not logged")
        else:
            say(f"composer-track: {self.label}: {self.logged} steps logged"
                + (f", run {self.status}" if not self.failed else " (stopped at the failure above)"))

    def batch_steps(self):
        return 1


class Wandb(Tracker):
    label = "wandb"

    def begin(self):
        with _import_lock:
            import wandb
        o = self.opts
        settings = wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S, console="off", silent=True)
        self.run_ = wandb.init(project=o.get("project") or None, entity=o.get("entity") or None,
                               name=o.get("name") or self.ctx["name"], mode=o.get("mode") or "online",
                               dir=self.ctx["out"], settings=settings,
                               config={**self.ctx["config"], "composer_resumed_at": self.ctx["resumed_at"]})
        mode = o.get("mode") or "online"
        if mode == "disabled":
            self.disabled = True
            say("composer-track: wandb disabled (mode disabled); nothing is logged")
            return
        where = self.run_.settings.sync_dir
        if mode == "offline":
            say(f"composer-track: wandb offline run in {where}; upload with: wandb sync {where}")
        else:
            say(f"composer-track: wandb run {self.run_.url} (local copy in {where})")

    def log(self, steps):
        for _, step, scalars, _ in steps:
            self.run_.log(dict(scalars), step=step)

    def end(self, status):
        self.run_.finish(exit_code=0 if status == "FINISHED" else 1)


class Mlflow(Tracker):
    label = "mlflow"
    steps_per_batch = 1

    def batch_steps(self):  # a tracker that fell behind catches up in batches of whole steps
        return self.steps_per_batch

    def begin(self):
        with _import_lock:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
            from mlflow.utils import validation
        self.Metric, self.validation = Metric, validation
        ctx = self.ctx
        uri = self.opts.get("tracking_uri") or "file://" + os.path.join(ctx["out"], "mlruns")
        name = self.opts.get("experiment") or ctx["name"]
        self.client = client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                client.create_experiment(name)
            except Exception:  # noqa: BLE001 -- another run may have made it meanwhile
                pass
            experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise RuntimeError(f"experiment {name!r} is missing and could not be made")
        run = client.create_run(experiment.experiment_id, run_name=ctx["name"],
                                tags={"composer_resumed_at": str(ctx["resumed_at"])})
        self.run_id = run.info.run_id
        say(f"composer-track: mlflow run {self.run_id} in experiment {name} at {uri}")
        params, refused = [], []
        for key, value in flatten_config(ctx["config"], validation.MAX_PARAM_VAL_LENGTH):
            try:
                validation._validate_param_name(key)
                if len(key) > validation.MAX_ENTITY_KEY_LENGTH:
                    raise ValueError(key)
                params.append(Param(key, value))
            except Exception:  # noqa: BLE001 -- a name MLflow refuses
                refused.append(key)
        if refused:
            say(f"composer-track: mlflow: config keys MLflow refuses as param names, in the artifact "
                f"config.resolved.json only: {', '.join(refused)}", sys.stderr)
        per_batch = validation.MAX_PARAMS_TAGS_PER_BATCH
        for i in range(0, len(params), per_batch):
            client.log_batch(self.run_id, params=params[i:i + per_batch])
        self.refused_metrics = set()
        try:
            client.log_artifact(self.run_id, ctx["config_path"])
        except Exception as e:  # noqa: BLE001 -- the params hold the config; the metrics go on
            say(f"composer-track: mlflow: the config artifact: {one_line(e)}; the metrics go on", sys.stderr)

    def metrics(self, step, scalars, timestamp):
        for key, value in scalars:
            if key in self.refused_metrics:
                continue
            try:
                self.validation._validate_metric_name(key)
            except Exception:  # noqa: BLE001
                self.refused_metrics.add(key)
                say(f"composer-track: mlflow: {key!r} is not a metric name MLflow accepts; "
                    f"it is not logged to mlflow", sys.stderr)
                continue
            yield self.Metric(key, value, timestamp, step)

    def log(self, steps):
        metrics = [m for _, step, scalars, ts in steps for m in self.metrics(step, scalars, ts)]
        per_batch = self.validation.MAX_METRICS_PER_BATCH
        for i in range(0, len(metrics), per_batch):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + per_batch])
        widest = max(len(scalars) for _, _, scalars, _ in steps)
        self.steps_per_batch = max(1, per_batch // max(1, widest))

    def end(self, status):
        self.client.set_terminated(self.run_id, status)


def flatten_config(config, limit, prefix=""):
    """(dotted key, value as the config file spells it), a value over limit characters cut."""
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from flatten_config(value, limit, path + ".")
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > limit:
            note = f" ... [cut: {len(text)} characters; the whole value is in config.resolved.json]"
            text = text[:limit - len(note)] + note
        yield path, text


def scalar(value):
    if isinstance(value, (bool, str)):
        raise ValueError(f"{value!r} is not a number")
    return float("nan") if value is None else float(value)


def read_input(trackers):
    """Reads stdin to its end into every tracker's queue; the end status goes last."""
    fd = os.dup(0)  # the protocol's stream, away from fd 0 so no library can read it
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(os.devnull)
    steps, end, bad, number = 0, None, 0, 0
    with os.fdopen(fd, "rb", buffering=1 << 16) as stream:
        for raw in stream:
            number += 1
            if end is not None or not raw.strip():
                continue
            try:
                line = json.loads(raw)
                if "end" in line:
                    end = str(line["end"])
                    continue
                item = ("step", int(line["step"]), [(str(k), scalar(v)) for k, v in line["scalars"]],
                        int(time.time() * 1000))
            except Exception as e:  # noqa: BLE001 -- a line composer did not mean; the rest go on
                if not bad:
                    say(f"composer-track: input line {number} is not a step: {one_line(e)}; skipped "
                        f"(and any more like it)", sys.stderr)
                bad += 1
                continue
            steps += 1
            for t in trackers:
                t.inbox.put(item)
    status = end if end in ("FINISHED", "FAILED") else "FINISHED" if steps else "KILLED"
    for t in trackers:
        t.inbox.put(("end", status))
    return steps, bad


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--wandb", metavar="JSON")
    p.add_argument("--mlflow", metavar="JSON")
    p.add_argument("--resumed-at", type=int, default=0)
    args = p.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with open(args.config) as f:
            config = json.load(f)
    except Exception as e:  # noqa: BLE001 -- the trackers log the metrics without it
        say(f"composer-track: the config {args.config}: {one_line(e)}; logged without it", sys.stderr)
        config = {}
    out = os.path.abspath(args.out_dir)
    ctx = {"out": out, "config": config, "config_path": os.path.abspath(args.config),
           "name": str(config.get("name") or os.path.basename(out)), "resumed_at": args.resumed_at}
    for flag in ("wandb", "mlflow"):  # a bad option drops its tracker, not the other
        text = getattr(args, flag)
        try:
            opts = None if text is None else json.loads(text)
            if opts is not None and not isinstance(opts, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            say(f"composer-track: {flag}: --{flag} {text!r}: {one_line(e)}; no logging to {flag}, "
                f"training goes on", sys.stderr)
            opts = None
        setattr(args, flag, opts)
    trackers = []
    if args.wandb is not None:
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # its SDK telemetry delays the exit
        trackers.append(Wandb(args.wandb, ctx))
    if args.mlflow is not None:
        uri = args.mlflow.get("tracking_uri") or ""
        if urllib.parse.urlparse(uri).scheme in ("", "file"):
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        for key, value in MLFLOW_HTTP_ENV.items():
            os.environ.setdefault(key, value)
        trackers.append(Mlflow(args.mlflow, ctx))
    for t in trackers:
        t.start()
    steps, bad = read_input(trackers)
    deadline = time.monotonic() + FINISH_WAIT_S
    for t in trackers:
        t.join(max(0.0, deadline - time.monotonic()))
    late = [f"{t.label} at {t.logged} of {steps} steps" for t in trackers if t.is_alive()]
    say(f"composer-track: {steps} steps read" + (f", {bad} lines skipped" if bad else ""))
    if late:
        say(f"composer-track: not finished {FINISH_WAIT_S:.0f} s after the end of input: "
            f"{', '.join(late)}; exiting, training goes on", sys.stderr)
    # The libraries' exit handlers (wandb's service teardown) under the same kind of deadline.
    cleanup = threading.Thread(target=atexit._run_exitfuncs, daemon=True)
    cleanup.start()
    cleanup.join(max(1.0, deadline + EXIT_WAIT_S - time.monotonic()))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # noqa: BLE001 -- never a non-zero exit for composer to report
        if not isinstance(e, SystemExit) or e.code:
            say(f"composer-track: {one_line(e)}; no tracking, training goes on", sys.stderr)
        sys.exit(0)
