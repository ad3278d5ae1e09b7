"""`specserve train-mtp`: the chained training objective matches inference, the loss goes down, the checkpoint
round-trips through the engine's loader, and a trained head on a tiny target is loadable, lossless and accepts
clearly more than a random head."""

import json
import os
import shutil

import pytest
import torch

from specserve.batch import CacheKind, ForwardBatch, ForwardMode, fixed_width_out_cache_loc
from specserve.graphs.prefill import ExtendBatch
from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.train.attention import chain_mask
from specserve.train.data import Sample, load_prompts, record_messages
from specserve.train.hidden import collect_hidden, pad_ids, target_hidden
from specserve.train.objective import (
    ObjectiveConfig,
    build_draft,
    chained_forward,
    chained_loss,
    init_draft_from_target,
)
from specserve.train.vocab import DraftVocab, build_draft_vocab

CPU = torch.device("cpu")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from helpers import build_tiny_model

    # a 64-token vocabulary: the random target's greedy text falls into short loops a head can learn
    return build_tiny_model(str(tmp_path_factory.mktemp("train") / "llama"), "llama", seed=5, vocab_size=64)


def _word_prompts(path, n, seed):
    g = torch.Generator().manual_seed(seed)

    def word():
        k = int(torch.randint(2, 7, (1,), generator=g))
        return "".join(LETTERS[int(i)] for i in torch.randint(0, 26, (k,), generator=g))

    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"question": " ".join(word() for _ in range(int(torch.randint(2, 6, (1,),
                                                                                             generator=g))))})
                    + "\n")
    return str(path)


