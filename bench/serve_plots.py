"""The serving comparison's plots: throughput by concurrency, TTFT CDFs, service per tenant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.plots import cdfs, lines, stacked_service


def draw_plots(results: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write the PNGs for whatever servers ran; returns their paths."""
    paths: list[Path] = []
    if not results:
        return paths
    first = next(iter(results.values()))
    realistic = [name for name in first["runs"] if name.startswith("realistic_chat_c")]
    if realistic:
        xs = [first["runs"][name]["concurrency"] for name in realistic]
        series = {
            server: [r["runs"][name]["output_tok_s"] for name in realistic if name in r["runs"]]
            for server, r in results.items()
        }
        paths.append(
            lines(
                xs,
                series,
                "realistic chat output tok/s by concurrency",
                "concurrency",
                "output tokens/s",
                out_dir / "serve_realistic_throughput.png",
            )
        )
        last = realistic[-1]
        samples = {s: r["ttft_samples"].get(last, []) for s, r in results.items()}
        paths.append(
            cdfs(samples, f"TTFT, {last}", "seconds", out_dir / "serve_realistic_ttft_cdf.png")
        )
    sweep = [name for name in first["runs"] if name.startswith("shared_prefix_c")]
    if sweep:
        xs = [first["runs"][name]["concurrency"] for name in sweep]
        series = {
            server: [r["runs"][name]["output_tok_s"] for name in sweep if name in r["runs"]]
            for server, r in results.items()
        }
        paths.append(
            lines(
                xs,
                series,
                "shared-prefix output tok/s by concurrency",
                "concurrency",
                "output tokens/s",
                out_dir / "serve_throughput.png",
            )
        )
        last = sweep[-1]
        samples = {s: r["ttft_samples"].get(last, []) for s, r in results.items()}
        paths.append(cdfs(samples, f"TTFT, {last}", "seconds", out_dir / "serve_ttft_cdf.png"))
    for server, r in results.items():
        if not r.get("flood"):
            continue
        service = r["flood"]["service_over_time"]
        paths.append(
            stacked_service(
                service["times"],
                service["tokens"],
                f"{server}: tokens per tenant per second, t0 flooding",
                out_dir / f"serve_flood_{server}.png",
            )
        )
    return paths
