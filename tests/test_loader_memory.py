"""The loader puts a checkpoint straight on the device in the target dtype, streaming shard by shard: peak host
memory is about the model in the target dtype plus one shard, never the model in float32 (models/loader.py).

A ~27M-parameter Llama saved in float32 in ~16 MB shards is loaded in bfloat16 in a fresh subprocess (so the memory
of other tests does not hide the peak), the resident-set high-water mark reset just before the load; the same is
measured for the previous loader's recipe (the whole model materialised in float32 on the host, then cast). The
loaded model holds exactly the checkpoint's tensors cast to bfloat16, its logits match transformers', and the
progress bar counts the checkpoint's tensors.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import _spread_weights, build_tiny_model

from specserve.models.loader import ModelSource, load_target
from specserve.weights.safetensors_loader import iter_safetensors, safetensors_files, tensor_names

MB = 1 << 20
SLACK = 24 * MB
CPU = torch.device("cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")

# Run in a fresh interpreter: warm every lazy import and the allocator on a tiny checkpoint, reset the high-water
# mark (clear_refs 5), load, and report VmRSS before and VmHWM after.
_MEASURE = r"""
import gc, json, sys
import torch

mode, folder, warm = sys.argv[1:4]
torch.set_num_threads(1)
cpu = torch.device("cpu")

from specserve.models.loader import ModelSource, load_hf_config, load_target
from specserve.models.registry import config_from_hf, model_class
from specserve.weights.safetensors_loader import iter_safetensors


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def ours(path):
    return load_target(ModelSource.resolve(path), torch.bfloat16, cpu, 512).model


def old(path):
    # the previous loader: build, materialise in float32 on the host, load every tensor, then cast the model
    src = ModelSource.resolve(path)
    cfg = config_from_hf(load_hf_config(src))
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, 512)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    with torch.no_grad():
        model.load_weights(iter_safetensors(src.folder))
    return model.to(device=cpu, dtype=torch.bfloat16)


load = {"ours": ours, "old": old}[mode]
load(warm)  # the warm-up model is dropped at once
gc.collect()
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError as e:
    print(json.dumps({"skip": f"cannot reset the RSS high-water mark: {e}"}))
    sys.exit(0)
