"""Sampling on CUDA: every path of the sampler, logprobs, penalties and grammar masks on GPU
logits, compared with the same work on the CPU; then an engine on CUDA (FlashInfer, bfloat16)
running every sampling path at once, watched as tests/unit/engine/test_device_placement.py
watches the CPU engine, but with no host read allowed beyond the one copy of a step's results
(its overlapped decode steps read theirs in engine/transfers.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.logits_processing import RowState, TokenHistory, process_logits
from engine.logprobs import gather, take_raw
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

# Grammar masks and the engine need xgrammar, transformers and gguf (the check's bundle brings
# what the GPU machine lacks): imported by the tests that use them, so tests/gpu collects on a
# machine with torch and FlashInfer alone.

pytestmark = pytest.mark.gpu

VOCAB = 1000
CPU = torch.device("cpu")
FILTERED = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01)


def random_logits(rows: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 3).to(device)


def test_unseeded_rows_draw_from_a_generator_on_the_gpu(cuda: torch.device) -> None:
    sampler = Sampler()
    logits = random_logits(8, 0, cuda)
    ids = sampler.sample(logits, [FILTERED] * 8, [None] * 8)
    assert ids.device == logits.device and ids.dtype == torch.long and ids.shape == (8,)
    assert sampler.generator_for(cuda).device == cuda
    top_k = logits.topk(50, dim=-1).indices
    assert bool((top_k == ids[:, None]).any(dim=1).all())  # every choice within its top-k
    draws = {tuple(sampler.sample(logits, [FILTERED] * 8, [None] * 8).tolist()) for _ in range(4)}
    assert len(draws) > 1  # unseeded: the draws differ


def test_seeded_rows_repeat_on_the_gpu_whatever_shares_the_batch(cuda: torch.device) -> None:
    logits = random_logits(6, 1, cuda)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=5), FILTERED]
    params = params * 2

    def run(rows: list[int]) -> list[int]:
        gens = [
            None if params[i].seed is None else torch.Generator(device=cuda).manual_seed(5)
            for i in rows
        ]
        picked = [params[i] for i in rows]
        return list(Sampler().sample(logits[rows], picked, gens).tolist())

    first, second = run(list(range(6))), run(list(range(6)))
    assert [first[i] for i in (1, 4)] == [second[i] for i in (1, 4)]
    assert run([4]) == [first[4]]  # alone as in the batch
    assert first[0] == int(logits[0].argmax()) and first[3] == int(logits[3].argmax())


def test_logprobs_come_back_as_on_the_cpu(cuda: torch.device) -> None:
    wanted = [2, None, 0, 5]
    cpu_logits = random_logits(4, 2, CPU)
    chosen = cpu_logits.argmax(dim=-1)
    on_cpu = gather(chosen, take_raw(cpu_logits, wanted))
    on_gpu = gather(chosen.to(cuda), take_raw(cpu_logits.to(cuda), wanted))
    assert on_gpu[0] == on_cpu[0] == chosen.tolist()
    assert sorted(on_gpu[1]) == [0, 2, 3]
    for row, expected in on_cpu[1].items():
        got = on_gpu[1][row]
        assert got.token_id == expected.token_id
        assert got.logprob == pytest.approx(expected.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in expected.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in expected.top], abs=1e-4)


def test_penalties_and_logit_bias_change_gpu_logits_as_cpu_ones(cuda: torch.device) -> None:
    params = SamplingParams(
        temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
        logit_bias=((7, 3.0), (9, -2.0)), min_tokens=4,
    )  # fmt: skip
    results = []
    for device in (CPU, cuda):
        history = TokenHistory.of(params, [1, 2, 3, 7], [0], VOCAB, device)
        for token in (5, 5, 9):
            history.append(token)
        rows = [RowState(params, history, 3), RowState(SamplingParams(), None, 0)]
        results.append(process_logits(random_logits(2, 3, device), rows).cpu())
    torch.testing.assert_close(results[1], results[0])
    assert results[0][0, 0] == float("-inf")  # EOS banned before min_tokens
    assert not torch.equal(results[0][0], random_logits(1, 3, CPU)[0])


def test_the_grammar_bitmask_applies_on_the_gpu_as_on_the_cpu(cuda: torch.device) -> None:
    import xgrammar

    from engine.structured.masks import MaskFiller, StepMask

    gen = torch.Generator().manual_seed(4)
    words = -(-VOCAB // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int32)
    rows = [0, 2]
    cpu_logits = random_logits(3, 5, CPU)
    gpu_logits = cpu_logits.to(cuda)
    xgrammar.apply_token_bitmask_inplace(cpu_logits, bitmask, indices=rows, vocab_size=VOCAB)
    MaskFiller.apply(gpu_logits, StepMask(bitmask, rows))
    assert torch.equal(gpu_logits.cpu(), cpu_logits)
    assert bool(cpu_logits[0].isinf().any()) and not bool(cpu_logits[1].isinf().any())


# 4 query heads per KV head (tensor-core decode) and head_dim 64, the modules the check compiled;
# the byte-level vocabulary of tests/support/tiny_llama.py.
ENGINE_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 260,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 257, "eos_token_id": 258,
}  # fmt: skip


def test_an_engine_on_cuda_runs_every_sampling_path_reading_the_gpu_once_a_step(
    cuda: torch.device, prefill_kernel: str, tmp_path: Path
) -> None:
    from bench.serve_model import write_adapter, write_model
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model.loader import load_model
    from radix_cache.radix_prefix_cache import RadixPrefixCache
    from tests.support.step_audit import check_every_path_ran, every_path_requests, run_audited
    from tests.support.tiny_llama import byte_level_tokenizer

    tokenizer_dir = tmp_path / "tokenizer"
    byte_level_tokenizer().save_pretrained(str(tokenizer_dir))
    model_dir = write_model(tmp_path / "model", tokenizer_dir, ENGINE_MODEL, seed=1)
    adapter = write_adapter(tmp_path / "adapter", ENGINE_MODEL, seed=3, rank=4)
    loaded = load_model(str(model_dir), dtype=torch.bfloat16, device=str(cuda))
    config = EngineConfig(
        num_pages=64, max_num_batched_tokens=256, max_num_seqs=16, max_loras=1,
        max_lora_rank=4, speculative_tokens=3, device=str(cuda), prefill_kernel=prefill_kernel,
    )  # fmt: skip
    run = run_audited(
        lambda: LLMEngine(loaded, config, prefix_cache_factory=RadixPrefixCache),
        every_path_requests(adapter),
    )
    assert run.engine.runner.backend.name == "flashinfer"
    check_every_path_ran(run, drafted=False)  # random bfloat16 weights may never repeat
    assert run.audit.no_device == []
    assert run.generators_made == []
    reads = dict(run.audit.host_reads)
    # Overlapped decode steps (on by default on CUDA) read their ids in engine/transfers.py.
    waits = reads.pop(("engine/transfers.py", "wait"), 0)
    assert waits == run.engine.stats.num_overlapped_steps
    assert 0 < reads.pop(("engine/logprobs.py", "gather")) <= run.num_steps - waits
    assert reads == {}  # nothing else waits on the GPU
