"""EAGLE-3 heads on tiny random models: vocabulary maps, feature capture, the training-time test
against the serving cache, training, save/load, and lossless decoding in the engine."""

import re

import pytest
import torch

from decoding.engine import DecodeSettings, generate
from decoding.quantise import Int4Linear, Int8Linear
from drafts.eagle3 import (
    IGNORE,
    Eagle3Draft,
    Eagle3ForTraining,
    Eagle3Head,
    FusedLayer,
    HeadCache,
    check_aux_layers,
    check_vocab_maps,
    default_aux_layers,
    draft_index,
    most_frequent_ids,
    target_ids,
    unroll,
    vocab_maps,
)
from recipe import ConfigError, Eagle3Config
from tests.decoding.test_engine import _prompts
from tests.decoding.test_tree import candidate_path
from tests.helpers import assert_same_state, logged_chains, tiny_llama
from train.data import Example, collate
from train.features import target_hidden

VOCAB, EOS, LAYERS, AUX = 256, 2, 4, [1, 2, 3]


def _tiny(seed):
    return tiny_llama(VOCAB, seed=seed, layers=LAYERS, eos_token_id=EOS, pad_token_id=0)


@pytest.fixture(scope="module")
def target():
    return _tiny(0)


def _head(target, draft_size=200, seed=1, layers=1, eagle31=False):
    """eagle31: with EAGLE 3.1's fc_norm (its norms at random scales, so they count) and
    norm_output."""
    torch.manual_seed(seed)
    counts = torch.randint(0, 50, (VOCAB,))
    head = Eagle3Head.from_target(target, AUX, most_frequent_ids(counts, draft_size),
                                  layers=layers, fc_norm=eagle31, norm_output=eagle31)
    with torch.no_grad():  # a random head, not the target's own rows: a draft that errs
        head.lm_head.weight.normal_(0, 0.3)
        for norm in head.fc_norm or []:
            norm.weight.uniform_(0.5, 1.5)
    return head.eval()


VERSIONS = pytest.mark.parametrize("eagle31", [False, True], ids=["EAGLE-3", "EAGLE 3.1"])


def test_draft_vocabulary_round_trip_for_every_id():
    counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(0))
    ids = most_frequent_ids(counts, 100)
    assert torch.equal(ids, ids.sort().values) and len(ids.unique()) == 100
    assert counts[ids].min() >= counts[~torch.isin(torch.arange(VOCAB), ids)].max()
    d2t, t2d = vocab_maps(ids, VOCAB)
    check_vocab_maps(d2t, t2d)
    every = torch.arange(100)
    assert torch.equal(target_ids(every, d2t), ids)  # draft id -> target id, every id
    index = draft_index(d2t, VOCAB)
    assert torch.equal(index[ids], every)  # and back
    assert (index[~t2d] == IGNORE).all() and t2d.sum() == 100


def test_most_frequent_ids_breaks_ties_by_the_lower_id_and_checks_the_size():
    counts = torch.tensor([5, 1, 5, 1, 9])
    assert most_frequent_ids(counts, 3).tolist() == [0, 2, 4]
    with pytest.raises(ConfigError, match="draft_vocab_size=6 must be in"):
        most_frequent_ids(counts, 6)


def test_the_vocabulary_line_counts_training_and_held_out_labels_by_hand():
    from drafts.vocabulary import label_share, vocabulary_line

    # labels (loss_mask 1): train 3, 3, 5, 1; held out 3, 7, 7, 2
    train = [Example("a", [9, 3, 3, 5], [0, 1, 1, 1]), Example("b", [1, 9], [1, 0])]
    held_out = [Example("c", [3, 7, 7, 2, 5], [1, 1, 1, 1, 0])]
    ids = torch.tensor([1, 3, 4])  # 4 is never a training label
    assert label_share(train, ids, 10) == (0.75, 2)
    assert label_share(held_out, ids, 10) == (0.25, 1)
    line = vocabulary_line(train, held_out, ids, 10)
    assert "(3 tokens) holds 75.00 % of the training labels" in line
    assert "1 of its tokens are never a training label" in line
    assert "25.00 % of the held-out labels" in line
    assert "never a training label" not in vocabulary_line(train, [], torch.tensor([1, 3]), 10)


