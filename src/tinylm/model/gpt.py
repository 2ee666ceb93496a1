"""The GPT-style Transformer language model, in one sitting.

The model maps a sequence of token ids x_0..x_{T-1} to logits u_1..u_T, one vector in R^|V| per
position, with p(x_t | x_<t) = softmax(u_t). The path of one position's vector:

    h = E[x] (+ P[t])                     token embedding (times sqrt(d) with embed_scale), plus a position vector
    n_layer times:                        a Block, each position keeps a d-vector (the residual stream)
        h = h + attn(norm_1(h))           positions exchange information (causally: only the past)
        h = h + mlp(norm_2(h))            each position alone, the same MLP everywhere
    u = norm_f(h) @ W_head                W_head is d x |V|, optionally E^T itself (tied)

(That is pre-norm; post-norm puts the norm after each residual addition instead and has no final
norm; Gemma's "sandwich" also normalizes each sublayer's output before the addition: h = h +
norm_1_out(attn(norm_1(h))).) Training minimises the mean over positions of -log softmax(u_t)[x_t], the next-token
cross-entropy; a target of `IGNORE_INDEX` (-100) is left out of the mean, which is how padded
positions are kept out of the loss.

Usage::

    model = GPT(GPTConfig(vocab_size=100, block_size=64, n_layer=2, d_model=64, n_head=4))
    logits, loss = model(idx, targets)            # idx, targets: (B, T) token ids
    weights = model.attention_weights(idx)        # per layer, (B, nh, T, T), for heatmaps

Initialisation follows GPT-2: every weight matrix and embedding ~ N(0, init_std^2), biases 0, and
the two projections that write into the residual stream (W_o and the MLP's W_2) scaled by
1/sqrt(2 n_layer), so the stream's variance does not grow with depth (2 additions per block).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.model.attention import CausalSelfAttention, KVCacheLayer
from tinylm.model.head_loss import IGNORE_INDEX, head_loss, next_token_loss
from tinylm.model.lora import head_weight
from tinylm.model.memory import check_fits
from tinylm.model.mlp import MLP, mlp_activation  # noqa: F401 (mlp_activation: the fast decoder's)
from tinylm.model.moe import MoE
from tinylm.model.positions import LearnedPositions, RopeScaling, RotaryPositions, SinusoidalPositions


class RMSNorm(nn.Module):
    """RMSNorm (Zhang and Sennrich, 2019): x / sqrt(mean(x^2) + eps) * g. LayerNorm without the mean and the bias."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))  # the gain g

    def forward(self, x: Tensor) -> Tensor:
        # F.rms_norm is exactly the formula above, fused into one kernel
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """One Transformer layer: attention then MLP, each with a norm and a residual connection."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.pre_norm = config.norm_position in ("pre", "sandwich")
        self.norm_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer)
        self.norm_2 = make_norm(config)
        self.mlp = MoE(config) if config.moe_experts else MLP(config)  # MoE: experts behind a router
        # sandwich (Gemma 2 and 3): each sublayer's output normalized too before it joins the stream
        self.norm_1_out = make_norm(config) if config.norm_position == "sandwich" else nn.Identity()
        self.norm_2_out = make_norm(config) if config.norm_position == "sandwich" else nn.Identity()
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        h: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        key_mask: Tensor | None = None,
        kv_cache: KVCacheLayer | None = None,
        need_weights: bool = False,
        ve: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        # The residual form h + f(h) lets each sublayer learn a correction to h rather than a whole
        # new representation, and gives gradients a direct path through a deep stack.
        if self.pre_norm:
            a, weights = self.attn(self.norm_1(h), rope, key_mask, kv_cache, need_weights, ve)
            h = h + self.dropout(self.norm_1_out(a))  # (B, T, d)
            h = h + self.dropout(self.norm_2_out(self.mlp(self.norm_2(h))))  # (B, T, d)
        else:
            a, weights = self.attn(h, rope, key_mask, kv_cache, need_weights, ve)
            h = self.norm_1(h + self.dropout(a))  # (B, T, d)
            h = self.norm_2(h + self.dropout(self.mlp(h)))  # (B, T, d)
        return h, weights


def residual_mlp_projections(mlp: nn.Module) -> list[nn.Linear]:
    """The W_2 of a dense MLP, or of every expert (and the shared one) of a Mixture of Experts: they write into the stream."""
    return [expert.W_2 for expert in mlp.all_experts()] if isinstance(mlp, MoE) else [mlp.W_2]


def check_token_ids(idx: Tensor) -> None:
    """Refuse anything but a (B, T) tensor of integer token ids as a model's input."""
    if idx.dim() != 2 or idx.dtype not in (torch.long, torch.int32):
        raise TinyLMError(f"idx must be a (batch, time) tensor of token ids, got {tuple(idx.shape)} {idx.dtype}")


