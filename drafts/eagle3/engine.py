"""The EAGLE-3 head in the engine: it proposes a chain of k from the target's features of the
last verification and keeps its own KV cache of the verified tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from decoding.quantise import quantise_linear
from decoding.speculative import draw, sampling_probs
from decoding.tree import grow_tree
from drafts.eagle3.compiled import CompiledHead
from drafts.eagle3.head import Eagle3Head, attend, rotate_half
from drafts.fused import RotaryTable, rms_norm
from drafts.kind import aux_features
from drafts.slots import SlotKV
from drafts.vocabulary import scatter


class FusedLayer:
    """The head's layers for inference, in fewer and larger operations than Eagle3Head's
    training form: q/k/v one product over the 2H input, gate and up one product, the norms
    torch's fused rms_norm, rotary cos/sin read from a table of positions. Same project /
    finish / logits as the head (the same arithmetic up to rounding: tests compare the two);
    weights are copied when made, so a head trained further needs a new FusedLayer
    (Eagle3Draft.start makes one whenever the head's parameters changed). weights 'int8' or
    'int4': the five matrices of a step (q/k/v, o, gate/up, down, lm_head) and fc (the
    target's features into the head, once per verified token) quantised (decoding/quantise.py):
    the target's forward between two draft steps streams its weights through the CPU's caches,
    so a step reads the head's weights from memory again, and fc in fp32 was nearly a third
    of them.
    The draft's q is then the quantised head's, which verification reads as it is (lossless;
    acceptance is measured, not assumed)."""

    def __init__(self, head: Eagle3Head, weights: str = "model"):
        self.num_layers = head.num_layers
        matrices = {"lm_head": head.lm_head.weight, "fc": head.fc.weight}  # fc [H, 3H]
        norms = {"final": head.norm}
        with torch.no_grad():
            for i in range(head.num_layers):  # each layer's matrices and norms, named <name><i>
                layer = head.layer(i)
                attn, mlp = layer.self_attn, layer.mlp
                matrices.update({
                    f"qkv{i}": torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                          attn.v_proj.weight]),
                    f"o{i}": attn.o_proj.weight,
                    f"gate_up{i}": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),  # [2I, H]
                    f"down{i}": mlp.down_proj.weight})
                norms.update({f"post{i}": layer.post_attention_layernorm,
                              f"input{i}": layer.input_layernorm})  # layer 0: the embedding's
                if i == 0:
                    norms["hidden0"] = layer.hidden_norm
            for i, norm in enumerate(head.fc_norm or []):  # EAGLE 3.1: a norm per aux feature
                norms[f"fc_norm{i}"] = norm
        self.fc_norms = len(head.fc_norm or [])
        self.norm_output = head.norm_output
        self.linears = {name: partial(F.linear, weight=weight) if weights == "model" else
                        quantise_linear(weight, None, weights) for name, weight in matrices.items()}
        self.norms = {name: (norm.weight, norm.variance_epsilon) for name, norm in norms.items()}
        attn = head.midlayer.self_attn
        self.split = (attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim,
                      attn.num_kv_heads * attn.head_dim)
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.groups = head.groups
        self.act = F.silu if head.config.hidden_act == "silu" else mlp.act_fn
        # positions [B, t], all below limit -> cos, sin [B, 1, t, d]
        self.cos_sin = RotaryTable(head.rotary, self.head_dim)

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, *self.norms[name])

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                limit: int | None = None, index: int = 0):
        """As Eagle3Head.project: -> q [B, n, t, d], k, v [B, kv, t, d], residual [B, t, H].
        limit: a bound on positions the caller knows (HeadCache: its slot count), so that the
        rotary table grows without reading positions back from the device."""
        cos, sin = self.cos_sin(hidden, positions, int(positions.max()) + 1 if limit is None
                                else limit)
        return *self.project_rotated(embeds, hidden, cos, sin, index), hidden

    def project_rotated(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, index: int = 0):
        """project with the rotary cos, sin [B, 1, t, d] given -> q, k, v."""
        x = (torch.cat([self.norm("input0", embeds), self.norm("hidden0", hidden)], dim=-1)
             if index == 0 else self.norm(f"input{index}", hidden))
        batch, t, _ = x.shape
        q, k, v = self.linears[f"qkv{index}"](x).split(self.split, dim=-1)
        q = q.view(batch, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, attended: torch.Tensor, residual: torch.Tensor,
               index: int = 0) -> torch.Tensor:
        """As Eagle3Head.finish: [B, n, t, d], [B, t, H] -> pre-norm output [B, t, H]."""
        batch, _, t, _ = attended.shape
        linears = self.linears
        residual = linears[f"o{index}"](attended.transpose(1, 2).reshape(batch, t, -1)) + residual
        gate, up = linears[f"gate_up{index}"](self.norm(f"post{index}", residual)).chunk(2, dim=-1)
        return linears[f"down{index}"](self.act(gate) * up) + residual

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[..., H] -> draft-vocabulary logits [..., Vd]."""
        return self.linears["lm_head"](self.norm("final", prenorm))

    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """As Eagle3Head.features: the target's aux features [..., 3H] -> [..., H]."""
        if self.fc_norms:
            aux = torch.cat([self.norm(f"fc_norm{i}", chunk)
                             for i, chunk in enumerate(aux.chunk(self.fc_norms, -1))], dim=-1)
        return self.linears["fc"](aux)

    def feedback(self, prenorm: torch.Tensor) -> torch.Tensor:
        """As Eagle3Head.feedback: [..., H] -> what the next draft step reads."""
        return self.norm("final", prenorm) if self.norm_output else prenorm


Layer = Eagle3Head | FusedLayer  # what HeadCache runs: num_layers, project, finish, groups


class HeadCache:
    """The head's own KV cache, one per layer (drafts.slots.SlotKV: preallocated, a slot mask
    [B, L] with holes for rejected slots, as in decoding/kv.py) and each row's next position
    [B]."""

    def __init__(self, batch: int, head: Eagle3Head, device):
        attn = head.midlayer.self_attn
        self.slots = SlotKV(batch, head.num_layers, attn.num_kv_heads, attn.head_dim,
                            head.fc.weight.dtype, device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def mask(self) -> torch.Tensor:
        return self.slots.mask

    def rows(self, index) -> HeadCache:
        """The cache of some rows (a slice or index tensor over the batch), a copy."""
        other = HeadCache.__new__(HeadCache)
        other.slots, other.next_position = self.slots.rows(index), self.next_position[index]
        return other

    def _layers(self, layer: Layer, embeds, hidden, positions, valid, allowed) -> torch.Tensor:
        """New slots through every layer of the head: embeds, hidden [B, t, H] (hidden the
        first layer's input), positions [B, t], valid [B, t] bool, allowed [B, t, L] (L counting
        the new slots) -> the last layer's pre-norm outputs [B, t, H]. Layer i's keys and values
        enter its own cache at the new slots before its queries read that cache."""
        t, limit = valid.shape[1], self.slots.length + valid.shape[1]
        for i in range(layer.num_layers):
            q, k, v, residual = layer.project(embeds, hidden, positions, limit, index=i)
            if i == 0:
                self.slots.append([(k, v)], valid)
            else:
                self.slots.write(i, k, v)
            hidden = layer.finish(attend(q, self.slots.keys(i), self.slots.values(i), allowed,
                                         layer.groups), residual, index=i)
        return hidden

    def run(self, layer: Layer, embeds, hidden, valid) -> torch.Tensor:
        """Append slots: embeds, hidden [B, t, H], valid [B, t] bool -> pre-norm outputs
        [B, t, H] (layer: the head, or its FusedLayer)."""
        t = valid.shape[1]
        steps = valid.long()
        positions = self.next_position[:, None] + steps.cumsum(1) - steps  # [B, t]
        length = self.slots.length + t
        mask = torch.cat([self.mask, valid], dim=1)  # [B, L]: the slots once appended
        if t == 1:  # a drafted token: every kept slot, and itself (a hole sees itself)
            allowed = mask.clone()
            allowed[:, -1] = True
            allowed = allowed[:, None]  # [B, 1, L]
        else:
            slot = torch.arange(length, device=valid.device)
            query_slot = torch.arange(length - t, length, device=valid.device)
            allowed = (slot[None, :] <= query_slot[:, None])[None] & mask[:, None, :]
            allowed = allowed | (slot[None, :] == query_slot[:, None])[None]  # [B, t, L]
        out = self._layers(layer, embeds, hidden, positions, valid, allowed)
        self.next_position = self.next_position + steps.sum(1)
        return out

    def step(self, layer: Layer, embeds, hidden) -> torch.Tensor:
        """One drafted token per row: embeds, hidden [B, 1, H] -> pre-norm output [B, 1, H]. Its
        slot is valid and sees every kept slot and itself: run's t = 1 case without building
        positions and masks."""
        valid = self.mask.new_ones(len(hidden), 1)
        allowed = torch.cat([self.mask, valid], dim=1)[:, None]  # [B, 1, L]
        out = self._layers(layer, embeds, hidden, self.next_position[:, None], valid, allowed)
        self.next_position = self.next_position + 1
        return out

    def run_tree(self, layer: Layer, embeds, hidden, depth, sees) -> torch.Tensor:
        """Append m draft-tree slots: embeds, hidden [B, m, H], depth [B, m] (1: a child of the
        pending token), sees [B, m, S] bool: which of the S tree slots appended since the last
        crop (these m the last ones) each attends, its ancestors and itself; every committed
        slot is seen. Positions are next_position + depth - 1, and next_position stays: the
        tree's slots are dropped with crop(S, valid=False) -> pre-norm outputs [B, m, H]."""
        m, tree_slots = depth.shape[1], sees.shape[2]
        committed = self.mask[:, None, :self.slots.length + m - tree_slots].expand(-1, m, -1)
        allowed = torch.cat([committed, sees], dim=2)  # [B, m, L]: L counting the m new slots
        return self._layers(layer, embeds, hidden, self.next_position[:, None] + depth - 1,
                            torch.ones_like(depth, dtype=torch.bool), allowed)

    def crop(self, n: int, valid: bool = True) -> None:
        """Drop the last n slots of every row (valid: they counted as positions)."""
        if n <= 0:
            return
        if valid:
            self.next_position = self.next_position - self.mask[:, -n:].sum(1)
        self.slots.crop(n)


@dataclass
class Eagle3Model:
    """A loaded head with the target embedding it reads tokens through."""

    head: Eagle3Head
    embedding: nn.Module
    layers: dict = field(default_factory=dict)
    """Eagle3Draft's FusedLayer (and CompiledHead) per what they were made from, kept here so
    that every engine run of this head reuses them (a compilation takes tens of seconds)."""


class Eagle3Draft:
    """The engine's draft: the head proposes a chain of k from the target's features of the
    last verification, keeping its own KV cache of the verified tokens. compile: greedy chains
    and the settling after verification run compiled (drafts/eagle3/compiled.py); sampled
    chains and trees run eager."""

    uses_target_hidden = True
    failures = None

    def __init__(self, head: Eagle3Head, embedding: nn.Module, name: str = "eagle3",
                 weights: str = "model", compile: bool = False, layers: dict | None = None):
        self.head, self.embed, self.name, self.weights = head, embedding, name, weights
        self.compile, self.layers = compile, {} if layers is None else layers
        self.layer, self.compiled = None, None  # the FusedLayer, and its CompiledHead
        self.draft_logits: torch.Tensor | None = None  # [B, k, Vd] of the last chain

    def _features(self, target_hidden) -> torch.Tensor:
        return self.layer.features(aux_features(target_hidden, self.head.aux_layers).to(
            self.head.fc.weight.dtype))

    def _embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens).to(self.head.fc.weight.dtype)

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        batch = input_ids.shape[0]
        self.draft_ids = self.head.draft_to_target  # [Vd] target ids: once a batch, not a token
        self.cache = HeadCache(batch, self.head, input_ids.device)
        made_from = (self.weights, self.compile,
                     tuple((p.data_ptr(), p._version) for p in self.head.parameters()))
        if made_from not in self.layers:  # new, or the head's weights changed (training's eval)
            for stale in [key for key in self.layers if key[2] != made_from[2]]:
                del self.layers[stale]
            layer = FusedLayer(self.head, self.weights)
            self.layers[made_from] = layer, CompiledHead(
                layer, self.embed, self.head.fc, self.head.fc.weight.dtype,
                input_ids.device) if self.compile else None
        self.layer, self.compiled = self.layers[made_from]
        following = torch.cat([input_ids[:, 1:], first_token[:, None]], dim=1)  # x_{t+1}
        out = self.cache.run(self.layer, self._embeds(following), self._features(target_hidden),
                             attention_mask.bool())
        # [B, H] left padding: the last slot is every row's last token (contiguous, as accept
        # leaves it: a compiled chain then never sees another stride)
        self.hidden = out[:, -1].clone(memory_format=torch.contiguous_format)
        self.chain = 0

    def propose(self, k, sampling, history, generator=None):
        """A chain of k, each token drawn on the draft vocabulary (q is zero outside it, so
        the distribution over the target's vocabulary is q scattered into zeros)."""
        if self.compiled is not None and sampling.temperature == 0:
            self.tokens, self.draft_logits = self.compiled.propose(self.cache, self.hidden,
                                                                   self.draft_ids, k)
            self.chain = k - 1
            probs = torch.zeros(*self.tokens.shape, self.head.vocab_size,
                                device=self.tokens.device)  # one-hot q: greedy drafting
            return self.tokens, probs.scatter_(-1, self.tokens[..., None], 1.0)
        layer, hidden = self.layer, self.hidden
        tokens, probs, logits = [], [], []
        for i in range(k):
            logits.append(layer.logits(hidden))  # [B, Vd]
            q = sampling_probs(logits[-1], sampling.temperature, sampling.top_p, sampling.top_k)
            token = self.draft_ids[draw(q, sampling.temperature, generator)]  # [B]
            tokens.append(token)
            probs.append(q)
            if i < k - 1:
                hidden = self.cache.step(layer, self._embeds(token[:, None]),
                                         layer.feedback(hidden)[:, None])[:, 0]
        self.chain = k - 1  # slots to drop once the target has verified
        self.tokens = torch.stack(tokens, 1)  # [B, k]
        self.draft_logits = torch.stack(logits, 1)  # [B, k, Vd]
        probs = scatter(torch.stack(probs, 1), self.draft_ids, self.head.vocab_size, 0.0)
        return self.tokens, probs  # [B, k], [B, k, V]

    @property
    def scores(self) -> torch.Tensor:
        """[B, k, V] the last proposal's logits over the target's vocabulary (-inf outside
        the draft's), made when a tree asks for them; None before any chain."""
        if self.draft_logits is None:
            return None
        return scatter(self.draft_logits, self.draft_ids, self.head.vocab_size, float("-inf"))

    def propose_tree(self, k: int, width: int, generator=None):
        """EAGLE-2's expansion (decoding.tree.grow_tree) with tree attention inside the head's
        cache: a frontier node enters the head with the output that proposed it, at position
        next + depth - 1, seeing the committed slots, its expanded ancestors and itself. The
        tree's slots are dropped before returning. Deterministic: every candidate is verified
        as a fixed one, so sampling stays lossless."""
        (batch, hidden_size), device = self.hidden.shape, self.hidden.device
        committed = self.cache.mask.shape[1]
        state = {"slot": torch.zeros(batch, 0, dtype=torch.long, device=device),  # [B, M]
                 "ancestors": torch.zeros(batch, 0, 0, dtype=torch.bool, device=device),
                 "out": torch.zeros(batch, 0, hidden_size, dtype=self.hidden.dtype,
                                    device=device)}  # each expanded slot's output [B, S, H]

        def logp(prenorm):  # [B, n, H] -> [B, n, V]
            return torch.log_softmax(scatter(self.layer.logits(prenorm), self.draft_ids,
                                             self.head.vocab_size, float("-inf")).float(), dim=-1)

        def expand(frontier, tokens, parents):
            s, w = state["ancestors"].shape[1], frontier.shape[1]
            slot = torch.cat([state["slot"], state["slot"].new_full(
                (batch, tokens.shape[1] - state["slot"].shape[1]), -1)], dim=1)  # [B, M]
            parent = parents.gather(1, frontier)  # [B, w]
            parent_slot = slot.gather(1, parent.clamp(min=0)).clamp(min=0)  # [B, w]
            has_parent = (parent >= 0)[..., None]
            inherited = state["ancestors"].gather(1, parent_slot[..., None].expand(-1, -1, s))
            sees = torch.cat([inherited & has_parent, torch.eye(w, dtype=torch.bool, device=device)
                              .expand(batch, -1, -1)], dim=2)  # [B, w, S + w]
            root = self.hidden[:, None].expand(-1, w, -1)  # what proposed the root's children
            made_by = root if s == 0 else torch.where(has_parent, state["out"].gather(
                1, parent_slot[..., None].expand(-1, -1, hidden_size)), root)
            depth = torch.full_like(frontier, s // w + 1)  # w slots per earlier expansion
            prenorm = self.cache.run_tree(self.layer, self._embeds(tokens.gather(1, frontier)),
                                          self.layer.feedback(made_by), depth, sees)  # [B, w, H]
            state["ancestors"] = torch.cat([torch.cat(
                [state["ancestors"], state["ancestors"].new_zeros(batch, s, w)], 2), sees], 1)
            state["slot"] = slot.scatter(1, frontier, s + torch.arange(w, device=device)
                                         .expand(batch, -1))
            state["out"] = torch.cat([state["out"], prenorm], dim=1)
            return logp(prenorm)

        candidates = grow_tree(logp(self.hidden), k, width, expand)
        self.cache.crop(self.cache.mask.shape[1] - committed, valid=False)
        self.chain = 0  # nothing of the tree stays in the cache
        self.tokens = torch.zeros(batch, k, dtype=torch.long, device=device)  # accept's shape
        return candidates

    def accept(self, num_accepted, next_token, target_hidden=None, path=None):
        """Replace the chain's slots by the verified tokens' slots, made from the target's
        features: slot i of the chunk [pending, d_1..d_k] reads d_{i+1} (i < n) or next_token
        (i = n); slots past n are holes. A tree's path replaces d. The chunk is cut after the
        longest row's n + 1 slots: columns every row would leave as holes are not run."""
        self.cache.crop(self.chain)
        batch, k = self.tokens.shape
        rows = torch.arange(batch, device=next_token.device)
        accepted = self.tokens if path is None else path  # [B, k]
        following = torch.cat([accepted, next_token[:, None]], dim=1)  # [B, k+1]
        following[rows, num_accepted] = next_token
        valid = torch.arange(k + 1, device=next_token.device)[None] <= num_accepted[:, None]
        width = int(num_accepted.max()) + 1
        following, valid = following[:, :width], valid[:, :width]  # [B, width]
        target_hidden = {i: target_hidden[i][:, :width] for i in self.head.aux_layers}  # views
        if self.compiled is not None:
            out = self.compiled.run(self.cache, following,
                                    aux_features(target_hidden, self.head.aux_layers), valid)
        else:
            out = self.cache.run(self.layer, self._embeds(following),
                                 self._features(target_hidden), valid)
        self.hidden = out[rows, num_accepted]  # [B, H]