@pytest.mark.parametrize("corrupt", ["shift", "swap"])
def test_a_d2t_that_does_not_match_t2d_is_refused(corrupt):
    d2t, t2d = vocab_maps(torch.tensor([1, 4, 7, 9]), 12)
    bad = d2t.clone()
    if corrupt == "shift":
        bad[2] += 1
    else:  # same set of target ids, two draft ids exchanged
        bad[1], bad[2] = d2t[2] + 1, d2t[1] - 1
    with pytest.raises(ConfigError, match="does not map onto"):
        check_vocab_maps(bad, t2d)


def test_aux_layers_are_checked_against_the_target():
    assert default_aux_layers(30) == [2, 15, 27]
    assert check_aux_layers([2, 3, 3], 6) == [2, 3, 3]  # vLLM's default for 6 layers
    with pytest.raises(ConfigError, match=r"must lie in \[0, 3\]"):
        check_aux_layers([1, 2, 4], 4)
    with pytest.raises(ConfigError, match="three ids"):
        check_aux_layers([3, 1, 2], 4)


def test_feature_capture_reads_the_inputs_of_the_named_decoder_layers(target):
    inputs = {}
    hooks = [layer.register_forward_pre_hook(
        lambda module, args, kwargs, i=i: inputs.__setitem__(i, kwargs.get(
            "hidden_states", args[0] if args else None)), with_kwargs=True)
        for i, layer in enumerate(target.model.layers)]
    batch = collate([Example("a", list(range(3, 20)), [0] * 8 + [1] * 9)], 0, 64)
    out = target_hidden(target, batch, AUX)
    for hook in hooks:
        hook.remove()
    H = target.config.hidden_size
    for n, layer in enumerate(AUX):
        assert torch.allclose(out.aux[..., n * H:(n + 1) * H], inputs[layer])
    last_layer = target.model.layers[-1]
    positions = torch.arange(17)[None]
    layer_out = last_layer(inputs[LAYERS - 1], attention_mask=None, position_ids=positions,
                           position_embeddings=target.model.rotary_emb(inputs[LAYERS - 1],
                                                                       positions))
    layer_out = layer_out[0] if isinstance(layer_out, tuple) else layer_out
    manual_last = target.model.norm(layer_out)  # the post-norm output of the last layer
    assert torch.allclose(out.last, manual_last, atol=1e-5)
    assert torch.equal(out.embeds, target.model.embed_tokens(batch.input_ids))


@VERSIONS
@pytest.mark.parametrize("layers", [1, 2], ids=["1 layer", "2 layers"])
@pytest.mark.parametrize("fused", [False, True], ids=["head", "fused layer"])
def test_training_time_test_matches_the_serving_cache(target, fused, layers, eagle31):
    """Step j of the unroll at index p is what the head computes in serving for draft token j+1
    after the verified prefix x_0..x_{p+1}, when the chain so far is the true continuation; the
    engine's FusedLayer (one q/k/v product, a rotary table, fused norms) computes the same, and
    the same logits; with a head of two layers too (each with its own cache), and an EAGLE 3.1
    head (its features normed per aux layer, its post-norm output fed back)."""
    head = _head(target, layers=layers, eagle31=eagle31)
    layer = FusedLayer(head) if fused else head
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (1, 24), generator=g)
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[i] for i in AUX], -1)
        embeds = target.model.embed_tokens(ids)
        steps = unroll(head, embeds, aux, torch.ones_like(ids), 4)
        for p in (5, 12):
            cache = HeadCache(1, head, "cpu")
            out = cache.run(layer, embeds[:, 1:p + 2], layer.features(aux[:, :p + 1]),
                            torch.ones(1, p + 1, dtype=torch.bool))
            h = out[:, -1:]
            assert torch.allclose(h, steps[0][:, p:p + 1], atol=1e-5)
            for j in range(1, 4):
                h = cache.run(layer, embeds[:, p + 1 + j:p + 2 + j], layer.feedback(h),
                              torch.ones(1, 1, dtype=torch.bool))
                assert torch.allclose(h, steps[j][:, p:p + 1], atol=1e-5), (p, j)
                assert torch.allclose(layer.logits(h), head.logits(steps[j][:, p:p + 1]),
                                      atol=1e-4), (p, j)


