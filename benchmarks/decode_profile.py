"""Where a decode step's time goes: the built-in engine, ``--batch`` sequences of different lengths
decoding together, timed and then profiled with ``torch.profiler`` (CPU by default).

The sequences are prefilled first (random prompts of ``--context`` ± 20 tokens, so that their KV
lengths differ as a server's do), then ``--steps`` decode steps are timed one by one (median and
minimum) and ``--profile-steps`` more run under the profiler. The table groups the profiler's self
time per step: torch's int4 and int8 weight kernels, the KV gather, SDPA, the KV write, the rest
(norms, RoPE, casts, sampling, dispatch), and the thread's CPU time outside torch's ops (the native
decode-attention kernel, decision 148, the native int8/int4 matmuls, decision 157, and Python).
``--attention-backend sdpa`` takes torch's gather + SDPA for the decodes instead of the kernel;
``--ab-attention`` alternates the two step by step in one engine and prints both.

Usage: ``python benchmarks/decode_profile.py --batch 8 --threads 1`` (``--model`` an HF directory or
a preset, ``--quantization`` as ``kvwire serve``'s).

``--waves N`` measures instead what a server sees at concurrency ``--batch``: N waves of ``--batch``
prompts of ``--context`` tokens submitted together, each run to ``--output`` tokens (prefill, then the
batched decode), with the prefill step and the wave timed (wall and this thread's CPU time) and the
prefill step's minor page faults counted.
``--compare-model M`` (with ``--compare-quantization``) builds a second engine and alternates the two
wave by wave, so that both see the same load (decision 142). ``--ab-prompt`` alternates instead, in
one engine, the whole prompts' attention between the native kernel and torch's SDPA per prompt
(decision 152). ``--no-malloc-tuning`` leaves glibc's malloc at its defaults (decision 152) and
``--engine-thread`` runs the waves on a thread of their own, as ``kvwire serve`` runs its engine.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import threading
import time
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from kvwire.engine import SamplingParams, attention
from kvwire.engine.config import AttentionBackend, EngineConfig
from kvwire.engine.llm_engine import LLMEngine

GROUPS = {
    "aten::_weight_int4pack_mm_for_cpu": "int4 projections",
    "aten::_weight_int8pack_mm": "int8 projections / LM head",
    "aten::index_select": "KV gather",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "SDPA",
    "aten::index_copy_": "KV write",
    "aten::mm": "dense matmul",
    "aten::addmm": "dense matmul",
}
AB = (AttentionBackend.SDPA, AttentionBackend.PAGED)  # --ab-attention: torch's gather + SDPA, the kernel
OUTSIDE = "outside torch ops (native decode attention and quantized matmuls, Python)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "paged"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--waves", type=int, default=0, help="time N waves of prompts instead")
    parser.add_argument("--output", type=int, default=64, help="output tokens per request (--waves)")
    parser.add_argument("--compare-model", default=None, help="a second engine, alternated (--waves)")
    parser.add_argument("--compare-quantization", default=None, help="its quantization (default: the same)")
    parser.add_argument("--ab-attention", action="store_true", help="alternate torch's and the kernel's")
    parser.add_argument(
        "--ab-prompt", action="store_true", help="alternate the prompt kernel and SDPA per prompt (--waves)"
    )
    parser.add_argument("--no-malloc-tuning", action="store_true", help="glibc malloc at its defaults")
    parser.add_argument("--engine-thread", action="store_true", help="--waves on a thread, as the server")
    args = parser.parse_args()
    if args.waves and args.engine_thread:
        worker = threading.Thread(target=_waves, args=(args,), name="kvwire-engine")
        worker.start()
        worker.join()
        return
    if args.waves:
        _waves(args)
        return
    engine = _engine(args)
    if args.ab_attention:
        _ab_attention(engine, args)
        return
    step_times = [_timed_step(engine) for _ in range(args.steps)]
    print(
        f"{args.model} ({args.quantization}, attention {engine.runner.backend.value}), batch {args.batch}, "
        f"context ~{args.context}, "
        f"{args.threads} thread(s): step median {statistics.median(step_times) * 1e3:.2f} ms, "
        f"min {min(step_times) * 1e3:.2f} ms over {args.steps} steps"
    )
    _profile(engine, args.profile_steps)


def _engine(args: argparse.Namespace) -> LLMEngine:
    steps = args.steps * (2 if args.ab_attention else 1) + args.profile_steps
    longest = args.context + 20 + steps + 8
    config = EngineConfig(
        model=args.model,
        quantization=args.quantization,
        cpu_threads=args.threads,
        block_size=16,
        max_model_len=longest + 1,
        num_kv_blocks=args.batch * -(-longest // 16) + 8,
        max_num_batched_tokens=max(2048, longest),
        max_num_seqs=args.batch,
        enable_prefix_caching=False,
        attention_backend=args.attention_backend,
        cpu_malloc_tuning=not args.no_malloc_tuning,
    )
    engine = LLMEngine(config)
    rng = random.Random(0)
    vocab = min(engine.model.config.vocab_size, 256)
    params = SamplingParams(max_tokens=longest - args.context, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randrange(vocab) for _ in range(args.context + rng.randrange(-20, 21))]
        engine.add_request(f"profile-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < args.batch:  # every sequence prefilled: the steps below are decode-only
        started |= {out.request_id for out in engine.step() if out.new_token_ids}
    for _ in range(3):
        engine.step()
    return engine


def _wave_engine(args: argparse.Namespace, model: str, quantization: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model, quantization=quantization, cpu_threads=args.threads, block_size=16,
            max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch * args.context),
            num_kv_blocks=args.batch * -(-(args.context + args.output) // 16) + 8,
            enable_prefix_caching=False, attention_backend=args.attention_backend,
            cpu_malloc_tuning=not args.no_malloc_tuning,
        )
    )  # fmt: skip


def _waves(args: argparse.Namespace) -> None:
    specs = [(args.model, args.quantization)]
    if args.compare_model is not None:
        specs.append((args.compare_model, args.compare_quantization or args.quantization))
    kinds = [f"{model} ({quantization})" for model, quantization in specs]
    engines = {kind: _wave_engine(args, *spec) for kind, spec in zip(kinds, specs, strict=True)}
    kernels = {kind: attention._prompt_native for kind in kinds}  # the prompt kernel each kind runs with
    if args.ab_prompt:  # one engine, the whole prompts' attention by SDPA (kernel handle off) or the kernel
        engine = engines[kinds[0]]
        kinds = [f"{kinds[0]}, prompts by SDPA", f"{kinds[0]}, prompts by the kernel"]
        engines = dict.fromkeys(kinds, engine)
        kernels = {kinds[0]: None, kinds[1]: attention._prompt_native}
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    rows: dict[str, list[tuple[float, float, float, float, float]]] = {kind: [] for kind in kinds}
    for wave in range(args.waves + 1):  # wave 0 warms up, not counted
        prompts = [[rng.randrange(256) for _ in range(args.context)] for _ in range(args.batch)]
        for kind in kinds if wave % 2 else kinds[::-1]:  # the same prompts for every engine
            engine, attention._prompt_native = engines[kind], kernels[kind]
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{kind}-{wave}-{i}", prompt, params)
            faults = _page_faults()
            wall, cpu = time.perf_counter(), time.thread_time()
            engine.step()  # the prompts (one step when they fit --max-num-batched-tokens)
            prefill = (time.perf_counter() - wall, time.thread_time() - cpu, _page_faults() - faults)
            while engine.has_unfinished_requests():
                engine.step()
            if wave:
                rows[kind].append((*prefill, time.perf_counter() - wall, time.thread_time() - cpu))
    attention._prompt_native = kernels[kinds[-1]]
    print(f"waves of {args.batch} x ({args.context} + {args.output}) tokens, {args.threads} thread(s), "
          f"medians of {args.waves} waves:\n")  # fmt: skip
    print("| engine | prefill wall | prefill CPU | prefill page faults | wave wall | wave CPU "
          "| out tok/s (wall / CPU) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for kind, got in rows.items():
        pw, pc, pf, ww, wc = (statistics.median(col) for col in zip(*got, strict=True))
        tokens = args.batch * args.output
        print(f"| {kind} | {pw * 1e3:.0f} ms | {pc * 1e3:.0f} ms | {pf:.0f} | {ww * 1e3:.0f} ms "
              f"| {wc * 1e3:.0f} ms | {tokens / ww:.1f} / {tokens / wc:.1f} |")  # fmt: skip


def _page_faults() -> float:
    """This thread's minor page faults so far (Linux: a fresh page of a large buffer, decision 152)."""
    return float(resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt)


