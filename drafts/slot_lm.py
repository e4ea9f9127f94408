"""A Llama-family draft LM over a preallocated cache, its forward compiled
(eval.draft_compile for independent and PARD drafts).

decoding/kv.py's CachedLM runs an HF model through its forward: per drafted token the mask
building, cache objects and hundreds of small operator calls of six decoder layers cost more
than their products on a CPU. SlotLM runs the same arithmetic on the model's own weights, fused
(q/k/v one product, gate and up one, norms torch's rms_norm, rotary from a table), over a
drafts.slots.SlotKV cache, with CachedLM's interface (prefill, extend, reject_last,
extend_tree, drop_tree) so that the independent and PARD drafts run either. With CompiledSteps,
prefill and every extension are one torch.compile'd call that sees the cache as its whole
buffers (the first slot written passed as a tensor, the capacity and the number of tokens
dynamic dimensions, slots written in place), so that two or three compilations serve every
step; a greedy chain of k (the pending tokens, then k - 1 drafted ones, each chosen by argmax)
is one more compiled call, one per k. Trees run the same functions eager. Inductor may fuse
and round differently from eager, so a compiled draft can propose another token in a near
tie; verification reads the draft's own logits as they are, so decoding stays lossless either
way.

Architectures: Llama, Qwen2, Qwen3 (its q/k norms) and Mistral without a sliding window, the
families whose decoder layer is RMSNorm, rotary GQA attention and a gated MLP; others, and any
sliding-window attention, are refused with the fix (eval.draft_compile=false).
"""

from __future__ import annotations

import torch
from torch import nn

from decoding.kv import head_rows
from drafts.eagle3.head import attend, rotate_half
from drafts.fused import CompiledSteps, RotaryTable, fuse_linears, mark_capacity_dynamic, rms_norm
from drafts.slots import SlotKV
from recipe import ConfigError

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def check_slot_lm(model) -> None:
    """Refuse a model SlotLM cannot run exactly, naming why and the fix."""
    config = model.config
    family = getattr(config, "model_type", type(model).__name__)
    fix = "set eval.draft_compile=false to draft with it eager."
    if family not in FAMILIES:
        raise ConfigError(f"eval.draft_compile=true: compiled steps run independent drafts of "
                          f"the {', '.join(FAMILIES)} families, and this draft is a {family} "
                          f"model: {fix}")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    sliding = layer_types != {"full_attention"} or (
        family == "mistral" and getattr(config, "sliding_window", None) is not None)
    if sliding:
        raise ConfigError(f"eval.draft_compile=true: this {family} draft attends through a "
                          f"sliding window, which compiled steps do not apply: {fix}")


