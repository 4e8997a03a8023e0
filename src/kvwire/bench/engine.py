"""``kvwire bench engine``: built-in engine prefill and decode throughput, with baselines from the
same run.

* prefill: time to first token of one ``--prompt-len`` prompt through the engine (paged KV write,
  scheduler, sampling) against a dense torch forward of the same model object on the same tokens
  (no KV cache; causal SDPA; LM head on the last token only). Goal on CUDA: within 1.3x.
* decode: tokens/s with ``B`` requests decoding together, against the ceiling of reading every weight
  once per step at this device's measured copy bandwidth.
* throughput: ``--num-requests`` prompts of ``--decode-prompt-len`` tokens, ``--output-len`` tokens
  each, submitted at once: output tokens/s end to end.

Example (H200): ``kvwire bench engine --device cuda --model llama3-8b-random --json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvwire.engine import EngineConfig, LLMEngine, SamplingParams
from kvwire.engine.attention import NATIVE_DECODE, ForwardContext
from kvwire.engine.quant import Int4Linear, Int8Linear


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="model name (tiny, smollm2-135m, ...), .gguf file or HF directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8", "int4"])
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="prefill prompt (default 2048 cuda, 512 cpu)"
    )
    parser.add_argument("--decode-batch-sizes", default="1,32", help="comma-separated")
    parser.add_argument("--decode-prompt-len", type=int, default=128)
    parser.add_argument(
        "--decode-steps", type=int, default=None, help="timed steps (default 64 cuda, 32 cpu)"
    )
    parser.add_argument("--num-requests", type=int, default=32, help="throughput: requests at once")
    parser.add_argument("--output-len", type=int, default=64, help="throughput: tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "sdpa", "paged"])
    parser.add_argument("--decode-graphs", action="store_true", help="replay decode steps from CUDA graphs")
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    prompt_len = args.prompt_len or (2048 if cuda else 512)
    steps = args.decode_steps or (64 if cuda else 32)
    batches = [int(b) for b in args.decode_batch_sizes.split(",")]
    with _build_engine(args, prompt_len, max([*batches, args.num_requests]), steps) as engine:
        bench = _Bench(engine, args.repeats)
        results: dict[str, Any] = {
            "environment": _environment(args, engine),
            "prefill": bench.prefill(prompt_len),
        }
        results["decode"] = [bench.decode(b, args.decode_prompt_len, steps) for b in batches]
        results["throughput"] = bench.throughput(args.num_requests, args.decode_prompt_len, args.output_len)
    print(json.dumps(results, indent=2) if args.json else _table(results))
    return 0


def _build_engine(args: argparse.Namespace, prompt_len: int, max_batch: int, steps: int) -> LLMEngine:
    per_request = args.decode_prompt_len + max(_decode_tokens(steps, args.repeats), args.output_len) + 1
    blocks = -(-prompt_len // args.block_size) + 2 * max_batch * -(-per_request // args.block_size) + 8
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=blocks,
        max_model_len=max(prompt_len, per_request) + 1,
        max_num_batched_tokens=max(prompt_len, 2048),
        max_num_seqs=max_batch,
        enable_prefix_caching=False,  # repeated prompts must be computed every time
        attention_backend=args.attention_backend,
        decode_graphs=args.decode_graphs,
        quantization=args.quantization,
        cpu_threads=args.threads,
    )
    engine = LLMEngine(config)
    if engine.runner.graphs is not None:
        engine.runner.graphs.capture_all()  # not during the timed steps
    return engine


class _Bench:
    def __init__(self, engine: LLMEngine, repeats: int) -> None:
        self.engine, self.repeats = engine, repeats
        self.vocab = min(engine.model.config.vocab_size, 256)
        self.rng = random.Random(0)
        self.ids = iter(range(1 << 30))

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _timed(self, *fns: Callable[[], object]) -> list[float]:
        """Median seconds of each ``fn`` over the repeats, after one warm-up call each. The functions
        take turns within every repeat, so a load change on the machine hits them alike."""
        for fn in fns:
            fn()
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(self.repeats):
            for fn, fn_times in zip(fns, times, strict=True):
                _sync(self.engine.device)
                start = time.perf_counter()
                fn()
                _sync(self.engine.device)
                fn_times.append(time.perf_counter() - start)
        return [statistics.median(t) for t in times]

    def _submit(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        ids = [f"bench-{next(self.ids)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.engine.add_request(
                request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
        return ids

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def prefill(self, prompt_len: int) -> dict[str, float]:
        prompt = self._prompt(prompt_len)

        def engine_ttft() -> None:
            self._submit([prompt], 1)
            self._drain()

        model, device = self.engine.model, self.engine.device
        input_ids = torch.tensor(prompt, device=device)
        positions = torch.arange(prompt_len, device=device)

        @torch.inference_mode()
        def dense() -> None:
            hidden = model(input_ids, positions, ForwardContext(None, [], None))
            model.compute_logits(hidden[-1:]).argmax(-1).tolist()

        engine_s, dense_s = self._timed(engine_ttft, dense)
        return {
            "prompt_len": prompt_len,
            "engine_ms": engine_s * 1e3,
            "dense_ms": dense_s * 1e3,
            "ratio": engine_s / dense_s,
            "engine_tokens_per_s": prompt_len / engine_s,
        }

    def decode(self, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
        ids = self._submit(
            [self._prompt(prompt_len) for _ in range(batch)], _decode_tokens(steps, self.repeats)
        )
        started: set[str] = set()
        while len(started) < batch:  # prefill every request first
            started |= {out.request_id for out in self.engine.step() if out.new_token_ids}
        step_s = self._timed(lambda: [self.engine.step() for _ in range(steps)])[0] / steps
        assert self.engine.stats().num_running == batch, "every request must decode in every timed step"
        for request_id in ids:
            self.engine.abort_request(request_id)
        self._drain()
        ceiling_s = _weight_read_seconds(self.engine)
        return {
            "batch": batch,
            "context_len": prompt_len,
            "step_ms": step_s * 1e3,
            "tokens_per_s": batch / step_s,
            "weight_read_ceiling_tokens_per_s": batch / ceiling_s,
        }

    def throughput(self, num_requests: int, prompt_len: int, output_len: int) -> dict[str, float]:
        prompts = [self._prompt(prompt_len) for _ in range(num_requests)]

        def run_all() -> None:
            self._submit(prompts, output_len)
            self._drain()

        [seconds] = self._timed(run_all)
        return {
            "num_requests": num_requests,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "seconds": seconds,
            "output_tokens_per_s": num_requests * output_len / seconds,
            "total_tokens_per_s": num_requests * (prompt_len + output_len) / seconds,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode_tokens(steps: int, repeats: int) -> int:
    """Output tokens a decode request needs to stay running through warm-up + timed repeats."""
    return steps * (repeats + 1) + 4


def _decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter, and a quantized layer's packed weight and scales
    (not its bf16 copy for prompt rows; engine/quant.py). The embedding table counts whole where it
    is also the LM head (tied, dense); a quantized head has its own packed copy."""
    params = dict(model.named_parameters())
    if getattr(model, "head", None) is not None:
        params.pop("embed_tokens.weight", None)  # read one row per token
    total = sum(p.numel() * p.element_size() for p in params.values())
    for name, buf in model.named_buffers():
        if not name.endswith(("dense_weight", "cos_table", "sin_table")):
            total += buf.numel() * buf.element_size()
    return total


