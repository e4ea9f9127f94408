"""The DFlash drafter (block diffusion drafting): a few decoder layers that fill a block of k
mask tokens in ONE forward, reading the target's own hidden states as context.

The target's hidden states at some layers (aux layers, as EAGLE-3 reads them) are concatenated
and projected by `fc` to one context state c_t per position. Each draft layer turns c_t into
keys and values (hidden_norm, then the layer's k/v projections, k_norm and RoPE at position t):
the draft keeps no KV cache of its own tokens, only the target's context. The query block is
[x_p, mask x k] at positions p..p+k (x_p the token the target just emitted): its embeddings (the
target's, frozen) go through Qwen3-style layers (q/k norms) whose attention sees the context at
positions < p and every slot of the block (non-causal inside the block). The final norm and the
lm_head (the target's, frozen unless train.freeze_embeddings=false) give draft token j at mask j.

Weights and config.json are in the layout vLLM's `DFlashQwen3ForCausalLM` loads (architecture
`DFlashDraftModel`, `dflash_config.mask_token_id` and `target_layer_ids`), so the trained folder
is what `--speculative-config '{"method": "dflash", ...}'` serves. vLLM's target_layer_ids count
decoder layer outputs (id i = the input of layer i+1), our aux layers layer inputs: ids = aux-1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from drafts.eagle3.head import default_aux_layers, rotate_half
from drafts.folders import load_folder, save_folder
from drafts.kind import LossRows, SameVocabulary, TargetHidden
from drafts.parallel import block_attention, block_plan
from recipe import ConfigError

ARCHITECTURE = "DFlashDraftModel"  # vLLM's registry name for DFlashQwen3ForCausalLM


def check_aux_layers(layers: list[int], num_layers: int) -> list[int]:
    """Layer inputs 1..n-1, low to high (vLLM's target_layer_ids = these minus one must name
    decoder layers whose output it captures)."""
    if not layers or sorted(set(layers)) != list(layers):
        raise ConfigError(f"DFlash aux layers {layers} must be distinct ids from low to high, "
                          f"e.g. {default_aux_layers(num_layers)}.")
    if not all(1 <= i <= num_layers - 1 for i in layers):
        raise ConfigError(f"DFlash aux layers {layers} must lie in [1, {num_layers - 1}]: the "
                          f"target has {num_layers} decoder layers, layer k means the input of "
                          "layer k (HF output_hidden_states[k]) and vLLM reads the output of "
                          f"layer k-1; the default is {default_aux_layers(num_layers)}.")
    return list(layers)


def draft_config(target_config, num_layers: int):
    """The draft's Qwen3Config: the target's attention and MLP shapes, num_layers layers."""
    from transformers import Qwen3Config

    t = target_config
    heads = t.num_attention_heads
    rope = getattr(t, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": getattr(t, "rope_theta", 10000.0)}
    return Qwen3Config(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads,
        hidden_act=getattr(t, "hidden_act", "silu"), rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings, rope_parameters=dict(rope),
        vocab_size=t.vocab_size, tie_word_embeddings=False, attention_bias=False)


class Attention(nn.Module):
    def __init__(self, config):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(d, config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, config.rms_norm_eps)


class Layer(nn.Module):
    def __init__(self, config):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)


class DFlashHead(nn.Module):
    """fc + hidden_norm + layers + norm + lm_head; block_size: the k it was trained to fill."""

    architecture = ARCHITECTURE
    """config.json's architectures[0], which vLLM's registry maps to the model it loads."""

    def __init__(self, config, aux_layers: list[int], mask_token_id: int, block_size: int):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        super().__init__()
        self.config, self.aux_layers = config, list(aux_layers)
        self.mask_token_id, self.block_size = mask_token_id, block_size
        self.target_layers: int | None = None
        hidden = config.hidden_size
        self.vocab_size = config.vocab_size
        self.fc = nn.Linear(len(aux_layers) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.rotary = Qwen3RotaryEmbedding(config)
        # the target's embedding of the mask token (not stored: vLLM embeds it with the target's)
        self.register_buffer("mask_embedding", torch.zeros(hidden), persistent=False)

    @classmethod
    def from_target(cls, target, aux_layers: list[int], num_layers: int, mask_token_id: int,
                    block_size: int, init: str = "target", **fields) -> DFlashHead:
        """A fresh draft; init 'random': the layers, fc and norms in Qwen3 init (norms at one),
        the lm_head the target's; init 'target' starts from the target's own weights: layer i
        is a copy of the target's layer a+i (a = the highest aux layer, or as high as fits), fc
        passes that layer's input through (its slot of the concatenation), hidden_norm is that
        layer's input norm, and the final norm and lm_head are the target's. So the context
        keys/values start as the target's layer a computes them, with the attention patterns it
        learnt (a random start has to learn to attend to the recent context from scratch: on 2
        answers of 24 tokens it reached greedy alpha_1 0.06 where this start reached 0.25 in 40
        steps). The q/k norms (Qwen3's, absent from Llama targets) start at one. fields: a
        subclass's own constructor arguments."""
        config = draft_config(target.config, num_layers)
        config.vocab_size = target.get_output_embeddings().weight.shape[0]
        head = cls(config, check_aux_layers(aux_layers, target.config.num_hidden_layers),
                   mask_token_id, block_size, **fields)
        head.target_layers = target.config.num_hidden_layers
        with torch.no_grad():
            for module in head.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, config.initializer_range)
            head.lm_head.weight.copy_(target.get_output_embeddings().weight.float())
            if init == "target":
                head._copy_target_layers(target)
            elif init != "random":
                raise ConfigError(f"DFlash init {init!r}: use 'random' or 'target'.")
        head.read_mask_embedding(target.get_input_embeddings())
        return head.to(target.get_output_embeddings().weight.device)

    def _copy_target_layers(self, target) -> None:
        """See from_target; a target whose layers are named otherwise keeps the random start."""
        decoder, hidden = target.get_decoder(), self.config.hidden_size
        layers = getattr(decoder, "layers", [])
        first = min(self.aux_layers[-1], len(layers) - len(self.layers))
        names = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                 "mlp": ("gate_proj", "up_proj", "down_proj")}
        state = {}
        for i in range(len(self.layers)):
            source = layers[first + i].state_dict()
            for block, projections in names.items():
                for name in projections:
                    state[f"layers.{i}.{block}.{name}.weight"] = source.get(
                        f"{block}.{name}.weight")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                state[f"layers.{i}.{norm}.weight"] = source.get(f"{norm}.weight")
        state["hidden_norm.weight"] = layers[first].state_dict().get("input_layernorm.weight") \
            if layers else None
        state["norm.weight"] = getattr(getattr(decoder, "norm", None), "weight", None)
        own = self.state_dict()
        if any(v is None or v.shape != own[k].shape for k, v in state.items()):
            return
        self.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        slot = len(self.aux_layers) - 1  # fc passes layer a's input through
        self.fc.weight.zero_()
        self.fc.weight[:, slot * hidden:(slot + 1) * hidden] = torch.eye(hidden)

    def read_mask_embedding(self, embedding: nn.Module) -> None:
        with torch.no_grad():
            token = torch.tensor([self.mask_token_id], device=embedding.weight.device)
            self.mask_embedding = embedding(token)[0].to(self.fc.weight)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, *P, d] at positions [B, *P] -> rotated x."""
        flat = positions.reshape(positions.shape[0], -1)
        cos, sin = self.rotary(x, flat)  # [B, P, d]
        shape = (positions.shape[0], 1, *positions.shape[1:], x.shape[-1])
        cos, sin = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def context_kv(self, layer: Layer, context: torch.Tensor, positions: torch.Tensor):
        """Context states c [B, L, H] at positions [B, L] -> this layer's k, v [B, kv, L, d]."""
        attn, (batch, length, _) = layer.self_attn, context.shape
        normed = self.hidden_norm(context)
        k = attn.k_norm(attn.k_proj(normed).view(batch, length, attn.num_kv_heads, -1))
        v = attn.v_proj(normed).view(batch, length, attn.num_kv_heads, -1)
        return self._rope(k.transpose(1, 2), positions), v.transpose(1, 2)

    def contexts(self, aux: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
        """The target's aux features [B, L, A*H] -> every layer's context (k, v)."""
        context = self.fc(aux)
        return [self.context_kv(layer, context, positions) for layer in self.layers]

    def blocks(self, embeds: torch.Tensor, positions: torch.Tensor, contexts: list[tuple],
               context_allowed: torch.Tensor) -> torch.Tensor:
        """S blocks per row: embeds [B, S, m, H] at positions [B, S, m]; contexts: per layer
        (k, v) [B, kv, L, d]; context_allowed [B, S, L] -> normed outputs [B, S, m, H]."""
        batch, blocks, m, _ = embeds.shape
        h = embeds
        for layer, (k_context, v_context) in zip(self.layers, contexts):
            attn = layer.self_attn
            x = layer.input_layernorm(h)

            def heads(proj, n, x=x, attn=attn):  # -> [B, n, S, m, d]
                return proj(x).view(batch, blocks, m, n, attn.head_dim).permute(0, 3, 1, 2, 4)

            q = self._rope(attn.q_norm(heads(attn.q_proj, attn.num_heads)), positions)
            k = self._rope(attn.k_norm(heads(attn.k_proj, attn.num_kv_heads)), positions)
            v = heads(attn.v_proj, attn.num_kv_heads)
            out = block_attention(q, k, v, k_context, v_context,
                                  context_allowed)  # [B, n, S, m, d]
            h = h + attn.o_proj(out.permute(0, 2, 3, 1, 4).reshape(batch, blocks, m, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    # saving in vLLM's layout
    def config_dict(self) -> dict:
        config = self.config.to_dict()
        for key in ("transformers_version", "dtype", "torch_dtype", "_name_or_path"):
            config.pop(key, None)
        config.update({
            "architectures": [self.architecture], "model_type": "qwen3",
            "target_hidden_size": self.config.hidden_size, "block_size": self.block_size + 1,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": [i - 1 for i in self.aux_layers]},
            "draftsmith": {"aux_layers": self.aux_layers, "trained_k": self.block_size,
                           "target_num_hidden_layers": self.target_layers,
                           "aux_layers_meaning": "HF output_hidden_states indices (the input "
                                                 "of decoder layer k); vLLM's target_layer_ids "
                                                 "are these minus one"}})
        return config

    def save_pretrained(self, folder: Path, state_dict: dict | None = None) -> None:
        state = self.state_dict() if state_dict is None else state_dict
        save_folder(folder, {k: v for k, v in state.items() if not k.startswith("rotary.")},
                    self.config_dict())

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype=torch.float32,
                        device: torch.device | str = "cpu") -> DFlashHead:
        def build(raw: dict, state: dict) -> DFlashHead:
            from transformers import Qwen3Config

            if cls.architecture not in (raw.get("architectures") or []):
                raise ConfigError(f"{folder} is not a {cls.what} (architectures "
                                  f"{raw.get('architectures')}).")
            ours, dflash = raw.get("draftsmith", {}), raw.get("dflash_config") or {}
            if "mask_token_id" not in dflash:
                raise ConfigError(f"{folder}: dflash_config has no mask_token_id.")
            aux = ours.get("aux_layers") or [i + 1 for i in dflash.get("target_layer_ids", [])]
            trained_k = ours.get("trained_k") or int(raw.get("block_size", 2)) - 1
            config = Qwen3Config(**{k: v for k, v in raw.items() if k not in cls.config_keys})
            head = cls(config, aux, int(dflash["mask_token_id"]), trained_k,
                       **cls.fields_of(raw))
            head.target_layers = ours.get("target_num_hidden_layers")
            return head

        return load_folder(folder, build, cls.what, dtype, device, derived=("rotary.",))

    what = "a DFlash drafter"
    config_keys = frozenset({"architectures", "model_type", "draftsmith", "dflash_config",
                             "block_size", "target_hidden_size"})
    """config.json's keys that are not the drafter's Qwen3Config."""

    @classmethod
    def fields_of(cls, config: dict) -> dict:
        """A subclass's own constructor arguments, read from its config.json."""
        return {}


def check_fits_target(head: DFlashHead, target) -> None:
    """Refuse a drafter made for another hidden size, vocabulary or layer count."""
    weight = target.get_output_embeddings().weight  # [V, H]
    if (head.vocab_size, head.config.hidden_size) != tuple(weight.shape):
        raise ConfigError(f"the DFlash drafter reads hidden size {head.config.hidden_size} over "
                          f"{head.vocab_size} tokens, the target has {weight.shape[1]} and "
                          f"{weight.shape[0]}: a drafter only works on the target it was trained "
                          "on.")
    layers = target.config.num_hidden_layers
    if head.target_layers not in (None, layers):
        raise ConfigError(f"the DFlash drafter was trained on a {head.target_layers}-layer "
                          f"target; this one has {layers} layers.")
    check_aux_layers(head.aux_layers, layers)
    if not 0 <= head.mask_token_id < head.vocab_size:
        raise ConfigError(f"the DFlash drafter's mask_token_id {head.mask_token_id} lies outside "
                          f"the target's vocabulary [0, {head.vocab_size}).")
    head.target_layers = layers


class DFlashForTraining(SameVocabulary, nn.Module):
    """Blocks after the starts of block_plan, all in one forward: block (b, s) holds [x_{s+1},
    mask x k] at positions s+1..s+1+k, sees the context at positions <= s, and its draft
    position j is scored against the target at s + j (weight decay**(j-1))."""

    needs_target_hidden = True

    def __init__(self, head: DFlashHead, decay: float, starts_per_row: int):
        super().__init__()
        self.lm, self.decay, self.starts_per_row = head, decay, starts_per_row
        self.aux_layers = head.aux_layers

    def plan(self, pred_mask):
        return block_plan(pred_mask, self.lm.block_size, self.starts_per_row)

    def loss_rows(self, pred_mask: torch.Tensor) -> list[LossRows]:
        return self.plan(pred_mask).loss_rows(pred_mask, self.decay)

    def forward(self, input_ids, attention_mask, pred_mask,
                target_hidden: TargetHidden | None = None):
        head, plan = self.lm, self.plan(pred_mask)
        dtype, k = head.fc.weight.dtype, head.block_size
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)
        contexts = head.contexts(target_hidden.aux.to(dtype), positions.expand(batch, length))
        known = plan.starts + 1  # [B, S]: the block's known token x_{s+1}
        embeds = target_hidden.embeds.to(dtype).gather(
            1, known.clamp(max=length - 1)[..., None].expand(-1, -1, head.config.hidden_size))
        masks = head.mask_embedding.expand(batch, known.shape[1], k, -1)
        block = torch.cat([embeds[:, :, None], masks], 2)  # [B, S, k+1, H]
        block_positions = known[..., None] + torch.arange(k + 1, device=known.device)
        allowed = ((positions[None, None] <= plan.starts[..., None])
                   & attention_mask.bool()[:, None, :] & plan.valid[..., None])  # [B, S, T]
        out = head.blocks(block, block_positions, contexts, allowed)  # [B, S, k+1, H]
        return self.draft_logits(out, plan, input_ids)

    def draft_logits(self, out: torch.Tensor, plan, input_ids: torch.Tensor) -> torch.Tensor:
        """The blocks' outputs [B, S, k+1, H] -> the scored rows' logits [M, V], draft position
        by draft position (the LossRows' order)."""
        return torch.cat([self.lm.lm_head(out[:, :, j][plan.scored[j - 1]])
                          for j in range(1, self.lm.block_size + 1)])
