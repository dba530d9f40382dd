"""FlashInfer against the torch backend on CUDA over random paged batches.

Head groups: 8/2 decodes on tensor cores (FA2's prefill kernel), 9/3 (the default model's) on the
plain decode kernel. Tolerance: FlashInfer runs in bfloat16 and is compared with the torch backend
run in float32 on the same (bf16-representable) inputs, within atol = rtol = 2e-2 (a few bf16 ulps
of outputs ~1).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.backend import AttentionBackend
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.gpu

PAGE, NUM_PAGES, D = 16, 256, 64
HEADS = [(8, 2), (9, 3)]
TOL = 2e-2


def random_step(rng: random.Random, decode_only: bool) -> list[SeqSlice]:
    """Fresh prompts, chunks over cached prefixes, decodes; ragged last pages; shuffled page ids."""
    free = list(range(NUM_PAGES))
    rng.shuffle(free)
    seqs = []
    for _ in range(rng.randint(1, 8)):
        kind = "decode" if decode_only else rng.choice(["fresh", "chunk", "decode"])
        computed = 0 if kind == "fresh" else rng.randint(1, 300)
        new = 1 if kind == "decode" else rng.randint(2, 200)
        num_pages = -(-(computed + new) // PAGE)
        seqs.append(SeqSlice([free.pop() for _ in range(num_pages)], computed, new))
    return seqs


def run(
    backend: AttentionBackend, seqs: list[SeqSlice], inputs: list[torch.Tensor], cache: torch.Tensor
) -> torch.Tensor:
    backend.plan(build_attention_metadata(seqs, PAGE, cache.device))
    q, k, v = inputs
    return backend.forward(0, q, k, v, cache)


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("use_decode_kernel", [True, False])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
def test_flashinfer_matches_the_torch_backend(
    cuda: torch.device,
    prefill_kernel: str,
    hq: int,
    hkv: int,
    seed: int,
    decode_only: bool,
    use_decode_kernel: bool,
) -> None:
    rng = random.Random(seed)
    gen = torch.Generator(device=cuda).manual_seed(seed)
    seqs = random_step(rng, decode_only)
    n = sum(s.num_new_tokens for s in seqs)
    shapes = [(n, hq, D), (n, hkv, D), (n, hkv, D)]
    inputs = [torch.randn(s, device=cuda, generator=gen).bfloat16() for s in shapes]
    cache = torch.randn(NUM_PAGES, 2, PAGE, hkv, D, device=cuda, generator=gen).bfloat16()

    flash = FlashInferAttentionBackend(
        hq, hkv, D, PAGE, torch.bfloat16, cuda, num_pages=NUM_PAGES,
        use_decode_kernel=use_decode_kernel, prefill_kernel=prefill_kernel,
    )  # fmt: skip
    fi_cache = cache.clone()
    out = run(flash, seqs, inputs, fi_cache)
    ref_cache = cache.float()
    ref = run(TorchAttentionBackend(), seqs, [t.float() for t in inputs], ref_cache)

    assert out.dtype == torch.bfloat16 and out.shape == (n, hq, D)
    torch.testing.assert_close(out.float(), ref, atol=TOL, rtol=TOL)
    assert torch.equal(fi_cache.float(), ref_cache)  # same slots written, bit for bit


@pytest.mark.parametrize(("hq", "hkv"), HEADS)
def test_two_steps_reuse_the_pages_the_first_one_wrote(
    cuda: torch.device, prefill_kernel: str, hq: int, hkv: int
) -> None:
    """A prompt prefilled in two chunks, then decoded: every step reads what the last wrote."""
    gen = torch.Generator(device=cuda).manual_seed(7)
    flash = FlashInferAttentionBackend(
        hq, hkv, D, PAGE, torch.bfloat16, cuda, prefill_kernel=prefill_kernel
    )
    ref = TorchAttentionBackend()
    fi_cache = torch.zeros(NUM_PAGES, 2, PAGE, hkv, D, device=cuda, dtype=torch.bfloat16)
    ref_cache = fi_cache.float()
    pages = [9, 3, 40, 17, 5]
    for computed, new in [(0, 37), (37, 30), (67, 1), (68, 1)]:
        seqs = [SeqSlice(pages, computed, new)]
        shapes = [(new, hq, D), (new, hkv, D), (new, hkv, D)]
        inputs = [torch.randn(s, device=cuda, generator=gen).bfloat16() for s in shapes]
        out = run(flash, seqs, inputs, fi_cache)
        expected = run(ref, seqs, [t.float() for t in inputs], ref_cache)
        torch.testing.assert_close(out.float(), expected, atol=TOL, rtol=TOL)
