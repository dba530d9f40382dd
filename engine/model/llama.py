"""The Llama-family decoder over a flattened, unpadded batch; what other architectures (Mistral,
Qwen2/3, Phi-3, Gemma 2/3) change is read from ``config.spec`` (``architectures.py``).

Each layer is a handful of kernels: fused QKV and gate/up matmuls, RoPE on Q and K together in
place, and the residual adds folded into the output projections (``addmm``). On CPU the
projection weights are also kept pre-packed for oneDNN (``packed_linear``; bf16 and float32),
which gives the same results (float32: to rounding) faster, and RMSNorm and RoPE run as one C
pass each (``native_ops``) where the C compiler is available.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.functional import rms_norm

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.load_progress import LoadProgress, NullProgress
from engine.model.config import ModelConfig
from engine.model.mlp import MLP, Scratch
from engine.model.native_ops import DTYPES as NATIVE_DTYPES
from engine.model.native_ops import NativeOps, load_native_ops
from engine.model.packed_linear import (
    PAIR_BATCH,
    SMALL_BATCH,
    Packed,
    gather_pairs,
    pack,
    packing_supported,
    project,
    project_add,
)
from engine.model.rope import RopeTables, rope_cos_sin, rope_inplace, signed_sin

if TYPE_CHECKING:
    from engine.lora.batch import LoraStep


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native: NativeOps | None = None  # see ``LlamaForCausalLM.use_native_ops``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (as the reference implementation does).
        if self.native is not None and x.dtype in NATIVE_DTYPES:
            return self.native.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.layer = config.attention_layers[layer_id]
        # Qwen3: an RMSNorm over each head of Q and K (torch's: the rows are strided views).
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qkv_packed: Packed | None = None  # see ``LlamaForCausalLM.pack_weights``
        self.o_packed: Packed | None = None
        self.native: NativeOps | None = None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden], normalised
        residual: torch.Tensor | None,  # [num_tokens, hidden], or None: the output alone
        rope: RopeTables,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        rows: torch.Tensor | None = None,  # [num_out] int64: the only rows returned, or all
        lora: LoraStep | None = None,  # the step's adapters, if any row has one
    ) -> torch.Tensor:  # [num_out, hidden]: residual + attention output
        n, d = x.shape[0], self.head_dim
        qkv_proj = self.qkv_proj
        qkv = project(x, qkv_proj.weight, self.qkv_packed, qkv_proj.bias)  # [n, q + 2 * kv]
        if lora is not None:
            lora.add(self.layer_id, "qkv", x, qkv)
        qk_end = self.q_size + self.kv_size
        if self.q_norm is not None and self.k_norm is not None:
            q_heads = qkv[:, : self.q_size].view(n, self.num_heads, d)
            k_heads = qkv[:, self.q_size : qk_end].view(n, self.num_kv_heads, d)
            q_heads.copy_(self.q_norm(q_heads))
            k_heads.copy_(self.k_norm(k_heads))
        # Q and K heads side by side: one rotation for both, written back into ``qkv``.
        qk = qkv[:, :qk_end].view(n, -1, d)
        if self.native is not None and qk.dtype in NATIVE_DTYPES:
            self.native.rope(qk, rope.cos, rope.sin)
        else:
            rope_inplace(qk, rope)
        q = qkv[:, : self.q_size].view(n, self.num_heads, d)
        k = qkv[:, self.q_size : qk_end].view(n, self.num_kv_heads, d)
        v = qkv[:, qk_end:].view(n, self.num_kv_heads, d)
        if self.layer.plain:
            out = backend.forward(self.layer_id, q, k, v, kv_cache)  # [n, heads, head_dim]
        else:
            out = backend.forward_layer(self.layer_id, q, k, v, kv_cache, self.layer)
        out = out.reshape(n, self.q_size)
        if rows is not None:  # every row's K/V is written above; only these go on
            out = out.index_select(0, rows)
        if residual is None:
            projected = project(out, self.o_proj.weight, self.o_packed)
        else:
            if rows is not None:
                residual = residual.index_select(0, rows)
            projected = project_add(out, self.o_proj.weight, self.o_packed, residual)
        if lora is not None:
            lora.add(self.layer_id, "o", out, projected, rows is not None)
        return projected


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, scratch: Scratch | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer_id, scratch)
        # Gemma 2's sandwich: a norm on the attention's and on the MLP's output too.
        self.attn_out_norm: RMSNorm | None = None
        self.mlp_out_norm: RMSNorm | None = None
        if config.spec.sandwich_norms:
            self.attn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: RopeTables,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
        rows: torch.Tensor | None = None,  # [num_out] int64: the only rows returned, or all
        lora: LoraStep | None = None,
    ) -> torch.Tensor:  # [num_out, hidden]
        sampled = rows is not None
        if self.attn_out_norm is not None and self.mlp_out_norm is not None:
            h = self.self_attn(self.input_layernorm(x), None, rope, backend, kv_cache, rows, lora)
            x = (x if rows is None else x.index_select(0, rows)) + self.attn_out_norm(h)
            h = self.mlp(self.post_attention_layernorm(x), None, lora, sampled)
            sandwiched: torch.Tensor = x + self.mlp_out_norm(h)
            return sandwiched
        x = self.self_attn(self.input_layernorm(x), x, rope, backend, kv_cache, rows, lora)
        out: torch.Tensor = self.mlp(self.post_attention_layernorm(x), x, lora, sampled)
        return out


class LlamaForCausalLM(nn.Module):
    """Build it (on the meta device for speed), then call :meth:`load_weights`."""

    rope_cos: torch.Tensor  # [max_positions, head_dim], model dtype
    rope_sin: torch.Tensor  # [max_positions, head_dim], model dtype, first half negated
    # The sliding layers' own tables where their RoPE base differs (Gemma 3), else empty.
    rope_local_cos: torch.Tensor
    rope_local_sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Given a weight, the embedding skips its random init (under the meta device, that init
        # would import torch's compiler stack, seconds of loading for nothing).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        scratch = Scratch()
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, scratch) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.output_packed: Packed | None = None
        for name in ("rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin"):
            self.register_buffer(name, torch.empty(0), persistent=False)
        # Per layer, whether it rotates with the local tables.
        local = config.rope_local_theta is not None
        self.local_rope = tuple(
            local and config.window(i) is not None for i in range(config.num_layers)
        )

    def load_weights(
        self, state: Mapping[str, torch.Tensor], progress: LoadProgress | None = None
    ) -> None:
        """Adopt ``state`` (our fused names, final dtype and device) and build the RoPE table;
        ``progress`` is told of the packing, where it applies."""
        self.load_state_dict(dict(state), strict=True, assign=True)
        weight = self.embed_tokens.weight
        c = self.config
        cos, sin = rope_cos_sin(
            c.head_dim,
            c.rope_theta,
            c.rope_scaling,
            c.max_position_embeddings,
            weight.device,
            c.rope_freq_factors,
        )
        # The table is computed in float32 and cast once, like the reference per-step cast.
        self.rope_cos = cos.to(weight.dtype)
        self.rope_sin = signed_sin(sin).to(weight.dtype)
        if c.rope_local_theta is not None:
            cos, sin = rope_cos_sin(
                c.head_dim, c.rope_local_theta, None, c.max_position_embeddings, weight.device
            )
            self.rope_local_cos = cos.to(weight.dtype)
            self.rope_local_sin = signed_sin(sin).to(weight.dtype)
        self.eval()
        self.pack_weights(progress)
        native = weight.device.type == "cpu" and weight.dtype in NATIVE_DTYPES
        self.use_native_ops(load_native_ops() if native else None)

    def use_native_ops(self, ops: NativeOps | None) -> None:
        """RMSNorm and RoPE through ``ops`` (bf16 and float32 on CPU), or torch with None."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention):
                module.native = ops
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                if norm is not None:  # it runs over strided head views: torch's
                    norm.native = None

    def pack_weights(self, progress: LoadProgress | None = None) -> bool:
        """Keep a oneDNN-packed copy of every projection where that applies (CPU, bf16 or float32);
        the parameters stay as they are (state dict, export). Returns whether it applied.
        ``progress`` is told of each weight (the first of a shape may take seconds: its small
        products are checked against oneDNN's)."""
        if not packing_supported(self.output_weight):
            return False
        progress = progress or NullProgress()
        # (module, attribute for its packed copy, weight, largest step the pair product takes)
        slots: list[tuple[nn.Module, str, torch.Tensor, int]] = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            slots += [
                (attn, "qkv_packed", attn.qkv_proj.weight, PAIR_BATCH),
                (attn, "o_packed", attn.o_proj.weight, PAIR_BATCH),
                (mlp, "gate_up_packed", mlp.gate_up_proj.weight, PAIR_BATCH),
                (mlp, "down_packed", mlp.down_proj.weight, PAIR_BATCH),
            ]
        # The LM head takes one row per sampled sequence: checked up to decode batch sizes.
        slots.append((self, "output_packed", self.output_weight, SMALL_BATCH))
        # The pair layouts in one buffer on huge pages (they are streamed every decode step).
        progress.stage("pack weights", total=len(slots), unit="weights")
        packs: list[Packed | None] = []
        for _, _, weight, rows in slots:
            packs.append(pack(weight, rows))
            progress.advance()
        packs = gather_pairs(packs)
        for (module, name, _, _), packed in zip(slots, packs, strict=True):
            setattr(module, name, packed)
        return True

    @property
    def output_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],  # per layer [num_pages, 2, page_size, kv_heads, head_dim]
        logits_indices: torch.Tensor,  # [num_logits] int64
        lora: LoraStep | None = None,  # the step's LoRA adapters; None when no row has one
        plan: bool = True,
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        """Run one step; plans the backend for ``meta`` first (unless ``plan`` is False: the
        caller planned it, as a CUDA graph's replay needs), then writes K/V per layer."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} KV caches, got {len(kv_caches)}")
        if plan:
            backend.plan(meta)
        # Gathered once per step, shared by every layer: [num_tokens, 1, head_dim] each.
        rope = RopeTables(
            self.rope_cos.index_select(0, positions).unsqueeze(1),
            self.rope_sin.index_select(0, positions).unsqueeze(1),
        )
        local_rope = rope
        if any(self.local_rope):
            local_rope = RopeTables(
                self.rope_local_cos.index_select(0, positions).unsqueeze(1),
                self.rope_local_sin.index_select(0, positions).unsqueeze(1),
            )
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.config.spec.embed_scale:  # Gemma: by sqrt(hidden), rounded to the model dtype
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype, device=x.device)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            # The last layer runs its output projection and MLP on the sampled rows alone: the
            # other rows' K/V are all that later steps read of them (a prefill chunk's rows
            # but its last, ~3% of a prefill step's products).
            tables = local_rope if self.local_rope[i] else rope
            x = layer(x, tables, backend, kv_cache, logits_indices if i == last else None, lora)
        x = self.norm(x)  # [num_logits, hidden]
        logits = project(x, self.output_weight, self.output_packed).float()  # [num_logits, vocab]
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
