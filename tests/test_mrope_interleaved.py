"""Interleaved mRoPE (Qwen3.5): frequency band j of the rotary half-dim turns with position row 1 (height) where
j % 3 == 1 and j < 3 s1, row 2 (width) where j % 3 == 2 and j < 3 s2, else row 0 (time); sections (s0, s1, s2).

- the reference rotary (kernels/reference.py rope_cos_sin) and the family's RotaryEmbedding, built from transformers'
  Qwen3.5 / Qwen3.5-MoE text configs, rotate q and k as transformers' Qwen3_5TextRotaryEmbedding +
  apply_rotary_pos_emb (partial rotary 0.25) at 3-row positions whose rows differ, whatever the config's
  mrope_interleaved says and with transformers' default sections when the config has none;
- config parsing: the flag read from rope parameters (core fields), forced on for the Qwen3.5 family, off for
  Qwen3-Next;
- the Triton rope kernel and the fused q/k prep kernel (Triton's interpreter on CPU, conftest.py) == the reference;
  through QKPrep.store (layers/attention.py) with either fused op; the contiguous layout is still another one;
- three equal rows, or 1-D positions, == 1-D rope exactly;
- a tiny Qwen3.5 vision-language checkpoint's language model (random weights) through the engine's prefill at the
  3-row positions of a prompt with image placeholder tokens (models/mrope_positions.py; token embeddings only, no
  vision tower), then text decode steps at seq_len + mrope_delta, against transformers' language model given the
  same positions; the MTP layer's draft extend at those positions against transformers' modules.
"""

from __future__ import annotations

import types

import pytest
import torch
from hybrid_helpers import TINY_HYBRID, build_tiny_hybrid, hf_mtp_logits

from specserve.graphs.padding import LiveInputs
from specserve.graphs.prefill import ExtendBatch
from specserve.kernels import reference as ref
from specserve.kvcache.manager import KVHandle
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.config import ModelConfig
from specserve.models.mrope_positions import mrope_positions
from specserve.models.qwen3_next import QWEN3_5_MROPE_SECTION, Qwen3NextConfig, Qwen3NextForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU = torch.device("cpu")
MAX_POS = 256
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}
EXACT = dict(atol=0, rtol=0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _table(rot_dim: int, device=DEV) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)  # [P, rot_dim]


def _rows(t: int, g: torch.Generator, device=DEV) -> torch.Tensor:
    """[3, t] positions whose three rows differ everywhere (so every band's row choice shows)."""
    base = torch.randint(0, MAX_POS - 80, (t,), generator=g)
    return torch.stack([base, base + 1 + torch.randint(0, 30, (t,), generator=g),
                        base + 40 + torch.randint(0, 30, (t,), generator=g)]).to(device)


def _bands_by_rule(section, half: int) -> list[int]:
    """The rule as plain Python, independent of reference.mrope_row_of_band."""
    return [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
            for j in range(half)]


# ------------------------------------------------------------------------------------------------ vs transformers
def _hf_text(arch: str, rope_extra: dict):
    """(transformers text config, its text rotary module class, its apply_rotary_pos_emb) of a tiny Qwen3.5 or
    Qwen3.5-MoE: 2 q heads / 1 kv head of 128 dims, rotary 0.25 of them = 32 (16 bands)."""
    if arch == "Qwen3_5ForCausalLM":
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig as Config
        rotary_cls = m.Qwen3_5TextRotaryEmbedding
    else:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig as Config
        rotary_cls = m.Qwen3_5MoeTextRotaryEmbedding
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, **rope_extra}
    cfg = Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_hidden_layers=4,
                 vocab_size=64, max_position_embeddings=MAX_POS, rope_parameters=params)
    cfg.architectures = [arch]
    return cfg, rotary_cls, m.apply_rotary_pos_emb


