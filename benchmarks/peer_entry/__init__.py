"""Scripts a peer trainer's own venv runs (benchmarks/side_by_side.py starts them): they import
nothing of draftsmith."""
