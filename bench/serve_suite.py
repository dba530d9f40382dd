"""The serving suite run against one server: shared prefix by concurrency, chat, Poisson, flood."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from bench.chat_workload import conversations, run_conversations
from bench.loadgen import (
    Target,
    run_chat_sessions,
    run_closed_loop,
    run_per_tenant,
    run_poisson,
)
from bench.metrics import (
    RequestRecord,
    backlogged_shares,
    jain_index,
    latency_summary,
    percentile,
    service_over_time,
)
from bench.text_workloads import (
    TextShape,
    chat_sessions,
    flood_specs,
    ideal_text_hit_rate,
    shared_prefix_specs,
)

PAGE_SIZE = 16  # Atrium's page; the ideal hit rate is counted in these pages


@dataclass(frozen=True, slots=True)
class SuiteConfig:
    words: Sequence[str]
    tokenizer_json: Path
    shape: TextShape
    concurrency: tuple[int, ...] = (4, 16)
    rate: float | None = None
    chat_users: int = 4
    chat_turns: int = 3
    flood_per_tenant: int = 4
    flood_factor: int = 10
    flood_concurrency: int = 2
    flood_prompt_len: int = 256
    deadline_s: float = 300.0
    workloads: tuple[str, ...] = ("realistic", "synthetic")
    realistic_concurrency: tuple[int, ...] = (8, 32)
    realistic_tenants: int = 4
    realistic_max_tokens: int = 128


def realistic_size(concurrency: int) -> int:
    """Conversations in a realistic run: six per slot of concurrency, within the corpus."""
    return min(6 * concurrency, 192)


def _ttfts(records: Sequence[RequestRecord]) -> list[float]:
    return [r.ttft for r in records if r.ok]


def _p99_ttft(records: Sequence[RequestRecord]) -> float:
    return percentile(_ttfts(records), 99)


async def run_suite(target: Target, config: SuiteConfig) -> dict[str, Any]:
    tokenizer = Tokenizer.from_file(str(config.tokenizer_json))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    runs: dict[str, Any] = {}
    ttfts: dict[str, list[float]] = {}
    if "realistic" in config.workloads:
        # Natural stops: whatever the suite's other runs send, these never ignore EOS.
        chat_target = dataclasses.replace(target, extra_body={})
        for i, concurrency in enumerate(config.realistic_concurrency):
            items = conversations(
                config.realistic_tenants,
                realistic_size(concurrency),
                seed=500 + i,
                max_tokens=config.realistic_max_tokens,
            )
            records = await run_conversations(chat_target, items, concurrency, config.deadline_s)
            name = f"realistic_chat_c{concurrency}"
            runs[name] = {
                "concurrency": concurrency,
                "conversations": len(items),
                "follow_ups": sum(len(c.turns) - 1 for c in items),
                "sampled": sum(c.temperature > 0 for c in items),
                **latency_summary(records),
            }
            ttfts[name] = _ttfts(records)
    if "synthetic" not in config.workloads:
        return {"runs": runs, "flood": None, "ttft_samples": ttfts}
    shape = config.shape
    # A fresh seed per run: nothing one run cached helps the next.
    for i, concurrency in enumerate(config.concurrency):
        specs = shared_prefix_specs(config.words, shape, seed=100 + i)
        records = await run_closed_loop(target, specs, concurrency, config.deadline_s)
        name = f"shared_prefix_c{concurrency}"
        runs[name] = {
            "concurrency": concurrency,
            "ideal_cached_fraction": ideal_text_hit_rate(specs, encode, PAGE_SIZE),
            **latency_summary(records),
        }
        ttfts[name] = _ttfts(records)
    if config.rate is not None:
        specs = shared_prefix_specs(config.words, shape, seed=200)
        records = await run_poisson(target, specs, config.rate, 0, config.deadline_s)
        runs["shared_prefix_poisson"] = {"rate": config.rate, **latency_summary(records)}
        ttfts["shared_prefix_poisson"] = _ttfts(records)
    sessions = chat_sessions(
        config.words,
        config.chat_users,
        config.chat_turns,
        shape.system_len,
        shape.question_len,
        max(shape.num_tenants, 1),
        seed=300,
    )
    records = await run_chat_sessions(target, sessions, shape.output_len, config.deadline_s)
    runs["multi_turn_chat"] = latency_summary(records)
    ttfts["multi_turn_chat"] = _ttfts(records)
    flood = await run_flood(target, config)
    return {"runs": runs, "flood": flood, "ttft_samples": ttfts}


async def run_flood(target: Target, config: SuiteConfig) -> dict[str, Any]:
    """Each tenant alone, the normal tenants together, then all at once with t0 sending ×factor:
    TTFT inflation over each baseline, and shares."""
    tenants = max(config.shape.num_tenants, 4)
    concurrency = {
        f"t{t}": config.flood_concurrency * (config.flood_factor if t == 0 else 1)
        for t in range(tenants)
    }

    def specs(seed: int) -> dict[str, Any]:
        return flood_specs(
            config.words,
            tenants,
            config.flood_per_tenant,
            config.flood_factor,
            config.flood_prompt_len,
            config.shape.output_len,
            seed,
        )

    solo: dict[str, float] = {}
    for tenant, tenant_specs in specs(401).items():
        if tenant == "t0":
            continue  # the flooder alone is the flood minus the others
        records = await run_closed_loop(
            target, tenant_specs, concurrency[tenant], config.deadline_s
        )
        solo[tenant] = _p99_ttft(records)
    # The same normal tenants together without the flooder: what the flood itself adds.
    others = {t: s for t, s in specs(403).items() if t != "t0"}
    calm_records = await run_per_tenant(target, others, concurrency, config.deadline_s)
    calm = {t: _p99_ttft([r for r in calm_records if r.tenant == t]) for t in others}
    records = await run_per_tenant(target, specs(402), concurrency, config.deadline_s)
    shares = backlogged_shares(records)
    times, per_tenant = service_over_time(records, 1.0)
    p99 = {t: _p99_ttft([r for r in records if r.tenant == t]) for t in concurrency}
    return {
        "concurrency_by_tenant": concurrency,
        "summary": latency_summary(records),
        "p99_ttft_s": p99,
        "solo_p99_ttft_s": solo,
        "p99_ttft_over_solo": {t: p99[t] / solo[t] for t in solo if solo[t] > 0},
        "without_flooder_p99_ttft_s": calm,
        "p99_ttft_over_without_flooder": {t: p99[t] / calm[t] for t in calm if calm[t] > 0},
        "backlogged_shares": shares,
        "jain_index": jain_index(shares.values()),
        "service_over_time": {"bin_s": 1.0, "times": times, "tokens": per_tenant},
    }