# sections whose limits 3 s1 / 3 s2 fall inside the 16 bands (13, 14 go to row 0), the flag absent or even false
# (transformers interleaves regardless), and none at all (transformers' default [11, 11, 10])
ROPE_CASES = {
    "interleaved": {"mrope_section": [8, 4, 4], "mrope_interleaved": True},
    "flag_absent": {"mrope_section": [8, 4, 4]},
    "flag_false": {"mrope_section": [6, 5, 5], "mrope_interleaved": False},
    "no_section": {},
}


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotation_matches_transformers(arch, case):
    hf_cfg, rotary_cls, apply_rotary_pos_emb = _hf_text(arch, ROPE_CASES[case])
    cfg = Qwen3NextConfig.from_hf(hf_cfg, arch)
    want_section = ROPE_CASES[case].get("mrope_section", list(QWEN3_5_MROPE_SECTION))
    assert cfg.mrope_section == want_section and cfg.mrope_interleaved and cfg.rotary_dim == 32
    with torch.device(CPU):
        rotary = Qwen3NextForCausalLM.make_rotary(cfg, MAX_POS)
    assert rotary.mrope_section == want_section and rotary.mrope_interleaved
    t, hq, hkv, d = 9, 2, 1, 128
    g = _gen(3)
    pos = _rows(t, g, CPU)  # [3, T]
    q_hf = torch.randn(1, hq, t, d, generator=g)  # transformers' [B, heads, T, D]
    k_hf = torch.randn(1, hkv, t, d, generator=g)
    hf_rotary = rotary_cls(hf_cfg)
    cos, sin = hf_rotary(q_hf, pos[:, None, :])  # [1, T, 32]: the band values twice (rotate-half layout)
    want_q, want_k = apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    # the cos/sin table itself, and the rule spelled out
    our_cos, our_sin = ref.rope_cos_sin(rotary.cos_sin_cache, pos, rotary.mrope_section, True)  # [T, 16]
    torch.testing.assert_close(our_cos, cos[0, :, :16], **TOL[torch.float32])
    torch.testing.assert_close(our_sin, sin[0, :, :16], **TOL[torch.float32])
    assert ref.mrope_row_of_band(want_section, 16).tolist() == _bands_by_rule(want_section, 16)
    # q, k [T, heads, D] rotated on their first 32 dims (the rest pass through)
    q, k = q_hf[0].transpose(0, 1).clone(), k_hf[0].transpose(0, 1).clone()
    got_q, got_k = rotary(pos, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), **TOL[torch.float32])
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), **TOL[torch.float32])
    # the rows matter: contiguous bands at these positions are another rotation
    contiguous = RotaryEmbedding(32, MAX_POS, 1.0 / (10000 ** (torch.arange(0, 32, 2) / 32)), 1.0, [6, 5, 5])
    other_q, _ = contiguous(pos, q_hf[0].transpose(0, 1).clone(), k_hf[0].transpose(0, 1).clone())
    assert (other_q - got_q).abs().max() > 1e-2


def test_config_reads_the_flag_and_families_set_it():
    def core(rope):
        hf = types.SimpleNamespace(hidden_size=64, num_hidden_layers=2, vocab_size=64, rope_scaling=rope)
        return ModelConfig.core_fields(hf, "Qwen2ForCausalLM")

    c = core({"type": "mrope", "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    assert c["mrope_section"] == [2, 3, 3] and c["mrope_interleaved"]
    c = core({"type": "mrope", "mrope_section": [2, 3, 3]})
    assert c["mrope_section"] == [2, 3, 3] and not c["mrope_interleaved"]  # contiguous stays the default
    assert not core({"mrope_interleaved": True})["mrope_interleaved"]  # no sections: no mRoPE at all
    from transformers import Qwen3NextConfig as HFQwen3NextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    nxt = HFQwen3NextConfig(**TINY_HYBRID, intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32)
    cfg = Qwen3NextConfig.from_hf(nxt, "Qwen3NextForCausalLM")
    assert cfg.mrope_section is None and not cfg.mrope_interleaved
    with torch.device(CPU):
        assert Qwen3NextForCausalLM.make_rotary(cfg, 64).mrope_section is None
    text = dict(TINY_HYBRID, intermediate_size=128,
                rope_parameters=dict(TINY_HYBRID["rope_parameters"], mrope_section=[2, 1, 1]))
    vl = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=2))
    cfg = Qwen3NextConfig.from_hf(vl, "Qwen3_5ForConditionalGeneration")  # sections from text_config
    assert cfg.mrope_section == [2, 1, 1] and cfg.mrope_interleaved


