"""Drafts the engine can use: an independent LM, and prompt lookup (n-gram, training-free);
Medusa heads live in serving/medusa.py, EAGLE-3 heads in serving/eagle3.py.

A draft proposes k tokens per row with the distribution q each was sampled from; the engine's
verification keeps the output the target's whatever the draft proposes. Head drafts set
`uses_target_hidden` and receive the target's hidden states of each forward.
"""

from __future__ import annotations

from typing import Protocol

import torch

from recipe import ConfigError
from serving.kv import CachedLM
from serving.speculative import sampling_probs


class Sampling(Protocol):
    temperature: float
    top_p: float
    top_k: int


class Draft(Protocol):
    name: str
    uses_target_hidden: bool
    """True: start/accept receive target_hidden, the hidden states of the target's last forward
    (HF output_hidden_states: a tuple of [B, t, H], post-norm last hidden state last)."""

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              first_token: torch.Tensor, target_hidden=None) -> None:
        """A new batch: prompts [B, T] (left-padded) and the target's first token [B]."""

    def propose(self, k: int, sampling: Sampling, history: list[list[int]]):
        """-> (tokens [B, k] long, probs [B, k, V] float): what the draft proposes and the
        distribution q each token was sampled from. history: each row's tokens so far."""

    def accept(self, num_accepted: torch.Tensor, next_token: torch.Tensor,
               target_hidden=None) -> None:
        """The verification outcome: accepted draft tokens [B] and the token emitted after them;
        target_hidden covers the verified chunk [pending, d_1..d_k]."""


class ModelDraft:
    """An independent draft LM with the target's vocabulary and its own KV cache."""

    uses_target_hidden = False

    def __init__(self, model, name: str = "draft"):
        self.lm, self.name = CachedLM(model), name
        self.failures = None  # [B] bool: rows whose draft produced non-finite logits

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        self.lm.prefill(input_ids, attention_mask)
        batch = input_ids.shape[0]
        self.pending = torch.stack([first_token, first_token], dim=1)  # [B, 2]
        self.pending_valid = torch.tensor([[False, True]] * batch, device=input_ids.device)
        self.failures = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)

    def propose(self, k, sampling, history):
        logits = self.lm.extend(self.pending, self.pending_valid)[:, -1]  # [B, V]
        tokens, probs = [], []
        for i in range(k):
            q = sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
            broken = ~torch.isfinite(logits).all(-1) | self.failures  # [B]
            if broken.any():  # lossless fallback: propose from a uniform q, count the row
                self.failures |= broken
                q[broken] = 1.0 / q.shape[-1]
            token = torch.multinomial(q, 1)[:, 0]  # [B]
            tokens.append(token)
            probs.append(q)
            if i < k - 1:
                logits = self.lm.extend(token[:, None], torch.ones_like(token[:, None],
                                                                         dtype=torch.bool))[:, -1]
        self.tokens = torch.stack(tokens, 1)  # [B, k]
        return self.tokens, torch.stack(probs, 1)  # [B, k], [B, k, V]

    def accept(self, num_accepted, next_token, target_hidden=None):
        k = self.tokens.shape[1]
        fed = k - 1  # the draft fed x_1..x_{k-1} to itself, never x_k
        self.lm.reject_last(fed - num_accepted.clamp(max=fed))
        all_accepted = num_accepted == k  # then x_k still has to be fed, before next_token
        self.pending = torch.stack([torch.where(all_accepted, self.tokens[:, -1], next_token),
                                    next_token], dim=1)
        self.pending_valid = torch.stack([all_accepted, torch.ones_like(all_accepted)], dim=1)


class VocabMismatchError(ConfigError):
    """Draft and target do not share a vocabulary, so draft tokens would mean other words."""


def check_same_vocab(target, draft, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Refuse a draft whose vocabulary differs from the target's, before any generation."""
    t_size = target.get_output_embeddings().weight.shape[0]
    d_size = draft.get_output_embeddings().weight.shape[0]
    if t_size != d_size:
        raise VocabMismatchError(f"the draft's vocabulary has {d_size} tokens, the target's "
                                 f"{t_size}: a draft must use the target's tokenizer.")
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise VocabMismatchError("the draft's tokenizer maps tokens to other ids than the "
                                     "target's: a draft must use the target's tokenizer.")


def load_draft(spec: str, target, target_tokenizer, dtype, device):
    """'self', 'layer-truncated:<n>', a Medusa or EAGLE-3 folder, or an HF folder / hub id ->
    (name, draft model, MedusaHeads or Eagle3Model), checked against the target."""
    from serving import eagle3
    from serving.medusa import MedusaHeads, check_fits_target, is_medusa_folder

    if spec == "self":
        return "target as its own draft", target
    if spec.startswith("layer-truncated:"):
        from train.draft_init import layer_truncated

        n = int(spec.split(":", 1)[1])
        return f"target's first {n} layers (untrained)", layer_truncated(target, n)
    if is_medusa_folder(spec):
        heads = MedusaHeads.from_pretrained(spec, dtype, device)
        check_fits_target(heads, target)
        return f"{spec} (Medusa, {heads.num_heads} heads)", heads
    if eagle3.is_eagle3_folder(spec):
        head = eagle3.Eagle3Head.from_pretrained(spec, dtype, device)
        eagle3.check_fits_target(head, target)
        return (f"{spec} (EAGLE-3, draft vocabulary {head.draft_vocab_size})",
                eagle3.Eagle3Model(head, target.get_input_embeddings()))
    draft = pretrained_draft(spec, target, target_tokenizer, dtype).eval().to(device)
    draft.requires_grad_(False)
    return spec, draft


def engine_draft(model, name: str = "draft"):
    """What load_draft returned -> a fresh Draft for one engine run."""
    from serving.eagle3 import Eagle3Draft, Eagle3Model
    from serving.medusa import MedusaDraft, MedusaHeads

    if isinstance(model, Eagle3Model):
        return Eagle3Draft(model.head, model.embedding, name)
    return MedusaDraft(model, name) if isinstance(model, MedusaHeads) else ModelDraft(model, name)


def is_head(model) -> bool:
    """Whether load_draft gave a head on the target's features (no LM of its own)."""
    from serving.eagle3 import Eagle3Model
    from serving.medusa import MedusaHeads

    return isinstance(model, (MedusaHeads, Eagle3Model))


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


class PromptLookupDraft:
    """Prompt lookup decoding: continue the latest n-gram's earlier occurrence in the row's own
    tokens (prompt and output), for n from max_ngram down to min_ngram. No training, no model;
    q is a point mass on each proposed token, which verification handles like any draft."""

    uses_target_hidden = False

    def __init__(self, vocab_size: int, max_ngram: int = 4, min_ngram: int = 2,
                 name: str = "prompt lookup"):
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        self.name = name

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        self.device = input_ids.device

    def lookup(self, history: list[int], k: int) -> list[int]:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(history) <= n:
                continue
            tail = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):  # latest earlier occurrence
                if history[start : start + n] == tail:
                    following = history[start + n : start + n + k]
                    if following:
                        return following
        return []

    def propose(self, k, sampling, history):
        rows = []
        for h in history:
            found = self.lookup(h, k)
            rows.append((found + [h[-1]] * k)[:k])  # pad with a guess that will mostly fail
        tokens = torch.tensor(rows, dtype=torch.long, device=self.device).view(len(history), k)
        probs = torch.nn.functional.one_hot(tokens, self.vocab_size).float()  # [B, k, V]
        return tokens, probs

    def accept(self, num_accepted, next_token, target_hidden=None):
        pass
