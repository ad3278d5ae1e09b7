"""Weight-only int8 drafts on CPU (`--speculative-draft-model-quantization int8`, layers/quant.py and
layers/cpu_linear.py): the int8 linear against F.linear, when it steps aside, its rebuild after a weight edit, which
modules get it, that a quantized draft mostly proposes the float draft's tokens, that speculation with it stays
lossless, and the flag's checks."""

import pytest
import torch
import torch.nn.functional as F

from specserve.layers.cpu_linear import Int8Weight, int8_cpu_linear
from specserve.layers.linear import Linear
from specserve.layers.quant import quantize_draft, quantize_weights_int8
from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.server_args import ServerArgs

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [1, 3, 70])
def test_int8_linear_close_to_float(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(2, rows, 64, generator=g)
    with torch.no_grad():
        y = int8_cpu_linear(x, w, b, Int8Weight())
        ref = F.linear(x, w, b)
    assert y.shape == ref.shape and y.dtype == torch.float32
    rel = (y - ref).norm() / ref.norm()
    assert rel < 0.02, rel  # int8 weights and bfloat16 activations: about 1% error
    # far from a wrong kernel: dropping the scales or transposing would be off by O(1)
    assert not torch.allclose(int8_cpu_linear(x, w.flip(0), b, Int8Weight()), ref, atol=0.5)


def test_int8_linear_steps_aside_and_follows_weight_edits():
    w = torch.randn(8, 16)
    q = Int8Weight()
    assert int8_cpu_linear(torch.randn(1, 16), w, None, None) is None  # not enabled
    assert int8_cpu_linear(torch.randn(1, 16, dtype=torch.float64), w, None, q) is None  # not float32
    assert int8_cpu_linear(torch.randn(1, 16, requires_grad=True), w, None, q) is None  # autograd: float path
    with torch.no_grad():
        x = torch.randn(1, 16)
        first = int8_cpu_linear(x, w, None, q)
        w.mul_(2.0)  # an in-place edit bumps the version counter: the int8 copy is rebuilt
        second = int8_cpu_linear(x, w, None, q)
    torch.testing.assert_close(second, 2 * first, rtol=1e-2, atol=1e-2)


def test_quantized_draft_layers_and_tokens(tiny_models, tmp_path):
    """Every own linear layer of a draft (with its own head) goes through int8, close to its float output, and the
    quantized head mostly proposes the float head's tokens; the target's modules are left alone."""
    from helpers import build_draft_folder

    t = load_target(ModelSource.resolve(tiny_models["llama"]), torch.float32, CPU, 200)
    folder = build_draft_folder(str(tmp_path / "draft"), tiny_models["llama"], seed=5, own_head=True)
    draft = load_mtp_draft(t, folder, torch.float32, CPU, 200)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, t.config.hidden_size, generator=g) * 3
    linears = [m for m in draft.modules() if isinstance(m, Linear)]
    inputs = [torch.randn(4, m.in_features, generator=g) for m in linears]
    with torch.inference_mode():
        want_tokens = draft.draft_tokens(hidden)
        want = [m(x) for m, x in zip(linears, inputs)]
        n = quantize_weights_int8(draft)
        got_tokens = draft.draft_tokens(hidden)
        got = [m(x) for m, x in zip(linears, inputs)]
    assert n == len(linears) + 1 and draft.lm_head.int8 is not None  # eh_proj, qkv, o, gate_up, down + head
    assert t.model.lm_head.int8 is None and all(m.int8 is None for m in t.model.modules() if isinstance(m, Linear))
    for m, a, b in zip(linears, got, want):
        assert m.int8.key is not None  # the int8 path ran
        assert (a - b).norm() / b.norm() < 0.02
    agree = (got_tokens == want_tokens).float().mean()
    assert agree > 0.8, agree


def test_int8_draft_is_lossless(tiny_models):
    from specserve import Engine

    prompts = [[5, 9, 11, 3, 7], [1, 2, 3, 4, 5, 6, 7, 8], [42] * 6]
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    kw = dict(max_total_tokens=2048, context_length=128, speculative_algorithm="MTP", speculative_num_steps=3)
    ref = Engine(model_path=tiny_models["llama_mtp"], **kw).generate(input_ids=prompts, sampling_params=sp)
    eng = Engine(model_path=tiny_models["llama_mtp"], speculative_draft_model_quantization="int8", **kw)
    assert eng.core.model_runner.draft.eh_proj.int8 is not None
    out = eng.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    plain = Engine(model_path=tiny_models["llama_mtp"], max_total_tokens=2048, context_length=128)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in plain.generate(input_ids=prompts,
                                                                                       sampling_params=sp)]


def test_quantization_flag_checks():
    with pytest.raises(ValueError, match="one of"):
        ServerArgs(speculative_algorithm="MTP", speculative_draft_model_quantization="int4")
    with pytest.raises(ValueError, match="needs --speculative-algorithm"):
        ServerArgs(model_path="/m", speculative_draft_model_quantization="int8")  # the embedded model speculates
    with pytest.raises(ValueError, match="CPU"):
        ServerArgs(speculative_algorithm="MTP", speculative_draft_model_quantization="int8", device="cuda")
    embedded = ServerArgs().with_embedded_defaults("head", "cpu")
    assert embedded.speculative_draft_model_quantization == "int8"
    assert ServerArgs().with_embedded_defaults("head", "cuda").speculative_draft_model_quantization == "none"
    asked = ServerArgs(speculative_draft_model_quantization="none").with_embedded_defaults("head", "cpu")
    assert asked.speculative_draft_model_quantization == "none"  # an explicit choice stays
    layer = Linear(4, 4)
    quantize_draft(layer, "none", CPU)
    assert layer.int8 is None
    with pytest.raises(ValueError, match="CPU"):  # "auto" resolved to a GPU
        quantize_draft(layer, "int8", torch.device("cuda"))
    quantize_draft(layer, "int8", CPU)
    assert layer.int8 is not None
