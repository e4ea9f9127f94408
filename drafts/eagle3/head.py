"""The EAGLE-3 head (Li et al. 2025): one decoder layer (or a few) on the target's own features.

The target's hidden states at three layers (low, middle, high) are concatenated and projected
by `fc` [H, 3H] to one feature h_t. The head's decoder layer reads, at position t,
cat(input_layernorm(embed(x_{t+1})), hidden_norm(h_t)) [2H] and its attention spans the head's
own KV cache; the final norm and an lm_head over a reduced draft vocabulary (Vd of the target's
V tokens) predict x_{t+2}. The layer's pre-norm output is fed back as h for the next draft token
(and, in training, for the next step of the training-time test). A head of n layers (vLLM's
num_hidden_layers) stacks n - 1 plain decoder layers [H] on the first, each with its own
attention and cache; the last one's pre-norm output is what the final norm reads and what is
fed back.

Weights are named as vLLM's `LlamaForCausalLMEagle3` loads them (`fc`, `midlayer.*`,
`layers.<i>.*` for i >= 1, `norm`, `lm_head`, `d2t`, `t2d`), so export only writes the config
vLLM expects. The token embedding is the target's, frozen, and is not stored with the head.

Vocabulary maps: draft id i means target id i + d2t[i]; t2d[v] says whether target id v is in
the draft vocabulary. Both are built from one sorted list of target ids and checked against each
other wherever a head is loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from drafts.folders import load_folder, save_folder
from drafts.vocabulary import IGNORE, most_frequent_ids, scatter  # noqa: F401 (re-exported)
from recipe import ConfigError

# --- aux layers ----------------------------------------------------------------------------

def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default (2, n//2, n-3) for an n-layer target, as HF output_hidden_states indices
    (index k = the input of decoder layer k; 0 = the embeddings)."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(layers: list[int], num_layers: int) -> list[int]:
    """Three layer ids in [0, n-1], low to high: the inputs of decoder layers, which is what
    vLLM captures (its default repeats an id for a 6-layer target, so repeats are allowed)."""
    if len(layers) != 3 or sorted(layers) != list(layers):
        raise ConfigError(f"EAGLE-3 aux layers {layers} must be three ids from low to high, e.g. "
                          f"{default_aux_layers(num_layers)}.")
    if not all(0 <= i < num_layers for i in layers):
        raise ConfigError(f"EAGLE-3 aux layers {layers} must lie in [0, {num_layers - 1}]: the "
                          f"target has {num_layers} decoder layers and layer k means the input of "
                          f"layer k (HF output_hidden_states[k]); the default is "
                          f"{default_aux_layers(num_layers)}.")
    return list(layers)


# --- draft vocabulary --------------------------------------------------------------------

def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted target ids [Vd] -> (d2t [Vd] int64: target = draft + d2t[draft], t2d [V] bool)."""
    d2t = draft_ids.long() - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def target_ids(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft ids [...] -> target ids [...]."""
    return draft_ids + d2t[draft_ids]


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, where: str = "the head") -> None:
    """Refuse a d2t that does not encode exactly the target ids t2d marks, in increasing order
    (as vocab_maps builds it, so that a swap is caught too): a mismatched or regenerated d2t
    makes draft tokens mean other words."""
    mapped = target_ids(torch.arange(len(d2t), device=d2t.device), d2t)
    ok = (len(d2t) == int(t2d.sum()) and bool((mapped[1:] > mapped[:-1]).all())
          and torch.equal(mapped, t2d.nonzero()[:, 0].to(mapped)))
    if not ok:
        raise ConfigError(f"{where}: d2t ({len(d2t)} draft ids) does not map onto the "
                          f"{int(t2d.sum())} target ids its t2d marks, so its draft tokens would "
                          "be read as other words. The vocabulary maps were edited or come from "
                          "another training run: re-export the head from its training run.")


def draft_index(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] the draft id of each target id, IGNORE where the draft vocabulary lacks it."""
    index = torch.full((vocab_size,), IGNORE, dtype=torch.long, device=d2t.device)
    index[target_ids(torch.arange(len(d2t), device=d2t.device), d2t)] = torch.arange(
        len(d2t), device=d2t.device)
    return index


# --- the head ----------------------------------------------------------------------------

def head_config(target_config, draft_vocab_size: int, aux_layers: list[int],
                intermediate_size: int | None = None, layers: int = 1):
    """The head's LlamaConfig: the target's attention shape, an MLP of intermediate_size units
    (None: the target's), `layers` decoder layers, Vd outputs."""
    from transformers import LlamaConfig

    t = target_config
    hidden = t.hidden_size
    heads = t.num_attention_heads
    rope = getattr(t, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": getattr(t, "rope_theta", 10000.0)}
    return LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate_size or t.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
        head_dim=getattr(t, "head_dim", None) or hidden // heads,
        hidden_act=getattr(t, "hidden_act", "silu"), rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings, rope_parameters=dict(rope),
        vocab_size=t.vocab_size, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False)


class Attention(nn.Module):
    """q/k/v over the 2H input (the first layer) or the H input (the layers above it), o back
    to H (vLLM's names)."""

    def __init__(self, config, inputs: int = 2):
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        self.q_proj = nn.Linear(inputs * hidden, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(inputs * hidden, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(inputs * hidden, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)


class MidLayer(nn.Module):
    """The first layer: the token embedding and the fed-in hidden state, each normed, [2H]."""

    def __init__(self, config):
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps)  # on the token embedding
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps)  # on the fed-in hidden state
        self.self_attn = Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config)


