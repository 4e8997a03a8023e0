"""What D's P/D connector costs a decode step when no transfer is in flight (issue 36: "TPOT no worse").

Two built-in engines in this process on the same model: one as a colocated instance has it (no
connector), one as a decode instance has it (the real scheduler and worker connector halves and a
transfer agent on loopback, nothing sent to it). Each round decodes ``--batch`` local requests of a
60-token prompt for ``--steps`` steps in each engine, the engines taking turns so that both see the
same load; the table gives the median step time per round and over the rounds, and their ratio.

Usage: ``PYTHONPATH=src python benchmarks/decode_connector_cost.py [--model tiny] [--batch 1]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.factory import build_connectors
from kvwire.engine import SamplingParams
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.protocol.kv_params import Role
from kvwire.transfer import TransferConfig

PROMPT = list(range(1, 61))


def _decode_step_ms(engine: LLMEngine, batch: int, steps: int) -> float:
    """Median wall time of ``steps`` decode steps of ``batch`` requests (their prefill not counted)."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(uuid.uuid4().hex, PROMPT, params)
    engine.step()  # the prompts
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    deadline = time.monotonic() + 60.0
    while engine.has_unfinished_requests():  # the last tokens: the next round starts empty
        assert time.monotonic() < deadline, "requests did not finish"
        engine.step()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    config = EngineConfig(model=args.model)
    plain = LLMEngine(config)
    info = EngineInfo(block_size=config.block_size, device="cpu", tp_size=1,
                      num_kv_heads=plain.model.config.num_kv_heads)
    scheduler, worker = build_connectors(ConnectorConfig(role=Role.DECODE, transfer=TransferConfig()), info)
    decode = LLMEngine(config, scheduler_connector=scheduler, worker_connector=worker)
    rows: dict[str, list[float]] = {"no connector (colocated)": [], "decode connector, idle": []}
    try:
        for _ in range(args.rounds):
            for name, engine in zip(rows, (plain, decode), strict=True):
                rows[name].append(_decode_step_ms(engine, args.batch, args.steps))
    finally:
        worker.close()
    print(f"decode step, model {args.model}, batch {args.batch}, {args.steps} steps x {args.rounds} rounds")
    print("| engine | median step per round (ms) | median (ms) |")
    print("|---|---|---|")
    medians = {}
    for name, values in rows.items():
        medians[name] = statistics.median(values)
        print(f"| {name} | {' / '.join(f'{v:.3f}' for v in values)} | {medians[name]:.3f} |")
    base, with_connector = medians.values()
    print(f"ratio (connector / none): {with_connector / base:.3f}")


if __name__ == "__main__":
    main()
