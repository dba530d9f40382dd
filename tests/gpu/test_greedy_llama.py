"""Greedy decoding of a small random-weight Llama: FlashInfer and the torch backend agree on CUDA.

The model is built in process (no files, so no transformers, tokenizers or gguf needed), in two
head layouts: 4 query heads per KV head (tensor-core decode) and the default model's 9/3 (plain
decode kernel). Both backends run the same bfloat16 weights (std 0.1); only attention differs.
Tokens must be identical except where the reference's top-2 logit margin is below TIE_MARGIN
(4 bf16 ulps at |logit| 4..8: a near-tie that rounding may flip); the first step's logits must
be as close to a float32 run of the same weights as the torch backend's (within twice its error),
and within LOGIT_ATOL of the torch backend's.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import AttentionBackend, allocate_kv_caches
from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.attention.registry import create_backend
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.gpu

PAGE, CHUNK, STEPS = 16, 32, 24
TIE_MARGIN = 0.125
LOGIT_ATOL = 0.2  # bfloat16 against bfloat16: twice what rounding alone was seen to move
LOGIT_FLOOR = 0.02  # what float32 accumulation in another order may add
# head_dim 64 as in the GPU bench and the default model, so all share FlashInfer's compiled kernels.
HEADS = [(4, 1), (9, 3)]
PROMPTS = [[(7 * i + 3) % 250 for i in range(n)] for n in (37, 5, 70, 16)]


def greedy(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
    """Chunked prefill mixed with decodes, as the engine schedules them; returns tokens, margins
    and the logits of the first step."""
    cfg = model.config
    per_seq = -(-(max(map(len, PROMPTS)) + STEPS) // PAGE)
    caches = allocate_kv_caches(
        cfg.num_layers, per_seq * len(PROMPTS), PAGE, cfg.num_kv_heads, cfg.head_dim,
        dtype, device,
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


def random_llama(
    num_heads: int, num_kv_heads: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> LlamaForCausalLM:
    """A 2-layer Llama with head_dim 64 and N(0, 0.1) weights (norms 1), made on ``device``
    (the same weights whatever ``dtype``: drawn in bfloat16, then widened)."""
    config = ModelConfig(
        vocab_size=256, hidden_size=64 * num_heads, intermediate_size=512, num_layers=2,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, max_position_embeddings=256,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    gen = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name, meta in model.state_dict().items():
        t = torch.empty(meta.shape, dtype=torch.bfloat16, device=device)
        t = t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0, 0.1, generator=gen)
        state[name] = t.to(dtype)
    model.load_weights(state)
    return model


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_greedy_tokens_agree_between_backends(
    cuda: torch.device, prefill_kernel: str, num_heads: int, num_kv_heads: int
) -> None:
    model = random_llama(num_heads, num_kv_heads, cuda)
    cfg = model.config
    backends = {
        name: create_backend(
            cuda, cfg, page_size=PAGE, dtype=torch.bfloat16, name=name,
            prefill_kernel=prefill_kernel,
        )
        for name in ("torch", "flashinfer")
    }  # fmt: skip
    assert backends["flashinfer"].name == "flashinfer"
    ref_tokens, ref_margins, ref_first = greedy(model, backends["torch"], cuda)
    fi_tokens, _, fi_first = greedy(model, backends["flashinfer"], cuda)
    # Against the same weights in float32: FlashInfer's bfloat16 logits are as close as the
    # torch backend's bfloat16 ones (bfloat16 rounding alone moved a logit by 0.1006 on an H200).
    wide = random_llama(num_heads, num_kv_heads, cuda, torch.float32)
    exact_backend = create_backend(cuda, cfg, page_size=PAGE, dtype=torch.float32, name="torch")
    _, _, exact = greedy(wide, exact_backend, cuda, torch.float32)
    torch_error = (ref_first.float() - exact).abs().max().item()
    fi_error = (fi_first.float() - exact).abs().max().item()
    assert fi_error <= 2 * torch_error + LOGIT_FLOOR, (fi_error, torch_error)
    torch.testing.assert_close(fi_first, ref_first, atol=LOGIT_ATOL, rtol=0)
    for ref, got, margin in zip(ref_tokens, fi_tokens, ref_margins, strict=True):
        diverged = next((j for j, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
        if diverged is not None:
            assert margin[diverged] < TIE_MARGIN, (
                f"tokens differ at step {diverged} with a clear margin {margin[diverged]:.3f}: "
                f"reference {ref}, flashinfer {got}"
            )
