"""Start-up time of the three services as ``make run`` starts them, cold and warm.

Cold: an empty model cache (``SPECSERVE_CACHE_DIR``), so the verifier and the
coordinator convert the packaged GGUF and the verifier measures its cost
curve. Warm: the same cache again, so both are read from it. Each run starts
the verifier, the drafter and the coordinator as child processes on free
ports and times, from the moment they are spawned, when each answers SERVING
on grpc.health.v1 (the coordinator waits for the verifier's VerifierInfo, so
it comes last). The verifier's own log gives where its time went.

    python -m bench.startup [--warm-runs 2] [--out-dir bench/out/startup]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specserve.local_cluster import LocalCluster, free_port, wait_serving
from specserve.model_loading import DEFAULT_MODEL

from . import machine
from .target import progress

# Log lines of the verifier worth quoting in the report: what it loaded, packed, measured or read from the cache.
_NOTABLE = re.compile(r"converting|cost curve|engine step|captured|listening", re.IGNORECASE)
_LEVEL = re.compile(r" (?:DEBUG|INFO|WARNING|ERROR) ")  # what precedes it is the timestamp and the process
_PATH = re.compile(r"/\S*/(?=[^/\s]+\.gguf)")  # where the GGUF lies on this machine


def start_once(cache: Path, log_dir: Path, timeout_s: float, model: str) -> dict[str, Any]:
    """Start the three services once with ``cache`` as the model cache; seconds until each is SERVING."""
    os.environ["SPECSERVE_CACHE_DIR"] = str(cache)
    cluster = LocalCluster(
        coordinator_port=free_port(),
        drafter_port=free_port(),
        verifier_port=free_port(),
        model=model,
        log_dir=log_dir,
    )
    started = time.monotonic()
    failure: list[BaseException] = []

    def start() -> None:
        try:
            cluster.start(timeout_s)
        except BaseException as exc:  # reported below; start() has stopped what it started
            failure.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    ready: dict[str, float] = {}

    def watch(name: str, address: str) -> None:
        try:
            wait_serving(address, timeout_s)
        except (TimeoutError, RuntimeError):  # not recorded: reported below
            return
        ready[name] = round(time.monotonic() - started, 1)

    watchers = [
        threading.Thread(target=watch, args=(name, address), daemon=True)
        for name, address in (
            ("verifier", cluster.verifier_address),
            ("drafter", cluster.drafter_address),
            ("coordinator", cluster.coordinator_address),
        )
    ]
    try:
        for watcher in watchers:
            watcher.start()
        thread.join(timeout_s)
        for watcher in watchers:
            watcher.join(10.0)  # each checks every 0.3 s, a check waiting up to 2 s
        if failure or thread.is_alive() or len(ready) < len(watchers):
            raise RuntimeError(f"the cluster did not start: {failure[0] if failure else 'timed out'}")
    finally:
        cluster.stop()
    log = (log_dir / "verifier.log").read_text(errors="replace") if (log_dir / "verifier.log").exists() else ""
    notable = [
        _PATH.sub("", _LEVEL.split(line, maxsplit=1)[-1].replace(str(cache), "<cache>"))[:200]
        for line in log.splitlines()
        if _LEVEL.search(line) and _NOTABLE.search(line)  # logger lines only, no progress bars
    ]
    return {"ready_s": ready, "verifier_log": notable}


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    host = meta["machine"]
    lines = [
        "# Start-up time",
        "",
        f"Run {meta['started_at']}, commit `{host['git_commit']}`{' (dirty)' if host['git_dirty'] else ''}. "
        f"Machine: {host['cpu_model']}, {host['cpus_available']} CPUs available, flags "
        f"{', '.join(host.get('cpu_flags') or [])}; torch {host['torch_version']}. Model {meta['model']}. "
        "Seconds from spawning the verifier, drafter and coordinator (as `make run` does) until each answers "
        "SERVING; cold: an empty model cache (GGUF converted, cost curve measured), warm: the same cache again.",
        "",
        "| run | verifier s | drafter s | coordinator (all serving) s |",
        "|---|---|---|---|",
    ]
    for run in runs:
        ready = run["ready_s"]
        lines.append(f"| {run['name']} | {ready['verifier']} | {ready['drafter']} | {ready['coordinator']} |")
    for run in runs:
        lines += ["", f"Verifier log, {run['name']}:", "", *(f"- `{line}`" for line in run["verifier_log"])]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.startup", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--warm-runs", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/startup"))
    args = parser.parse_args(argv)
    if args.warm_runs < 1:
        parser.error("--warm-runs must be at least 1")
    meta: dict[str, Any] = {
        "started_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": args.model,
        "machine": machine.describe(),
    }
    runs: list[dict[str, Any]] = []
    shutil.rmtree(args.out_dir / "tmp", ignore_errors=True)  # the services append to their logs
    with tempfile.TemporaryDirectory(prefix="specserve-startup-") as cache:
        for index, name in enumerate(["cold", *(f"warm {i + 1}" for i in range(args.warm_runs))]):
            progress(f"starting the services, {name}")
            log_dir = args.out_dir / "tmp" / f"run-{index}"
            runs.append({"name": name, **start_once(Path(cache), log_dir, args.timeout_s, args.model)})
            progress(f"  {name}: {runs[-1]['ready_s']}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "startup.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    (args.out_dir / "startup.md").write_text(markdown(meta, runs))
    print(markdown(meta, runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
