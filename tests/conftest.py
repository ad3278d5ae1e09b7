import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

torch = pytest.importorskip("torch")

# Triton kernels run on CPU tensors under Triton's interpreter; it is read when kernels are decorated, so it must be
# set before anything imports triton. With a GPU the same tests run the compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy CI machine OpenMP workers spinning for a core
    slow small ops down by orders of magnitude. Modules opt in with pytest.mark.usefixtures("one_thread")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Random tiny checkpoints of each dense family, plus MTP layers in both layouts."""
    from helpers import build_draft_folder, build_tiny_model

    root = tmp_path_factory.mktemp("models")
    out = {}
    # Fixed seeds, not hash(arch): str hashes are salted per process (PYTHONHASHSEED), so every run got new weights.
    for arch, seed in (("llama", 1), ("qwen2", 2), ("qwen3", 3)):
        out[arch] = build_tiny_model(str(root / arch), arch, seed=seed)
    out["llama_mtp"] = build_tiny_model(str(root / "llama_mtp"), "llama", seed=11, mtp_layout="deepseek")
    out["qwen3_mtp"] = build_tiny_model(str(root / "qwen3_mtp"), "qwen3", seed=12, mtp_layout="deepseek")
    out["qwen3_moe"] = build_tiny_model(str(root / "qwen3_moe"), "qwen3_moe", seed=4)
    out["qwen3_moe_mtp"] = build_tiny_model(str(root / "qwen3_moe_mtp"), "qwen3_moe", seed=13, mtp_layout="deepseek")
    out["qwen3_moe_draft"] = build_draft_folder(str(root / "qwen3_moe_draft"), out["qwen3_moe"], seed=23)
    out["llama_draft"] = build_draft_folder(str(root / "llama_draft"), out["llama"], seed=21)
    out["llama_draft_aux"] = build_draft_folder(str(root / "llama_draft_aux"), out["llama"], seed=22,
                                                aux_layers=[0, 1])
    return out