# ------------------------------------------------------------------------------------------------ Triton kernels
SECTIONS = {8: [3, 3, 2], 16: [8, 4, 4], 32: [11, 11, 10]}  # per half-dim; 32: Qwen3.5's (rotary dim 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,head_dim", [(4, 2, 16), (6, 2, 32), (4, 1, 64)])
@pytest.mark.parametrize("section", ["fit", "default"])
def test_triton_rope_matches_reference(dtype, hq, hkv, head_dim, section):
    pytest.importorskip("triton")
    from specserve.kernels import triton_ops

    half = head_dim // 2
    sec = SECTIONS[half] if section == "fit" else list(QWEN3_5_MROPE_SECTION)  # the latter need not sum to half
    g = _gen(hq * 100 + head_dim)
    t = 11
    cache = _table(head_dim)
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g).to(dtype).to(DEV)
    q = qkv[:, :hq * head_dim].view(t, hq, head_dim)  # strided views of one projection, as the layers pass them
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(t, hkv, head_dim)
    v_before = qkv[:, (hq + hkv) * head_dim:].clone()
    pos = _rows(t, g)
    cos, sin = ref.rope_cos_sin(cache, pos, sec, True)
    want_q, want_k = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    got_q, got_k = triton_ops.rope(q, k, cache, pos, sec, True)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    torch.testing.assert_close(qkv[:, (hq + hkv) * head_dim:], v_before, **EXACT)  # v untouched
    # contiguous bands are another rotation at these rows (the flag reaches the kernel)
    if sum(sec) == half:
        cos_c, sin_c = ref.rope_cos_sin(cache, pos, sec)
        assert (ref.apply_rope(q, cos_c, sin_c).float() - got_q.float()).abs().max() > 1e-2


def _split(qkv: torch.Tensor, hq: int, hkv: int, d: int):
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def _prep_both(qkv, hq, hkv, d, rot_dim, pos, sec, dtype, offset, g, interleaved=True):
    """ref.qk_norm_rope_store and the Triton kernel on copies of qkv -> [(qkv, k_cache, v_cache)] x 2, loc."""
    from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton

    t, slots = qkv.shape[0], 24
    loc = (torch.randperm(slots - 1, generator=g)[:t] + 1).to(DEV)
    qw, kw = ((torch.randn(d, generator=g) * 0.3 + 1.0 - offset).to(dtype).to(DEV) for _ in range(2))
    out = []
    for fn in (ref.qk_norm_rope_store, qk_norm_rope_store_triton):
        buf = qkv.clone()
        q, k, v = _split(buf, hq, hkv, d)
        caches = [torch.full((slots, hkv, d), float("nan"), dtype=dtype, device=DEV) for _ in range(2)]
        fn(q, k, v, *caches, loc, _table(rot_dim), pos, sec, qw, kw, 1e-6, offset, mrope_interleaved=interleaved)
        out.append((buf, *caches))
    return out, loc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,rot_dim", [(4, 2, 64, 16), (4, 2, 32, 32), (6, 2, 128, 32)])