@pytest.mark.parametrize("weights, linear", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_quantised_weights_keep_the_output_the_targets(target, weights, linear):
    """A head on int8 or int4 weights drafts, and greedy output is still the target's; the
    draft makes its FusedLayer again once the head's weights change."""
    _, ids, mask = _prompts([5, 11, 8])
    plain = generate(target, ids, mask, DecodeSettings(max_new_tokens=16, k=3), set())
    draft = Eagle3Draft(_head(target), target.get_input_embeddings(), weights=weights)
    spec = generate(target, ids, mask, DecodeSettings(max_new_tokens=16, k=3), set(), draft)
    assert spec.tokens == plain.tokens
    assert all(isinstance(draft.layer.linears[name], linear) for name in draft.layer.linears)
    layer = draft.layer
    generate(target, ids, mask, DecodeSettings(max_new_tokens=4, k=3), set(), draft)
    assert draft.layer is layer  # unchanged weights: made once
    with torch.no_grad():
        draft.head.lm_head.weight.mul_(2)
    generate(target, ids, mask, DecodeSettings(max_new_tokens=4, k=3), set(), draft)
    assert draft.layer is not layer


@pytest.mark.slow  # inductor compiles three graphs (~1 minute on 2 CPU cores)
def test_compiled_steps_draft_what_the_eager_head_drafts(target):
    """eval.draft_compile: greedy chains and the settling after verification run compiled
    (drafts/eagle3/compiled.py) and propose what the eager head proposes, chain by chain (the
    same tokens, logits within rounding), over left-padded rows of different lengths (holes in
    the head's cache), a row whose cache outgrows its first capacity (256 slots), and a second
    k; output stays the target's. Sampled decoding (eager chains, compiled settling) repeats
    the eager run's output under the same seed. A later engine run reuses the compiled code,
    and leaves the head's state a fresh start's. The head has two layers and EAGLE 3.1's norms:
    the compiled code loops over the layers and calls the head's own feedback, so one layer
    and the plain EAGLE-3 head are the same code with less in it (each graph compile costs
    about a minute here)."""
    head = _head(target, layers=2, eagle31=True)
    prompts, ids, mask = _prompts([5, 250, 8])
    runs = {}
    for compile in (False, True):
        draft = Eagle3Draft(head, target.get_input_embeddings(), compile=compile, layers={})
        chains = logged_chains(draft)
        for k in (3, 4):
            runs[compile, k] = generate(target, ids, mask, DecodeSettings(max_new_tokens=24, k=k),
                                        set(), draft).tokens
        runs[compile, "chains"] = chains[:]  # the greedy runs' chains
        sampled = generate(target, ids, mask, DecodeSettings(max_new_tokens=16, k=3,
                                                             temperature=1.0), set(), draft,
                           torch.Generator().manual_seed(0))
        runs[compile, "sampled"] = sampled.tokens, sum(s.accepted for s in sampled.stats)
        if compile:
            assert draft.cache.slots.capacity > 256  # the long row grew the head's cache
            compiled = draft.compiled
            again = generate(target, ids, mask, DecodeSettings(max_new_tokens=6, k=3), set(), draft)
            assert draft.compiled is compiled
            last = max(s.steps for s in again.stats)  # rows that drafted to the end
            _assert_fresh_start_state(target, draft, prompts, again.tokens,
                                      [r for r in range(3) if again.stats[r].steps == last])
    plain = generate(target, ids, mask, DecodeSettings(max_new_tokens=24), set()).tokens
    assert runs[True, 3] == runs[False, 3] == runs[True, 4] == plain
    assert len(runs[True, "chains"]) == len(runs[False, "chains"]) > 10
    for (tokens, logits), (eager_tokens, eager_logits) in zip(runs[True, "chains"],
                                                              runs[False, "chains"]):
        assert torch.equal(tokens, eager_tokens)
        assert torch.allclose(logits, eager_logits, atol=1e-4)
    assert runs[True, "sampled"] == runs[False, "sampled"]
    assert runs[True, "sampled"][1] > 0  # drafted tokens got through: settling ran on them


@pytest.mark.slow  # dynamo traces the step before the C++ compiler is called
def test_a_compiled_step_that_cannot_compile_names_the_fix(target, tmp_path, monkeypatch):
    import torch._inductor.config as inductor

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing compiled before
    _, ids, mask = _prompts([6])
    draft = Eagle3Draft(_head(target, draft_size=120), target.get_input_embeddings(),
                        compile=True, layers={})
    # inductor's own patching: its config module is restored whole for later compilations
    with inductor.patch({"fx_graph_cache": False, "cpp.cxx": ("no-such-c++-compiler",)}), \
            pytest.raises(ConfigError, match="torch.compile could not compile .* set "
                                             "eval.draft_compile=false"):
        generate(target, ids, mask, DecodeSettings(max_new_tokens=8, k=3), set(), draft)


def test_training_time_test_lowers_the_loss_on_a_tiny_model(target):
    from recipe import TrainConfig
    from train.loop import weighted_loss

    head = _head(target).train()
    model = Eagle3ForTraining(head, steps=3, decay=0.8)
    g = torch.Generator().manual_seed(4)
    examples = [Example(str(i), torch.randint(3, VOCAB, (32,), generator=g).tolist(),
                        [0] * 8 + [1] * 24) for i in range(4)]
    batch = collate(examples, 0, 64)
    features = target_hidden(target, batch, AUX)
    p_logits = target.lm_head(features.last[batch.pred_mask]).detach()
    cfg = TrainConfig(draft="eagle3", loss="fkl", eval_k=3, eagle3=Eagle3Config(ttt_steps=3))
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(30):
        slots = model.loss_rows(batch.pred_mask)
        logits = model(batch.input_ids, batch.attention_mask, batch.pred_mask, features)
        loss = weighted_loss(cfg, model, slots, logits, p_logits, batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses[::5]
    assert [s.position for s in slots] == [1, 2, 3]


def test_restrict_ignores_labels_outside_the_draft_vocabulary(target):
    head = _head(target, draft_size=10)
    model = Eagle3ForTraining(head, steps=2, decay=1.0)
    inside = head.draft_to_target[3]
    outside = int(torch.nonzero(~head.t2d)[0])
    p, labels = model.restrict(torch.randn(2, VOCAB), torch.tensor([int(inside), outside]))
    assert p.shape == (2, 10) and labels.tolist() == [3, IGNORE]
    full = model.expand(torch.zeros(1, 10))
    assert torch.isinf(full).sum() == VOCAB - 10 and (full[0, head.draft_to_target] == 0).all()


def test_save_and_load_round_trip_and_a_corrupted_d2t_is_refused(target, tmp_path):
    from safetensors.torch import load_file, save_file

    head = _head(target, layers=2)
    head.save_pretrained(tmp_path / "head")
    loaded = Eagle3Head.from_pretrained(tmp_path / "head")
    assert_same_state(loaded.state_dict(), head.state_dict())
    assert loaded.aux_layers == AUX and loaded.num_layers == 2
    state = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert "embed_tokens.weight" not in state and state["lm_head.weight"].shape == (200, 64)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    # the second layer as vLLM loads it (midlayer is its layers.0), reading the layer below [H]
    assert state["layers.1.self_attn.q_proj.weight"].shape == (64, 64)
    assert "layers.1.hidden_norm.weight" not in state
    state["d2t"] = state["d2t"].roll(1)
    save_file(state, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(ConfigError, match="does not map onto"):
        Eagle3Head.from_pretrained(tmp_path / "head")


@pytest.mark.parametrize("k, layers, eagle31", [(1, 1, False), (3, 1, False), (6, 1, False),
                                                (3, 2, False), (3, 1, True), (3, 2, True)])
def test_greedy_speculation_with_a_head_equals_target_greedy_batched(target, k, layers, eagle31):
    _, ids, mask = _prompts([5, 11, 8])
    settings = DecodeSettings(max_new_tokens=24, temperature=0.0, k=k)
    plain = generate(target, ids, mask, settings, {EOS})
    draft = Eagle3Draft(_head(target, layers=layers, eagle31=eagle31),
                        target.get_input_embeddings())
    spec = generate(target, ids, mask, settings, {EOS}, draft)
    assert spec.tokens == plain.tokens
    assert sum(s.steps for s in spec.stats) < sum(len(t) for t in plain.tokens)  # it drafts


@pytest.mark.parametrize("layers", [1, 2], ids=["1 layer", "2 layers"])
def test_the_head_cache_after_decoding_equals_a_fresh_prefill(target, monkeypatch, layers):
    """After the engine's accept steps (holes, crops), the head's state at the last verified token
    is what a fresh start on the whole history computes; each accept runs the verified chunk up
    to the longest row's next token, not the whole k + 1."""
    prompts, ids, mask = _prompts([6, 9])
    draft = Eagle3Draft(_head(target, layers=layers), target.get_input_embeddings())
    fed, longest = [], []  # tokens the head's fc maps per call; max(n) + 1 per accept
    features = FusedLayer.features
    monkeypatch.setattr(FusedLayer, "features",
                        lambda layer, aux: (fed.append(aux.shape[1]), features(layer, aux))[1])
    accept = draft.accept
    draft.accept = lambda n, *rest: (longest.append(int(n.max()) + 1), accept(n, *rest))[1]
    out = generate(target, ids, mask, DecodeSettings(max_new_tokens=12, k=3), set(), draft)
    assert fed[1:] == longest and min(longest) < 4  # fed[0]: the start's prompt
    _assert_fresh_start_state(target, draft, prompts, out.tokens, range(2))


def _assert_fresh_start_state(target, draft, prompts, outputs, rows):
    """The head's state at each row's last verified token is what a fresh start on the row's
    whole history computes."""
    for row in rows:
        history = prompts[row] + outputs[row]
        context = torch.tensor([history[:-1]])
        fresh = Eagle3Draft(draft.head, target.get_input_embeddings())
        with torch.no_grad():
            hidden = target(context, output_hidden_states=True).hidden_states
            fresh.start(context, torch.ones_like(context), torch.tensor([history[-1]]), hidden)
        assert torch.allclose(fresh.hidden[0], draft.hidden[row], atol=1e-5)


def test_sampling_with_a_head_keeps_the_target_distribution(target):
    """k=1 at temperature 1: the second emitted token (drafted, then verified) is distributed as
    the target's marginal sum_f p(f) p(. | f) over the first token f."""
    _, ids, mask = _prompts([7])
    rows = 6000
    settings = DecodeSettings(max_new_tokens=2, temperature=1.0, k=1)
    draft = Eagle3Draft(_head(target), target.get_input_embeddings())
    out = generate(target, ids.expand(rows, -1), mask.expand(rows, -1), settings, set(), draft,
                   torch.Generator().manual_seed(0))
    assert sum(s.accepted for s in out.stats) > 0  # the draft's tokens do get through
    with torch.no_grad():
        p1 = torch.softmax(target(ids).logits[0, -1], -1)  # [V]
        every_first = torch.cat([ids.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        p2 = torch.softmax(target(every_first).logits[:, -1], -1)  # [V, V]
    marginal = (p1 @ p2).double()
    second = torch.tensor([t[1] for t in out.tokens])
    # randomized probability integral transform: Uniform(0, 1) iff second ~ marginal (a TVD
    # bound over 256 tokens from 6,000 samples mostly measures the sampling noise)
    u = (marginal.cumsum(0) - marginal)[second] + torch.rand(
        rows, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * marginal[second]
    counts = torch.bincount((u * 20).long().clamp(max=19), minlength=20).double()
    chi2 = ((counts - rows / 20) ** 2 / (rows / 20)).sum()
    assert float(torch.special.gammaincc(torch.tensor(9.5, dtype=torch.float64), chi2 / 2)) > 1e-3


def _started_draft(target, prompt_lengths, layers=1, eagle31=False):
    """A head draft after start() on left-padded prompts, as the engine leaves it."""
    _, ids, mask = _prompts(prompt_lengths)
    draft = Eagle3Draft(_head(target, layers=layers, eagle31=eagle31),
                        target.get_input_embeddings())
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
        draft.start(ids, mask, out.logits[:, -1].argmax(-1), out.hidden_states)
    return draft


@torch.no_grad()
@pytest.mark.parametrize("layers, eagle31", [(1, False), (2, False), (1, True)],
                         ids=["1 layer", "2 layers", "EAGLE 3.1"])
def test_a_dynamic_tree_scores_every_path_as_the_chain_would(target, layers, eagle31):
    """Each candidate's cumulative log-probability equals the sum of the head's log-probs
    along its path drafted token by token (the tree attention, positions and hidden-state
    feeding of the expansion are the chain's); the head's cache is as before afterwards."""
    import copy

    draft = _started_draft(target, [6, 10], layers, eagle31)
    slots = draft.cache.slots
    before = ([slots.keys(i).clone() for i in range(layers)], draft.cache.mask.clone(),
              draft.cache.next_position.clone())
    chain_copy = copy.deepcopy(draft)
    tokens, parents, scores = draft.propose_tree(3, 3)
    assert tokens.shape == (2, 3 + 2 * 9)
    assert all(torch.equal(slots.keys(i), before[0][i]) for i in range(layers))
    assert torch.equal(draft.cache.mask, before[1])
    assert torch.equal(draft.cache.next_position, before[2])
    head = chain_copy.head
    for row in range(2):
        for m in range(tokens.shape[1]):
            path = candidate_path(tokens, parents, row, m)
            sequential = copy.deepcopy(chain_copy)
            hidden, total = sequential.hidden[row : row + 1], 0.0
            sequential.cache = sequential.cache.rows(slice(row, row + 1))
            for i, token in enumerate(path):
                logp = torch.log_softmax(head.full_vocab_logits(head.logits(hidden)).float(), -1)
                total += float(logp[0, token])
                if i < len(path) - 1:
                    embeds = sequential._embeds(torch.tensor([[token]]))
                    hidden = sequential.cache.run(head, embeds, head.feedback(hidden)[:, None],
                                                  torch.ones(1, 1, dtype=torch.bool))[:, 0]
            assert abs(total - float(scores[row, m])) < 1e-4, (row, m, path)


@pytest.mark.parametrize("nodes,hybrid", [(8, False), (16, True)])
def test_greedy_dynamic_tree_speculation_equals_target_greedy_batched(target, nodes, hybrid):
    prompts, ids, mask = _prompts([5, 11, 8])
    plain = generate(target, ids, mask, DecodeSettings(max_new_tokens=24, k=3), set())
    settings = DecodeSettings(max_new_tokens=24, k=3, tree=True, tree_width=3, tree_nodes=nodes,
                              ngram_branch=hybrid)
    draft = Eagle3Draft(_head(target), target.get_input_embeddings())
    spec = generate(target, ids, mask, settings, set(), draft)
    assert spec.tokens == plain.tokens
    assert sum(s.accepted for s in spec.stats) > 0  # the tree's tokens did get through
    assert all(s.drafted <= s.steps * (nodes + 3) for s in spec.stats)
    chain = generate(target, ids, mask, DecodeSettings(max_new_tokens=24, k=3), set(),
                     Eagle3Draft(_head(target), target.get_input_embeddings()))
    def tau(out):
        return sum(s.accepted for s in out.stats) / sum(s.steps for s in out.stats)

    assert tau(spec) >= tau(chain)
    # after the tree steps the head's state is a fresh start's on the whole history (rows
    # that finished early went on drafting past their output: checked are those that did not)
    last = max(s.steps for s in spec.stats)
    _assert_fresh_start_state(target, draft, prompts, spec.tokens,
                              [r for r in range(3) if spec.stats[r].steps == last])


@torch.no_grad()
@pytest.mark.parametrize("width", [None, 300])
def test_the_target_init_computes_the_targets_layer_on_its_feature(target, width, tmp_path):
    """head_init 'target' with the embedding half of q/k/v zeroed: step 0 of the head over a
    sequence is the target's decoder layer 2 on its input (the highest aux feature), exactly;
    also with an MLP wider than the target's, whose width the saved head keeps; a head of two
    layers is the target's layers 2 and 3."""
    from drafts.eagle3 import Eagle3
    from drafts.kind import aux_features
    from recipe import TrainConfig

    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, [0, 1, 2], torch.arange(VOCAB), init="target",
                                  intermediate_size=width)
    units = width or target.config.intermediate_size
    assert head.midlayer.mlp.down_proj.weight.shape == (64, units)
    if width:  # the extra units are live: they read the input, and only their output is zero
        assert head.midlayer.mlp.gate_proj.weight[target.config.intermediate_size:].abs().sum() > 0
        head.save_pretrained(tmp_path / "head")
        loaded = Eagle3Head.from_pretrained(tmp_path / "head")
        assert loaded.config.intermediate_size == width
        assert_same_state(loaded.state_dict(), head.state_dict())
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(head.midlayer.self_attn, name).weight[:, :64] = 0
    ids = torch.randint(3, VOCAB, (2, 9))
    hs = target(ids, output_hidden_states=True).hidden_states
    out = unroll(head, target.get_input_embeddings()(ids), aux_features(hs, [0, 1, 2]),
                 torch.ones_like(ids), steps=1)[0]
    torch.testing.assert_close(out, hs[3], atol=1e-5, rtol=1e-5)  # layer 2's output
    assert torch.equal(head.norm.weight, target.model.norm.weight)
    two = Eagle3Head.from_target(target, [0, 1, 1], torch.arange(VOCAB), init="target",
                                 intermediate_size=width, layers=2)
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(two.midlayer.self_attn, name).weight[:, :64] = 0
    out = unroll(two, target.get_input_embeddings()(ids), aux_features(hs, [0, 1, 1]),
                 torch.ones_like(ids), steps=1)[0]
    torch.testing.assert_close(out, hs[3], atol=1e-5, rtol=1e-5)  # layers 1 and 2
    with pytest.raises(ConfigError, match="lower train.eagle3.layers to 1 or the highest of "
                                          "train.aux_layers to 2"):
        Eagle3Head.from_target(target, AUX, torch.arange(VOCAB), init="target", layers=2)
    deep = TrainConfig(draft="eagle3", head_init="target", aux_layers=AUX,
                       eagle3=Eagle3Config(ttt_steps=4, layers=2))
    with pytest.raises(ConfigError, match="lower train.eagle3.layers"):  # before any stage
        Eagle3().check_target(deep, 4, target.config.to_dict())
    with pytest.raises(ConfigError, match="'random' or 'target'"):
        Eagle3Head.from_target(target, [0, 1, 2], torch.arange(VOCAB), init="layer")
    with pytest.raises(ConfigError, match="eagle3.intermediate_size >= "):
        Eagle3Head.from_target(target, [0, 1, 2], torch.arange(VOCAB), init="target",
                               intermediate_size=target.config.intermediate_size - 1)
    narrow = TrainConfig(draft="eagle3", head_init="target", aux_layers=AUX,
                         eagle3=Eagle3Config(ttt_steps=4,
                                             intermediate_size=target.config.intermediate_size - 1))
    with pytest.raises(ConfigError, match="eagle3.intermediate_size >= "):  # before any stage
        Eagle3().check_target(narrow, 4, target.config.to_dict())


def test_feature_noise_is_bounded_seeded_per_micro_batch():
    from drafts.kind import TargetHidden
    from train.features import noisy_features

    hidden = TargetHidden(torch.zeros(2, 5, 4), torch.zeros(2, 5, 12), torch.zeros(2, 5, 4))
    a, b = noisy_features(hidden, 0.2, 0, 3), noisy_features(hidden, 0.2, 0, 3)
    assert torch.equal(a.aux, b.aux) and a.aux.abs().max() <= 0.1 and a.aux.abs().max() > 0.05
    assert not torch.equal(a.aux, noisy_features(hidden, 0.2, 0, 4).aux)
    assert torch.equal(a.last, hidden.last)  # the target's logits stay exact



def test_a_train_key_only_other_kinds_read_is_refused_by_the_kind():
    from drafts import check_train_config
    from recipe import TrainConfig

    for draft, key, value, readers in [
            ("medusa:3", "feature_noise", 0.2, "['eagle3', 'dspark', 'dflash']"),
            ("dflash:2", "eagle3", Eagle3Config(ttt_steps=2), "['eagle3']"),
            ("layer-truncated:2", "block_size", 3, "['dspark', 'dflash', 'pard']"),
            ("eagle3", "mask_token_id", 5, "['dspark', 'dflash', 'pard']")]:
        with pytest.raises(ConfigError, match=rf"train.{key}=.* read by {re.escape(readers)}"):
            check_train_config(TrainConfig(draft=draft, **{key: value}))
    check_train_config(TrainConfig(draft="eagle3", feature_noise=0.2, head_init="target",
                                   eagle3=Eagle3Config(ttt_steps=4), eval_k=4))  # its own keys pass
    with pytest.raises(ConfigError, match="feature_noise=-0.1 must be >= 0"):
        check_train_config(TrainConfig(draft="dflash:2", feature_noise=-0.1))
    with pytest.raises(ConfigError, match="block_size=0 must be >= 1"):
        check_train_config(TrainConfig(draft="pard:layer-truncated:2", block_size=0))


def test_a_dynamic_tree_whose_head_turns_nan_falls_back_and_counts_it(target):
    _, ids, mask = _prompts([5, 11])
    plain = generate(target, ids, mask, DecodeSettings(max_new_tokens=10, k=3), set())
    head = _head(target)
    with torch.no_grad():
        head.lm_head.weight[0, 0] = float("nan")
    settings = DecodeSettings(max_new_tokens=10, k=3, tree=True, tree_nodes=8)
    spec = generate(target, ids, mask, settings, set(),
                    Eagle3Draft(head, target.get_input_embeddings()))
    assert spec.tokens == plain.tokens
    assert all(s.tree_fallbacks > 0 for s in spec.stats)


def test_target_logits_on_the_draft_vocabulary_alone_give_the_same_loss(target):
    """Training computes the target's logits on the draft vocabulary's rows only ([N, Vd], a
    sixth of the arithmetic for 8,192 of 49,152): the loss and its gradient must be those of
    the full [N, V] logits restricted afterwards."""
    from contextlib import nullcontext

    from recipe import load_config
    from train.loop import TargetSignal, target_logits, weighted_loss

    head = _head(target, draft_size=40)
    model = Eagle3ForTraining(head, steps=3, decay=0.8)
    examples = [Example(str(i), torch.randint(3, VOCAB, (n,)).tolist(), [0] * 5 + [1] * (n - 5))
                for i, n in enumerate((19, 27))]
    batch = collate(examples, pad_id=0, max_len=64)
    signal = TargetSignal.for_run(load_config(None, []), target, model, nullcontext)
    hidden, on_rows = signal(batch)
    full = target_logits(target, batch, hidden)
    assert on_rows.shape == (batch.loss_tokens, 40) and full.shape == (batch.loss_tokens, VOCAB)
    torch.testing.assert_close(on_rows, full[:, head.draft_to_target])
    tcfg = load_config(None, []).train
    grads = []
    for p_logits in (on_rows, full):
        head.zero_grad()
        q = model(batch.input_ids, batch.attention_mask, batch.pred_mask, hidden)
        loss = weighted_loss(tcfg, model, model.loss_rows(batch.pred_mask), q, p_logits,
                             batch.labels)
        loss.backward()
        grads.append((float(loss.detach()), head.fc.weight.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_the_greedy_walk_predicts_exactly_what_the_engine_counts(target):
    """On the replies our engine wrote greedily, the held-out evaluation's walk reproduces the
    engine's drafting steps and accepted-per-position counters (the head is fitted a little to
    these replies so that it both accepts and rejects)."""
    from recipe import TrainConfig
    from train.loop import evaluate_held_out, weighted_loss

    k = 3
    _, ids, mask = _prompts([5, 11, 8])
    settings = DecodeSettings(max_new_tokens=40, temperature=0.0, k=k)
    plain = generate(target, ids, mask, settings, {EOS})

    def examples_of(replies):
        prompts = [ids[row][mask[row].bool()].tolist() for row in range(len(replies))]
        return [Example(str(row), p + r, [0] * len(p) + [1] * len(r))
                for row, (p, r) in enumerate(zip(prompts, replies))]

    head = _head(target).train()
    model = Eagle3ForTraining(head, steps=k, decay=0.8)
    cfg = TrainConfig(draft="eagle3", loss="fkl", eval_k=k, eagle3=Eagle3Config(ttt_steps=k))
    batch = collate(examples_of(plain.tokens), 0, 128)
    features = target_hidden(target, batch, AUX)
    p_logits = target.lm_head(features.last[batch.pred_mask]).detach()
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(25):
        logits = model(batch.input_ids, batch.attention_mask, batch.pred_mask, features)
        loss = weighted_loss(cfg, model, model.loss_rows(batch.pred_mask), logits, p_logits,
                         batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    head.eval()

    out = generate(target, ids, mask, settings, {EOS},
                   Eagle3Draft(head, target.get_input_embeddings()))
    assert out.tokens == plain.tokens
    examples = examples_of(out.tokens)
    batches = [collate(examples[:2], 0, 128), collate(examples[2:], 0, 128)]
    with torch.no_grad():
        result = evaluate_held_out(model, target, batches, cfg, torch.device("cpu"),
                                   lambda b: target_hidden(target, b, AUX))
    steps = sum(s.steps for s in out.stats)
    accepted = [sum(s.accepted_per_position[j] for s in out.stats) for j in range(k)]
    assert 0 < accepted[0] < steps  # the draft both accepts and rejects
    assert result["walk_steps"] == steps
    assert result["walk_alpha"] == [round(a / steps, 6) for a in accepted]
    assert result["walk_tau"] == pytest.approx(1 + sum(accepted) / steps)
