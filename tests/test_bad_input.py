"""Bad input to Engine.generate raises a clear ValueError, queues nothing, and the engine keeps working; bad server
arguments are rejected with clear messages."""

import pytest

from specserve import Engine
from specserve.server_args import ServerArgs


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(model_path=tiny_models["llama_mtp"], max_total_tokens=4096, speculative_algorithm="MTP",
                  speculative_num_steps=2)


BAD = [
    (dict(prompt=""), "empty"),
    (dict(input_ids=[]), "empty"),
    (dict(prompt=["ok", ""]), "empty"),
    (dict(input_ids=list(range(3, 200)) * 3), "context length"),
    (dict(prompt="hello", sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
    (dict(prompt="hello", sampling_params={"top_p": 0.0}), "top_p"),
    (dict(prompt="hello", sampling_params={"top_p": 1.5}), "top_p"),
    (dict(prompt="hello", sampling_params={"temperature": -0.1}), "temperature"),
    (dict(prompt="hello", sampling_params={"top_k": 0}), "top_k"),
    (dict(prompt="hello", sampling_params={"min_p": 2}), "min_p"),
    (dict(prompt="hello", sampling_params={"frobnicate": 1}), "unknown sampling parameter"),
    (dict(prompt="hello", sampling_params={"stop": [""]}), "stop"),
    (dict(input_ids=[5, 999999]), "input_ids"),
    (dict(prompt=None), "exactly one"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_raises_and_engine_keeps_working(engine, kwargs, needle):
    sched = engine.scheduler
    free = sched.model_runner.kv.available_pages
    with pytest.raises(ValueError, match=needle):
        engine.generate(**kwargs)
    assert not sched.has_work and sched.model_runner.kv.available_pages == free
    out = engine.generate(prompt="abc", sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 4
    sched.check_idle_invariants()


def test_bad_batch_is_rejected_whole(engine):
    """One bad prompt in a batch: nothing of the batch runs."""
    sched = engine.scheduler
    done = sched.stats.finished
    with pytest.raises(ValueError):
        engine.generate(prompt=["fine", "also fine", ""])
    assert sched.stats.finished == done and not sched.has_work


@pytest.mark.parametrize("kwargs,needle", [
    (dict(speculative_algorithm="MEDUSA"), "unknown --speculative-algorithm"),
    (dict(speculative_algorithm="MTP", speculative_eagle_topk=4), "topk"),
    (dict(speculative_algorithm="MTP", speculative_num_steps=3, speculative_num_draft_tokens=8), "num-draft-tokens"),
    # a model of one's own needs the algorithm (the embedded one speculates by default: its flags tune that)
    (dict(model_path="/m", speculative_num_steps=3), "needs --speculative-algorithm"),
    (dict(tp_size=0), "tp-size"),
    (dict(page_size=0), "page-size"),
    (dict(dtype="int4"), "dtype"),
    (dict(mem_fraction_static=1.5), "mem-fraction-static"),
    (dict(model_path="/m", speculative_ngram_lookup=True), "ngram-lookup needs"),
    (dict(speculative_algorithm="NONE", speculative_ngram_lookup=True), "ngram-lookup needs"),
    (dict(speculative_algorithm="MTP", speculative_ngram_confidence=1.5), "ngram-confidence"),
])
def test_bad_server_args(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ServerArgs(**kwargs)


def test_unknown_engine_kwarg():
    with pytest.raises(ValueError, match="unknown server argument"):
        Engine(model_path="/nonexistent", not_a_flag=1)


def test_spec_defaults_derived():
    a = ServerArgs(speculative_algorithm="eagle")
    assert a.speculative_algorithm == "EAGLE" and a.speculative_num_steps == 3
    assert a.speculative_num_draft_tokens == 4 and a.speculative_eagle_topk == 1


def test_model_without_mtp_layer_needs_draft_path(tiny_models):
    with pytest.raises(ValueError, match="no MTP layer"):
        Engine(model_path=tiny_models["llama"], speculative_algorithm="MTP")


@pytest.mark.parametrize("temperature", [1e-40, 1.4e-45, 1e-30, 1e-8])
def test_tiny_temperature_is_greedy_not_nan(engine, temperature):
    """A positive temperature too small to divide logits by in float32 answers what greedy answers (before: NaN
    probabilities, every token 0), through speculative verification and drafting."""
    sp = {"max_new_tokens": 8, "ignore_eos": True}
    greedy = engine.generate(prompt="abc", sampling_params={**sp, "temperature": 0})["output_ids"]
    tiny = engine.generate(prompt="abc", sampling_params={**sp, "temperature": temperature})["output_ids"]
    assert tiny == greedy and greedy != [0] * 8
