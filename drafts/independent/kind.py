"""The independent draft: a small causal LM with the target's vocabulary and a KV cache of its
own, distilled from the target.

train.draft: 'layer-truncated:<n>' (the target's embeddings, first n layers, final norm and
head), 'fresh:<layers>[x<hidden>]' (the target's architecture, random weights), or an HF causal
LM folder / hub id with the target's vocabulary. eval.draft also takes 'self' (the target
drafting for itself, the tau = k+1 sanity bound).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import replace

import torch
from torch import nn

from assets.published import layer_parameters
from decoding.kv import CachedLM
from decoding.quantise import quantised_copy
from decoding.speculative import draw, sampling_probs
from decoding.tree import ancestor_mask, grow_tree
from drafts.folders import read_config
from drafts.fused import CompiledSteps
from drafts.kind import LoadedDraft, LossRows, TargetHidden, TrainingShape, micro_batch_tokens
from drafts.slot_lm import FusedDecoder, SlotLM
from drafts.vocabulary import DraftVocabulary, frequent_labels, logits_on_rows
from recipe import ConfigError, TrainConfig

# --- initial drafts --------------------------------------------------------------------------

def layer_truncated(target, num_layers: int):
    """A copy of the target keeping its embeddings, first `num_layers` decoder layers, final norm
    and head: the cheapest draft that already speaks the target's language (untrained)."""
    decoder = target.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ConfigError(f"{type(target).__name__} keeps no `layers` list in its decoder, so it "
                          "cannot be layer-truncated: name a draft model instead.")
    if not 1 <= num_layers < len(layers):
        raise ConfigError(f"layer-truncated:{num_layers} needs 1 <= n < {len(layers)} (the "
                          "target's layer count).")
    draft = copy.deepcopy(target)
    draft.get_decoder().layers = draft.get_decoder().layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:num_layers]
    draft.requires_grad_(False)
    return draft.eval()


def fresh(target, num_layers: int, hidden_size: int | None = None):
    """A randomly initialised model of the target's architecture: num_layers decoder layers and,
    when given, a narrower hidden size (attention heads and MLP width scale with it)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    if hidden_size is not None and hidden_size != config.hidden_size:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if hidden_size % head_dim:
            raise ConfigError(f"fresh draft hidden size {hidden_size} must be a multiple of the "
                              f"target's head size {head_dim}.")
        group = config.num_attention_heads // config.num_key_value_heads
        heads = hidden_size // head_dim
        config.num_attention_heads = heads
        config.num_key_value_heads = max(1, heads // group)
        config.head_dim = head_dim
        config.intermediate_size = config.intermediate_size * hidden_size // config.hidden_size
        config.hidden_size = hidden_size
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class VocabMismatchError(ConfigError):
    """Draft and target do not share a vocabulary, so draft tokens would mean other words."""


def first_vocab_difference(target_vocab: dict[str, int], draft_vocab: dict[str, int]) -> str | None:
    """The lowest token id the two tokenizers (token -> id maps) spell differently, described
    ('id 2: the target's '<|im_end|>', the draft's '</s>''), or None when they agree."""
    target_tokens = {i: t for t, i in target_vocab.items()}
    draft_tokens = {i: t for t, i in draft_vocab.items()}
    for i in sorted(set(target_tokens) | set(draft_tokens)):
        a, b = target_tokens.get(i), draft_tokens.get(i)
        if a != b:
            return (f"id {i}: the target's {a!r}, the draft's {b!r}" if a is not None and
                    b is not None else f"id {i}: only the {'target' if b is None else 'draft'} "
                    f"has it ({a if b is None else b!r})")
    return None


def check_same_vocab(target, draft, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Refuse a draft whose vocabulary differs from the target's, before any generation, naming
    the first token that differs."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        difference = first_vocab_difference(target_tokenizer.get_vocab(),
                                             draft_tokenizer.get_vocab())
        if difference is not None:
            raise VocabMismatchError(
                f"the draft's tokenizer differs from the target's at {difference}: a draft "
                "(independent or PARD) must use the target's tokenizer, so every token it "
                "proposes means the same to the target. Pick a draft of the target's family "
                "(e.g. Llama-3.2-1B-Instruct for Llama-3.1-8B, Qwen3-0.6B for Qwen3-8B), or "
                "train.draft=layer-truncated:<n> of the target itself.")
    t_size = target.get_output_embeddings().weight.shape[0]
    d_size = draft.get_output_embeddings().weight.shape[0]
    if t_size != d_size:
        raise VocabMismatchError(f"the draft's vocabulary has {d_size} tokens, the target's "
                                 f"{t_size}: a draft must use the target's tokenizer.")


def pretrained_draft(spec: str, target, target_tokenizer, dtype):
    """An HF causal LM folder / hub id, its vocabulary checked against the target's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    draft = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError):
        draft_tokenizer = None  # a bare model folder: the vocabulary size check still applies
    check_same_vocab(target, draft, target_tokenizer, draft_tokenizer)
    return draft


