"""speculators' trainer (`speculators train`) on a CPU. Runs in the peer's own venv
(benchmarks/side_by_side.py makes it) and imports nothing of draftsmith.

    <peer venv>/bin/python speculators_cpu.py <speculators train flags>

speculators 0.9.0 assumes an accelerator in three places; each is patched here, at run time,
never in the installed package:
- Trainer moves the model and each batch with `.to(local_rank)`, and an int means cuda:<i>:
  its local rank becomes the device "cpu".
- Its step timer calls torch.accelerator.synchronize(), which raises without an accelerator:
  there is nothing to wait for on a CPU.
- Trainer autocasts with the current accelerator's type, "cuda" when there is none (autocast
  then does nothing on CPU tensors and warns): it autocasts on "cpu".
"""

import sys

import torch


def patch_for_cpu() -> None:
    from speculators.train import trainer

    torch.accelerator.synchronize = lambda *args, **kwargs: None
    trainer.get_local_rank = lambda: "cpu"
    init = trainer.Trainer.__init__

    def init_on_cpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = init_on_cpu


def main(argv: list[str]) -> None:
    patch_for_cpu()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
