"""Helpers for the end-to-end P/D tests: prompts, a reference colocated server, metric scraping."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from kvwire.cluster.client import RequestResult, post_completion
from kvwire.cluster.local import ClusterSpec, LocalCluster, free_port, http_json
from kvwire.cluster.process import ManagedProcess, kvwire_argv

BLOCK = 16  # the engine's default block size
MAX_LEN = 1024  # tiny's max_model_len
MAX_TOKENS = 8
LENGTHS = (1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, MAX_LEN - MAX_TOKENS - 1)


def prompts(n: int = 24) -> list[list[int]]:
    """``n`` token-id prompts cycling through LENGTHS (ids within tiny's vocabulary)."""
    return [[(7 * j + 13 * i) % 250 + 1 for j in range(LENGTHS[i % len(LENGTHS)])] for i in range(n)]


def body(prompt: Sequence[int], *, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"model": "tiny", "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}


async def _send_all(url: str, bodies: Sequence[dict[str, Any]], timeout_s: float) -> list[RequestResult]:
    async with aiohttp.ClientSession() as session:
        calls = [post_completion(session, f"{url}/v1/completions", b, timeout_s=timeout_s) for b in bodies]
        return list(await asyncio.gather(*calls))


def send_all(url: str, bodies: Sequence[dict[str, Any]], timeout_s: float = 120.0) -> list[RequestResult]:
    """Send every body concurrently; results in order."""
    return asyncio.run(_send_all(url, bodies, timeout_s))


def metric(url: str, name: str) -> float:
    """Sum of the samples of ``name`` (any labels) on ``url``/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


@contextlib.contextmanager
def running_cluster(spec: ClusterSpec, log_path: Path) -> Iterator[LocalCluster]:
    """A started :class:`LocalCluster` whose processes log to ``log_path``; stopped on exit (also
    when starting it fails)."""
    with open(log_path, "w") as sink:
        cluster = LocalCluster(spec, sink=sink)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


class ColocatedServer:
    """One ``kvwire serve --role both`` (no router): the reference for token equality."""

    def __init__(self, sink: TextIO) -> None:
        port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{port}"
        argv = kvwire_argv("serve", "--model", "tiny", "--port", str(port), "--role", "both")
        self.process = ManagedProcess("both", argv, sink=sink, sink_lock=threading.Lock())
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.stop(5)
                raise RuntimeError(f"reference server did not start:\n{self.process.output()[-2000:]}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            http_json(f"{self.url}/health")
        except (OSError, ValueError):
            return False
        return True

    def stop(self) -> None:
        self.process.stop(10)
