"""Our dense models against transformers' implementations on small random checkpoints (fp32, tight tolerance):
prefill logits, and step-by-step decode logits through the engine's decode runner."""

import pytest
import torch

from specserve.graphs.padding import LiveInputs
from specserve.graphs.prefill import ExtendBatch
from specserve.models.loader import ModelSource, load_target
from specserve.server_args import ServerArgs

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _runner(path, page_size=1):
    from specserve.engine.model_runner import ModelRunner

    t = load_target(ModelSource.resolve(path), torch.float32, torch.device("cpu"), 600)
    args = ServerArgs(model_path=path, page_size=page_size, max_total_tokens=2048, max_running_requests=8)
    return ModelRunner(args, t.model, t.config, None, torch.device("cpu"), torch.float32, 512), t


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_and_decode_logits_match_hf(tiny_models, arch, page_size):
    path = tiny_models[arch]
    hf = _hf(path)
    mr, t = _runner(path, page_size)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (7, 19, 3)]
    steps = 6
    from specserve.kvcache.manager import KVHandle

    handles = [KVHandle() for _ in prompts]
    for h, p in zip(handles, prompts):
        assert mr.kv.assign_row(h)
        assert mr.kv.ensure([h], [len(p) + steps + 1])
    # --- prefill (one batch, variable lengths)
    ids = torch.tensor(sum(prompts, []))
    pos = torch.tensor(sum([list(range(len(p))) for p in prompts], []))
    table = mr.req_to_token.table
    loc = torch.cat([table[h.row, :len(p)] for h, p in zip(handles, prompts)])
    lens = [len(p) for p in prompts]
    hidden = mr.prefill.run(ExtendBatch(ids, pos, loc, [h.row for h in handles], lens, lens))
    ours = t.model.compute_logits(hidden)
    off = 0
    seqs = [list(p) for p in prompts]
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(ours[off:off + len(p)], ref, rtol=1e-4, atol=1e-4)
        off += len(p)
    # --- decode step by step through the decode runner (static replay), feeding HF's greedy tokens
    rows = torch.tensor([h.row for h in handles])
    for _ in range(steps):
        with torch.no_grad():
            refs = [hf(torch.tensor([s])).logits[0, -1] for s in seqs]
        nxt = [int(r.argmax()) for r in refs]
        for s, n in zip(seqs, nxt):
            s.append(n)
        s_lens = torch.tensor([len(s) - 1 for s in seqs])
        live = LiveInputs(len(seqs), torch.tensor(nxt), s_lens, rows, s_lens + 1, int(s_lens.max()) + 1)
        logits = mr.phases.decode.run(live)["logits"]
        with torch.no_grad():
            refs = torch.stack([hf(torch.tensor([s])).logits[0, -1] for s in seqs])
        torch.testing.assert_close(logits, refs, rtol=1e-4, atol=1e-4)


def test_bfloat16_engine_tracks_float32(tiny_models):
    """bfloat16 weights/KV on CPU: prefill logits close to float32 (bf16 tolerance) and greedy generation runs."""
    from specserve import Engine

    path = tiny_models["qwen3"]
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = {}
    for dt in ("float32", "bfloat16"):
        eng = Engine(model_path=path, dtype=dt, max_total_tokens=2048)
        assert eng.core.model_runner.caches.kv.dtype == getattr(torch, dt)
        outs[dt] = eng.generate(input_ids=prompts, sampling_params=sp)
        mr = eng.core.model_runner
        from specserve.kvcache.manager import KVHandle

        h = KVHandle()
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [7])
        loc = mr.req_to_token.table[h.row, :6]
        hid = mr.prefill.run(ExtendBatch(torch.tensor(prompts[0]), torch.arange(6), loc, [h.row], [6],
                                                   [6]))
        outs[dt + "_logits"] = mr.target.compute_logits(hid)
        mr.kv.release(h)
    a, b = outs["float32_logits"], outs["bfloat16_logits"]
    assert b.dtype == torch.float32  # logits are always float32
    assert (a - b).abs().max() / a.abs().max() < 0.05
    assert all(o["meta_info"]["completion_tokens"] == 6 for o in outs["bfloat16"])