def parse_spec(spec: str) -> tuple[str, int | None, int | None]:
    """'layer-truncated:<n>' -> ('layer-truncated', n, None); 'fresh:<layers>[x<hidden>]' ->
    ('fresh', layers, hidden or None); anything else -> ('pretrained', None, None)."""
    kind, _, arg = spec.partition(":")
    if kind == "layer-truncated":
        return kind, _positive(arg, spec), None
    if kind == "fresh":
        layers, _, hidden = arg.partition("x")
        return kind, _positive(layers, spec), _positive(hidden, spec) if hidden else None
    return "pretrained", None, None


def draft_layer_types(spec: str, target_config: dict) -> list[str] | None:
    """The attention type of each layer of the draft `spec` names ('sliding_attention',
    'full_attention', ...), read without loading weights; None when the config does not say
    (every layer alike) or a named draft's config.json is not on disk."""
    from assets.published import target_facts

    kind, layers, _ = parse_spec(spec)
    if kind == "pretrained":
        facts = target_facts(spec)
        return facts.config.get("layer_types") if facts is not None else None
    types = target_config.get("layer_types")
    return list(types[:layers]) if types else None


def _positive(text: str, spec: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"train.draft={spec!r}: expected a positive integer, got {text!r}.")
    return int(text)


def draft_vocabulary(model) -> DraftVocabulary | None:
    """The draft vocabulary a model's config carries (config.draft_vocabulary: sorted target
    ids, written by training with train.draft_vocab_size), on its head's device, or None: the
    whole vocabulary."""
    ids = getattr(getattr(model, "config", None), "draft_vocabulary", None)
    if not ids:
        return None
    rows = model.get_output_embeddings().out_features  # nn.Linear's, or decoding.quantise's
    return DraftVocabulary(torch.tensor(ids), rows).to(model.device)


def set_draft_vocabulary(model, examples, size: int, log) -> None:
    """Restrict the model's head to the `size` most frequent labels of the examples (config
    draft_vocabulary, saved with the model)."""
    for key in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, key, None):
            raise ConfigError(f"train.draft_vocab_size: the draft transforms its logits "
                              f"({key}), which a reduced head does not apply; drop "
                              "train.draft_vocab_size or choose another draft.")
    vocab = model.get_output_embeddings().weight.shape[0]
    ids, covered = frequent_labels(examples, vocab, size)
    model.config.draft_vocabulary = ids.tolist()
    log(f"[train] draft vocabulary: the {size} most frequent of {vocab} tokens, "
        f"{100 * covered:.2f} % of the training labels; its head scores these alone")


# --- training ----------------------------------------------------------------------------------

class LMHead:
    """What an LM draft's training wrapper (self.lm, self.vocabulary) does with its head: the
    whole vocabulary, or with a draft vocabulary (train.draft_vocab_size) its Vd tokens alone,
    scored against the target renormalised on them, as it drafts."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] -> logits [M, V], or [M, Vd] with a draft vocabulary."""
        head = self.lm.get_output_embeddings()
        if self.vocabulary is None:
            return head(hidden)
        return logits_on_rows(head, hidden, self.vocabulary.ids)

    @property
    def target_rows(self) -> torch.Tensor | None:
        return None if self.vocabulary is None else self.vocabulary.ids

    def restrict(self, target_logits, labels):
        if self.vocabulary is None:
            return target_logits, labels
        return self.vocabulary.to(labels.device).restrict(target_logits, labels)

    def expand(self, draft_logits):
        if self.vocabulary is None:
            return draft_logits
        return self.vocabulary.to(draft_logits.device).logits(draft_logits)


