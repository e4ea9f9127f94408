"""A new draft kind is one module plus one registry line: a toy kind, written here as such a
module would be, goes through training, loading, our engine, eval and export with no other
change anywhere."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from decoding.speculative import sampling_probs
from drafts import registry
from drafts.folders import load_folder, save_folder
from drafts.kind import LoadedDraft, LossRows, SameVocabulary
from recipe import ConfigError, TrainConfig
from tests.helpers import reference_tau
from train import accelerator_kwargs, train_draft

# --- the toy kind's module ----------------------------------------------------------------------


class Unigram(nn.Module):
    """One learned distribution over the vocabulary, whatever the context."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(vocab_size))

    def save_pretrained(self, folder, state_dict=None) -> None:
        save_folder(folder, self.state_dict() if state_dict is None else state_dict,
                    {"model_type": "toy-unigram", "vocab_size": len(self.logits)})


class UnigramForTraining(SameVocabulary, nn.Module):
    needs_target_hidden, aux_layers = False, None

    def __init__(self, draft: Unigram):
        super().__init__()
        self.lm = draft

    def loss_rows(self, pred_mask):
        return [LossRows(int(pred_mask.sum()), None, None, None)]

    def forward(self, input_ids, attention_mask, pred_mask, target_hidden=None):
        return self.lm.logits.expand(int(pred_mask.sum()), -1)  # [N, V]


class UnigramDraft:
    uses_target_hidden = False
    scores, failures, propose_tree = None, None, None

    def __init__(self, logits: torch.Tensor, name: str):
        self.logits, self.name = logits, name

    def start(self, input_ids, attention_mask, first_token, target_hidden=None):
        self.batch = input_ids.shape[0]

    def propose(self, k, sampling, history, generator=None):
        q = sampling_probs(self.logits.expand(self.batch, k, -1), sampling.temperature,
                           sampling.top_p, sampling.top_k)  # [B, k, V]
        tokens = torch.multinomial(q.flatten(0, 1), 1, generator=generator)
        return tokens.view(self.batch, k), q

    def accept(self, num_accepted, next_token, target_hidden=None):
        pass


class UnigramKind:
    name, description, formats = "unigram", "a unigram toy", ()
    train_keys = ()
    hf_assistant, quantised_weights = False, False
    compiled_steps = False

    def claims(self, spec):
        return spec == "unigram"

    def reads_folder(self, config):
        return config.get("model_type") == "toy-unigram"

    def check_train(self, cfg: TrainConfig):
        if cfg.on_policy_fraction or cfg.lora_rank:
            raise ConfigError("a unigram draft neither samples on policy nor takes LoRA.")

    def check_target(self, cfg, k, target_config):
        pass  # any depth, any vocabulary

    def parameters(self, cfg, target_config):
        return target_config["vocab_size"], 0

    def build(self, cfg, target, tokenizer, examples, log):
        vocab = target.get_output_embeddings().weight.shape[0]
        return Unigram(vocab).to(target.device).train()

    def freeze(self, draft, cfg):
        pass

    def wrap(self, draft, cfg):
        return UnigramForTraining(draft)

    def load(self, spec, target, tokenizer, dtype, device):
        draft = load_folder(spec, lambda config, state: Unigram(config["vocab_size"]),
                            "a unigram draft", dtype, device)
        return LoadedDraft(f"{spec} (unigram)", self, draft)

    def engine_draft(self, loaded, name):
        return UnigramDraft(loaded.model.logits.detach(), name)

    def check_export(self, draft_folder, k, target_shape):
        raise ConfigError("no serving engine loads a unigram draft.")

    def write_export(self, draft_folder, out, k, fmt, verifier):
        raise ConfigError("no serving engine loads a unigram draft.")

    def export_name(self, fmt):
        return self.name

    def check_exported(self, folder):
        pass


# --- the test -----------------------------------------------------------------------------------


@pytest.fixture
def unigram_registered(monkeypatch):
    """The one registry line: KINDS gains the toy kind."""
    monkeypatch.setattr(registry, "KINDS", [UnigramKind(), *registry.KINDS])


def test_a_toy_kind_trains_serves_and_is_measured_with_one_registry_line(
        tiny_run, unigram_registered):
    from eval.speculative import evaluate
    from serving.export import export_draft

    cfg = tiny_run("train.draft=unigram", "train.learning_rate=0.3", "train.eval_k=2",
                   "eval.draft=trained", "eval.k=2", "eval.max_new_tokens=12",
                   "eval.num_prompts=3", "eval.methods=[target, speculative, hf_assisted]",
                   f"eval.prompts={tiny_run().data.sources[0]}")
    summary = train_draft(cfg, Accelerator(**accelerator_kwargs(cfg)))
    log = [json.loads(line) for line in
           (cfg.run.output_path / "train" / "log.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in log if "loss" in e]
    assert losses[-1] < 0.8 * losses[0]
    assert summary.after["loss"] < summary.before["loss"]
    config = json.loads((summary.draft_dir / "config.json").read_text())
    assert config["model_type"] == "toy-unigram"

    report = evaluate(cfg, torch.device("cpu"))
    assert list(report["methods"]) == ["target", "speculative"]  # hf_assisted: not an LM
    spec = report["methods"]["speculative"]
    assert spec["identical_to_target"] == 3
    unigram = load_folder(summary.draft_dir, lambda config, state: Unigram(config["vocab_size"]),
                          "a unigram draft", torch.float32, torch.device("cpu"))
    top = int(unigram.logits.argmax())  # greedy: its argmax, k times
    assert spec["tau"] == pytest.approx(reference_tau(cfg, lambda target: lambda ids, k: [top] * k))
    assert report["draft"].endswith("(unigram)")

    with pytest.raises(ConfigError, match="no speculative method for a unigram toy"):
        export_draft(cfg, 2)
    with pytest.raises(ConfigError, match="neither samples on policy"):
        registry.check_train_config(tiny_run("train.draft=unigram",
                                             "train.on_policy_fraction=0.5").train)