class GPT(nn.Module):
    """The language model: token ids (B, T) -> next-token logits (B, T, |V|) and, given targets, the loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        check_fits(config)  # a size that cannot fit is refused before the first weight is allocated
        self.config = config
        d = config.d_model
        self.E = nn.Embedding(config.vocab_size, d)  # token embedding: row x is token x's vector
        self.pos_emb: nn.Module | None = None  # added to E[x] ("learned", "sinusoidal")
        self.rope: RotaryPositions | None = None  # applied to q and k in every layer ("rope")
        self.rope_local: RotaryPositions | None = None  # the windowed layers' own, with rope_local_theta
        if config.positions == "learned":
            self.pos_emb = LearnedPositions(config.block_size, d)
        elif config.positions == "sinusoidal":
            self.pos_emb = SinusoidalPositions(d)
        elif config.positions == "rope":
            self.rope = RotaryPositions(config.head_dim, config.rope_theta, RopeScaling.of(config))
            if config.rope_local_theta is not None:
                self.rope_local = RotaryPositions(config.head_dim, config.rope_local_theta)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        # post-norm blocks already end in a norm; pre-norm (and sandwich) leave the stream unnormalized
        self.norm_f = make_norm(config) if config.norm_position != "post" else nn.Identity()
        # optional extra embeddings: the token's value vector (shared by all layers), the hashed pair
        self.V_emb = nn.Embedding(config.vocab_size, config.kv_heads * config.head_dim) if config.value_embed else None
        self.bigram = nn.Embedding(config.bigram_hash, d) if config.bigram_hash else None
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)  # u = h @ lm_head.weight.T
        if config.tie_embeddings:
            # W_head = E^T: the same matrix reads tokens in and scores them out
            self.lm_head.weight = self.E.weight
        self._init_weights()

    def _init_weights(self) -> None:
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
        for block in self.blocks:
            for residual_projection in (block.attn.W_o, *residual_mlp_projections(block.mlp)):
                if self.config.zero_init_projections:
                    nn.init.zeros_(residual_projection.weight)
                else:
                    nn.init.normal_(residual_projection.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
        if self.bigram is not None:
            nn.init.zeros_(self.bigram.weight)  # the model starts as if it had no bigram table
        if not self.config.tie_embeddings and self.config.head_init_std is not None:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=self.config.head_init_std)

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: Sequence[KVCacheLayer] | None = None,
        reduction: str = "mean",
        return_logits: bool = True,
        segment_ids: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Logits (B, T, |V|) for token ids ``idx`` (B, T), and the next-token loss if ``targets`` is given.

        - ``targets`` (B, T): the token each position should predict (idx shifted left by one);
          `IGNORE_INDEX` (-100) marks positions left out of the loss, such as padding.
        - ``attention_mask`` (B, T_k), bool or 0/1, False at padding: padded positions are hidden
          from attention. With a KV cache it covers the cached positions too (T_k = T_past + T).
        - ``position_ids`` (T,) or (B, T): each token's position. By default 0, 1, ... counted over
          the real tokens only (so a left-padded row starts at 0) and continuing after the cache.
        - ``kv_cache``: one `KVCacheLayer` per block; the keys and values of these T tokens are
          appended to it and attention runs over everything stored. With a bigram-hash table the
          cache also keeps each row's last token (``last_tokens``), the first half of the next pair.
        - ``reduction``: "mean" (over the targets that count) or "sum".
        - ``return_logits=False`` (with ``targets``): only the loss; the head and the loss are computed
          a slice of positions at a time (`head_loss`), never holding all (B, T, |V|) logits, and the
          logits returned are None. Training a Transformer under bfloat16 autocast on a CPU uses it:
          it is faster and leaner there.
        - ``segment_ids`` (B, T): several sequences packed into one row (fine-tuning's conversations),
          each a run of equal ids. A token attends only to the earlier tokens of its own sequence, its
          position counts from that sequence's start, and it predicts as if the row held it alone.
        """
        if reduction not in ("mean", "sum"):
            raise TinyLMError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        h, _ = self._run(idx, attention_mask, position_ids, kv_cache, need_weights=False, segment_ids=segment_ids)
        if targets is not None and not return_logits:
            device = h.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
            loss = head_loss(h.flatten(0, 1), head_weight(self.lm_head), targets.flatten(), dtype, self.config.logit_softcap)
            if reduction == "mean":  # as F.cross_entropy: NaN when no target counts
                loss = loss / (targets != IGNORE_INDEX).sum()
            return None, loss
        logits = self.lm_head(h)  # (B, T, |V|)
        if self.config.logit_softcap is not None:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)  # (B, T, |V|), every entry in (-cap, cap)
        loss = None
        if targets is not None:
            loss = next_token_loss(logits, targets, reduction)
        return logits, loss

    @torch.no_grad()
    def attention_weights(
        self, idx: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> list[Tensor]:
        """Every layer's attention weights, (B, nh, T, T) each, row i the distribution of query i over keys.

        Computed by the reference implementation whatever ``config.attention`` says (the others never
        form the weights); the model's outputs are the same either way.
        """
        _, weights = self._run(idx, attention_mask, position_ids, None, need_weights=True)
        return weights

    def bigram_ids(self, idx: Tensor, key_padding_mask: Tensor | None = None, kv_cache=None,
                   segment_ids: Tensor | None = None) -> Tensor:
        """The bigram table's row for each position of ``idx`` (B, T): 1 + (prev * 1000003 + cur) mod (B - 1).

        The previous token is the one before in ``idx``; for the first position it is the last token
        the cache has read (``kv_cache.last_tokens``), and where there is none (a window's start, or
        padding before) the row is 0.
        """
        buckets = self.config.bigram_hash
        prev = torch.roll(idx, 1, dims=1)  # (B, T): prev[:, t] = idx[:, t - 1], wrapped at t = 0
        has_prev = torch.ones_like(idx, dtype=torch.bool)
        has_prev[:, 0] = False
        last = getattr(kv_cache, "last_tokens", None) if kv_cache is not None else None
        if last is not None and kv_cache.length > 0:
            prev[:, 0] = last.to(idx.device)  # (B,): the token each row read last
            has_prev[:, 0] = True
        if key_padding_mask is not None:  # (B, T_k): a padded previous position is no previous token
            T = idx.size(1)
            if key_padding_mask.size(1) > T:
                before = key_padding_mask[:, -T - 1:-1]  # (B, T)
            else:
                before = F.pad(key_padding_mask[:, :-1], (1, 0), value=False)  # (B, T)
            has_prev &= before
        if segment_ids is not None:  # the previous position of another packed sequence is no previous token
            has_prev[:, 1:] &= segment_ids[:, 1:] == segment_ids[:, :-1]
        ids = 1 + (prev.long() * 1000003 + idx.long()) % (buckets - 1)  # (B, T), in 1..B-1
        return torch.where(has_prev, ids, torch.zeros_like(ids))

    def _run(
        self,
        idx: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        kv_cache: Sequence[KVCacheLayer] | None,
        need_weights: bool,
        segment_ids: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """The final hidden states (B, T, d) and, if asked, each layer's attention weights."""
        check_token_ids(idx)
        B, T = idx.shape
        T_past = 0
        if kv_cache is not None:
            if len(kv_cache) != self.config.n_layer:
                raise TinyLMError(f"kv_cache needs one entry per layer ({self.config.n_layer}), got {len(kv_cache)}")
            T_past = kv_cache[0].length
        if T_past + T > self.config.block_size:
            raise TinyLMError(
                f"{T_past + T} positions do not fit the model's context of block_size = {self.config.block_size}; "
                f"shorten the input (or keep only its last {self.config.block_size} tokens)"
            )
        key_padding_mask = None
        if attention_mask is not None:
            if attention_mask.shape != (B, T_past + T):
                raise TinyLMError(
                    f"attention_mask must be (batch, {T_past + T}) to cover every key, got {tuple(attention_mask.shape)}"
                )
            key_padding_mask = attention_mask.bool()  # (B, T_k)
        key_mask = key_padding_mask
        if segment_ids is not None:
            key_mask, segment_positions = self._segments(segment_ids, idx, key_padding_mask, kv_cache)
            position_ids = segment_positions if position_ids is None else position_ids
        if position_ids is None:
            if key_padding_mask is not None:
                # count real tokens only: position = (number of real tokens up to here) - 1
                position_ids = (key_padding_mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, T_past:]  # (B, T)
            else:
                position_ids = torch.arange(T_past, T_past + T, device=idx.device)  # (T,)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]  # (1, T), broadcast over the batch

        h = self.E(idx)  # (B, T, d)
        if self.config.embed_scale:
            # Gemma: rows of E have about the head's scale; sqrt(d) brings them to the stream's
            h = h * math.sqrt(self.config.d_model)
        if self.bigram is not None:
            h = h + self.bigram(self.bigram_ids(idx, key_padding_mask, kv_cache, segment_ids))  # (B, T, d)
        ve = self.V_emb(idx) if self.V_emb is not None else None  # (B, T, n_kv * hs)
        if self.pos_emb is not None:
            h = h + self.pos_emb(position_ids)  # (B, T, d)
        h = self.dropout(h)
        rope = self.rope(position_ids) if self.rope is not None else None  # 2 x (B or 1, 1, T, hs)
        rope_local = self.rope_local(position_ids) if self.rope_local is not None else rope
        if self.bigram is not None and kv_cache is not None:
            # the next call's first pair starts with each row's last token (rows are left-padded:
            # the last column is real)
            kv_cache.last_tokens = idx[:, -1].detach()  # (B,)
        all_weights: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            layer_cache = kv_cache[i] if kv_cache is not None else None
            layer_rope = rope_local if block.attn.window is not None else rope
            h, weights = block(h, layer_rope, key_mask, layer_cache, need_weights, ve)
            if weights is not None:
                all_weights.append(weights)
        return self.norm_f(h), all_weights  # (B, T, d)

    @staticmethod
    def _segments(segment_ids: Tensor, idx: Tensor, key_padding_mask: Tensor | None,
                  kv_cache: Sequence[KVCacheLayer] | None) -> tuple[Tensor, Tensor]:
        """Packed sequences: which keys each query may see, (B, 1, T, T), and each token's position in its sequence."""
        if segment_ids.shape != idx.shape:
            raise TinyLMError(f"segment_ids must be (batch, T) like the input, {tuple(idx.shape)}; "
                              f"got {tuple(segment_ids.shape)}")
        if kv_cache is not None or key_padding_mask is not None:
            raise TinyLMError("segment_ids pack whole sequences into a row, without a kv_cache or an attention_mask; "
                              "give padding a segment id of its own instead")
        B, T = segment_ids.shape
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # (B, 1, T, T)
        t = torch.arange(T, device=segment_ids.device).expand(B, T)  # (B, T)
        starts = torch.ones_like(segment_ids, dtype=torch.bool)
        starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]  # (B, T): where a sequence begins
        first = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values  # (B, T): its start
        return same, t - first  # (B, 1, T, T), (B, T)