def _weight_read_seconds(engine: LLMEngine) -> float:
    """Seconds to read every weight once at this device's copy bandwidth (measured now on up to
    1 GiB): the floor of a decode step that is memory bound."""
    weight_bytes = _decode_weight_bytes(engine.model)
    probe = torch.empty(min(weight_bytes, 1 << 30) // 4, dtype=torch.float32, device=engine.device)
    dst = torch.empty_like(probe)
    dst.copy_(probe)
    _sync(engine.device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(probe)
    _sync(engine.device)
    read_bytes_per_s = 2 * 5 * probe.numel() * 4 / (time.perf_counter() - start)  # copy = read + write
    return weight_bytes / read_bytes_per_s


def _environment(args: argparse.Namespace, engine: LLMEngine) -> dict[str, Any]:
    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    return {
        "model": args.model,
        "device": name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": engine.quantization.value,
        "torch": torch.__version__,
        "block_size": args.block_size,
        "attention_backend": engine.runner.backend.value
        + ("" if engine.runner.backend.value != "paged" or NATIVE_DECODE else " (kernel not built: torch)"),
        "decode_graphs": engine.runner.graphs is not None,
        "quantized_kernels": _quantized_kernels(engine),
    }


def _quantized_kernels(engine: LLMEngine) -> str:
    """What the model's quantized layers multiply by (decision 157), "" when it has none."""
    native = {bool(m.native) for m in engine.model.modules() if isinstance(m, (Int4Linear, Int8Linear))}
    if not native:
        return ""
    return "native" if native == {True} else "torch" if native == {False} else "native and torch"


def _table(r: dict[str, Any]) -> str:
    env, p, t = r["environment"], r["prefill"], r["throughput"]
    lines = [
        f"built-in engine: {env['model']} {env['dtype']} (weights: {env['quantization']}) on {env['device']} "
        f"(torch {env['torch']}, "
        f"attention {env['attention_backend']}, decode graphs {'on' if env['decode_graphs'] else 'off'}"
        + (f", quantized matmuls {env['quantized_kernels']}" if env.get("quantized_kernels") else "")
        + ")",
        "",
        "| measurement | kvwire engine | baseline | ratio |",
        "|---|---|---|---|",
        f"| prefill {p['prompt_len']} tokens (TTFT) | {p['engine_ms']:.1f} ms | dense forward "
        f"{p['dense_ms']:.1f} ms | {p['ratio']:.2f}x |",
    ]
    for d in r["decode"]:
        ceiling = d["weight_read_ceiling_tokens_per_s"]
        lines.append(
            f"| decode batch {d['batch']} (context ~{d['context_len']}) | {d['tokens_per_s']:.1f} tok/s "
            f"({d['step_ms']:.2f} ms/step) | weight-read ceiling {ceiling:.1f} tok/s "
            f"| {d['tokens_per_s'] / ceiling:.2f} |"
        )
    lines.append(
        f"| throughput {t['num_requests']} x ({t['prompt_len']} in + {t['output_len']} out) | "
        f"{t['output_tokens_per_s']:.1f} out tok/s ({t['total_tokens_per_s']:.1f} total) | | |"
    )
    return "\n".join(lines)
