"""The prompt-lookup kind: drafts by matching the context's n-grams; nothing to train. kind.py holds
it: the DraftKind and what it drafts, trains and saves."""

from drafts.prompt_lookup.kind import (
    NgramSettings,
    PromptLookup,
    PromptLookupDraft,
)

__all__ = ["NgramSettings", "PromptLookup", "PromptLookupDraft"]
