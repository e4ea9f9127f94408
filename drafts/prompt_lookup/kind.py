"""Prompt lookup: continue the latest n-gram's earlier occurrence in the row's own tokens
(prompt and output). No training, no model: eval.draft='prompt-lookup' (or the eval method
prompt_lookup); vLLM serves the same idea as its 'ngram' method."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.ngram import ngram_continuation
from drafts.kind import LoadedDraft, TrainingShape
from recipe import ConfigError, TrainConfig


@dataclass
class NgramSettings:
    vocab_size: int
    max_ngram: int = 4
    min_ngram: int = 2


class PromptLookupDraft:
    """The engine's draft: n from max_ngram down to min_ngram; q is a point mass on each
    proposed token, which verification handles like any draft."""

    uses_target_hidden = False
    scores, failures, propose_tree = None, None, None  # fixed candidates, nothing ranked

    def __init__(self, vocab_size: int, max_ngram: int = 4, min_ngram: int = 2,
                 name: str = "prompt lookup"):
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        self.name = name

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        self.device = input_ids.device

    def lookup(self, history: list[int], k: int) -> list[int]:
        return ngram_continuation(history, k, self.max_ngram, self.min_ngram)

    def propose(self, k, sampling, history, generator=None):
        rows = []
        for h in history:
            found = self.lookup(h, k)
            rows.append((found + [h[-1]] * k)[:k])  # pad with a guess that will mostly fail
        tokens = torch.tensor(rows, dtype=torch.long, device=self.device).view(len(history), k)
        probs = torch.nn.functional.one_hot(tokens, self.vocab_size).float()  # [B, k, V]
        return tokens, probs

    def accept(self, num_accepted, next_token, target_hidden=None, path=None):
        pass


class PromptLookup:
    """eval.draft='prompt-lookup'."""

    name, description, formats = "prompt-lookup", "prompt lookup", ()
    train_keys = ()
    target_layers, target_architecture = False, False
    one_layer_draft = None
    hf_assistant, quantised_weights = False, False
    compiled_steps = False

    def claims(self, spec: str) -> bool:
        return spec == "prompt-lookup"

    def reads_folder(self, config: dict) -> bool:
        return False

    def check_train(self, cfg: TrainConfig) -> None:
        raise ConfigError("train.draft=prompt-lookup: prompt lookup has nothing to train; "
                          "measure it with eval.draft=prompt-lookup (or the prompt_lookup eval "
                          "method) and train another kind.")

    def check_target(self, cfg, k, target_config) -> None:
        pass  # nothing trained: check_train already refuses it

    def parameters(self, cfg, target_config) -> tuple[int, int]:
        return 0, 0

    def attention_layers(self, spec, target_config) -> list[str]:
        return []

    def training_shape(self, cfg, target_config) -> TrainingShape:
        return TrainingShape(0, 0, target_config["vocab_size"], 0)  # nothing to train

    def build(self, cfg, target, tokenizer, examples, log):
        self.check_train(cfg)

    def freeze(self, draft, cfg) -> None:
        pass

    def wrap(self, draft, cfg):
        self.check_train(cfg)

    def load(self, spec, target, tokenizer, dtype, device) -> LoadedDraft:
        vocab = target.get_output_embeddings().weight.shape[0]
        return LoadedDraft("prompt lookup (n-grams of the prompt and output)", self,
                           NgramSettings(vocab))

    def engine_draft(self, loaded: LoadedDraft, name: str) -> PromptLookupDraft:
        s = loaded.model
        return PromptLookupDraft(s.vocab_size, s.max_ngram, s.min_ngram, name)

    def check_export(self, draft_folder, k, target_shape) -> None:
        raise ConfigError("prompt lookup has no weights to export: vLLM serves it as "
                          "--speculative-config '{\"method\": \"ngram\", ...}'.")

    def write_export(self, draft_folder, out, k, fmt, verifier) -> None:
        self.check_export(draft_folder, k, (0, 0))

    def export_name(self, fmt: str) -> str:
        return self.name

    def check_exported(self, folder) -> None:
        pass
