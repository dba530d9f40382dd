"""Decode steps replayed from CUDA graphs agree with the same steps run eagerly on FlashInfer.

The small random-weight Llama of ``test_greedy_llama`` (4/1 heads: tensor-core decode; 9/3: the
plain decode kernel) decodes batches of 1, 3, 8 and 13 sequences (3 and 13 pad, to 4 and 16)
twice: eagerly, and through graphs captured once for sizes 1, 2, 4, 8 and 16. Prompts are
prefilled eagerly between batches, so the MLP's shared scratch grows after the capture (a graph
must not write into it). Greedy tokens must be identical except at a near-tie of the eager
run, and each batch's first decode logits within LOGIT_ATOL; padding rows write no page of the
pool (the scratch page lies past it).
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import allocate_kv_caches
from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.attention.registry import create_backend
from engine.cuda_graphs import DecodeGraphs, DecodeRow
from tests.gpu.test_greedy_llama import HEADS, PAGE, TIE_MARGIN, random_llama

pytestmark = pytest.mark.gpu

SIZES = (1, 2, 4, 8, 16)
BATCHES = (1, 3, 8, 13)
STEPS = 12
LOGIT_ATOL = 0.1  # the same kernels in bfloat16; split-KV may differ between the two modes


def _prompt(i: int) -> list[int]:
    return [(11 * i + 7 * j + 3) % 250 for j in range(5 + 9 * i)]


def _decode(
    mode: str, num_heads: int, num_kv_heads: int, cuda: torch.device, prefill_kernel: str
) -> tuple[dict[int, list[list[int]]], dict[int, list[list[float]]], dict[int, torch.Tensor]]:
    model = random_llama(num_heads, num_kv_heads, cuda)
    cfg = model.config
    per_seq = -(-(len(_prompt(max(BATCHES))) + STEPS) // PAGE)
    num_pages = per_seq * max(BATCHES)
    backend = create_backend(
        cuda, cfg, page_size=PAGE, dtype=torch.bfloat16, num_pages=num_pages + 1,
        prefill_kernel=prefill_kernel,
    )  # fmt: skip
    caches = allocate_kv_caches(
        cfg.num_layers, num_pages + 1, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, cuda
    )
    graphs = DecodeGraphs(
        model, backend, caches, sizes=SIZES, page_size=PAGE, scratch_page=num_pages,
        max_pages_per_seq=per_seq,
    )  # fmt: skip
    if mode == "graph":
        assert graphs.capture() > 0
        assert graphs.captured == SIZES
    tokens: dict[int, list[list[int]]] = {}
    margins: dict[int, list[list[float]]] = {}
    first: dict[int, torch.Tensor] = {}
    for batch in BATCHES:
        pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        seqs = [_prompt(i) for i in range(batch)]
        meta = build_attention_metadata(
            [SeqSlice(p, 0, len(s)) for p, s in zip(pages, seqs, strict=True)], PAGE, cuda
        )
        ids = torch.tensor([t for s in seqs for t in s], device=cuda)
        pos = torch.tensor([j for s in seqs for j in range(len(s))], device=cuda)
        logits = model(ids, pos, meta, backend, caches, (meta.qo_indptr[1:] - 1).long())
        out: list[list[int]] = [[int(t)] for t in logits.argmax(-1).tolist()]
        gaps: list[list[float]] = [[] for _ in range(batch)]
        for step in range(STEPS):
            rows = [
                DecodeRow(out[i][-1], len(seqs[i]) + len(out[i]) - 1, pages[i])
                for i in range(batch)
            ]
            if mode == "graph":
                logits = graphs.run(graphs.stage(rows))
            else:
                meta = build_attention_metadata(
                    [SeqSlice(r.page_ids, r.position, 1) for r in rows], PAGE, cuda
                )
                ids = torch.tensor([r.token_id for r in rows], device=cuda)
                pos = torch.tensor([r.position for r in rows], device=cuda)
                logits = model(ids, pos, meta, backend, caches, torch.arange(batch, device=cuda))
            if step == 0:
                first[batch] = logits.float().clone()
            top2 = logits.topk(2, dim=-1)
            for i in range(batch):
                out[i].append(int(top2.indices[i, 0]))
                gaps[i].append(float(top2.values[i, 0] - top2.values[i, 1]))
        tokens[batch], margins[batch] = out, gaps
        # Batches grow: pages past this one's were never any sequence's, and stay zero.
        assert all(not c[batch * per_seq : num_pages].any() for c in caches)
    return tokens, margins, first


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_graph_replays_decode_like_eager_steps(
    cuda: torch.device, prefill_kernel: str, num_heads: int, num_kv_heads: int
) -> None:
    eager_tokens, eager_margins, eager_first = _decode(
        "eager", num_heads, num_kv_heads, cuda, prefill_kernel
    )
    graph_tokens, _, graph_first = _decode("graph", num_heads, num_kv_heads, cuda, prefill_kernel)
    for batch in BATCHES:
        torch.testing.assert_close(graph_first[batch], eager_first[batch], atol=LOGIT_ATOL, rtol=0)
        for ref, got, margin in zip(
            eager_tokens[batch], graph_tokens[batch], eager_margins[batch], strict=True
        ):
            diverged = next(
                (j for j, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None
            )
            if diverged is not None:  # token 0 is the prefill's, shared by both runs
                assert margin[diverged - 1] < TIE_MARGIN, (
                    f"batch {batch}: tokens differ at {diverged} with a clear margin "
                    f"{margin[diverged - 1]:.3f}: eager {ref}, graphs {got}"
                )
