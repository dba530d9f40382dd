"""Engine configuration: page size, the KV budget, step token budget and limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CPU_MAX_NUM_BATCHED_TOKENS = 2048
GPU_MAX_NUM_BATCHED_TOKENS = 8192
DTYPE_NAMES = ("bfloat16", "float16", "float32")
MAX_MEMORY_FRACTION = 0.95  # some memory always stays for the step's own tensors
PREFILL_KERNELS = ("auto", "fa2", "fa3")  # FlashInfer's prefill kernels (auto: FA3 on sm90)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine sizes its KV cache and its steps; fixed for the engine's life.

    The KV budget is ``num_pages`` when given, else as many pages as ``kv_cache_bytes`` holds,
    else ``kv_cache_memory_fraction`` of the memory free once the model is loaded (None: 0.25 of
    host RAM on CPU, 0.9 of device memory on CUDA), never more pages than ``max_num_seqs``
    requests of ``max_model_len`` tokens fill (``engine/kv_budget.py``).
    ``max_num_batched_tokens`` None means 2048 on CPU and 8192 on CUDA; ``max_model_len`` None
    means the model's own context length. ``speculative_tokens`` is how many tokens a greedy
    decode may guess from its own context and check in the same step (``engine/speculative.py``;
    0 turns drafting off), matching the last ``speculative_ngram`` tokens (or at least two).
    Steps with more than ``speculative_max_batch`` decodes run no drafts (None: no limit): where a
    step is bound by its multiply-adds a draft row costs about what a decode's own does, which
    pays only when most drafts are right. ``target_tpot_ms`` bounds a step's time, so each
    running request's time per output token (``engine/step_target.py``): new requests are
    admitted and prefill chunks sized only while steps stay within it; "auto" derives it from
    costs measured at start; None sets no bound. ``max_loras`` is how many LoRA adapters stay
    resident at once (0: adapters off, no memory set aside), each of rank at most
    ``max_lora_rank`` (``engine/lora/``). ``cuda_graphs`` replays decode-only steps on CUDA from
    graphs captured at start, one per size of ``cuda_graph_sizes`` (None: 1, 2, 4, 8, then every
    8 up to ``max_num_seqs``, every 16 past 256; ``engine/cuda_graphs.py``); it means nothing on
    a CPU. ``overlap_steps`` lets the host schedule and prepare the next step on CUDA while the
    device runs a decode step, reading that step's ids only then (``engine/overlap.py``); off on
    a CPU, where nothing runs beside the host.
    """

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    speculative_tokens: int = 4
    speculative_ngram: int = 3
    speculative_max_batch: int | None = None
    target_tpot_ms: float | Literal["auto"] | None = None
    # Each request's first-token deadline, which the step-time target stretches for (None: none).
    target_ttft_ms: float | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_loras: int = 0
    max_lora_rank: int = 16
    # FlashInfer's prefill kernel on CUDA: auto (FA3 on Hopper, FA2 elsewhere), fa2 or fa3.
    prefill_kernel: str = "auto"
    cuda_graphs: bool = True
    cuda_graph_sizes: tuple[int, ...] | None = None
    overlap_steps: bool = True

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError("page_size must be positive")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError("num_pages must be positive")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= MAX_MEMORY_FRACTION:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, {MAX_MEMORY_FRACTION}]")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        # Every running request gets its next token each step, so all decodes must fit one step.
        if self.token_budget < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError("max_model_len must exceed 1")
        if not 0 <= self.speculative_tokens <= 64:
            raise ValueError("speculative_tokens must be between 0 and 64")
        if self.speculative_ngram < 2:
            raise ValueError("speculative_ngram must be at least 2")
        if self.speculative_max_batch is not None and self.speculative_max_batch <= 0:
            raise ValueError("speculative_max_batch must be positive")
        target = self.target_tpot_ms
        if target is not None and target != "auto" and not 0 < target < float("inf"):
            raise ValueError('target_tpot_ms must be a positive number of milliseconds or "auto"')
        ttft = self.target_ttft_ms
        if ttft is not None and not 0 < ttft < float("inf"):
            raise ValueError("target_ttft_ms must be a positive number of milliseconds")
        if not 0 <= self.max_loras <= 256:
            raise ValueError("max_loras must be between 0 and 256")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError("max_lora_rank must be between 1 and 512")
        if self.prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel must be one of {', '.join(PREFILL_KERNELS)}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}")
        sizes = self.cuda_graph_sizes
        if sizes is not None:
            if not sizes or any(not 0 < n <= self.max_num_seqs for n in sizes):
                raise ValueError("cuda_graph_sizes must be batch sizes from 1 to max_num_seqs")
            if list(sizes) != sorted(set(sizes)):
                raise ValueError("cuda_graph_sizes must be increasing")

    @property
    def token_budget(self) -> int:
        """Tokens one step may run (prefill chunks plus decodes)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.device.startswith("cuda"):
            return GPU_MAX_NUM_BATCHED_TOKENS
        return CPU_MAX_NUM_BATCHED_TOKENS

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        """The longest prompt plus output a request may have."""
        if self.max_model_len is None:
            return max_position_embeddings
        return min(self.max_model_len, max_position_embeddings)
