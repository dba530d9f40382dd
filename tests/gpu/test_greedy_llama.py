"""Greedy decoding of a small random-weight Llama: FlashInfer and the torch backend agree on CUDA.

Both run the same bfloat16 weights (std 0.1, so logits have std ~1.6); only attention differs.
Tokens must be identical except where the reference's top-2 logit margin is below TIE_MARGIN
(4 bf16 ulps at |logit| 4..8: a near-tie that rounding may flip); the first step's logits must
agree within LOGIT_ATOL (about 6% of their spread).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention.backend import AttentionBackend, allocate_kv_caches
from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.attention.registry import create_backend
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from tests.support.tiny_llama import make_tiny_llama

pytestmark = pytest.mark.gpu

PAGE, CHUNK, STEPS = 16, 32, 24
TIE_MARGIN = 0.125
LOGIT_ATOL = 0.1
# head_dim 64 and a KV group of 4, as in the GPU bench, so both share FlashInfer's compiled kernels.
SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "initializer_range": 0.1,
}
PROMPTS = [[(7 * i + 3) % 250 for i in range(n)] for n in (37, 5, 70, 16)]


def greedy(
    model: LlamaForCausalLM, backend: AttentionBackend, device: torch.device
) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
    """Chunked prefill mixed with decodes, as the engine schedules them; returns tokens, margins
    and the logits of the first step."""
    cfg = model.config
    per_seq = -(-(max(map(len, PROMPTS)) + STEPS) // PAGE)
    caches = allocate_kv_caches(
        cfg.num_layers, per_seq * len(PROMPTS), PAGE, cfg.num_kv_heads, cfg.head_dim,
        torch.bfloat16, device,
    )  # fmt: skip
    pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(PROMPTS))]
    tokens = [list(p) for p in PROMPTS]
    computed = [0] * len(PROMPTS)
    outs: list[list[int]] = [[] for _ in PROMPTS]
    margins: list[list[float]] = [[] for _ in PROMPTS]
    first: torch.Tensor | None = None
    while active := [i for i in range(len(PROMPTS)) if len(outs[i]) < STEPS]:
        seqs: list[SeqSlice] = []
        ids: list[int] = []
        pos: list[int] = []
        for i in active:
            new = min(CHUNK, len(tokens[i]) - computed[i])
            seqs.append(SeqSlice(pages[i], computed[i], new))
            ids += tokens[i][computed[i] : computed[i] + new]
            pos += range(computed[i], computed[i] + new)
        meta = build_attention_metadata(seqs, PAGE, device)
        logits = model(
            torch.tensor(ids, device=device), torch.tensor(pos, device=device), meta, backend,
            caches, (meta.qo_indptr[1:] - 1).long(),
        )  # fmt: skip
        first = logits if first is None else first
        top2 = logits.topk(2, dim=-1)
        for row, i in enumerate(active):
            computed[i] += seqs[row].num_new_tokens
            if computed[i] == len(tokens[i]):
                tokens[i].append(int(top2.indices[row, 0]))
                outs[i].append(tokens[i][-1])
                margins[i].append(float(top2.values[row, 0] - top2.values[row, 1]))
    assert first is not None
    return outs, margins, first


def test_greedy_tokens_agree_between_backends(tmp_path: Path, cuda: torch.device) -> None:
    path = make_tiny_llama(tmp_path / "m", **SHAPE)
    loaded = load_model(str(path), dtype=torch.bfloat16, device=str(cuda))
    model, cfg = loaded.model, loaded.config
    assert cfg.head_dim == 64
    backends = {
        name: create_backend(cuda, cfg, page_size=PAGE, dtype=torch.bfloat16, name=name)
        for name in ("torch", "flashinfer")
    }
    assert backends["flashinfer"].name == "flashinfer"
    ref_tokens, ref_margins, ref_first = greedy(model, backends["torch"], cuda)
    fi_tokens, _, fi_first = greedy(model, backends["flashinfer"], cuda)
    torch.testing.assert_close(fi_first, ref_first, atol=LOGIT_ATOL, rtol=0)
    for ref, got, margin in zip(ref_tokens, fi_tokens, ref_margins, strict=True):
        diverged = next((j for j, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
        if diverged is not None:
            assert margin[diverged] < TIE_MARGIN, (
                f"tokens differ at step {diverged} with a clear margin {margin[diverged]:.3f}: "
                f"reference {ref}, flashinfer {got}"
            )