before = status("VmRSS")
model = load(folder)
peak = status("VmHWM")
dtypes = sorted({str(p.dtype) for p in model.parameters()})
print(json.dumps({"before": before, "peak": peak, "dtypes": dtypes}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random float32 Llama (hidden 512, 6 layers, intermediate 1536, vocab 8192) in ~16 MB shards, and a tiny one
    to warm up on."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("loader_memory")
    cfg = LlamaConfig(hidden_size=512, num_hidden_layers=6, intermediate_size=1536, vocab_size=8192,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _spread_weights(model, 0)  # decisive logits, so the comparison with transformers tests something
    folder = str(root / "llama_sharded")
    model.save_pretrained(folder, max_shard_size="16MB")
    shards = safetensors_files(folder)
    assert len(shards) >= 5, "the checkpoint should be sharded"
    n_params = sum(p.numel() for p in model.parameters())
    warm = build_tiny_model(str(root / "warm"), "llama", seed=0)
    return dict(folder=folder, warm=warm, n_params=n_params, shard_bytes=max(os.path.getsize(s) for s in shards))


def _measure(mode: str, ckpt: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", _MEASURE, mode, ckpt["folder"], ckpt["warm"]], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


def test_streaming_load_peak_host_memory_is_one_shard_not_the_model(checkpoint):
    bf16_bytes, f32_bytes = 2 * checkpoint["n_params"], 4 * checkpoint["n_params"]
    shard = checkpoint["shard_bytes"]
    ours = _measure("ours", checkpoint)
    old = _measure("old", checkpoint)
    ours_peak, old_peak = ours["peak"] - ours["before"], old["peak"] - old["before"]
    bound = bf16_bytes + 3 * shard + SLACK
    print(f"\nparams {checkpoint['n_params'] / 1e6:.1f}M: bf16 {bf16_bytes / MB:.1f} MB, "
          f"float32 {f32_bytes / MB:.1f} MB, largest shard {shard / MB:.1f} MB")
    print(f"streaming load: peak - before = {ours_peak / MB:.1f} MB (bound {bound / MB:.1f} MB)")
    print(f"old-style load (float32 on the host, then cast): peak - before = {old_peak / MB:.1f} MB")
    assert ours["dtypes"] == ["torch.bfloat16"] and old["dtypes"] == ["torch.bfloat16"]
    assert ours_peak <= bound
    # never the whole model in float32 on the host (the old recipe needs at least that)
    assert ours_peak < f32_bytes
    assert old_peak >= f32_bytes, "the old-style baseline did not materialise the float32 model"
    assert ours_peak + (f32_bytes - bf16_bytes) // 2 < old_peak


def _our_logits(model, prompt: list[int], path: str, dtype: torch.dtype) -> torch.Tensor:
    from specserve.engine.model_runner import ModelRunner
    from specserve.graphs.prefill import ExtendBatch
    from specserve.kvcache.manager import KVHandle
    from specserve.server_args import ServerArgs

    mr = ModelRunner(ServerArgs(model_path=path, max_total_tokens=256, max_running_requests=2), model.model,
                     model.config, None, CPU, dtype, 128)
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(prompt)])
    n = len(prompt)
    loc = mr.req_to_token.table[h.row, :n]
    hidden = mr.prefill.run(ExtendBatch(torch.tensor(prompt), torch.arange(n), loc, [h.row], [n], [n]))
    return model.model.compute_logits(hidden).float()


_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


def test_bfloat16_load_holds_the_checkpoint_and_matches_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    path = checkpoint["folder"]
    t = load_target(ModelSource.resolve(path), torch.bfloat16, CPU, 512)
    params = dict(t.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert all(p.device.type == "cpu" for p in params.values())
    assert sum(p.numel() for p in params.values()) == checkpoint["n_params"]
    # every checkpoint tensor, cast to bfloat16, is exactly where it belongs (fused projections by slice)
    seen = 0
    for name, tensor in iter_safetensors(path):
        parts = name.split(".")
        if parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            module = t.model.get_submodule(".".join(parts[:-2] + [fused]))
            off, size = module.shard_offsets[shard]
            ours = module.weight[off:off + size]
        else:
            ours = params[name]
        assert torch.equal(ours, tensor.to(torch.bfloat16)), name
        seen += 1
    assert seen == len(tensor_names(path))
    # the rotary table stays float32
    assert t.model.model.rotary.cos_sin_cache.dtype == torch.float32

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 8192, (12,), generator=g).tolist()
    ours_bf16 = _our_logits(t, prompt, path, torch.bfloat16)
    with torch.no_grad():
        hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ref32 = hf32(torch.tensor([prompt])).logits[0]
        del hf32
        hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        ref16 = hf16(torch.tensor([prompt])).logits[0].float()
        del hf16
    assert ref32.abs().max() > 1.0  # decisive logits
    torch.testing.assert_close(ours_bf16, ref16, rtol=0.02, atol=0.15)
    torch.testing.assert_close(ours_bf16, ref32, rtol=0.02, atol=0.15)
    # float32 loads agree tightly
    t32 = load_target(ModelSource.resolve(path), torch.float32, CPU, 512)
    assert {p.dtype for p in t32.model.parameters()} == {torch.float32}
    torch.testing.assert_close(_our_logits(t32, prompt, path, torch.float32), ref32, rtol=1e-4, atol=1e-4)


def test_progress_bar_total_is_the_number_of_tensors(checkpoint, monkeypatch):
    import specserve.models.loader as loader

    bars = []

    class Recorder:
        def __init__(self, iterable, total=None, **kw):
            self.iterable, self.total, self.count = iterable, total, 0
            bars.append(self)

        def __iter__(self):
            for item in self.iterable:
                self.count += 1
                yield item

    monkeypatch.setattr(loader, "tqdm", Recorder)
    path = checkpoint["folder"]
    load_target(ModelSource.resolve(path), torch.float32, CPU, 512)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        indexed = len(json.load(f)["weight_map"])
    assert len(bars) == 1
    assert bars[0].total == len(tensor_names(path)) == indexed == bars[0].count


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory, checkpoint):
    """A random Llama (hidden 512, 12 layers, intermediate 3072) in ~16 MB shards, as an FP8 block-scaled (128 x 128)
    checkpoint and as the same values dequantized (tests/test_fp8_checkpoint.py _fp8_copies)."""
    from test_fp8_checkpoint import _fp8_copies
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("loader_memory_fp8")
    cfg = LlamaConfig(hidden_size=512, num_hidden_layers=12, intermediate_size=3072, vocab_size=8192,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    src = str(root / "src")
    model.save_pretrained(src, max_shard_size="16MB")
    linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    fp8_dir, ref_dir = _fp8_copies(src, str(root), (128, 128))
    return dict(fp8=fp8_dir, ref=ref_dir, warm=checkpoint["warm"], linear=linear)


def test_fp8_checkpoint_never_takes_its_bf16_size(fp8_checkpoints):
    """An FP8 checkpoint loaded with a bfloat16 model dtype: its linear layers are made FP8 before anything is
    allocated (models/loader.py materialize), so the peak holds their FP8 bytes, not bf16 ones; measured against
    the same values saved dequantized and loaded the same way (the difference is the linear weights' bf16 - FP8
    bytes, half of it required)."""
    fp8 = _measure("ours", dict(folder=fp8_checkpoints["fp8"], warm=fp8_checkpoints["warm"]))
    ref = _measure("ours", dict(folder=fp8_checkpoints["ref"], warm=fp8_checkpoints["warm"]))
    fp8_peak, ref_peak = fp8["peak"] - fp8["before"], ref["peak"] - ref["before"]
    saved = fp8_checkpoints["linear"]  # bytes: 2 per value in bf16, 1 in FP8 (scales: 1/4096 of that)
    print(f"\nFP8 checkpoint: peak - before = {fp8_peak / MB:.1f} MB; its dequantized copy: {ref_peak / MB:.1f} MB; "
          f"linear weights {saved / 1e6:.1f}M values")
    assert "torch.float8_e4m3fn" in fp8["dtypes"] and ref["dtypes"] == ["torch.bfloat16"]
    assert fp8_peak + saved // 2 < ref_peak