class FusedDecoder:
    """The model's weights in the forms a step runs: per layer q/k/v one product, gate and up
    one (decoding.quantise layers when the model runs on quantised weights), norms as
    (weight, eps); the head restricted to a draft vocabulary's rows. Weights are shared or
    copied when made: a model trained further needs a new FusedDecoder."""

    def __init__(self, model, vocabulary: torch.Tensor | None = None):
        check_slot_lm(model)
        config, decoder = model.config, model.get_decoder()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.groups = self.heads // self.kv_heads
        self.split = (self.heads * self.head_dim, self.kv_heads * self.head_dim,
                      self.kv_heads * self.head_dim)
        self.embedding = decoder.embed_tokens
        self.dtype = decoder.norm.weight.dtype
        self.layers = [self._layer(layer) for layer in decoder.layers]
        self.final = _norm(decoder.norm)
        head = model.get_output_embeddings()
        self.head = head if vocabulary is None else head_rows(
            head, vocabulary.to(decoder.norm.weight.device))
        self.cos_sin = RotaryTable(decoder.rotary_emb, self.head_dim)

    @staticmethod
    def _layer(layer) -> dict:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return {"input": _norm(layer.input_layernorm),
                "post": _norm(layer.post_attention_layernorm),
                "qkv": fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]), "o": attn.o_proj,
                "gate_up": fuse_linears([mlp.gate_proj, mlp.up_proj]), "down": mlp.down_proj,
                "act": mlp.act_fn, "q_norm": None if q_norm is None else _norm(q_norm),
                "k_norm": None if k_norm is None else _norm(k_norm)}

    def forward(self, tokens, cos, sin, keys, values, slots, allowed):
        """tokens [B, t] enter the cache at slots [t] (keys, values: per layer [B, kv, C, d],
        written in place) with rotary cos, sin [B, 1, t, d]; token i sees the slots allowed
        [B, t, C] -> the final norm's output [B, t, H]."""
        batch, t = tokens.shape
        x = self.embedding(tokens).to(self.dtype)
        for layer, layer_keys, layer_values in zip(self.layers, keys, values):
            q, k, v = layer["qkv"](rms_norm(x, *layer["input"])).split(self.split, dim=-1)
            q = q.view(batch, t, self.heads, self.head_dim)
            k = k.view(batch, t, self.kv_heads, self.head_dim)
            if layer["q_norm"] is not None:  # Qwen3: per head, before rotary
                q, k = rms_norm(q, *layer["q_norm"]), rms_norm(k, *layer["k_norm"])
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(batch, t, self.kv_heads, self.head_dim).transpose(1, 2)
            layer_keys.index_copy_(2, slots, k * cos + rotate_half(k) * sin)
            layer_values.index_copy_(2, slots, v)
            attended = attend(q * cos + rotate_half(q) * sin, layer_keys, layer_values, allowed,
                              self.groups)  # [B, n, t, d]
            x = x + layer["o"](attended.transpose(1, 2).reshape(batch, t, -1))
            gate, up = layer["gate_up"](rms_norm(x, *layer["post"])).chunk(2, dim=-1)
            x = x + layer["down"](layer["act"](gate) * up)
        return rms_norm(x, *self.final)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V], or [..., Vd] with a draft vocabulary."""
        if isinstance(self.head, nn.Linear):  # quantised layers take any dtype
            hidden = hidden.to(self.head.weight.dtype)
        return self.head(hidden)


def _norm(norm: nn.Module) -> tuple[torch.Tensor, float]:
    return norm.weight, norm.variance_epsilon


def visible(mask: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A chain's attention: tokens at slots [t] of a cache whose slot mask [B, C] already holds
    them see the kept slots up to their own and themselves -> allowed [B, t, C]."""
    every = torch.arange(mask.shape[1], device=mask.device)  # [C]
    before = every[None, :] <= slots[:, None]  # [t, C]
    return (before[None] & mask[:, None, :]) | (every[None, :] == slots[:, None])[None]


def _dynamic_width(tokens, valid, cos, sin) -> None:
    """tokens, valid [B, t] and rotary cos, sin [B, 1, t, d]: t a dynamic dimension."""
    for tensor, dim in ((tokens, 1), (valid, 1), (cos, 2), (sin, 2)):
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