class UpperLayer(nn.Module):
    """A layer above the first: a plain Llama decoder layer on the pre-norm output below [H]."""

    def __init__(self, config):
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config, inputs=1)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
           groups: int) -> torch.Tensor:
    """q [B, n, t, d] over keys, values [B, kv, L, d] (n = kv x groups), allowed [B, t, L] bool
    -> [B, n, t, d]; grouped-query heads read the kv heads in place (the engine's caches)."""
    return torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=allowed[:, None], enable_gqa=groups > 1)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv, t, d] -> [B, kv * groups, t, d] (grouped-query attention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def check_mlp_width(width: int, target_width: int) -> None:
    """The 'target' init copies the target's MLP into the head's: it needs at least as many
    units."""
    if width < target_width:
        raise ConfigError(f"EAGLE-3 head init 'target' copies the target's MLP of {target_width} "
                          f"units into one of {width}: set train.eagle3.intermediate_size >= "
                          f"{target_width}, or null.")


def check_target_init_layers(aux_layer: int, layers: int, target_layers: int) -> None:
    """The 'target' init copies the target's decoder layers aux_layer .. aux_layer + layers - 1
    into the head's: the target must have them."""
    if aux_layer + layers > target_layers:
        raise ConfigError(f"EAGLE-3 head init 'target' copies the target's decoder layers "
                          f"{aux_layer}..{aux_layer + layers - 1} (from the highest aux layer, "
                          f"{aux_layer}) into a head of {layers} layers, but the target has "
                          f"{target_layers}: lower train.eagle3.layers to "
                          f"{max(target_layers - aux_layer, 1)} or the highest of "
                          f"train.aux_layers to {max(target_layers - layers, 0)}.")


@torch.no_grad()
def _copy_target_layers(head: Eagle3Head, target, layer_index: int) -> None:
    """The 'target' init of Eagle3Head.from_target (see there)."""
    hidden = head.config.hidden_size
    decoder = target.get_decoder()
    check_target_init_layers(layer_index, head.num_layers, len(decoder.layers))
    head.norm.weight.copy_(decoder.norm.weight.float())
    head.fc.weight.zero_()
    head.fc.weight[:, 2 * hidden:].copy_(torch.eye(hidden))  # the highest aux feature
    for i in range(head.num_layers):
        source, layer = decoder.layers[layer_index + i], head.layer(i)
        if i == 0:  # the embedding half of q/k/v stays small and random
            layer.hidden_norm.weight.copy_(source.input_layernorm.weight.float())
            inputs = slice(hidden, None)
        else:
            layer.input_layernorm.weight.copy_(source.input_layernorm.weight.float())
            inputs = slice(None)
        layer.post_attention_layernorm.weight.copy_(
            source.post_attention_layernorm.weight.float())
        width = source.mlp.down_proj.weight.shape[1]  # the target's intermediate size
        check_mlp_width(layer.mlp.down_proj.weight.shape[1], width)
        for name in ("gate_proj", "up_proj"):  # [I, H]: the target's units first
            getattr(layer.mlp, name).weight[:width].copy_(
                getattr(source.mlp, name).weight.float())
        layer.mlp.down_proj.weight.zero_()  # [H, I]: units past the target's add nothing
        layer.mlp.down_proj.weight[:, :width].copy_(source.mlp.down_proj.weight.float())
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(layer.self_attn, name).weight[:, inputs].copy_(
                getattr(source.self_attn, name).weight.float())
        layer.self_attn.o_proj.weight.copy_(source.self_attn.o_proj.weight.float())


class Eagle3Head(nn.Module):
    """fc + decoder layers (midlayer, then layers["1"], ...) + norm + lm_head over Vd draft
    tokens, with d2t/t2d buffers.

    EAGLE 3.1 (arXiv 2605.09992; vLLM's llama_eagle3.py reads both fields): fc_norm, an RMSNorm
    per aux feature before fc (each of the target's layers at its own scale); norm_output, the
    final norm's output fed back to the next draft step instead of the pre-norm one."""

    def __init__(self, config, aux_layers: list[int], draft_ids: torch.Tensor,
                 fc_norm: bool = False, norm_output: bool = False):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        self.config, self.aux_layers = config, list(aux_layers)
        self.target_layers: int | None = None  # the target's decoder layer count, when known
        hidden = config.hidden_size
        self.vocab_size, self.draft_vocab_size = config.vocab_size, len(draft_ids)
        self.fc_norm = nn.ModuleList([LlamaRMSNorm(hidden, config.rms_norm_eps)
                                      for _ in range(3)]) if fc_norm else None
        self.norm_output = norm_output
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = MidLayer(config)
        self.layers = nn.ModuleDict({str(i): UpperLayer(config)  # saved as layers.<i>.*
                                     for i in range(1, config.num_hidden_layers)})
        self.norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, len(draft_ids), bias=False)
        d2t, t2d = vocab_maps(draft_ids, config.vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.rotary = LlamaRotaryEmbedding(config)

    @classmethod
    def from_target(cls, target, aux_layers: list[int], draft_ids: torch.Tensor,
                    init: str = "random", intermediate_size: int | None = None,
                    layers: int = 1, fc_norm: bool = False,
                    norm_output: bool = False) -> Eagle3Head:
        """A fresh head for this target: lm_head = the target's head rows of the draft
        vocabulary (so the head starts in the target's output space). init 'random': the layer
        in Llama init, the final norm at ones; 'target': the final norm the target's, fc
        passing the highest aux feature through, and the layer the target's decoder layer that
        reads that feature (its norms, MLP, o_proj, and q/k/v on the feature half; the
        embedding half of q/k/v stays small and random; an MLP wider than the target's
        (intermediate_size) holds the target's units first, the others with a zero output),
        and layer i >= 1 the target's decoder layer after it by i: at its start the head
        computes the target's layers from the highest aux feature on."""
        config = head_config(target.config, len(draft_ids), aux_layers, intermediate_size,
                             layers)
        if target.get_output_embeddings().weight.shape[0] != config.vocab_size:
            config.vocab_size = target.get_output_embeddings().weight.shape[0]
        head = cls(config, check_aux_layers(aux_layers, target.config.num_hidden_layers),
                   draft_ids, fc_norm, norm_output)
        head.target_layers = target.config.num_hidden_layers
        std = config.initializer_range
        with torch.no_grad():
            for module in head.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, std)
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids].float())
            if init == "target":
                _copy_target_layers(head, target, aux_layers[-1])
            elif init != "random":
                raise ConfigError(f"EAGLE-3 head init {init!r}: use 'random' or 'target'.")
        return head.to(target.get_output_embeddings().weight.device)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] the target id of each draft id."""
        return target_ids(torch.arange(self.draft_vocab_size, device=self.d2t.device), self.d2t)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def layer(self, index: int) -> MidLayer | UpperLayer:
        return self.midlayer if index == 0 else self.layers[str(index)]

    # a layer, in three parts: the projections, attention (outside: a cache in serving, the
    # training-time test's masks in training), and the output
    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                limit: int | None = None, index: int = 0):
        """Layer `index`: embeds, hidden [B, t, H] (the layer's input: the fed-in feature for
        layer 0, the pre-norm output of the layer below for the others, which ignore embeds),
        positions [B, t] -> q [B, n, t, d], k, v [B, kv, t, d] (with rotary), residual
        [B, t, H]. norm_before_residual = false: the residual is the input itself. limit (a
        bound on positions) is for the engine's FusedLayer; rotary here is computed per call."""
        layer = self.layer(index)
        attn = layer.self_attn
        x = (torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
             if index == 0 else layer.input_layernorm(hidden))
        batch, t, _ = x.shape

        def heads(proj, n):
            return proj(x).view(batch, t, n, attn.head_dim).transpose(1, 2)

        q, k, v = (heads(attn.q_proj, attn.num_heads), heads(attn.k_proj, attn.num_kv_heads),
                   heads(attn.v_proj, attn.num_kv_heads))
        cos, sin = self.rotary(x, positions)  # [B, t, d]
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v, hidden

    def finish(self, attended: torch.Tensor, residual: torch.Tensor,
               index: int = 0) -> torch.Tensor:
        """Layer `index`: attention output [B, n, t, d] and residual [B, t, H] -> the pre-norm
        output [B, t, H] (the next layer's input; the last layer's is fed back as the next
        hidden state)."""
        layer = self.layer(index)
        batch, _, t, _ = attended.shape
        residual = layer.self_attn.o_proj(attended.transpose(1, 2).reshape(batch, t, -1)) + residual
        return layer.mlp(layer.post_attention_layernorm(residual)) + residual

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[..., H] -> draft-vocabulary logits [..., Vd]."""
        return self.lm_head(self.norm(prenorm))

    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux features [..., 3H] -> the first layer's fed-in hidden state [..., H]
        (fc, after a norm per feature with fc_norm)."""
        if self.fc_norm is not None:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(3, -1))],
                            dim=-1)
        return self.fc(aux)

    def feedback(self, prenorm: torch.Tensor) -> torch.Tensor:
        """A draft step's last pre-norm output [..., H] -> what the next step reads as its
        hidden state: itself, or with norm_output the final norm of it."""
        return self.norm(prenorm) if self.norm_output else prenorm

    def full_vocab_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V], -inf on target tokens outside the draft vocabulary."""
        return scatter(draft_logits, self.draft_to_target, self.vocab_size, float("-inf"))

    @property
    def groups(self) -> int:
        attn = self.midlayer.self_attn
        return attn.num_heads // attn.num_kv_heads

    # saving in vLLM's layout
    def layer_config(self) -> dict:
        """The decoder layer's Llama config, as vLLM reads it."""
        config = self.config.to_dict()
        for key in ("transformers_version", "dtype", "torch_dtype", "_name_or_path",
                    "architectures"):
            config.pop(key, None)
        config.update({"model_type": "llama", "num_hidden_layers": self.num_layers,
                       "tie_word_embeddings": False})
        return config

    def eagle3_fields(self) -> dict:
        """What vLLM's EAGLE-3 loader reads besides the Llama fields. Aux layer ids are written
        only when they differ from the default: vLLM reads them as written, SGLang shifts them
        by one, and both agree on the default."""
        fields = {"draft_vocab_size": self.draft_vocab_size, "norm_before_residual": False,
                  "target_hidden_size": self.config.hidden_size}
        if self.fc_norm is not None:  # EAGLE 3.1's fields, written only when set
            fields["fc_norm"] = True
        if self.norm_output:
            fields["norm_output"] = True
        if self.target_layers and self.aux_layers != default_aux_layers(self.target_layers):
            fields["eagle_aux_hidden_state_layer_ids"] = self.aux_layers
        return fields

    def config_dict(self) -> dict:
        """config.json in vLLM's native layout (LlamaForCausalLMEagle3)."""
        fields = self.eagle3_fields()
        eagle = {"use_aux_hidden_state": True}
        if "eagle_aux_hidden_state_layer_ids" in fields:
            eagle["eagle_aux_hidden_state_layer_ids"] = fields.pop(
                "eagle_aux_hidden_state_layer_ids")
        return {**self.layer_config(), "architectures": ["LlamaForCausalLMEagle3"], **fields,
                "eagle_config": eagle, "draftsmith": self.provenance()}

    def provenance(self) -> dict:
        return {"aux_layers": self.aux_layers, "target_num_hidden_layers": self.target_layers,
                "aux_layers_meaning": "HF output_hidden_states indices (the input of decoder "
                                      "layer k), vLLM's convention"}

    def save_pretrained(self, folder: Path, state_dict: dict | None = None) -> None:
        state = self.state_dict() if state_dict is None else state_dict
        save_folder(folder, {k: v for k, v in state.items() if not k.startswith("rotary.")},
                    self.config_dict())

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype=torch.float32,
                        device: torch.device | str = "cpu") -> Eagle3Head:
        def build(raw: dict, state: dict) -> Eagle3Head:
            from transformers import LlamaConfig

            if not is_eagle3_config(raw):
                raise ConfigError(f"{folder} is not an EAGLE-3 head (architectures "
                                  f"{raw.get('architectures')}).")
            if raw.get("norm_before_residual", False):
                raise ConfigError(f"{folder}: norm_before_residual=true heads are not supported "
                                  "by draftsmith's engine (vLLM's default is false).")
            ours = raw.get("draftsmith", {})
            aux = (ours.get("aux_layers") or raw.get("eagle_aux_hidden_state_layer_ids")
                   or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
            for name in ("d2t", "t2d"):
                if name not in state:
                    raise ConfigError(f"{folder} holds no {name}: without it draft ids cannot "
                                      "be read as target ids.")
            check_vocab_maps(state["d2t"], state["t2d"], str(folder))
            config = LlamaConfig(**{k: v for k, v in raw.items() if k not in EAGLE3_KEYS})
            draft_ids = target_ids(torch.arange(len(state["d2t"])), state["d2t"])
            head = cls(config, aux or [], draft_ids.sort().values,
                       fc_norm=bool(raw.get("fc_norm", False)),
                       norm_output=bool(raw.get("norm_output", False)))
            head.target_layers = ours.get("target_num_hidden_layers")
            head.d2t, head.t2d = state["d2t"].long(), state["t2d"].bool()
            return head

        return load_folder(folder, build, "an EAGLE-3 head", dtype, device, derived=("rotary.",))


EAGLE3_KEYS = {"architectures", "model_type", "draftsmith", "eagle_config", "draft_vocab_size",
               "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
               "fc_norm", "norm_output"}


def is_eagle3_config(config: dict) -> bool:
    return "LlamaForCausalLMEagle3" in (config.get("architectures") or [])


def check_fits_target(head: Eagle3Head, target) -> None:
    """Refuse a head made for another hidden size, vocabulary or layer count."""
    weight = target.get_output_embeddings().weight  # [V, H]
    if (head.vocab_size, head.config.hidden_size) != tuple(weight.shape):
        raise ConfigError(f"the EAGLE-3 head reads hidden size {head.config.hidden_size} over a "
                          f"{head.vocab_size}-token vocabulary, but the target has hidden size "
                          f"{weight.shape[1]} and {weight.shape[0]} tokens: a head only works on "
                          "the target it was trained on.")
    layers = target.config.num_hidden_layers
    if head.target_layers not in (None, layers):
        raise ConfigError(f"the EAGLE-3 head was trained on a {head.target_layers}-layer target; "
                          f"this target has {layers} layers: a head only works on its target.")
    head.target_layers = layers
    if not head.aux_layers:
        head.aux_layers = default_aux_layers(layers)
    check_aux_layers(head.aux_layers, layers)
