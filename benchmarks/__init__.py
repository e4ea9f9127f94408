"""Benchmarks that run several stages (stage 1 backends with the features they feed, training
losses end to end): scripts that print figures, above the stages like distill.py."""
