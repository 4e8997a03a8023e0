"""Processes of the vLLM tier: vLLM API servers (with or without the kvwire plugin) and the router.

Every process starts in its own session (process group); :meth:`Proc.stop` ends that group (vLLM's
engine-core and worker children included): SIGTERM to its leader, then SIGKILL to the group after a
grace period. The group's
last members (Python's resource tracker unlinks the shared memory and named semaphores of vLLM's
spawned processes once they are gone) get a bounded moment to finish before that SIGKILL. /dev/shm
names a group mapped and left behind are recorded in ``shm_left`` and removed: after
:meth:`Proc.kill_hard` (a machine that died takes its tmpfs with it) and after a stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from support import leaks

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 1024
ROUTER_TTL_S = 10.0


class Proc:
    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.shm_seen: set[str] = set()  # /dev/shm names the group was seen mapping
        self.shm_left: set[str] = set()  # of those, left behind once the group was gone (removed)
        self.popen = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill_hard(self) -> None:
        """SIGKILL the whole process group at once (the 'machine died' case)."""
        self.note_shm()
        self._signal_group(signal.SIGKILL)
        self.popen.wait(timeout=30)
        self._drain_group(10.0)
        self._sweep_shm()

    def stop(self, grace_s: float = 20.0) -> None:
        if self.alive():
            self.note_shm()
            # The API server alone: it shuts its engine down (--shutdown-timeout) and its children
            # clean up; a SIGTERM to every member at once left a vLLM segment behind (2026-12-02).
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait(timeout=30)
        # Children of a stopped leader may linger in the group: a moment to finish, then SIGKILL.
        self._drain_group(10.0)
        self._signal_group(signal.SIGKILL)
        self._sweep_shm()
        self._log.close()

    def note_shm(self) -> None:
        """Remember the /dev/shm names the group maps now (checked once it is gone)."""
        self.shm_seen |= leaks.shm_names_mapped_by(leaks.group_pids(self.popen.pid))

    def _drain_group(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while leaks.group_pids(self.popen.pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _sweep_shm(self) -> None:
        left = leaks.orphaned(self.shm_seen)
        if left:
            self.shm_left |= left
            leaks.remove(left)

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def tail(self, num_bytes: int = 6000) -> str:
        data = self.log_path.read_bytes()
        return data[-num_bytes:].decode(errors="replace")


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def kv_transfer_config(
    role: str, extra: dict[str, Any], *, failure_policy: str = "recompute", kv_port: int | None = None
) -> str:
    # "recompute" for the P/D pair: the tier's killed-prefill case checks that path; vLLM's default
    # ("fail") runs on the kv_both instance (test_kv_both_fail_policy, test_delayed_prefill_*).
    config: dict[str, Any] = {
        "kv_connector": "KvwireConnector",
        "kv_connector_module_path": "kvwire.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": extra,
    }
    if kv_port is not None:
        config["kv_port"] = kv_port
    return json.dumps(config)


def kv_events_config(port: int) -> str:
    """vLLM's own KV event publisher (off by default in vLLM), bound on loopback at ``port``."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})


def start_vllm(
    name: str, model_dir: Path, port: int, log_dir: Path, kv_config: str | None,
    events_config: str | None = None,
) -> Proc:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
        # vLLM's defaults otherwise: prefix caching on, CUDA-graph/compile settings untouched
        # vLLM's default (0) SIGKILLs the engine core on shutdown: no connector.shutdown(), no
        # deregistration. A grace period lets the plugin close its agents and deregister.
        "--shutdown-timeout", "10",
    ]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", kv_config]
    if events_config is not None:
        cmd += ["--kv-events-config", events_config]
    return Proc(name, cmd, log_dir / f"{name}.log", vllm_env())


def start_router(
    http_port: int, discovery_port: int, mode: str, log_dir: Path, kv_deadline_s: float, policy: str | None
) -> Proc:
    cmd = [
        sys.executable, "-m", "kvwire.cli", "router", "--host", "127.0.0.1", "--port", str(http_port),
        "--discovery-host", "127.0.0.1", "--discovery-port", str(discovery_port), "--mode", mode,
        "--kv-deadline-s", str(kv_deadline_s), "--instance-ttl-s", str(ROUTER_TTL_S),
    ]
    if policy is not None:
        cmd += ["--policy", policy]
    return Proc(f"router-{mode}", cmd, log_dir / f"router-{mode}.log", dict(os.environ, PYTHONUNBUFFERED="1"))


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def wait_until(check: Any, timeout_s: float, procs: list[Proc], what: str) -> None:
    """Poll ``check()`` until true; fail at once if one of ``procs`` died (with its log tail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.tail()}")
        try:
            if check():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.tail(3000)}" for p in procs)
            raise TimeoutError(f"{what} not reached in {timeout_s:.0f} s\n{tails}")
        time.sleep(0.5)


def healthy(port: int) -> bool:
    return http_get(f"http://127.0.0.1:{port}/health")[0] == 200


def metric_total(port: int, name: str, labels: dict[str, str]) -> float:
    """Sum of a Prometheus metric's samples on ``/metrics`` whose labels include ``labels``."""
    _, body = http_get(f"http://127.0.0.1:{port}/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def complete(
    base_url: str, prompt: list[int] | str, *, extra: dict[str, Any] | None = None, timeout_s: float = 120
) -> dict[str, Any]:
    """A greedy completion of ``MAX_TOKENS`` tokens (token ids returned)."""
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, **(extra or {}),
    }
    req = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


MAX_TOKENS = 12
LOCAL_COMPUTE = {"source": "local_compute"}  # vllm:prompt_tokens_by_source: computed, not loaded
KV_DEADLINE_S = 15.0
# The P/D equality tests check the transfer path, so every request must go through P: a KV-aware
# router would serve a prompt D already holds without P (tests/vllm/test_vllm_kv_routing.py).
TRANSFER_POLICY = "round_robin"
STARTUP_TIMEOUT_S = 600.0
# P's prefill steps for transfers named "slow-*" are held this long (the plugin's fault_delay_send),
# longer than the fixed deadline those transfers are given (SHORT_DEADLINE_S).
SLOW_PREFIX = "slow-"
SLOW_DELAY_S = 8.0
SHORT_DEADLINE_S = 3.0


@dataclasses.dataclass
class Cluster:
    model_dir: Path
    log_dir: Path
    router_port: int
    discovery_port: int
    p_port: int
    d_port: int
    ref_port: int
    both_port: int
    procs: dict[str, Proc]
    both_kv_port: int = 0  # the kv_both instance's transfer-agent control port (fixed: tests dial it)
    p_events_port: int = 0  # vLLM's KV event publishers (--kv-events-config)
    d_events_port: int = 0

    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def start_router(
        self, mode: str, policy: str | None = TRANSFER_POLICY, kv_deadline_s: float = KV_DEADLINE_S
    ) -> None:
        """(Re)start the router; ``policy`` None: the router's default."""
        old = self.procs.pop("router", None)
        if old is not None:
            old.stop()
        self.procs["router"] = start_router(
            self.router_port, self.discovery_port, mode, self.log_dir, kv_deadline_s, policy
        )
        wait_until(
            lambda: self.registered() == {"prefill", "decode"}, 60, [self.procs["router"]], "registration"
        )

    def registered(self) -> set[str]:
        return {inst["role"] for inst in self.instances()}

    def instance_ids(self) -> set[str]:
        return {inst["id"] for inst in self.instances()}

    def instances(self) -> list[dict[str, Any]]:
        status, body = http_get(f"{self.router_url()}/instances")
        return list(json.loads(body)) if status == 200 else []
