"""Stage 2: the draft (initialisation so far)."""