def test_triton_qk_prep_matches_reference(dtype, hq, hkv, d, rot_dim):
    """Zero-centred q/k norms and partial rotary, as Qwen3.5's gated attention; K cache at loc too."""
    pytest.importorskip("triton")
    g = _gen(d + rot_dim)
    t = 7
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2.0).to(dtype).to(DEV)
    (want, got), loc = _prep_both(qkv, hq, hkv, d, rot_dim, _rows(t, g), SECTIONS[rot_dim // 2], dtype, 1.0, g)
    for w, o in zip(want, got):  # qkv in place (v untouched), then the K and V caches at loc
        torch.testing.assert_close(o[loc] if o.dim() == 3 else o, w[loc] if w.dim() == 3 else w, **TOL[dtype])


def test_qk_prep_store_passes_the_layout_to_either_fused_op():
    """QKPrep.store (layers/attention.py) with an interleaved rotary: the reference op and the Triton kernel agree
    and differ from the contiguous layout."""
    pytest.importorskip("triton")
    from specserve.kernels import ops
    from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton
    from specserve.layers.attention import QKPrep

    hq, hkv, d, rot_dim, t = 4, 2, 64, 16, 6
    g = _gen(17)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(DEV)
    pos = _rows(t, g)
    loc = torch.arange(1, t + 1, device=DEV)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    outs = {}
    for interleaved in (True, False):
        with torch.device(DEV):
            rotary = RotaryEmbedding(rot_dim, MAX_POS, inv_freq, 1.0, [3, 3, 2], interleaved)
        for name, fused in (("ref", ops.qk_norm_rope_store), ("triton", qk_norm_rope_store_triton)):
            buf = qkv.clone()
            q, k, v = _split(buf, hq, hkv, d)
            caches = [torch.zeros(t + 1, hkv, d, device=DEV) for _ in range(2)]
            QKPrep(rotary, pos).store(q, k, v, *caches, loc, fused)
            outs[interleaved, name] = buf
    torch.testing.assert_close(outs[True, "triton"], outs[True, "ref"], **TOL[torch.float32])
    torch.testing.assert_close(outs[False, "triton"], outs[False, "ref"], **TOL[torch.float32])
    assert (outs[True, "ref"] - outs[False, "ref"]).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------ equal rows == 1-D
@pytest.mark.parametrize("half", [8, 16, 32])
def test_equal_rows_are_1d_rope_exactly(half):
    g = _gen(half)
    t, sec = 10, SECTIONS[half]
    cache = _table(2 * half, CPU)
    p = torch.randint(0, MAX_POS, (t,), generator=g)
    for s in (sec, list(QWEN3_5_MROPE_SECTION)):
        c3, s3 = ref.rope_cos_sin(cache, p[None].expand(3, t), s, True)
        c1, s1 = ref.rope_cos_sin(cache, p, None)
        torch.testing.assert_close(c3, c1, **EXACT)
        torch.testing.assert_close(s3, s1, **EXACT)
    # the layer: an interleaved-mRoPE rotary fed 1-D positions or three equal rows == a 1-D rotary (partial rotary)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))
    with torch.device(CPU):
        plain = RotaryEmbedding(2 * half, MAX_POS, inv_freq)
        mrope = RotaryEmbedding(2 * half, MAX_POS, inv_freq, 1.0, sec, True)
    q, k = torch.randn(t, 4, 4 * half, generator=g), torch.randn(t, 2, 4 * half, generator=g)
    want_q, want_k = plain(p, q.clone(), k.clone())
    for positions in (p, p[None].expand(3, t)):
        got_q, got_k = mrope(positions, q.clone(), k.clone())
        torch.testing.assert_close(got_q, want_q, **EXACT)
        torch.testing.assert_close(got_k, want_k, **EXACT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equal_rows_are_1d_rope_exactly(dtype):
    pytest.importorskip("triton")
    from specserve.kernels import triton_ops

    hq, hkv, d, rot_dim, t = 4, 2, 64, 16, 9
    g = _gen(23)
    p = torch.randint(0, MAX_POS, (t,), generator=g).to(DEV)
    p3 = p[None].expand(3, t)
    cache = _table(d)
    q, k = (torch.randn(t, h, d, generator=g).to(dtype).to(DEV) for h in (hq, hkv))
    want = triton_ops.rope(q.clone(), k.clone(), cache, p, None)
    got = triton_ops.rope(q.clone(), k.clone(), cache, p3, SECTIONS[d // 2], True)
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w, **EXACT)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEV)
    (_, one_d), _ = _prep_both(qkv, hq, hkv, d, rot_dim, p, None, dtype, 1.0, _gen(5), interleaved=False)
    (_, rows3), _ = _prep_both(qkv, hq, hkv, d, rot_dim, p3, SECTIONS[rot_dim // 2], dtype, 1.0, _gen(5))
    for w, o in zip(one_d, rows3):
        torch.testing.assert_close(o, w, **EXACT, equal_nan=True)


# ------------------------------------------------------------------------------------------------ the model
IMAGE = 200  # an image placeholder id inside the tiny vocabulary: only its token embedding is used here
# rotary 0.25 of 64 = 16 dims (8 bands); sections [4, 2, 2]: rows 1 / 2 take bands 1, 4 / 2, 5, band 7 stays row 0
ROPE = dict(TINY_HYBRID["rope_parameters"], mrope_section=[4, 2, 2], mrope_interleaved=True)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    root = tmp_path_factory.mktemp("mrope")
    return {kind: build_tiny_hybrid(str(root / kind), kind, seed=71 + i, mtp=kind == "qwen3_5", head_dim=64,
                                    rope_parameters=ROPE)
            for i, kind in enumerate(("qwen3_5_vl", "qwen3_5"))}


def _prompt(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Text, an image of grid (1, 4, 6) (6 placeholders), text, a 2-frame image of grid (2, 4, 4) (8), text ->
    (ids [T], positions [3, T], mrope_delta)."""
    text = lambda n: torch.randint(3, 190, (n,), generator=g).tolist()
    ids = text(3) + [IMAGE] * 6 + text(2) + [IMAGE] * 8 + text(4)
    pos, delta = mrope_positions(ids, [[1, 4, 6], [2, 4, 4]], spatial_merge_size=2, image_token_id=IMAGE)
    assert delta < 0 and not torch.equal(pos[1], pos[2])
    return torch.tensor(ids), pos, delta


def _runner(path: str, n: int = 0):
    from specserve.engine.model_runner import ModelRunner
    from specserve.models.loader import ModelSource, load_mtp_draft, load_target
    from specserve.server_args import ServerArgs

    t = load_target(ModelSource.resolve(path), torch.float32, CPU, 600)
    draft = load_mtp_draft(t, None, torch.float32, CPU, 600) if n else None
    args = ServerArgs(model_path=path, max_total_tokens=1024, max_running_requests=4, cuda_graph_bs=[1, 2],
                      **({"speculative_algorithm": "MTP", "speculative_num_steps": n} if n else {}))
    return ModelRunner(args, t.model, t.config, draft, CPU, torch.float32, 512), t


def test_vl_language_model_prefill_and_decode_match_transformers(qwen3_5):
    """Prefill at the prompt's 3-row positions (the engine's eager prefill, CPU), then text decode steps at
    seq_len + mrope_delta through the decode runner (its 3-row static buffers, the 1-D positions broadcast),
    against transformers' Qwen3_5TextModel given the token embeddings and position_ids [3, 1, T]."""
    from transformers import AutoModelForImageTextToText

    path = qwen3_5["qwen3_5_vl"]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    lm = hf.model.language_model

    def hf_logits(ids, pos):
        with torch.no_grad():
            h = lm(inputs_embeds=lm.embed_tokens(ids[None]), position_ids=pos[:, None, :]).last_hidden_state
            return hf.lm_head(h)[0]  # [T, V]

    mr, t = _runner(path)
    rotary = t.model.model.rotary
    assert rotary.mrope_section == [4, 2, 2] and rotary.mrope_interleaved
    assert mr.phases.decode.buffers.positions.shape[0] == 3  # mRoPE model: 3-row static position buffers
    ids, pos, delta = _prompt(_gen(1))
    n = ids.shape[0]
    want = hf_logits(ids, pos)
    text_pos = torch.arange(n)[None].expand(3, n)
    assert (hf_logits(ids, text_pos) - want).abs().max() > 1e-2  # the image rows change the logits
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [n + 3])
    loc = mr.req_to_token.table[h.row, :n]
    got = t.model.compute_logits(mr.prefill.run(ExtendBatch(ids, pos, loc, [h.row], [n], [n])))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    seq, seq_pos = ids.tolist(), pos
    rows = torch.tensor([h.row])
    for step in range(3):  # generated text continues at seq_len + delta on all three rows
        tok = int(want[-1].argmax())
        s = len(seq)
        seq.append(tok)
        seq_pos = torch.cat([seq_pos, torch.full((3, 1), s + delta)], dim=1)
        out = mr.phases.decode.run(LiveInputs(1, torch.tensor([tok]), torch.tensor([s + delta]), rows,
                                              torch.tensor([s + 1]), s + 1))
        want = hf_logits(torch.tensor(seq), seq_pos)
        torch.testing.assert_close(out["logits"][0], want[-1], rtol=1e-4, atol=1e-4, msg=f"decode step {step}")
    mr.kv.release(h)


def test_mtp_draft_extend_at_mrope_positions_matches_transformers(qwen3_5):
    """The MTP layer (models/mtp.py, the family's rotary) in DRAFT_EXTEND at the prompt's 3-row positions, fed
    transformers' target hidden states at those positions, against the layer assembled from transformers' modules
    (hybrid_helpers.hf_mtp_logits) rotating at the same rows."""
    from transformers import AutoModelForCausalLM

    path = qwen3_5["qwen3_5"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mr, _ = _runner(path, n=2)
    assert mr.draft.rotary.mrope_section == [4, 2, 2] and mr.draft.rotary.mrope_interleaved
    ids, pos, _ = _prompt(_gen(2))
    t = ids.shape[0] - 1
    with torch.no_grad():
        hidden = hf.model(ids[None], position_ids=pos[:, None, :]).last_hidden_state[0, :t]  # [T, H]
    want = hf_mtp_logits(hf, path, ids[1:], hidden, positions=pos[:, :t])
    assert (hf_mtp_logits(hf, path, ids[1:], hidden) - want).abs().max() > 1e-3  # the rows matter
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [t])
    loc = mr.req_to_token.table[h.row, :t]
    got = []
    for a, b in ((0, 10), (10, t)):  # input at p: (token p + 1, target hidden at p), rotated at the rows of p
        x = ExtendBatch(ids[a + 1:b + 1], pos[:, a:b], loc[a:b], [h.row], [b], [b - a], hidden[a:b])
        got.append(mr.draft.compute_logits(mr.spec.prefill.run(x)))
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)
    mr.kv.release(h)
