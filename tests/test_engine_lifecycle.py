"""Engine lifecycle (issue 16): shutdown() (or leaving `with Engine(...)`) releases the model runner, its pools and
graphs, so a second engine can be created in the same process; on a GPU at the same --mem-fraction-static."""

import weakref

import pytest
import torch

from specserve import Engine


def _run(eng):
    out = eng.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                   "ignore_eos": True})
    assert out[0]["meta_info"]["completion_tokens"] == 4
    return out[0]["output_ids"]


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "MTP", "speculative_num_steps": 2}])
def test_shutdown_releases_the_model_runner(tiny_models, spec):
    eng = Engine(model_path=tiny_models["llama_mtp"], max_total_tokens=2048, **spec)
    first = _run(eng)
    refs = [weakref.ref(eng.core.model_runner), weakref.ref(eng.core.model_runner.target),
            weakref.ref(eng.core.model_runner.caches.kv.k[0])]
    if spec:
        refs.append(weakref.ref(eng.core.model_runner.spec))
    eng.shutdown()
    eng.shutdown()  # idempotent
    # no gc.collect() here: shutdown() itself must have freed them (the next engine measures free memory at once)
    assert all(r() is None for r in refs), "the runner, its model or its KV pool outlived shutdown()"
    with Engine(model_path=tiny_models["llama_mtp"], max_total_tokens=2048, **spec) as again:
        assert _run(again) == first


@pytest.mark.gpu
def test_second_engine_fits_on_the_gpu(tiny_models):
    outs = []
    for _ in range(2):
        eng = Engine(model_path=tiny_models["llama_mtp"], device="cuda", mem_fraction_static=0.6,
                     speculative_algorithm="MTP", speculative_num_steps=2, cuda_graph_bs=[1, 2])
        outs.append(_run(eng))
        eng.shutdown()
    assert outs[0] == outs[1]
    total = torch.cuda.get_device_properties(0).total_memory
    assert torch.cuda.memory_reserved() < 0.05 * total  # the KV pool (~60% of the GPU) is gone