class DraftForTraining(LMHead, nn.Module):
    """An independent draft LM: logits only at the N loss positions, [B, T] in, [N, V] out. Over a
    49k vocabulary the head is the largest matmul, and most positions of a conversation (the
    prompts) carry no loss."""

    needs_target_hidden = False
    aux_layers = None

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self._no_split_modules = getattr(lm, "_no_split_modules", None)  # FSDP auto-wrap units
        self.vocabulary = draft_vocabulary(lm)

    def loss_rows(self, pred_mask: torch.Tensor) -> list[LossRows]:
        return [LossRows(int(pred_mask.sum()), None, None, None)]

    def forward(self, input_ids, attention_mask, pred_mask,
                target_hidden: TargetHidden | None = None):
        hidden = self.lm.get_decoder()(input_ids=input_ids,
                                       attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[pred_mask])  # [N, V or Vd]


# --- serving -----------------------------------------------------------------------------------

def right_aligned(tokens: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens to feed [B, t] (valid [B, t]; False = a hole) with each row's valid tokens moved
    right, in order, and the columns no row feeds cut: the next forward is as wide as the row
    that feeds most and leaves the fewest holes in the draft's cache (a row's last valid token
    stays last)."""
    order = valid.int().sort(dim=1, stable=True).indices  # [B, t] holes first
    width = int(valid.sum(1).max())
    return tokens.gather(1, order)[:, -width:], valid.gather(1, order)[:, -width:]


class ModelDraft:
    """The engine's draft: the LM proposes k tokens one by one from its own KV cache. With a
    draft vocabulary (the model's config.draft_vocabulary) its head scores those tokens alone
    and q is zero elsewhere. compile: the LM runs as drafts.slot_lm.SlotLM, a greedy chain
    one compiled call, a sampled chain's forwards one each (trees eager, over the same
    cache)."""

    uses_target_hidden = False

    def __init__(self, model, name: str = "draft", compile: bool = False):
        self.vocabulary = draft_vocabulary(model)
        ids = None if self.vocabulary is None else self.vocabulary.ids
        self.name = name
        self.lm = compiled_lm(model, ids) if compile else CachedLM(model, vocabulary=ids)
        self.failures = None  # [B] bool: rows whose draft produced non-finite logits
        self.draft_logits = None  # [B, k, V or Vd] behind the last chain

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the draft's vocabulary -> over the target's (-inf outside)."""
        return logits if self.vocabulary is None else self.vocabulary.logits(logits)

    @property
    def scores(self) -> torch.Tensor | None:
        """[B, k, V] the logits behind the last chain (trees rank alternatives with them)."""
        return None if self.draft_logits is None else self._full(self.draft_logits)

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        self.lm.prefill(input_ids, attention_mask)
        batch = input_ids.shape[0]
        self.pending = torch.stack([first_token, first_token], dim=1)  # [B, 2]
        self.pending_valid = torch.tensor([[False, True]] * batch, device=input_ids.device)
        self.failures = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)

    def propose(self, k, sampling, history, generator=None):
        if (isinstance(self.lm, SlotLM) and sampling.temperature == 0 and k > 1
                and not self.failures.any()):
            chain = self._compiled_chain(k)
            if chain is not None:
                return chain
        logits = self.lm.extend(self.pending, self.pending_valid, last_only=True)[:, -1]  # [B, V]
        tokens, probs, scores = [], [], []
        for i in range(k):
            q = sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
            broken = ~torch.isfinite(logits).all(-1) | self.failures  # [B]
            if broken.any():  # lossless fallback: propose from a uniform q, count the row
                self.failures |= broken
                q[broken] = 1.0 / q.shape[-1]
            token = draw(q, sampling.temperature, generator)  # [B] (draft ids with a vocabulary)
            if self.vocabulary is not None:
                token = self.vocabulary.ids[token]
            tokens.append(token)
            probs.append(q)
            scores.append(logits)
            if i < k - 1:
                logits = self.lm.extend(token[:, None], torch.ones_like(
                    token[:, None], dtype=torch.bool), last_only=True)[:, -1]
        self.tokens = torch.stack(tokens, 1)  # [B, k]
        self.draft_logits = torch.stack(scores, 1)  # [B, k, V or Vd]
        self.fed = k - 1  # the draft fed x_1..x_{k-1} to itself, never x_k
        probs = torch.stack(probs, 1)
        if self.vocabulary is not None:
            probs = self.vocabulary.probs(probs)
        return self.tokens, probs  # [B, k], [B, k, V]

    def _compiled_chain(self, k: int):
        """A greedy chain of k as one compiled call (SlotLM.chain) -> tokens [B, k], the one-hot
        q [B, k, V]; None, with the cache as it was, where a logit is not finite: the eager
        loop then drafts the chain with its uniform fallback."""
        length, position = self.lm.slots.length, self.lm.next_position
        ids = None if self.vocabulary is None else self.vocabulary.ids
        drafted, logits = self.lm.chain(self.pending, self.pending_valid, k, ids)
        if not torch.isfinite(logits).all():
            self.lm.rewind(length, position)
            return None
        self.tokens = drafted if ids is None else ids[drafted]  # [B, k] target ids
        self.draft_logits = logits  # [B, k, V or Vd]
        self.fed = k - 1
        probs = torch.zeros(*self.tokens.shape, logits.shape[-1], device=logits.device)
        probs.scatter_(-1, drafted[..., None], 1.0)  # one-hot q: greedy drafting
        if self.vocabulary is not None:
            probs = self.vocabulary.probs(probs)
        return self.tokens, probs  # [B, k], [B, k, V]

    def propose_tree(self, k, width, generator=None):
        """EAGLE-2's expansion (decoding.tree.grow_tree): each expansion is one forward over
        every node expanded so far and the frontier, with the tree mask (each sees the cache and
        its ancestors), whose slots are dropped again; the pending tokens stay in the cache.
        Deterministic: every candidate is verified as a fixed one, so sampling stays lossless."""
        root = self._full(self.lm.extend(self.pending, self.pending_valid,
                                         last_only=True)[:, -1])  # [B, V]
        batch, device = root.shape[0], root.device
        self.pending = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.pending_valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        expanded = [torch.zeros(batch, 0, dtype=torch.long, device=device)]  # candidate ids

        def expand(frontier, tokens, parents):
            nodes = torch.cat([expanded[0], frontier], dim=1)  # [B, N] candidate ids
            is_parent = nodes[:, None, :] == parents.gather(1, nodes)[:, :, None]  # [B, N, N]
            local = torch.where(is_parent.any(-1), is_parent.long().argmax(-1), -1)  # [B, N]
            seen = ancestor_mask(local)  # [B, N, N]
            depth = seen.sum(-1) - 1  # 0: a child of the pending token, at next_position
            logits = self.lm.extend_tree(tokens.gather(1, nodes), depth, seen,
                                         torch.ones_like(nodes, dtype=torch.bool))
            self.lm.drop_tree(nodes.shape[1])
            expanded[0] = nodes
            return torch.log_softmax(self._full(logits[:, -frontier.shape[1]:]).float(), dim=-1)

        candidates = grow_tree(torch.log_softmax(root.float(), dim=-1), k, width, expand)
        self.tokens = torch.zeros(batch, k, dtype=torch.long, device=device)  # accept's shape
        self.fed = 0  # nothing of the tree stays in the cache
        return candidates

    def accept(self, num_accepted, next_token, target_hidden=None, path=None):
        """Keep the cached slots of the draft's own tokens that were accepted; feed the rest of
        the accepted tokens (a tree's alternative or n-gram branch) and next_token next step."""
        k, fed = self.tokens.shape[1], self.fed
        accepted = self.tokens if path is None else path  # [B, k]
        index = torch.arange(k + 1, device=next_token.device)[None]  # [1, k+1]
        agree = (accepted == self.tokens) & (index[:, :k] < num_accepted[:, None])
        keep = agree.int().cumprod(1).sum(1).clamp(max=fed)  # [B] own accepted slots kept
        self.lm.reject_last(fed - keep)
        pending = torch.cat([accepted, next_token[:, None]], dim=1)  # [B, k+1]
        valid = ((index >= keep[:, None]) & (index < num_accepted[:, None])) | (index == k)
        self.pending, self.pending_valid = right_aligned(pending, valid)


