"""The embedded default assets and loaders: the target LM and the prompt sources."""
