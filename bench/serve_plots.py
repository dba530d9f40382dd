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
    for prefix, title, stem in (
        ("realistic_chat_c", "realistic chat", "serve_realistic"),
        ("shared_prefix_c", "shared-prefix", "serve"),
    ):
        paths += _sweep_plots(results, prefix, title, out_dir, stem)
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


def _sweep_plots(
    results: dict[str, dict[str, Any]], prefix: str, title: str, out_dir: Path, stem: str
) -> list[Path]:
    """Output tok/s by concurrency and the TTFT CDFs at the highest, for the runs named
    ``prefix`` + concurrency; none when the first server ran none."""
    first = next(iter(results.values()))
    sweep = [name for name in first["runs"] if name.startswith(prefix)]
    if not sweep:
        return []
    xs = [first["runs"][name]["concurrency"] for name in sweep]
    series = {
        server: [r["runs"][name]["output_tok_s"] for name in sweep if name in r["runs"]]
        for server, r in results.items()
    }
    throughput = lines(
        xs,
        series,
        f"{title} output tok/s by concurrency",
        "concurrency",
        "output tokens/s",
        out_dir / f"{stem}_throughput.png",
    )
    last = sweep[-1]
    samples = {s: r["ttft_samples"].get(last, []) for s, r in results.items()}
    ttft = cdfs(samples, f"TTFT, {last}", "seconds", out_dir / f"{stem}_ttft_cdf.png")
    return [throughput, ttft]