class SlotLM:
    """CachedLM's interface over a FusedDecoder and a SlotKV cache: the slot mask with holes,
    each row's next position [B]; logits over the draft vocabulary when the decoder has one.
    steps: CompiledSteps that run prefill and extend, each one compiled call (None: eager);
    trees run eager."""

    def __init__(self, decoder: FusedDecoder, steps: CompiledSteps | None = None):
        self.decoder, self.steps = decoder, steps
        self.slots: SlotKV | None = None
        self.next_position: torch.Tensor | None = None  # [B] valid tokens so far

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Left-padded prompts [B, T] -> logits of the last position [B, V]."""
        d = self.decoder
        batch, length = input_ids.shape
        self.slots = SlotKV(batch, len(d.layers), d.kv_heads, d.head_dim, d.dtype,
                            input_ids.device, capacity=max(256, 2 * length))
        self.next_position = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
        valid = attention_mask.bool()
        positions = (attention_mask.cumsum(1) - 1).clamp(min=0)  # [B, T]
        logits = self._run(input_ids, positions, valid, last_only=True)
        self.next_position = attention_mask.sum(1)
        return logits[:, -1]

    def _run(self, tokens, positions, valid, seen=None, last_only=False) -> torch.Tensor:
        """tokens [B, t] at positions [B, t] into the next t slots (valid [B, t]); each sees
        the kept slots before it and itself (_extend, compiled with steps), or with seen
        [B, t, t] (a tree, eager) the cache's kept slots and the tree's nodes it sees -> logits
        [B, t (1 if last_only), V]."""
        slots, t = self.slots, tokens.shape[1]
        start = slots.length
        slots.reserve(t)
        slots.length += t
        cos, sin = self.decoder.cos_sin(self.decoder.final[0], positions, slots.length)
        if seen is None:
            # fresh strides: a [B, 1] slice of a wider tensor would recompile on its stride
            tokens, valid = (x.clone(memory_format=torch.contiguous_format)
                             for x in (tokens, valid))
            args = (tokens, valid, *self._buffers(), self._slot(start, tokens), cos, sin,
                    last_only)
            if self.steps is None:
                return self._extend(*args)
            name = "extend, last logits" if last_only else "extend"
            if name not in self.steps:
                self.steps.add(name, self._extend, fixed=True)
            _dynamic_width(tokens, valid, cos, sin)  # t varies call to call
            return self.steps(name, *args)
        keys = [slots.keys(i) for i in range(len(self.decoder.layers))]  # views [.., end, d]
        values = [slots.values(i) for i in range(len(self.decoder.layers))]
        index = start + torch.arange(t, device=tokens.device)  # [t]
        slots.mask[:, start:] = valid
        batch = tokens.shape[0]
        allowed = torch.cat([slots.mask[:, None, :start].expand(batch, t, start), seen], dim=2)
        hidden = self.decoder.forward(tokens, cos, sin, keys, values, index, allowed)
        return self.decoder.logits(hidden[:, -1:] if last_only else hidden)

    def _extend(self, tokens, valid, keys, values, mask, start, cos, sin, last_only: bool):
        """_run's static form: tokens [B, t] (valid [B, t]) enter slots start .. start + t - 1
        of the whole buffers -> logits [B, t (1 if last_only), V or Vd]."""
        index = start + torch.arange(tokens.shape[1], device=tokens.device)  # [t]
        mask.index_copy_(1, index, valid)
        hidden = self.decoder.forward(tokens, cos, sin, keys, values, index, visible(mask, index))
        return self.decoder.logits(hidden[:, -1:] if last_only else hidden)

    @torch.no_grad()
    def chain(self, tokens: torch.Tensor, valid: torch.Tensor, k: int,
              ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy chain of k >= 2 as one compiled call: the pending tokens [B, t] (valid
        [B, t]) enter the cache, then the k - 1 first drafted tokens (the last one is never
        fed); ids [Vd] maps a draft vocabulary's index to the target id the LM embeds (None:
        the full vocabulary) -> drafted indices [B, k] (into the head's rows), their logits
        [B, k, V or Vd]."""
        slots, t = self.slots, tokens.shape[1]
        start = slots.length
        slots.reserve(t + k - 1)
        steps = valid.long()
        positions = self.next_position[:, None] + steps.cumsum(1) - steps  # [B, t]
        following = self.next_position[:, None] + steps.sum(1, keepdim=True) + torch.arange(
            k - 1, device=tokens.device)  # [B, k - 1] the drafted tokens' positions
        limit = start + t + k - 1
        cos, sin = self.decoder.cos_sin(self.decoder.final[0], positions, limit)
        chain_cos, chain_sin = self.decoder.cos_sin(self.decoder.final[0], following, limit)
        tokens, valid = (x.clone(memory_format=torch.contiguous_format) for x in (tokens, valid))
        args = (tokens, valid, *self._buffers(), self._slot(start, tokens), cos, sin,
                chain_cos, chain_sin, ids)
        if self.steps is None:
            out = self._chain(*args)
        else:
            name = f"chain {k}"  # k is a constant of its code: each k compiles its own copy
            if name not in self.steps:
                self.steps.add(name, self._chain, fixed=True)
            _dynamic_width(tokens, valid, cos, sin)
            out = self.steps(name, *args)
        slots.length += t + k - 1
        self.next_position = self.next_position + steps.sum(1) + k - 1
        return out

    def _chain(self, tokens, valid, keys, values, mask, start, cos, sin, chain_cos, chain_sin,
               ids):
        """chain's static form: the pending tokens [B, t] through _extend, then k - 1 drafted
        tokens (rotary chain_cos, chain_sin [B, 1, k - 1, d]: a static shape) one at a time
        at the slots after them -> drafted indices [B, k], logits [B, k, V or Vd]."""
        logits = self._extend(tokens, valid, keys, values, mask, start, cos, sin, True)[:, -1]
        drafted, scores = [], [logits]
        ones = valid.new_ones(valid.shape[0], 1)  # [B, 1]
        for i in range(chain_cos.shape[2]):
            drafted.append(logits.argmax(-1))  # [B] greedy, as draw() of a one-hot q
            fed = drafted[-1] if ids is None else ids[drafted[-1]]
            logits = self._extend(fed[:, None], ones, keys, values, mask,
                                  start + tokens.shape[1] + i, chain_cos[:, :, i:i + 1],
                                  chain_sin[:, :, i:i + 1], True)[:, -1]
            scores.append(logits)
        drafted.append(logits.argmax(-1))
        return torch.stack(drafted, 1), torch.stack(scores, 1)

    def rewind(self, length: int, next_position: torch.Tensor) -> None:
        """Back to a cache of length slots whose rows' next positions are next_position [B]
        (what the cache was before a chain): the later slots leave it."""
        self.slots.crop(self.slots.length - length)
        self.next_position = next_position

    def _buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """The cache's whole buffers (keys, values per layer, the slot mask), their capacity
        a dynamic dimension of the compiled functions."""
        keys = [self.slots.buffers(i)[0] for i in range(len(self.decoder.layers))]
        values = [self.slots.buffers(i)[1] for i in range(len(self.decoder.layers))]
        mask = self.slots.buffers()[2]
        mark_capacity_dynamic(keys, values, mask)
        return keys, values, mask

    @staticmethod
    def _slot(index: int, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(index, dtype=torch.long, device=like.device)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, valid: torch.Tensor,
               last_only: bool = False) -> torch.Tensor:
        """Append slots: tokens [B, t], valid bool [B, t] (False = a hole) -> logits
        [B, t (1 if last_only), V]."""
        steps = valid.long()
        positions = self.next_position[:, None] + steps.cumsum(1) - steps  # [B, t]
        logits = self._run(tokens, positions, valid.bool(), last_only=last_only)
        self.next_position = self.next_position + steps.sum(1)
        return logits

    def reject_last(self, num_rejected: torch.Tensor) -> None:
        """Drop each row's last num_rejected [B] slots: the slots every row rejects leave the
        cache, the rest become holes."""
        self.next_position = self.next_position - num_rejected
        common = int(num_rejected.min())
        self.slots.crop(common)
        width = int((num_rejected - common).max())
        if width:
            tail = torch.arange(width, 0, -1, device=num_rejected.device)  # [w]: w, ..., 1
            drop = tail[None, :] <= (num_rejected - common)[:, None]  # [B, w]
            self.slots.mask[:, -width:] &= ~drop

    @torch.no_grad()
    def extend_tree(self, tokens: torch.Tensor, depth: torch.Tensor, seen: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
        """As CachedLM.extend_tree: tokens, depth [B, N], seen [B, N, N] (node i attends to
        node j), valid [B, N] -> logits [B, N, V]; the tree's slots stay until drop_tree."""
        size = tokens.shape[1]
        seen = (seen & valid[:, None, :]) | torch.eye(size, dtype=torch.bool,
                                                      device=tokens.device)
        return self._run(tokens, self.next_position[:, None] + depth, valid.bool(), seen)

    def drop_tree(self, size: int) -> None:
        self.slots.crop(size)
