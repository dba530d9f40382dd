"""Prefix cache on vs off, in-process on SmolLM2: hit rate against the ideal, TTFT, throughput.

    python -m bench.prefix_cache [--tenants 2 --groups 4 --prompts 8 --system-len 512]

Workloads: SGLang's generated shared prefix (tenants × groups × prompts) and multi-turn chat,
each under a closed loop of ``--concurrency`` requests; then the TTFT of a prompt whose
``--long-prefix`` tokens are cached against the same prompt missing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.cache_timer import CacheTimer
from bench.common import DEFAULT_OUT_DIR, emit, quiet_logging, ratio
from bench.engine_driver import DriveResult, ListSource, PromptSource, drive
from bench.engine_runs import STEP_PARTS, random_prompts, stats_delta
from bench.metrics import latency_summary, summarize
from bench.plots import bar_compare
from bench.workloads import ChatShape, ChatSource, Prompt, SharedPrefixShape, shared_prefix_prompts
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from radix_cache import RadixPrefixCache

TARGETS = {"hit_rate_vs_ideal": 0.95, "long_prefix_ttft_ratio": 0.20, "match_insert_share": 0.02}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tenants", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chat-users", type=int, default=8)
    parser.add_argument("--chat-turns", type=int, default=4)
    parser.add_argument("--long-prefix", type=int, default=2048)
    parser.add_argument("--long-repeats", type=int, default=3)
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def make_engine(loaded: LoadedModel, kv_mib: int, cache_on: bool) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=kv_mib * 2**20, enable_prefix_cache=cache_on)
    return LLMEngine(loaded, config, prefix_cache_factory=RadixPrefixCache)


def measure(engine: LLMEngine, source: PromptSource, concurrency: int, tag: str) -> dict[str, Any]:
    timer = CacheTimer()
    timer.install(engine.cache)
    before = engine.stats.copy()
    run: DriveResult = drive(engine, source, concurrency, engine.config.page_size, tag)
    split = stats_delta(before, engine.stats)
    step_s = sum(split[part] for part in STEP_PARTS)
    summary = latency_summary(run.records)
    prompt_tokens = sum(r.prompt_tokens for r in run.records)
    cached = sum(r.cached_tokens for r in run.records)
    hit_rate = cached / prompt_tokens if prompt_tokens else 0.0
    ideal = run.ideal_cached_tokens / prompt_tokens if prompt_tokens else 0.0
    return {
        "hit_rate": hit_rate,
        "ideal_hit_rate": ideal,
        "hit_rate_vs_ideal": ratio(hit_rate, ideal),
        "ttft_s": summary["ttft_s"],
        "output_tok_s": summary["output_tok_s"],
        "total_tok_s": (prompt_tokens + summary["completion_tokens"]) / run.seconds,  # type: ignore[operator]
        "req_s": summary["req_s"],
        "seconds": run.seconds,
        "num_errors": summary["num_errors"],
        "match_insert_share": (timer.match_s + timer.insert_s) / step_s if step_s else 0.0,
        "match_ms_per_call": 1e3 * timer.match_s / max(timer.num_match, 1),
        "insert_ms_per_call": 1e3 * timer.insert_s / max(timer.num_insert, 1),
    }


def on_vs_off(
    loaded: LoadedModel, args: argparse.Namespace, name: str, source_of: Any
) -> dict[str, Any]:
    """The same workload with the cache off, then on (fresh engine each time)."""
    out: dict[str, Any] = {}
    for cache_on in (False, True):
        engine = make_engine(loaded, args.kv_cache_mib, cache_on)
        out["on" if cache_on else "off"] = measure(engine, source_of(), args.concurrency, name)
        del engine
    on, off = out["on"], out["off"]
    out["speedup_total_tok_s"] = ratio(on["total_tok_s"], off["total_tok_s"])
    out["ttft_p50_ratio_on_off"] = ratio(on["ttft_s"]["p50"], off["ttft_s"]["p50"])
    return out


def long_prefix_ttft(loaded: LoadedModel, args: argparse.Namespace) -> dict[str, Any]:
    """TTFT of prefix + tail A (a miss) against prefix + tail B (prefix cached), alone."""
    engine = make_engine(loaded, args.kv_cache_mib, True)
    misses: list[float] = []
    hits: list[float] = []
    cached: list[int] = []
    for i in range(args.long_repeats):
        prefix = random_prompts(1, args.long_prefix, seed=1000 + i)[0]
        tails = random_prompts(2, 16, seed=2000 + i)
        for tail, bucket in ((tails[0], misses), (tails[1], hits)):
            prompt = Prompt("long", 0, tuple(prefix + tail), 1)
            run = drive(engine, ListSource([prompt]), 1, engine.config.page_size, f"long{i}")
            bucket.append(run.records[0].ttft)
            if bucket is hits:
                cached.append(run.records[0].cached_tokens)
    miss_ms = summarize(misses)["p50"] * 1e3
    hit_ms = summarize(hits)["p50"] * 1e3
    return {
        "prefix_tokens": args.long_prefix,
        "miss_ttft_ms_p50": miss_ms,
        "hit_ttft_ms_p50": hit_ms,
        "hit_over_miss": ratio(hit_ms, miss_ms),
        "hit_cached_tokens": cached,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logging()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=torch.bfloat16)
    started = time.perf_counter()
    warm = make_engine(loaded, 64, True)
    drive(warm, ListSource([Prompt("w", 0, tuple(range(100, 164)), 2)]), 1, 16, "warm")
    del warm
    shape = SharedPrefixShape(
        args.tenants, args.groups, args.prompts, args.system_len, args.question_len, args.output_len
    )
    prompts = shared_prefix_prompts(shape)
    chat = ChatShape(args.chat_users, args.chat_turns, output_len=args.output_len)
    shared = on_vs_off(loaded, args, "shared", lambda: ListSource(list(prompts)))
    chats = on_vs_off(loaded, args, "chat", lambda: ChatSource(chat))
    long = long_prefix_ttft(loaded, args)
    result: dict[str, Any] = {
        "model": loaded.name,
        "kv_cache_mib": args.kv_cache_mib,
        "torch_threads": torch.get_num_threads(),
        "concurrency": args.concurrency,
        "shared_prefix": {"shape": shape.__repr__(), **shared},
        "multi_turn_chat": {"shape": chat.__repr__(), **chats},
        "long_prefix": long,
        "checks": {
            "hit_rate_vs_ideal": min(
                shared["on"]["hit_rate_vs_ideal"], chats["on"]["hit_rate_vs_ideal"]
            ),
            "long_prefix_ttft_ratio": long["hit_over_miss"],
            "match_insert_share": max(
                shared["on"]["match_insert_share"], chats["on"]["match_insert_share"]
            ),
        },
        "targets": TARGETS,
        "seconds": time.perf_counter() - started,
    }
    result["plot"] = str(
        bar_compare(
            ["shared prefix", "multi-turn chat"],
            {
                "cache off": [shared["off"]["ttft_s"]["p50"], chats["off"]["ttft_s"]["p50"]],
                "cache on": [shared["on"]["ttft_s"]["p50"], chats["on"]["ttft_s"]["p50"]],
            },
            "TTFT p50, prefix cache off vs on",
            "workload",
            "seconds",
            args.out_dir / "prefix_cache_ttft.png",
        )
    )
    emit(result, args.out_dir, "prefix_cache")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
