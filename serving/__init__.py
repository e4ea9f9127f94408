"""Serving: the lossless speculative-decoding math and engine."""
