"""``atrium generate``: offline generation through the same engine the server uses."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.factory import EngineSpec, resolve_dtype_name
from engine.launch import start_engine
from engine.load_progress import progress_for
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from web.cli.env import EXIT_USAGE, env_default, env_flag


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "generate", help="generate a completion for one prompt and print it"
    )
    prompt = env_default("ATRIUM_PROMPT")
    parser.add_argument("--prompt", default=prompt, required=prompt is None, help="ATRIUM_PROMPT")
    add_model_flags(parser)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=int(env_default("ATRIUM_MAX_TOKENS", "256") or 256),
        help="the most tokens to generate (default 256; env ATRIUM_MAX_TOKENS)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=float(env_default("ATRIUM_TEMPERATURE", "0.0") or 0.0),
        help="0 is greedy (env ATRIUM_TEMPERATURE)",
    )
    seed = env_default("ATRIUM_SEED")
    parser.add_argument(
        "--seed",
        type=int,
        default=None if seed is None else int(seed),
        help="sampling seed, for the same answer again (env ATRIUM_SEED)",
    )
    parser.add_argument(
        "--raw",
        action="store_true",
        default=env_flag("ATRIUM_RAW"),
        help="send the prompt as is, without the chat template (env ATRIUM_RAW)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print {text, model, finish_reason, prompt_tokens, completion_tokens}",
    )
    parser.set_defaults(func=run_generate)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=env_default("ATRIUM_MODEL", "default"),
        help="'default' (SmolLM2-135M-Instruct), a model directory or a .gguf file",
    )
    parser.add_argument(
        "--dtype",
        default=env_default("ATRIUM_DTYPE", "auto"),
        choices=["auto", "bfloat16", "float16", "float32"],
        help="auto: bfloat16 on CPUs with native bfloat16 products, else float32",
    )


def run_generate(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(_generate(args))
    except (EngineError, ValueError, FileNotFoundError) as exc:
        print(f"atrium generate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        sys.stdout.write(msgspec.json.encode(result).decode("utf-8") + "\n")
    else:
        sys.stdout.write(result["text"] + "\n")
    return 0


async def _generate(args: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    params.validate()  # fail before loading the model
    dtype = resolve_dtype_name(args.dtype, "cpu")
    config = EngineConfig(dtype=dtype, max_num_seqs=1)
    spec = EngineSpec(model=args.model, dtype=dtype, config=config, prefix_cache=False)
    progress = progress_for(sys.stderr)  # stdout carries only the completion
    try:
        running = start_engine(spec, in_process=True, progress=progress)
    finally:
        progress.close()
    engine, tokenizer = running.client, running.tokenizer
    pieces: list[str] = []
    last: RequestOutput | None = None
    try:
        if args.raw:
            prompt_ids = tokenizer.encode(args.prompt)
        else:
            prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        request = GenerateRequest(f"cli-{uuid.uuid4().hex}", prompt_ids, params)
        async for output in engine.generate(request):
            if output.error is not None:
                raise EngineError(output.error)
            pieces.append(output.text)
            last = output
    finally:
        await engine.shutdown()
    return {
        "text": "".join(pieces),
        "model": running.name,
        "finish_reason": None if last is None else last.finish_reason,
        "prompt_tokens": 0 if last is None else last.num_prompt_tokens,
        "completion_tokens": 0 if last is None else last.num_output_tokens,
    }