def _random_draft(target, vocab, seed, aux_layers=None):
    """A head with every parameter random (not just the init), so equalities do not lean on the init's structure."""
    draft = build_draft(target.config, 600, vocab, CPU, aux_layers)
    init_draft_from_target(draft, target.model, vocab, 0.1, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return draft


# ---------------------------------------------------------------------------------------------------- the mask
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_chain_mask_is_the_inference_kv(depth):
    """Derive the allowed keys by replaying the engine's draft KV writes (DESIGN §1) and compare with chain_mask."""
    n = 9
    mask = chain_mask(n, depth, CPU)
    assert mask.shape == (n, depth * n)
    for i in range(n):
        # draft step `depth` at index i runs with seq index S = i - (depth - 2) of the spec step's first draft
        # decode; the draft extend left depth-1 keys at 0..S-1, and draft steps 2..depth wrote S, S+1, ..., i.
        s = i - (depth - 1) + 1
        kv = {t: 1 for t in range(max(s, 0))}
        for j in range(2, depth + 1):
            t = s + j - 2
            if t >= 0:
                kv[t] = j
        if depth == 1:
            kv[i] = 1  # draft extend itself: causal over clean keys, its own included
        expected = torch.zeros(depth * n, dtype=torch.bool)
        for t, j in kv.items():
            if t <= i:
                expected[(j - 1) * n + t] = True
        assert torch.equal(mask[i], expected), (depth, i)
    # every query keeps at least its own key (SDPA would give NaN on an empty row)
    assert bool(mask.any(dim=1).all())


# ------------------------------------------------------------------------------------------- training == inference
@pytest.mark.parametrize("aux_layers", [None, [0, 1]])
def test_training_forward_matches_engine(tiny_target, aux_layers):
    """Target hidden states and the chained draft at depths 1..3 from the training code equal the engine's target
    extend, draft extend and draft decode over the paged KV cache on the same inputs; also for a head reading
    aux layers (the target's features are then [final | layer 0 | layer 1])."""
    from specserve.attention.torch_backend import TorchAttentionBackend
    from specserve.engine.model_runner import ModelRunner
    from specserve.kvcache.manager import KVHandle
    from specserve.server_args import ServerArgs

    target = load_target(ModelSource.resolve(tiny_target), torch.float32, CPU, 600)
    target.model.set_aux_layers(aux_layers or [])
    vocab = DraftVocab(None, target.config.vocab_size, 1.0)
    draft = _random_draft(target, vocab, seed=3, aux_layers=aux_layers)
    args = ServerArgs(model_path=tiny_target, speculative_algorithm="MTP", speculative_num_steps=3,
                      max_total_tokens=1024, max_running_requests=4, device="cpu")
    mr = ModelRunner(args, target.model, target.config, draft, CPU, torch.float32, 256)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (14, 9)]
    ids, _ = pad_ids(seqs, CPU)
    with torch.no_grad():
        h_train = target_hidden(target.model, ids)  # [2, 14, F]
        g_train = chained_forward(draft, ids, h_train, 3)
    assert h_train.shape[-1] == target.config.hidden_size * (1 + len(aux_layers or []))

    handles = [KVHandle() for _ in seqs]
    for hd, s in zip(handles, seqs):
        assert mr.kv.assign_row(hd) and mr.kv.ensure([hd], [len(s) + 4])
    table = mr.req_to_token.table
    rows = [hd.row for hd in handles]
    # the engine's state after prefilling x_0..x_{S-1} and accepting x_S, x_{S+1}, x_{S+2} as drafts
    ss = [len(s) - 3 for s in seqs]
    flat = torch.tensor(sum((s[:n] for s, n in zip(seqs, ss)), []))
    pos = torch.cat([torch.arange(n) for n in ss])
    loc = torch.cat([table[r, :n] for r, n in zip(rows, ss)])
    h_eng = mr.prefill.run(ExtendBatch(flat, pos, loc, rows, ss, ss))
    nxt = torch.tensor(sum((s[1:n + 1] for s, n in zip(seqs, ss)), []))  # x_{i+1}
    d_eng = mr.spec.prefill.run(ExtendBatch(nxt, pos, loc, rows, ss, ss, h_eng))
    off = 0
    for b, n in enumerate(ss):
        torch.testing.assert_close(h_train[b, :n], h_eng[off:off + n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(g_train[0][b, :n], d_eng[off:off + n], rtol=1e-4, atol=1e-4)
        off += n
    # draft decode, two chained steps: index S (depth 2), then S+1 (depth 3)
    ends = torch.tensor(ss).cumsum(0) - 1
    hidden = d_eng[ends]  # g_1 at S-1
    rows_t, s_t = torch.tensor(rows), torch.tensor(ss)
    for step in range(2):
        tok = torch.tensor([s[n + 1 + step] for s, n in zip(seqs, ss)])
        seq_lens = s_t + 1 + step
        backend = TorchAttentionBackend(mr.req_to_token, mr.spec.caches.kv)
        fb = ForwardBatch(mode=ForwardMode.DRAFT_DECODE, batch_size=2, input_ids=tok, positions=s_t + step,
                          out_cache_loc=fixed_width_out_cache_loc(table, rows_t, seq_lens, 1),
                          req_pool_indices=rows_t, seq_lens=seq_lens, max_seq_len=int(seq_lens.max()), width=1,
                          hidden_in=hidden, backends={CacheKind.MHA: backend})
        backend.init_forward_metadata(fb)
        with torch.inference_mode():
            hidden = draft(fb)
        for b, n in enumerate(ss):
            torch.testing.assert_close(g_train[step + 1][b, n + step], hidden[b], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------- loss
def _toy_corpus(path, dev, dtype):
    """The tiny target, four random 6-token prompts with 40-token "responses", and their hidden states on dev."""
    target = load_target(ModelSource.resolve(path), dtype, dev, 600)
    g = torch.Generator().manual_seed(1)
    samples = [Sample(torch.randint(3, 60, (6,), generator=g).tolist(),
                      torch.randint(3, 60, (40,), generator=g).tolist(), False, "toy") for _ in range(4)]
    seqs = [s.ids for s in samples]
    return target, samples, seqs, collect_hidden(target.model, seqs, dev, dtype, dev)


def test_loss_goes_down_on_a_repeated_corpus(tiny_target):
    from specserve.train.trainer import TrainSettings, train_draft

    target, samples, seqs, store = _toy_corpus(tiny_target, CPU, torch.float32)
    for loss in ("kl", "ce"):
        vocab = DraftVocab(None, target.config.vocab_size, 1.0)
        draft = build_draft(target.config, 600, vocab, CPU)
        init_draft_from_target(draft, target.model, vocab, 0.01, 0)
        res = train_draft(draft, seqs, [s.prompt_len for s in samples], store, vocab.to_draft_index(64, CPU),
                          target.model.lm_head.weight, ObjectiveConfig(chain_steps=2, loss=loss),
                          TrainSettings(train_steps=60, batch_size=4, lr=3e-3, log_every=5), CPU)
        first, last = sum(res.loss_history[:5]) / 5, sum(res.loss_history[-5:]) / 5
        assert last < 0.5 * first, (loss, first, last)
        assert len(res.final_top1) == 2
        if loss == "kl":  # top-1 is agreement with the target's greedy token, which "kl" learns (not "ce" here)
            assert res.final_top1[0] > 0.3, res.final_top1
    # a time budget far below 60 steps' worth stops at the floor of 20 steps
    res = train_draft(draft, seqs, [s.prompt_len for s in samples], store, vocab.to_draft_index(64, CPU),
                      target.model.lm_head.weight, ObjectiveConfig(chain_steps=2),
                      TrainSettings(train_steps=60, batch_size=4, lr=3e-3, time_budget_s=1e-6), CPU)
    assert res.steps == 20 and len(res.loss_history) == 20


@pytest.mark.gpu
def test_training_on_cuda_reaches_every_parameter(tiny_target):
    """bf16 autocast, fused AdamW, a reduced vocabulary, states kept on the GPU; the trainer raises if a kernel
    without backward (the Triton ops) cut the autograd graph, and the loss must still fall."""
    from specserve.train.trainer import TrainSettings, train_draft

    dev = torch.device("cuda")
    target, samples, seqs, store = _toy_corpus(tiny_target, dev, torch.bfloat16)
    vocab = build_draft_vocab([s.response_ids for s in samples], [], 64, 48, forced=[2])
    draft = build_draft(target.config, 600, vocab, dev)
    init_draft_from_target(draft, target.model, vocab, 0.01, 0)
    res = train_draft(draft, seqs, [s.prompt_len for s in samples], store, vocab.to_draft_index(64, dev),
                      target.model.lm_head.weight[vocab.ids.to(dev)], ObjectiveConfig(chain_steps=3),
                      TrainSettings(train_steps=60, batch_size=4, lr=3e-3, log_every=5), dev)
    first, last = sum(res.loss_history[:5]) / 5, sum(res.loss_history[-5:]) / 5
    assert last < 0.5 * first, (first, last)

# ---------------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("vocab_size", [0, 24])
def test_export_round_trip(tiny_target, tmp_path, vocab_size):
    from specserve.train.export import write_draft_checkpoint

    target = load_target(ModelSource.resolve(tiny_target), torch.float32, CPU, 600)
    g = torch.Generator().manual_seed(2)
    responses = [torch.randint(3, 60, (30,), generator=g).tolist() for _ in range(8)]
    vocab = build_draft_vocab(responses, [], 64, vocab_size, forced=[2])
    draft = _random_draft(target, vocab, seed=4)
    write_draft_checkpoint(draft, target.config, str(tmp_path), torch.float32)
    back = load_mtp_draft(target, str(tmp_path), torch.float32, CPU, 600)
    ours, theirs = dict(draft.named_parameters()), dict(back.named_parameters())
    assert set(ours) == set(theirs)
    for name, p in ours.items():
        assert torch.equal(p.detach(), theirs[name]), name
    if vocab_size:
        assert back.lm_head.weight.shape == (vocab_size, 64)
        assert torch.equal(back.draft_vocab, vocab.ids) and 2 in vocab.ids.tolist()
    else:
        assert back.draft_vocab is None and back.lm_head is None
    # bfloat16 export: the same tensors, rounded once
    write_draft_checkpoint(draft, target.config, str(tmp_path / "bf16"), torch.bfloat16)
    back16 = dict(load_mtp_draft(target, str(tmp_path / "bf16"), torch.float32, CPU, 600).named_parameters())
    for name, p in ours.items():
        assert torch.equal(p.detach().bfloat16().float(), back16[name]), name
    if vocab_size:
        # a head whose rows stay the target's: not stored, rebuilt from the target's lm-head at load
        write_draft_checkpoint(draft, target.config, str(tmp_path / "nohead"), torch.float32, include_head=False)
        from safetensors import safe_open

        with safe_open(str(tmp_path / "nohead" / "model.safetensors"), framework="pt") as f:
            assert not any("shared_head.head" in k for k in f.keys())  # noqa: SIM118
        nohead = load_mtp_draft(target, str(tmp_path / "nohead"), torch.float32, CPU, 600)
        assert torch.equal(nohead.lm_head.weight, target.model.lm_head.weight[vocab.ids])
        assert torch.equal(nohead.eh_proj.weight, draft.eh_proj.weight.detach())


def test_draft_vocab_and_prompt_fields(tmp_path):
    v = build_draft_vocab([[5, 5, 5, 7, 7, 9], [5, 11]], [[9, 9, 13]], 32, 3, forced=[2])
    assert v.ids.tolist() == [2, 5, 7]  # forced EOS, then by response count
    assert v.coverage == pytest.approx(6 / 8)
    m = v.to_draft_index(32, CPU)
    assert m[5].item() == 1 and m[9].item() == -1
    assert build_draft_vocab([[1]], [], 32, 0, [2]).ids is None
    assert record_messages({"instruction": "Do", "input": "x"})[0]["content"] == "Do\n\nx"
    assert record_messages({"instruction": "Do", "input": ""})[0]["content"] == "Do"
    assert record_messages({"turns": ["a", "b"]})[0]["content"] == "a"
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert record_messages({"messages": chat}) == chat[:1]
    assert record_messages({"question": "q", "answer": "a"})[0]["content"] == "q"
    assert record_messages({"answer": "a"}) is None
    p = tmp_path / "p.json"
    p.write_text(json.dumps([{"prompt": "x"}, {"text": "y"}, {"other": 1}]))
    assert [q.messages[0]["content"] for q in load_prompts([str(p)])] == ["x", "y"]


# ---------------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    """One `specserve train-mtp` run on the tiny target (75% greedy / 25% sampled self-distillation, 200 steps),
    of a head that reads aux layers ('auto': 0 and 1 of the 2), with the target run per training batch."""
    from specserve.train.cli import main

    root = tmp_path_factory.mktemp("trained")
    train_file = _word_prompts(root / "train.jsonl", 64, seed=1)
    held_file = _word_prompts(root / "held.jsonl", 16, seed=2)
    out = root / "head"
    argv = ["--model-path", tiny_target, "--prompts", train_file, "--held-out", held_file, "--output", str(out),
            "--max-new-tokens", "64", "--sampled-fraction", "0.25", "--train-steps", "200", "--batch-size", "8",
            "--chain-steps", "3", "--max-seq-len", "128", "--lr", "1e-3", "--loss", "ce", "--val-fraction", "0.03",
            "--eval-num-steps", "1,3", "--eval-max-new-tokens", "64", "--device", "cpu",
            "--max-total-tokens", "16384", "--log-level", "warning", "--aux-hidden-layers", "auto",
            "--live-target-states"]
    assert main(argv) == 0
    return {"out": str(out), "held": held_file, "argv": argv, "root": root}


def test_cli_writes_checkpoint_and_report(trained):
    out = trained["out"]
    assert {"config.json", "model.safetensors", "report.json"} <= set(os.listdir(out))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLMNextN"]
    assert cfg["aux_hidden_state_layer_ids"] == [0, 1]
    with open(os.path.join(out, "report.json")) as f:
        rep = json.load(f)
    assert rep["data"]["num_sequences"] == 64 and rep["data"]["sampled_sequences"] == 16
    assert rep["data"]["num_tokens"] > rep["data"]["num_response_tokens"] > 64 * 16
    assert rep["train"]["steps"] == 200 and len(rep["train"]["final_loss"]) == 3
    assert rep["train"]["val_sequences"] == 2 and len(rep["train"]["val_top1"]) == 3
    assert all(f < i for f, i in zip(rep["train"]["final_loss"], rep["train"]["initial_loss"]))
    assert set(rep["held_out"]["held.jsonl"]) == {"1", "3"}
    assert rep["draft_vocab"] == {"size": 64, "coverage": 1.0}


def test_trained_head_is_lossless_and_beats_a_random_head(trained, tiny_target):
    """The engine loads the head; greedy speculative output equals plain greedy output; held-out accept length at
    N = 3 is clearly above a random head's (measured over three target seeds: trained 1.55-1.72, random 1.01)."""
    from helpers import build_draft_folder

    import specserve
    from specserve.train.acceptance import measure_acceptance
    from specserve.train.data import load_prompts, prompt_token_ids

    kw = {"device": "cpu", "max_total_tokens": 16384}
    plain = specserve.Engine(model_path=tiny_target, **kw)
    ids = [prompt_token_ids(plain, p.messages) for p in load_prompts([trained["held"]])]
    sp = {"max_new_tokens": 48, "temperature": 0.0}
    ref = [o["output_ids"] for o in plain.generate(input_ids=ids, sampling_params=sp)]
    plain.shutdown()
    spec = specserve.Engine(model_path=tiny_target, speculative_algorithm="MTP", speculative_num_steps=3,
                            speculative_draft_model_path=trained["out"], **kw)
    got = [o["output_ids"] for o in spec.generate(input_ids=ids, sampling_params=sp)]
    spec.shutdown()
    assert got == ref

    with open(os.path.join(trained["out"], "report.json")) as f:
        ours = json.load(f)["held_out"]["held.jsonl"]["3"]
    rand_dir = build_draft_folder(str(trained["root"] / "random_head"), tiny_target, seed=9)
    rand = measure_acceptance(tiny_target, rand_dir, [trained["held"]], [3], 16, 64, kw)["held.jsonl"]["3"]
    assert rand < 1.1
    assert ours > rand + 0.35, (ours, rand)


def test_rerun_reuses_generated_data(trained):
    from specserve.train.cli import main

    argv = list(trained["argv"])
    out2 = str(trained["root"] / "head2")
    argv[argv.index("--output") + 1] = out2
    os.makedirs(out2)
    # same generation settings: copy the cache to the new folder; the run must not regenerate
    shutil.copytree(os.path.join(trained["out"], "selfdistill"), os.path.join(out2, "selfdistill"))
    argv[argv.index("--train-steps") + 1] = "2"
    argv[argv.index("--held-out") + 1:argv.index("--output")] = []
    argv.remove("--held-out")
    argv.append("--greedy-only")  # training settings only: the cache still matches
    argv[argv.index("--aux-hidden-layers") + 1] = "none"
    assert main(argv) == 0
    with open(os.path.join(out2, "report.json")) as f:
        rep = json.load(f)
    assert rep["data"]["from_cache"] is True and rep["data"]["num_sequences"] == 64
    assert rep["data"]["trained_sequences"] == 48  # the 25% sampled responses left out
    assert rep["held_out"] == {}
    with open(os.path.join(out2, "config.json")) as f:
        assert "aux_hidden_state_layer_ids" not in json.load(f)  # --aux-hidden-layers none


def test_aux_features_are_the_hf_layer_outputs(tiny_target):
    """The target's features with aux layers: [final-norm hidden | output of layer 0 | output of layer 1], checked
    against transformers' hidden_states (hidden_states[i + 1] is layer i's output; the last one is final-normed)."""
    from transformers import AutoModelForCausalLM

    target = load_target(ModelSource.resolve(tiny_target), torch.float32, CPU, 600)
    target.model.set_aux_layers([0])
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    ids = torch.randint(3, 60, (1, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        feats = target_hidden(target.model, ids)  # [1, 11, 2H]
        ref = hf(ids, output_hidden_states=True).hidden_states
    h = target.config.hidden_size
    assert feats.shape == (1, 11, 2 * h)
    torch.testing.assert_close(feats[..., :h], ref[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(feats[..., h:], ref[1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="outside"):
        target.model.set_aux_layers([target.config.num_layers])


def test_live_target_states_equal_the_store(tiny_target):
    """Per-batch target states (LiveTargetStates) equal the precomputed ones on every real position, with aux
    layers, including through subsets (train/validation split)."""
    from specserve.train.hidden import LiveTargetStates

    target, samples, seqs, _ = _toy_corpus(tiny_target, CPU, torch.float32)
    seqs = [s[:n] for s, n in zip(seqs, (46, 30, 41, 12))]  # unequal lengths: padding in every batch
    target.model.set_aux_layers([0])
    store = collect_hidden(target.model, seqs, CPU, torch.float32, CPU)
    live = LiveTargetStates(target.model)
    for idx in ([0, 1, 2, 3], [3, 1]):
        ids, lens = pad_ids([seqs[i] for i in idx], CPU)
        (hs, ts), (hl, tl) = store.batch(idx, ids), live.batch(idx, ids)
        assert hs.shape == hl.shape and hs.shape[-1] == 2 * target.config.hidden_size
        for b, n in enumerate(lens.tolist()):
            torch.testing.assert_close(hl[b, :n], hs[b, :n], rtol=1e-5, atol=1e-5)
            assert torch.equal(tl[b, :n], ts[b, :n])
    sub = store.subset([2, 0])
    ids, _ = pad_ids([seqs[2], seqs[0]], CPU)
    assert torch.equal(sub.batch([0, 1], ids)[0], store.batch([2, 0], ids)[0])


def test_batches_padded_to_a_multiple_give_the_same_loss(tiny_target):
    """make_batch rounds the padded length up (on CUDA: few kernel shapes). Padding is never a label: loss, top-1
    and counts are those of the tight batch, from stored and from live target states."""
    from specserve.train.hidden import LiveTargetStates
    from specserve.train.trainer import make_batch

    target, samples, seqs, _ = _toy_corpus(tiny_target, CPU, torch.float32)
    seqs = [s[:n] for s, n in zip(seqs, (46, 30, 41, 12))]
    prompt_lens = [s.prompt_len for s in samples]
    store = collect_hidden(target.model, seqs, CPU, torch.float32, CPU)
    vocab = DraftVocab(None, target.config.vocab_size, 1.0)
    draft = build_draft(target.config, 600, vocab, CPU)
    init_draft_from_target(draft, target.model, vocab, 0.01, 0)
    obj = ObjectiveConfig(chain_steps=3)
    for states in (store, LiveTargetStates(target.model)):
        outs = []
        for multiple in (1, 32):
            batch = make_batch([0, 1, 2, 3], seqs, prompt_lens, states, CPU, torch.float32, multiple)
            assert batch.ids.shape[1] == (46 if multiple == 1 else 64) == batch.hidden.shape[1] == batch.top1.shape[1]
            outs.append(chained_loss(draft, batch, vocab.to_draft_index(64, CPU), target.model.lm_head.weight, obj))
        torch.testing.assert_close(outs[0].loss, outs[1].loss, rtol=1e-5, atol=1e-5)
        assert torch.equal(outs[0].depth_count, outs[1].depth_count)
        torch.testing.assert_close(outs[0].depth_top1, outs[1].depth_top1)
    ids, lens = pad_ids(seqs, CPU, 32)  # the stored states' batches are padded the same way
    assert ids.shape == (4, 64) and lens.tolist() == [46, 30, 41, 12] and not ids[:, 46:].any()


def test_aux_head_initialised_from_a_plain_head_is_the_same_function(tiny_target, tmp_path):
    """--init-draft from a head without aux layers into one with them: aux_fc starts as [I | 0] (noise 0), so the
    chained outputs are the plain head's; a checkpoint with other aux layers is refused."""
    from specserve.train.export import write_draft_checkpoint
    from specserve.train.objective import init_draft_from_checkpoint

    target, samples, seqs, _ = _toy_corpus(tiny_target, CPU, torch.float32)
    vocab = DraftVocab(None, target.config.vocab_size, 1.0)
    plain = _random_draft(target, vocab, seed=5)
    write_draft_checkpoint(plain, target.config, str(tmp_path / "plain"), torch.float32)
    aux = build_draft(target.config, 600, vocab, CPU, [0, 1])
    init_draft_from_target(aux, target.model, vocab, 0.0, seed=0)
    init_draft_from_checkpoint(aux, target, str(tmp_path / "plain"), 600)
    assert target.model.model.aux_layers == ()  # loading the checkpoint left the target's features alone
    ids, _ = pad_ids(seqs, CPU)
    with torch.no_grad():
        want = chained_forward(plain, ids, target_hidden(target.model, ids), 3)
        target.model.set_aux_layers([0, 1])
        got = chained_forward(aux, ids, target_hidden(target.model, ids), 3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    write_draft_checkpoint(aux, target.config, str(tmp_path / "aux"), torch.float32)
    other = build_draft(target.config, 600, vocab, CPU, [1])
    with pytest.raises(ValueError, match="aux hidden layers"):
        init_draft_from_checkpoint(other, target, str(tmp_path / "aux"), 600)


def test_aux_hidden_layers_flag():
    from specserve.train.cli import aux_hidden_layers

    assert aux_hidden_layers("auto", 30) == [1, 14, 26]  # SmolLM2: EAGLE-3's low / mid / high
    assert aux_hidden_layers("auto", 2) == [0, 1]
    assert aux_hidden_layers("none", 30) == [] and aux_hidden_layers("", 30) == []
    assert aux_hidden_layers("7, 3,7", 30) == [3, 7]
    for bad in ("30", "-1", "a,b"):
        with pytest.raises(SystemExit):
            aux_hidden_layers(bad, 30)
