"""The DSpark drafter in our engine: DFlash's one backbone forward per step, then the Markov
head drawn left to right (each position biased by the token drawn before it) and the confidence
of each drawn token, which adaptive verification reads (decoding.steps.confident_prefix)."""

from __future__ import annotations

import torch

from decoding.speculative import draw, sampling_probs
from drafts.dflash.engine import DFlashDraft


class DSparkDraft(DFlashDraft):
    confidence: torch.Tensor | None = None
    """[B, k] the confidence head's acceptance estimate of each token of the last proposal."""

    def propose(self, k, sampling, history, generator=None):
        head = self.head
        hidden = self.block_outputs(k)  # [B, k, H]
        base = head.lm_head(hidden)  # [B, k, V]
        previous, tokens, probs, logits, confidence = self.pending, [], [], [], []
        for j in range(k):  # the sequential stage: position j sees the token drawn at j-1
            logits_j, confidence_j = head.markov(base[:, j], hidden[:, j], previous)
            q = sampling_probs(logits_j, sampling.temperature, sampling.top_p, sampling.top_k)
            previous = draw(q, sampling.temperature, generator)  # [B]
            tokens.append(previous)
            probs.append(q)
            logits.append(logits_j)
            confidence.append(torch.sigmoid(confidence_j.float()))
        self.tokens = torch.stack(tokens, 1)  # [B, k]
        self.scores = torch.stack(logits, 1)  # [B, k, V]
        self.confidence = torch.stack(confidence, 1)  # [B, k]
        return self.tokens, torch.stack(probs, 1)  # [B, k], [B, k, V]

    def truncate(self, n: int) -> None:
        """The step verifies the first n tokens of the proposal alone."""
        self.tokens, self.scores = self.tokens[:, :n], self.scores[:, :n]
        self.confidence = self.confidence[:, :n]
