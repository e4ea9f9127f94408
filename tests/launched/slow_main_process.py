"""distill.py under `accelerate launch`, with the main process's eval replaced by a wait longer
than the process group's timeout; each process that runs eval writes a file named after its
rank into the folder given as the first argument. tests/test_launch.py runs it."""

import importlib.util
import sys
import time
from pathlib import Path

import torch.distributed as torch_dist

import eval.speculative
from tests.helpers import ROOT

marks, wait_s, argv = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]


def slow_eval(cfg, device) -> None:
    time.sleep(wait_s)
    (marks / f"eval-rank{torch_dist.get_rank()}").write_text("done\n")


eval.speculative.evaluate = slow_eval  # distill.py imports it inside main()
spec = importlib.util.spec_from_file_location("distill_recipe", ROOT / "distill.py")
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)
sys.exit(recipe.main(argv))
