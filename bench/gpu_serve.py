"""The GPU check's serve stage: a real ``atrium serve`` on loopback, driven by the official
``openai`` client, every answer checked.

``python -m bench.gpu_serve --device cuda --tokenizer DIR --out serve.json`` writes a random-weight
model of SmolLM2-135M's shape with SmolLM2's own tokenizer (``bench/serve_model.py``) and a LoRA
adapter of it, starts the server (its engine in a child process), makes tenants, keys and the
adapter through the admin API, then runs the checks one after another: greedy, sampled without
a seed, seeded twice, logprobs, a JSON schema, a tool call, n=2, stop strings, the prefix cache of
two tenants, the adapter, drafts, a client that disconnects, and a burst of concurrent streams
(TTFT p50/p99). A failed check is recorded and the next one runs; the exit status is 1 when any
failed. ``--device cpu --shape tiny --burst 8`` is the CPU dry run of the same driver.

Identical requests are compared only when they run the same way: alone in the engine and from
tenants with nothing cached, since a cached prefix changes the kernels that compute the logits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import httpx
import openai

from bench.serve_model import SHAPES, write_adapter, write_model

ADMIN_TOKEN = "gpu-serve-admin-token"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
    },
    "required": ["ok", "color", "count"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "Write a short poem about a lighthouse keeper."}]
LONG_PREFIX = " ".join(f"Rule {i}: answer briefly and cite clause {i * 7 % 13}." for i in range(60))


class CheckFailedError(AssertionError):
    """A check's answer was not what the API promises."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailedError(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """``atrium serve`` in its own process group, its log in ``log_path``."""

    def __init__(
        self, model: Path, device: str, work: Path, kv_cache_bytes: int, dtype: str
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = work / "serve.log"
        env = {
            **os.environ,
            "ATRIUM_DATABASE_URL": f"sqlite+aiosqlite:///{work / 'atrium.db'}",
            "ATRIUM_ADMIN_TOKEN": ADMIN_TOKEN,
            "ATRIUM_USAGE_SPOOL_PATH": str(work / "usage.spool"),
            "ATRIUM_KV_CACHE_BYTES": str(kv_cache_bytes),
            "ATRIUM_PREFILL_KERNEL": os.environ.get("PREFILL_KERNEL", "auto"),
            "ATRIUM_MAX_LORAS": "2",
            "ATRIUM_MAX_LORA_RANK": "8",
            "ATRIUM_DTYPE": dtype,
        }
        cmd = [sys.executable, "-m", "web.cli", "serve", "--device", device,
               "--model", str(model), "--port", str(self.port)]  # fmt: skip
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=log, start_new_session=True
            )

    def wait_ready(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"atrium serve exited with {self.proc.returncode}")
            with suppress(httpx.HTTPError):
                if httpx.get(self.base + "/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.25)
        raise RuntimeError(f"atrium serve was not ready within {timeout_s:.0f} s")

    def admin(self, method: str, path: str, body: object = None) -> Any:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        reply = httpx.request(method, self.base + path, json=body, headers=headers, timeout=30)
        expect(
            reply.status_code in (200, 201), f"{method} {path}: {reply.status_code} {reply.text}"
        )
        return reply.json()

    def tenant(self, name: str) -> tuple[str, str]:
        """A new tenant's id and an API key of it."""
        tenant = self.admin("POST", "/admin/v1/tenants", {"name": name})
        key = self.admin("POST", f"/admin/v1/tenants/{tenant['id']}/keys", {})["key"]
        return str(tenant["id"]), str(key)

    def metric(self, name: str) -> float:
        """The sum of a metric's samples in /metrics (every label set)."""
        text = httpx.get(self.base + "/metrics", timeout=10).text
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
        return sum(float(v) for v in pattern.findall(text))

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


class Driver:
    def __init__(self, server: Server, model_name: str, adapter: Path, burst: int) -> None:
        self.server = server
        self.model = model_name
        self.adapter = adapter
        self.burst = burst
        self.results: list[dict[str, Any]] = []
        self._tenants = 0
        self.greedy_text = ""

    def client(self, key: str | None = None) -> Any:
        """An ``openai.OpenAI`` client (typed loosely: the checks send plain dicts)."""
        return openai.OpenAI(
            base_url=self.server.base + "/v1",
            api_key=key or self.fresh_key(),
            max_retries=0,
            timeout=120,
        )

    def fresh_key(self) -> str:
        """A key of a new tenant: nothing of it is cached."""
        return self.fresh_tenant()[1]

    def fresh_tenant(self) -> tuple[str, str]:
        self._tenants += 1
        return self.server.tenant(f"tenant-{self._tenants}")

    def run(self, name: str, check: Callable[[], dict[str, Any] | None]) -> None:
        start = time.monotonic()
        row: dict[str, Any] = {"check": name}
        try:
            row.update(check() or {})
            row["ok"] = True
        except Exception as exc:  # recorded; the next check still runs
            row["ok"] = False
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        row["seconds"] = round(time.monotonic() - start, 2)
        self.results.append(row)
        print(f"  {'ok  ' if row['ok'] else 'FAIL'} {name:<16} {row['seconds']:>6} s"
              + ("" if row["ok"] else f"  {row['error']}"), flush=True)  # fmt: skip

    # -- the checks ---------------------------------------------------------------------------

    def chat(self, key: str | None = None, **kwargs: Any) -> Any:
        body = {"model": self.model, "messages": QUESTION, "max_tokens": 24, **kwargs}
        return self.client(key).chat.completions.create(**body)

    def greedy(self) -> dict[str, Any]:
        first = self.chat(temperature=0)
        choice = first.choices[0]
        text = choice.message.content
        expect(isinstance(text, str) and text != "", f"empty greedy answer: {first}")
        expect(choice.finish_reason in ("length", "stop"), f"finish_reason {choice.finish_reason}")
        usage = first.usage
        expect(0 < usage.completion_tokens <= 24 and usage.prompt_tokens > 0, f"usage {usage}")
        expect(choice.finish_reason != "length" or usage.completion_tokens == 24, f"{usage}")
        again = self.chat(temperature=0)  # another tenant: the same computation
        expect(again.choices[0].message.content == text, "greedy differs between two runs")
        streamed = self.client().chat.completions.create(
            model=self.model, messages=QUESTION, max_tokens=24, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
        expect("".join(pieces) == text, "the streamed greedy answer differs")
        self.greedy_text = text
        return {"text": text, "completion_tokens": usage.completion_tokens}

    def sampled(self) -> dict[str, Any]:
        texts = []
        for _ in range(2):
            reply = self.chat(temperature=1.0, top_p=0.95)
            texts.append(reply.choices[0].message.content)
            expect(reply.usage.completion_tokens > 0, f"no tokens: {reply}")
            expect(isinstance(texts[-1], str), f"no content: {reply}")
        return {"texts": texts}

    def seeded(self) -> dict[str, Any]:
        texts = [self.chat(temperature=0.9, seed=1234).choices[0].message.content for _ in "ab"]
        expect(texts[0] == texts[1] and bool(texts[0]), f"seeded answers differ: {texts}")
        return {"text": texts[0]}

    def logprobs(self) -> dict[str, Any]:
        reply = self.chat(temperature=0, logprobs=True, top_logprobs=3)
        content = reply.choices[0].logprobs.content
        expect(len(content) == reply.usage.completion_tokens, "one logprob per token expected")
        for item in content:
            top = item.top_logprobs
            expect(len(top) == 3 and item.logprob <= 0, f"bad logprob entry {item}")
            values = [t.logprob for t in top]
            expect(values == sorted(values, reverse=True), f"top_logprobs unsorted: {values}")
            # Greedy takes the most likely token: its logprob is the best alternative's.
            expect(abs(item.logprob - values[0]) < 1e-4, f"greedy token not the best: {item}")
        return {"tokens": len(content)}

    def json_schema(self) -> dict[str, Any]:
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                      "strict": True}}  # fmt: skip
        reply = self.chat(temperature=0.7, max_tokens=48, response_format=fmt)
        value = json.loads(reply.choices[0].message.content)
        expect(set(value) == {"ok", "color", "count"}, f"keys {value}")
        expect(isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue"), "")
        expect(isinstance(value["count"], int) and not isinstance(value["count"], bool), "count")
        return {"value": value}

    def tool_call(self) -> dict[str, Any]:
        named = {"type": "function", "function": {"name": "get_weather"}}
        reply = self.chat(temperature=0.7, max_tokens=48, tools=[WEATHER_TOOL], tool_choice=named)
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        expect(len(calls) == 1 and calls[0].function.name == "get_weather", f"calls {calls}")
        arguments = json.loads(calls[0].function.arguments)
        expect(set(arguments) == {"city"} and isinstance(arguments["city"], str), f"{arguments}")
        expect(choice.finish_reason in ("tool_calls", "length"), f"{choice.finish_reason}")
        return {"arguments": arguments, "finish_reason": choice.finish_reason}

    def n_choices(self) -> dict[str, Any]:
        reply = self.chat(temperature=1.0, n=2, max_tokens=12)
        expect([c.index for c in reply.choices] == [0, 1], f"choices {reply.choices}")
        expect(all(isinstance(c.message.content, str) for c in reply.choices), "no content")
        expect(0 < reply.usage.completion_tokens <= 24, f"usage {reply.usage}")
        return {"texts": [c.message.content for c in reply.choices]}

    def stop_strings(self) -> dict[str, Any]:
        text = self.greedy_text or self.chat(temperature=0).choices[0].message.content
        # A stop string from the middle of the greedy answer, at its first occurrence.
        starts = range(max(1, len(text) // 3), len(text) - 2)
        usable = (i for i in starts if text.find(text[i : i + 3]) == i and text[i : i + 3].strip())
        cut = next(usable, None)
        expect(cut is not None, f"no usable stop string in {text!r}")
        assert cut is not None
        stop = text[cut : cut + 3]
        reply = self.chat(temperature=0, stop=[stop, "\u2603\u2603"])
        choice = reply.choices[0]
        expect(choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}")
        expect(
            choice.message.content == text[:cut], f"{choice.message.content!r} != {text[:cut]!r}"
        )
        return {"stop": stop, "kept_chars": cut}

    def tenants_cache(self) -> dict[str, Any]:
        owner, other = self.fresh_key(), self.fresh_key()
        messages = [{"role": "system", "content": LONG_PREFIX}, *QUESTION]

        def cached(key: str) -> int:
            reply = self.client(key).chat.completions.create(
                model=self.model, messages=messages, max_tokens=4, temperature=0
            )
            details = reply.usage.prompt_tokens_details
            return int(details.cached_tokens or 0) if details else 0

        first, second, theirs = cached(owner), cached(owner), cached(other)
        expect(first == 0 and second > 0, f"owner cached {first} then {second}")
        expect(theirs == 0, f"the other tenant was served {theirs} cached tokens")
        return {"owner_cached": second, "other_cached": theirs}

    def lora(self) -> dict[str, Any]:
        owner, key = self.fresh_tenant()
        body = {"name": "gpu-style", "path": str(self.adapter), "tenant_id": owner}
        self.server.admin("POST", "/admin/v1/lora-adapters", body)
        reply = self.chat(key, model="gpu-style", temperature=0)
        text = reply.choices[0].message.content
        expect(reply.model == "gpu-style" and isinstance(text, str), f"{reply}")
        base = self.greedy_text or self.chat(temperature=0).choices[0].message.content
        expect(text != base, "the adapter changed nothing")
        try:
            self.chat(model="gpu-style", temperature=0)  # another tenant's adapter
        except openai.NotFoundError:
            pass
        else:
            raise CheckFailedError("another tenant could use the adapter")
        return {"text": text}

    def drafts(self) -> dict[str, Any]:
        before = (self.server.metric("atrium_draft_tokens_total"),
                  self.server.metric("atrium_draft_tokens_accepted_total"))  # fmt: skip
        text = "one two three four five six seven eight nine ten " * 8
        messages = [{"role": "user", "content": f"Repeat this: {text}"}]
        replies = [
            self.chat(messages=messages, temperature=0, max_tokens=48).choices[0].message.content
            for _ in "ab"
        ]
        expect(replies[0] == replies[1] and bool(replies[0]), "drafted greedy answers differ")
        drafted = self.server.metric("atrium_draft_tokens_total") - before[0]
        accepted = self.server.metric("atrium_draft_tokens_accepted_total") - before[1]
        expect(0 <= accepted <= drafted, f"accepted {accepted} of {drafted} drafted")
        return {"drafted": drafted, "accepted": accepted}

    def disconnect(self) -> dict[str, Any]:
        before = self.server.metric("atrium_completion_tokens_total")
        max_tokens = 1500
        stream = self.client().chat.completions.create(
            model=self.model, messages=QUESTION, max_tokens=max_tokens, temperature=1.0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        seen = 0
        for chunk in stream:
            seen += 1 if chunk.choices and chunk.choices[0].delta.content else 0
            if seen >= 3:
                break
        stream.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.server.metric("atrium_requests_in_flight") == 0:
                break
            time.sleep(0.05)
        else:
            raise CheckFailedError("the abandoned request was still in flight after 30 s")
        metered = self.server.metric("atrium_completion_tokens_total") - before
        expect(metered < max_tokens, f"{metered} tokens metered: the request ran to its end")
        after = self.chat(temperature=0, max_tokens=4)  # and the server serves on
        expect(after.usage.completion_tokens > 0, "no answer after the disconnect")
        return {"read": seen, "metered": metered}

    def burst_streams(self) -> dict[str, Any]:
        key = self.fresh_key()
        return asyncio.run(self._burst(key))

    async def _burst(self, key: str) -> dict[str, Any]:
        client: Any = openai.AsyncOpenAI(
            base_url=self.server.base + "/v1", api_key=key, max_retries=0, timeout=300
        )
        max_tokens = 32

        async def one(i: int) -> tuple[float, int, str]:
            start = time.perf_counter()
            ttft = None
            text = ""
            usage = None
            finish = None
            stream = await client.chat.completions.create(
                model=self.model, max_tokens=max_tokens, temperature=0.8, stream=True,
                messages=[{"role": "user", "content": f"Story number {i}: once upon a time"}],
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text += chunk.choices[0].delta.content
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                usage = chunk.usage or usage
            expect(ttft is not None and usage is not None, f"stream {i}: no content or usage")
            assert ttft is not None and usage is not None
            expect(finish == "length", f"stream {i}: finish_reason {finish}")
            expect(usage.completion_tokens == max_tokens, f"stream {i}: {usage}")
            return ttft, usage.completion_tokens, text

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(self.burst)))
        wall = time.perf_counter() - start
        await client.close()
        ttfts = sorted(r[0] for r in results)
        tokens = sum(r[1] for r in results)
        return {
            "streams": self.burst,
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
            "wall_s": round(wall, 2),
            "output_tok_per_s": round(tokens / wall, 1),
        }

    def all_checks(self) -> list[tuple[str, Callable[[], dict[str, Any] | None]]]:
        return [
            ("greedy", self.greedy), ("sampled", self.sampled), ("seeded", self.seeded),
            ("logprobs", self.logprobs), ("json_schema", self.json_schema),
            ("tool_call", self.tool_call), ("n_choices", self.n_choices),
            ("stop_strings", self.stop_strings), ("two_tenants", self.tenants_cache),
            ("lora", self.lora), ("drafts", self.drafts), ("disconnect", self.disconnect),
            ("burst", self.burst_streams),
        ]  # fmt: skip


def startup_record(log_text: str) -> dict[str, Any]:
    """From the server's JSON log lines: seconds from its process's start to ready
    (``serve_ready``) and where the engine found its FlashInfer modules (``flashinfer_kernels``;
    None on the torch backend)."""
    events: dict[str, dict[str, Any]] = {}
    for line in log_text.splitlines():
        if line.startswith("{") and '"event"' in line:
            with suppress(ValueError):
                event = json.loads(line)
                events.setdefault(str(event.get("event")), event)
    ready, kernels = events.get("serve_ready", {}), events.get("flashinfer_kernels")
    fields = ("prebuilt", "cached", "to_compile", "missing")
    return {
        "startup_s": ready.get("startup_s"),
        "kernels": None if kernels is None else {k: kernels.get(k) for k in fields},
    }


def expect_no_compile(record: dict[str, Any]) -> dict[str, Any]:
    """The warm-up compiled every module the engine loads: its start compiled none."""
    kernels = record["kernels"]
    expect(kernels is not None, "the engine logged no flashinfer_kernels event")
    expect(kernels["to_compile"] == 0, f"modules compiled at start: {kernels['missing']}")
    return {"modules": kernels["prebuilt"] + kernels["cached"]}


def serve_check(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    shape = SHAPES[args.shape]
    model = write_model(work / "model", args.tokenizer, shape, seed=0)
    adapter = write_adapter(work / "adapter", shape, seed=1, rank=8)
    report: dict[str, Any] = {"device": args.device, "shape": args.shape, "ok": False}
    server = Server(model, args.device, work, args.kv_cache_bytes, args.dtype)
    try:
        report["ready_s"] = round(server.wait_ready(args.ready_timeout), 1)
        report.update(startup_record(server.log_path.read_text(errors="replace")))
        print(f"  ready in {report['ready_s']} s on {args.device} ({report['startup_s']} s "
              f"from the server's start; kernels {report['kernels']})", flush=True)  # fmt: skip
        driver = Driver(server, model.name, adapter, args.burst)
        if args.device == "cuda":
            driver.run("no_compile_at_start", lambda: expect_no_compile(report))
        for name, check in driver.all_checks():
            driver.run(name, check)
        report["checks"] = driver.results
        report["ok"] = all(r["ok"] for r in driver.results)
        burst = next((r for r in driver.results if r["check"] == "burst" and r["ok"]), None)
        report["burst"] = None if burst is None else {k: v for k, v in burst.items()
                                                       if k not in ("check", "ok")}  # fmt: skip
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if server.proc.poll() is not None:
            report["server_exit"] = server.proc.returncode
        if not report["ok"]:
            report["server_log_tail"] = server.log_tail()
        server.stop()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_serve", description=__doc__)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the dry run")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--tokenizer", type=Path, required=True, help="SmolLM2's tokenizer files")
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    parser.add_argument("--burst", type=int, default=64, help="concurrent streams at the end")
    parser.add_argument("--kv-cache-bytes", type=int, default=2**30)
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    args = parser.parse_args(argv)
    if not any((args.tokenizer / n).is_file() for n in ("tokenizer.json", "tokenizer.json.gz")):
        missing = f"no tokenizer.json in {args.tokenizer}: rebuild it (python -m bench.gpu_bundle)"
        report: dict[str, Any] = {"ok": False, "device": args.device, "error": missing}
    else:
        with tempfile.TemporaryDirectory(prefix="atrium_gpu_serve_") as tmp:
            report = serve_check(args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if "error" in report:
        print(f"  FAILED: {report['error']}\n{report.get('server_log_tail', '')}", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
