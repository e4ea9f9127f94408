"""n-gram matching over a row's own tokens (prompt and output): the candidates of prompt lookup
and of the n-gram branch of a hybrid tree."""

from __future__ import annotations


def ngram_continuation(history: list[int], k: int, max_ngram: int = 4,
                       min_ngram: int = 2) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of history's last n tokens,
    for n from max_ngram down to min_ngram; [] when none matches."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(history) <= n:
            continue
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):  # latest earlier occurrence
            if history[start : start + n] == tail:
                following = history[start + n : start + n + k]
                if following:
                    return following
    return []
