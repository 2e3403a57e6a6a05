"""Work before admission, measured: a flood of huge prompts from one tenant against a small coordinator.

Starts a real local cluster (verifier and coordinator, no drafter) with API keys and ``--max-concurrent-streams
4``, then has ``--callers`` authenticated callers of tenant ``flood`` each send a ``--prompt-mib`` prompt at
once over their own connections, while one caller of tenant ``probe`` sends a small prompt a moment later.
Reports the coordinator's peak RSS (``VmHWM``, and its RSS at rest before the flood), the probe's time to first
token and total latency, how the flood's calls ended, and the machine::

    .venv/bin/python -m bench.admission_flood                  # 200 callers x 4 MiB, as issue 32 asks
    .venv/bin/python -m bench.admission_flood --out /tmp/flood.json

The flood's prompts are far longer than the model's context, so each is refused once counted: what it costs
is the work done before that (receiving, copying, tokenizing) and the slots and queue places it takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from bench.machine import describe
from specserve.auth.keys import key_entry, new_key
from specserve.local_cluster import LocalCluster, free_port
from specserve.v1 import generation_pb2, generation_pb2_grpc

FILLER = "the quick brown fox jumps over the lazy dog while speculative decoding drafts ahead. "


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def channel(address: str) -> grpc.aio.Channel:
    """Its own connection (a local subchannel pool), as a separate client would have."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


async def flood_call(address: str, key: str, prompt: str, deadline_s: float) -> str:
    async with channel(address) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        request = generation_pb2.GenerateRequest(prompt=prompt, max_new_tokens=8)
        try:
            async for _ in stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),), timeout=deadline_s):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "OK"


async def probe_call(address: str, key: str, deadline_s: float) -> dict[str, Any]:
    """One small stream: seconds to its first text and to its end, and how it ended."""
    async with channel(address) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        chat = generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="user", content="Write one sentence about the sea.")]
        )
        request = generation_pb2.GenerateRequest(chat=chat, max_new_tokens=16)
        started = time.monotonic()
        first: float | None = None
        tokens = 0
        status = "OK"
        try:
            metadata = (("authorization", f"Bearer {key}"),)
            async for response in stub.Generate(request, metadata=metadata, timeout=deadline_s):
                if response.HasField("delta") and response.delta.token_ids:
                    first = round(time.monotonic() - started, 3) if first is None else first
                elif response.HasField("stats"):
                    tokens = response.stats.num_generated_tokens
        except grpc.aio.AioRpcError as exc:
            status = f"{exc.code().name}: {exc.details()}"
        total_s = round(time.monotonic() - started, 3)
        return {"status": status, "generated_tokens": tokens, "first_token_s": first, "total_s": total_s}


async def flood(cluster: LocalCluster, args: argparse.Namespace, keys: dict[str, str]) -> dict[str, Any]:
    pid = cluster.processes["coordinator"].pid
    address = cluster.coordinator_address
    prompt = (FILLER * (args.prompt_mib * (1 << 20) // len(FILLER) + 1))[: args.prompt_mib << 20]
    warm = await probe_call(address, keys["probe"], args.deadline_s)  # loads what a first request loads
    at_rest = memory_kib(pid)
    peak_rss = at_rest["VmRSS"]
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak_rss
        while not stop.is_set():
            peak_rss = max(peak_rss, memory_kib(pid)["VmRSS"])
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    calls = [
        asyncio.create_task(flood_call(address, keys["flood"], prompt, args.deadline_s)) for _ in range(args.callers)
    ]
    await asyncio.sleep(args.probe_after_s)
    probe = await probe_call(address, keys["probe"], args.deadline_s)
    outcomes = Counter(await asyncio.gather(*calls))
    flood_s = time.monotonic() - started
    stop.set()
    await sampler
    return {
        "warm_probe": warm,
        "coordinator_rss_at_rest_mib": round(at_rest["VmRSS"] / 1024, 1),
        # Sampled every 50 ms during the flood; VmHWM is the kernel's peak over the whole life (start-up included).
        "coordinator_peak_rss_mib": round(peak_rss / 1024, 1),
        "coordinator_vmhwm_mib": round(memory_kib(pid)["VmHWM"] / 1024, 1),
        "probe_during_flood": probe,
        "flood_outcomes": dict(outcomes),
        "flood_s": round(flood_s, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", type=int, default=200)
    parser.add_argument("--prompt-mib", type=int, default=4)
    parser.add_argument("--max-concurrent-streams", type=int, default=4)
    parser.add_argument("--probe-after-s", type=float, default=3.0, help="when the small stream starts")
    parser.add_argument("--deadline-s", type=float, default=120.0, help="every call's gRPC deadline")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    keys = {"flood": new_key(), "probe": new_key()}
    with tempfile.TemporaryDirectory() as tmp:
        key_file = Path(tmp) / "keys.yaml"
        lines = [f"  - {key_entry(key, tenant, tenant)[2:]}" for tenant, key in keys.items()]
        key_file.write_text("keys:\n" + "\n".join(lines) + "\n")
        cluster = LocalCluster(free_port(), free_port(), free_port(), with_drafter=False, log_dir=Path(tmp) / "logs")
        cluster.extra_coordinator_args = [
            "--api-keys-file",
            str(key_file),
            "--max-concurrent-streams",
            str(args.max_concurrent_streams),
        ]
        with cluster:
            figures = asyncio.run(flood(cluster, args, keys))
    report = {
        "command": " ".join(["python -m bench.admission_flood", *(argv if argv is not None else sys.argv[1:])]),
        "callers": args.callers,
        "prompt_mib": args.prompt_mib,
        "max_concurrent_streams": args.max_concurrent_streams,
        **figures,
        "machine": describe(),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