_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> (what it was made from, its FusedDecoder, CompiledSteps): every engine run of a
loaded draft reuses the compiled code (a compilation takes tens of seconds)."""


def compiled_lm(model, vocabulary: torch.Tensor | None,
                what: str = "the independent draft's") -> SlotLM:
    """A SlotLM of the model whose forwards run compiled, its fused weights and compiled code
    kept per model and made again when its weights (or the vocabulary) changed."""
    made_from = (None if vocabulary is None else tuple(vocabulary.tolist()),
                 tuple((t.data_ptr(), t._version)
                       for t in (*model.parameters(), *model.buffers())))
    kept = _compiled.get(model)
    if kept is None or kept[0] != made_from:
        decoder = FusedDecoder(model, vocabulary)
        kept = made_from, decoder, CompiledSteps(decoder.final[0].device, what)
        _compiled[model] = kept
    return SlotLM(kept[1], kept[2])


# --- the kind ----------------------------------------------------------------------------------

class Independent:
    """Any causal LM with the target's vocabulary; the registry's last kind, so it takes every
    spec and folder no other kind claims."""

    name, description = "independent", "an independent draft model"
    train_keys = ("draft_vocab_size",)
    target_layers, target_architecture = False, True
    one_layer_draft = 'layer-truncated:1'
    formats = ("vllm",)
    hf_assistant, quantised_weights = True, True
    compiled_steps = True

    def claims(self, spec: str) -> bool:
        return True

    def reads_folder(self, config: dict) -> bool:
        return True

    def check_train(self, cfg: TrainConfig) -> None:
        parse_spec(cfg.draft)
        if cfg.draft_vocab_size is not None and cfg.draft_vocab_size < 1:
            raise ConfigError("train.draft_vocab_size must be >= 1 (or null: the target's whole "
                              "vocabulary).")

    def check_target(self, cfg: TrainConfig, k: int, target_config: dict) -> None:
        from assets.published import target_facts

        kind, layers, _ = parse_spec(cfg.draft)
        depth, vocab = target_config["num_hidden_layers"], target_config["vocab_size"]
        draft = target_facts(cfg.draft) if kind == "pretrained" else None
        if draft is not None and draft.vocab != vocab:
            raise ConfigError(f"train.draft={cfg.draft!r} predicts {draft.vocab} tokens, the "
                              f"target {vocab}: a draft must use the target's tokenizer; pick "
                              "one of the target's family, or train.draft=layer-truncated:<n>.")
        if kind == "layer-truncated" and layers >= depth:
            raise ConfigError(f"train.draft={cfg.draft!r} keeps {layers} of the target's {depth} "
                              f"layers: a draft is cheaper only with fewer, e.g. "
                              f"'layer-truncated:{max(1, depth // 8)}'.")

    def parameters(self, cfg: TrainConfig, target_config: dict) -> tuple[int, int]:
        from assets.published import TargetFacts, target_facts

        kind, layers, hidden = parse_spec(cfg.draft)
        if kind == "pretrained":
            facts = target_facts(cfg.draft)
            if facts is None:
                raise ConfigError(f"train.draft={cfg.draft!r}: its config.json is neither a local "
                                  "folder nor in the HF cache, so its size is unknown; download "
                                  "it first (huggingface-cli download) to plan with it.")
            total, _ = facts.parameters()
            return total, 0
        facts = TargetFacts("target", target_config, "")
        h, v = hidden or facts.hidden, facts.vocab
        embeddings = v * h * (1 if target_config.get("tie_word_embeddings") else 2)
        if kind == "layer-truncated":  # h is the target's: its layers, embeddings aside
            body = layers * (facts.parameters()[0] - embeddings) // facts.layers
        else:
            body = layers * layer_parameters(target_config, hidden=h, intermediate=4 * h)
        freeze = cfg.freeze_embeddings if cfg.freeze_embeddings is not None else kind != "fresh"
        return (body, embeddings) if freeze else (body + embeddings, 0)

    def attention_layers(self, spec: str, target_config: dict) -> list[str]:
        types = draft_layer_types(spec, target_config)
        if types:
            return types
        form, layers, _ = parse_spec(spec)
        return ["full_attention"] * layers if form != "pretrained" else []

    def training_shape(self, cfg: TrainConfig, target_config: dict) -> TrainingShape:
        return TrainingShape(*self.parameters(cfg, target_config),
                             cfg.draft_vocab_size or target_config["vocab_size"],
                             micro_batch_tokens(cfg))

    def build(self, cfg: TrainConfig, target, tokenizer, examples, log):
        spec = cfg.draft
        kind, layers, hidden = parse_spec(spec)
        if kind == "layer-truncated":
            draft = layer_truncated(target, layers)
        elif kind == "fresh":
            draft = fresh(target, layers, hidden)
        else:
            try:
                draft = pretrained_draft(spec, target, tokenizer, torch.float32)
            except ConfigError:
                raise  # a vocabulary mismatch already says what is wrong
            except (OSError, ValueError) as e:
                raise ConfigError(f"train.draft={spec!r} is not 'layer-truncated:<n>', "
                                  f"'fresh:<layers>[x<hidden>]', nor a loadable causal LM "
                                  f"({type(e).__name__}: {str(e).splitlines()[0][:160]}).") \
                    from None
        if getattr(draft.config, "final_logit_softcapping", None):
            raise ConfigError("the draft caps its logits (final_logit_softcapping), which the "
                              "training forward does not apply: choose another draft "
                              "architecture.")
        if cfg.draft_vocab_size is not None:
            set_draft_vocabulary(draft, examples, cfg.draft_vocab_size, log)
        elif getattr(draft.config, "draft_vocabulary", None):
            draft.config.draft_vocabulary = None  # a pretrained draft's: this run scores all
        draft = draft.to(device=target.device, dtype=torch.float32)
        draft.requires_grad_(True)
        return draft.train()

    def freeze(self, draft, cfg: TrainConfig) -> None:
        freeze = cfg.freeze_embeddings
        if freeze is None:  # fresh embeddings are random and must learn
            freeze = not cfg.draft.startswith("fresh:")
        if freeze:
            draft.get_input_embeddings().requires_grad_(False)
            draft.get_output_embeddings().requires_grad_(False)

    def wrap(self, draft, cfg: TrainConfig) -> DraftForTraining:
        return DraftForTraining(draft)

    def load(self, spec, target, tokenizer, dtype, device) -> LoadedDraft:
        if spec == "self":
            return LoadedDraft("target as its own draft", self, target)
        if spec.startswith("layer-truncated:"):
            n = _positive(spec.split(":", 1)[1], spec)
            return LoadedDraft(f"target's first {n} layers (untrained)", self,
                               layer_truncated(target, n))
        draft = pretrained_draft(spec, target, tokenizer, dtype).eval().to(device)
        draft.requires_grad_(False)
        vocabulary = draft_vocabulary(draft)
        name = spec if vocabulary is None else f"{spec} (draft vocabulary {len(vocabulary.ids)})"
        return LoadedDraft(name, self, draft)

    def quantise(self, loaded: LoadedDraft, weights: str) -> LoadedDraft:
        return replace(loaded, model=quantised_copy(loaded.model, weights))

    def engine_draft(self, loaded: LoadedDraft, name: str) -> ModelDraft:
        return ModelDraft(loaded.model, name, loaded.compile)

    def check_export(self, draft_folder, k, target_shape) -> None:
        vocab = (read_config(draft_folder) or {}).get("vocab_size")
        if vocab != target_shape[1]:
            raise ConfigError(f"the draft's vocabulary has {vocab} tokens, the target's "
                              f"{target_shape[1]}: a draft must use the target's tokenizer.")

    def write_export(self, draft_folder, out, k, fmt, verifier) -> None:
        """The HF folder as trained is what vLLM's draft_model and transformers load. Neither
        has a reduced head for a draft model: they draft over the whole vocabulary with the
        full lm_head the folder keeps (still lossless; acceptance may differ a little from our
        engine's)."""
        size = len((read_config(draft_folder) or {}).get("draft_vocabulary") or [])
        if size:
            print(f"[export] the draft's head scores {size} tokens in draftsmith's engine; "
                  f"{fmt} serves it with the full lm_head the folder keeps (no engine serves a "
                  "reduced head for a draft model)")

    def export_name(self, fmt: str) -> str:
        return "draft-model"

    def check_exported(self, folder) -> None:
        pass