def _ab_attention(engine: LLMEngine, args: argparse.Namespace) -> None:
    """The same engine, the same sequences, the decodes' attention switched every step between
    torch's gather + SDPA and the native kernel (decision 148): both see the same load and the
    same context lengths. Wall and thread CPU time per step."""
    times: dict[AttentionBackend, list[tuple[float, float]]] = {b: [] for b in AB}
    for i in range(2 * args.steps):
        backend = AttentionBackend.PAGED if i % 2 else AttentionBackend.SDPA
        engine.runner.backend = backend
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        times[backend].append((time.perf_counter() - wall, time.thread_time() - cpu))
    print(f"{args.model} ({args.quantization}), batch {args.batch}, context ~{args.context}, {args.threads} "
          f"thread(s), {args.steps} steps each, alternating:\n")  # fmt: skip
    print("| decode attention | step wall median | step CPU median | CPU min |\n|---|---|---|---|")
    for backend, got in times.items():
        wall_ms, cpu_ms = ([t * 1e3 for t in col] for col in zip(*got, strict=True))
        name = "torch gather + SDPA" if backend is AttentionBackend.SDPA else "native kernel"
        print(f"| {name} | {statistics.median(wall_ms):.2f} ms | {statistics.median(cpu_ms):.2f} ms "
              f"| {min(cpu_ms):.2f} ms |")  # fmt: skip


def _timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _profile(engine: LLMEngine, steps: int) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cpu = time.thread_time()
        for _ in range(steps):
            engine.step()
        cpu = time.thread_time() - cpu
    per_group: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        group = GROUPS.get(event.key, "everything else")
        per_group[group] += event.self_cpu_time_total / steps / 1e3
        calls[group] += event.count // steps
    # The profiler sees torch's ops only: the native decode-attention kernel (decision 148) and the
    # Python between ops are the thread's CPU time outside them.
    per_group[OUTSIDE] = max(0.0, cpu / steps * 1e3 - sum(per_group.values()))
    total = sum(per_group.values())
    print(f"\nper step under the profiler ({steps} steps), self CPU time:\n")
    print("| part | ms per step | share | ops per step |\n|---|---|---|---|")
    for group, ms in sorted(per_group.items(), key=lambda kv: -kv[1]):
        print(f"| {group} | {ms:.2f} | {ms / total:.0%} | {calls[group]} |")
    print(f"| **step** | **{total:.2f}** | | {sum(calls.values())} |")


if __name__ == "__main__":
    main()
