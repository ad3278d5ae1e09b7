"""The row-indexed recurrent-state pool and its lifetime rules (kvcache/state_pool.py, DESIGN §2).

StatePool alone (rows, zeroing, commit, shapes and dtypes), KVManager taking a page-table row and a state row
together, ModelCaches building one pool per cache kind, the per-token / per-row byte counts, and the engine: a
target that declares recurrent layers gets its state rows from the model runner, and a mixed workload with
retractions and an abort returns every row, with exactly one state row held per request holding a page-table row.
"""


import pytest
import torch

from specserve.batch import CacheKind
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req, ReqState
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.stop import StopChecker
from specserve.kvcache.allocator import PageAllocator
from specserve.kvcache.cache_spec import (
    LatentCacheSpec,
    MHACacheSpec,
    RecurrentStateSpec,
    bytes_per_state_row,
    bytes_per_token,
)
from specserve.kvcache.caches import ModelCaches
from specserve.kvcache.kv_pool import KVPool, LatentPool
from specserve.kvcache.manager import KVHandle, KVManager
from specserve.kvcache.req_to_token import ReqToTokenPool
from specserve.kvcache.state_pool import StatePool
from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.server_args import ServerArgs

CPU = torch.device("cpu")
SPEC = RecurrentStateSpec(conv_shape=(6, 3), ssm_shape=(2, 4, 5))  # default dtypes: conv bf16, ssm float32


def _pool(layers=3, rows=4, slots=3, spec=SPEC) -> StatePool:
    return StatePool([spec] * layers, rows, slots, CPU)


def _scribble(pool: StatePool, row: int, value: float) -> None:
    pool.conv[:, row] = value
    pool.ssm[:, row] = value
    pool.current[row] = pool.slots_per_row - 1


def _row_is_zero(pool: StatePool, row: int) -> bool:
    return bool((pool.conv[:, row] == 0).all() and (pool.ssm[:, row] == 0).all() and int(pool.current[row]) == 0)


# ---------------------------------------------------------------------------------------------- StatePool alone
def test_rows_are_handed_out_until_exhausted_and_never_row_0():
    pool = _pool(rows=4)
    rows = [pool.alloc() for _ in range(4)]
    assert sorted(rows) == [1, 2, 3, 4]
    assert pool.num_free_rows == 0
    assert pool.alloc() is None
    assert pool.alloc() is None  # still exhausted, nothing changed
    pool.free(rows[2])
    assert pool.num_free_rows == 1
    assert pool.alloc() == rows[2]  # the freed row is reused
    assert pool.alloc() is None


def test_rows_handed_out_many_times_never_include_the_dummy():
    pool = _pool(rows=3)
    g = torch.Generator().manual_seed(0)
    held: list[int] = []
    seen: set[int] = set()
    for _ in range(200):
        if held and (pool.num_free_rows == 0 or torch.rand((), generator=g) < 0.5):
            pool.free(held.pop(int(torch.randint(len(held), (), generator=g))))
        else:
            row = pool.alloc()
            assert row is not None and row not in held
            held.append(row)
            seen.add(row)
        assert pool.num_free_rows == pool.max_rows - len(held)
    assert seen == {1, 2, 3}


def test_handed_out_row_is_zeroed_in_every_layer_and_slot():
    pool = _pool(layers=3, rows=2, slots=3)
    a, b = pool.alloc(), pool.alloc()
    _scribble(pool, a, 7.0)
    _scribble(pool, b, -3.0)
    _scribble(pool, 0, 5.0)  # the dummy row is written by padded graph rows
    pool.free(a)
    again = pool.alloc()
    assert again == a
    assert _row_is_zero(pool, a)
    # zeroing one row touches no other: b and the dummy keep what was written
    assert (pool.conv[:, b] == -3.0).all() and (pool.ssm[:, b] == -3.0).all()
    assert int(pool.current[b]) == pool.slots_per_row - 1
    assert (pool.conv[:, 0] == 5.0).all() and (pool.ssm[:, 0] == 5.0).all()


def test_fresh_pool_rows_are_zero_with_current_slot_0():
    pool = _pool(rows=3)
    for _ in range(3):
        assert _row_is_zero(pool, pool.alloc())


@pytest.mark.parametrize("bad", [0, -1, 5, 100])
def test_freeing_a_row_outside_the_pool_raises(bad):
    pool = _pool(rows=4)
    pool.alloc()
    with pytest.raises(ValueError):
        pool.free(bad)
    assert pool.num_free_rows == 3  # nothing was added to the free list


def test_freeing_a_row_twice_raises():
    pool = _pool(rows=4)
    row = pool.alloc()
    pool.free(row)
    with pytest.raises(ValueError, match="twice"):
        pool.free(row)
    assert pool.num_free_rows == 4
    held = pool.alloc()
    never = next(r for r in range(1, 5) if r != held)
    with pytest.raises(ValueError, match="twice"):
        pool.free(never)  # a row that was never handed out is still free
    assert pool.num_free_rows == 3


def test_commit_sets_the_current_slot_of_each_row():
    pool = _pool(rows=4, slots=3)
    rows = [pool.alloc() for _ in range(4)]
    pool.commit(torch.tensor([rows[0], rows[2], rows[3]]), torch.tensor([2, 1, 0]))
    assert pool.current[rows[0]] == 2 and pool.current[rows[2]] == 1 and pool.current[rows[3]] == 0
    assert pool.current[rows[1]] == 0
    pool.commit(torch.tensor([rows[1]]), torch.tensor([2]))
    assert pool.current[rows[1]] == 2 and pool.current[rows[0]] == 2


def test_flat_slots_index_a_layer_viewed_as_rows_times_slots():
    pool = _pool(layers=2, rows=4, slots=3)
    rows = torch.tensor([[1, 4], [2, 0]])
    slots = torch.tensor([[0, 2], [1, 2]])
    flat = pool.flat_slots(rows, slots)
    assert flat.shape == rows.shape
    assert flat.tolist() == [[3, 14], [7, 2]]
    # the flat index addresses the same element as (row, slot) in a layer's [rows * S, ...] view
    conv, ssm = pool.layer(1)
    g = torch.Generator().manual_seed(1)
    ssm.copy_(torch.randn(ssm.shape, generator=g))
    view = ssm.reshape(-1, *ssm.shape[2:])
    for r, s, f in zip(rows.flatten().tolist(), slots.flatten().tolist(), flat.flatten().tolist()):
        assert torch.equal(view[f], ssm[r, s])


@pytest.mark.parametrize("conv_dtype,ssm_dtype", [(None, None), (torch.float16, torch.bfloat16)])
def test_shapes_and_dtypes_follow_the_spec(conv_dtype, ssm_dtype):
    kw = {} if conv_dtype is None else dict(conv_dtype=conv_dtype, ssm_dtype=ssm_dtype)
    spec = RecurrentStateSpec((10, 3), (2, 4, 6), **kw)
    pool = StatePool([spec] * 5, 7, 4, CPU)
    assert pool.conv.shape == (5, 8, 4, 10, 3)
    assert pool.ssm.shape == (5, 8, 4, 2, 4, 6)
    assert pool.current.shape == (8,) and pool.current.dtype == torch.int64
    assert pool.conv.dtype == (conv_dtype or torch.bfloat16)
    assert pool.ssm.dtype == (ssm_dtype or torch.float32)
    conv, ssm = pool.layer(3)
    assert conv.shape == (8, 4, 10, 3) and ssm.shape == (8, 4, 2, 4, 6)
    assert pool.bytes() == 8 * bytes_per_state_row([spec] * 5, 4)


def test_default_dtypes_are_conv_bf16_and_ssm_float32():
    assert SPEC.conv_dtype == torch.bfloat16 and SPEC.ssm_dtype == torch.float32


@pytest.mark.parametrize("other", [
    RecurrentStateSpec((6, 4), (2, 4, 5)),
    RecurrentStateSpec((6, 3), (2, 4, 6)),
    RecurrentStateSpec((6, 3), (2, 4, 5), conv_dtype=torch.float32),
    RecurrentStateSpec((6, 3), (2, 4, 5), ssm_dtype=torch.bfloat16),
])
def test_mismatched_specs_raise(other):
    with pytest.raises(ValueError, match="share"):
        StatePool([SPEC, other, SPEC], 2, 1, CPU)


def test_a_pool_needs_a_layer():
    with pytest.raises(ValueError):
        StatePool([], 2, 1, CPU)


# ---------------------------------------------------------------------------------------------- KVManager
def _manager(page_rows: int, state_rows: int | None) -> KVManager:
    pool = None if state_rows is None else _pool(rows=state_rows)
    return KVManager(PageAllocator(32, 4), ReqToTokenPool(page_rows, 16, CPU), pool)


def test_assign_row_takes_a_page_table_row_and_a_zeroed_state_row():
    kv = _manager(page_rows=4, state_rows=4)
    handles = [KVHandle() for _ in range(3)]
    for h in handles:
        assert kv.assign_row(h)
        assert h.row and h.state_row
        assert _row_is_zero(kv.state_pool, h.state_row)
        _scribble(kv.state_pool, h.state_row, 9.0)
    assert len({h.state_row for h in handles}) == 3
    assert kv.req_to_token.num_free_rows == 1 and kv.state_pool.num_free_rows == 1
    assert kv.assign_row(handles[0])  # already has both: takes nothing more
    assert kv.req_to_token.num_free_rows == 1 and kv.state_pool.num_free_rows == 1
    assert kv.ensure(handles, [5, 9, 1])
    old = handles[1].state_row
    kv.release(handles[1])
    assert handles[1].row == 0 and handles[1].state_row == 0 and handles[1].pages == []
    assert kv.req_to_token.num_free_rows == 2 and kv.state_pool.num_free_rows == 2
    fresh = KVHandle()
    assert kv.assign_row(fresh)
    assert fresh.state_row == old and _row_is_zero(kv.state_pool, fresh.state_row)  # reused, and zeroed again
    for h in (handles[0], handles[2], fresh):
        kv.release(h)
    assert kv.req_to_token.num_free_rows == 4 and kv.state_pool.num_free_rows == 4
    assert kv.allocator.num_free_pages == kv.allocator.capacity_pages


def test_assign_row_takes_neither_when_the_state_pool_is_exhausted():
    kv = _manager(page_rows=5, state_rows=2)
    held = [KVHandle(), KVHandle()]
    assert all(kv.assign_row(h) for h in held)
    late = KVHandle()
    assert not kv.assign_row(late)
    assert late.row == 0 and late.state_row == 0
    assert kv.req_to_token.num_free_rows == 3  # no page-table row was taken for it
    kv.release(held[0])
    assert kv.assign_row(late) and late.row and late.state_row


def test_assign_row_takes_neither_when_the_page_table_is_exhausted():
    kv = _manager(page_rows=2, state_rows=4)
    held = [KVHandle(), KVHandle()]
    assert all(kv.assign_row(h) for h in held)
    late = KVHandle()
    assert not kv.assign_row(late)
    assert late.row == 0 and late.state_row == 0
    assert kv.state_pool.num_free_rows == 2  # no state row was taken for it


def test_without_a_state_pool_no_state_row_is_taken():
    kv = _manager(page_rows=2, state_rows=None)
    h = KVHandle()
    assert kv.assign_row(h) and h.row and h.state_row == 0
    kv.release(h)
    assert kv.req_to_token.num_free_rows == 2


# ---------------------------------------------------------------------------------------------- ModelCaches
def _mixed_specs() -> list:
    mha = MHACacheSpec(num_kv_heads=2, head_dim=8)
    rec = RecurrentStateSpec((12, 3), (2, 4, 4))
    # a hybrid stack: recurrent, recurrent, attention, ... plus one MLA latent and one indexer-key layer
    return [rec, rec, mha, rec, rec, mha, LatentCacheSpec(40), LatentCacheSpec(16, CacheKind.INDEX_KEYS), rec]


def test_model_caches_builds_one_pool_per_kind():
    specs = _mixed_specs()
    caches = ModelCaches(specs, num_slots=64, kv_dtype=torch.float16, device=CPU, state_rows=5, state_slots=3)
    assert set(caches.kinds) == {CacheKind.MHA, CacheKind.MLA, CacheKind.INDEX_KEYS, CacheKind.RECURRENT}
    kv = caches.kv
    assert isinstance(kv, KVPool) and kv.num_layers == 2 and len(kv.k) == len(kv.v) == 2
    assert all(t.shape == (64, 2, 8) and t.dtype == torch.float16 for t in kv.k + kv.v)
    mla, idx = caches.pools[CacheKind.MLA], caches.pools[CacheKind.INDEX_KEYS]
    assert isinstance(mla, LatentPool) and mla.kind is CacheKind.MLA and mla.num_layers == 1
    assert [tuple(r.shape) for r in mla.rows] == [(64, 40)] and mla.rows[0].dtype == torch.float16
    assert isinstance(idx, LatentPool) and idx.kind is CacheKind.INDEX_KEYS
    assert [tuple(r.shape) for r in idx.rows] == [(64, 16)]
    state = caches.state
    assert isinstance(state, StatePool)
    assert state.num_layers == 5 and state.max_rows == 5 and state.slots_per_row == 3
    assert state.conv.shape == (5, 6, 3, 12, 3) and state.conv.dtype == torch.bfloat16  # not kv_dtype
    assert state.ssm.shape == (5, 6, 3, 2, 4, 4) and state.ssm.dtype == torch.float32


def test_model_caches_without_recurrent_layers_has_no_state_pool():
    specs = [s for s in _mixed_specs() if s.kind is not CacheKind.RECURRENT]
    caches = ModelCaches(specs, num_slots=16, kv_dtype=torch.float32, device=CPU)
    assert caches.state is None and CacheKind.RECURRENT not in caches.kinds
    with pytest.raises(ValueError, match="state rows"):
        ModelCaches(_mixed_specs(), num_slots=16, kv_dtype=torch.float32, device=CPU)


def test_bytes_per_token_counts_only_token_indexed_kinds():
    specs = _mixed_specs()
    for dtype, size in ((torch.float16, 2), (torch.float32, 4)):
        mha = 2 * 2 * 8 * size  # K and V, 2 heads of 8
        assert bytes_per_token(specs, dtype) == 2 * mha + 40 * size + 16 * size
    only_state = [s for s in specs if s.kind is CacheKind.RECURRENT]
    assert bytes_per_token(only_state, torch.float16) == 0


def test_bytes_per_state_row_is_slots_times_slot_bytes():
    specs = _mixed_specs()
    slot = 12 * 3 * 2 + 2 * 4 * 4 * 4  # conv bf16 + ssm float32
    assert RecurrentStateSpec((12, 3), (2, 4, 4)).bytes_per_slot() == slot
    for slots in (1, 3, 5):
        assert bytes_per_state_row(specs, slots) == slots * 5 * slot
    assert bytes_per_state_row([s for s in specs if s.kind.token_indexed], 3) == 0
    caches = ModelCaches(specs, 8, torch.float16, CPU, state_rows=5, state_slots=3)
    assert caches.state.bytes() == 6 * bytes_per_state_row(specs, 3)  # 5 rows + the dummy


# ---------------------------------------------------------------------------------------------- engine lifetime
FAKE_STATE = RecurrentStateSpec((8, 3), (2, 4, 4))


def _scheduler_with_state_rows(path: str, spec_steps: int | None, **kw) -> Scheduler:
    if spec_steps:
        kw.update(speculative_algorithm="MTP", speculative_num_steps=spec_steps)
    args = ServerArgs(model_path=path, schedule_conservativeness=0.0, **kw)  # so that the tight pool retracts
    t = load_target(ModelSource.resolve(path), torch.float32, CPU, 600)
    draft = load_mtp_draft(t, None, torch.float32, CPU, 600) if spec_steps else None
    specs = t.model.cache_specs()
    # two recurrent layers beside the attention ones (their backend builds metadata; no layer reads the state)
    t.model.cache_specs = lambda: specs[:1] + [FAKE_STATE] + specs[1:] + [FAKE_STATE]
    mr = ModelRunner(args, t.model, t.config, draft, CPU, torch.float32, args.context_length)
    return Scheduler(mr, StopChecker(None, {2}), args.chunked_prefill_size)


def _requests(seed: int) -> list[Req]:
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(12):
        n = int(torch.randint(4, 70, (1,), generator=g))
        prompt = torch.randint(3, 250, (n,), generator=g).tolist()
        sp = SamplingParams(max_new_tokens=int(torch.randint(1, 48, (1,), generator=g)), temperature=0.0,
                            ignore_eos=i % 3 != 1)
        if i % 4 == 1:
            sp.stop_token_ids = [int(torch.randint(3, 250, (1,), generator=g))]
        reqs.append(Req(f"r{i}", prompt, sp, seed=i))
    return reqs


@pytest.mark.parametrize("spec_steps,page_size", [(None, 1), (None, 16), (2, 1)])
def test_state_rows_come_back_after_finish_abort_and_retraction(tiny_models, spec_steps, page_size):
    sched = _scheduler_with_state_rows(tiny_models["llama_mtp"], spec_steps, context_length=128, page_size=page_size,
                                       chunked_prefill_size=32, max_total_tokens=160, max_running_requests=6)
    mr = sched.model_runner
    pool = mr.caches.state
    # the runner built the state pool from the target's specs and handed it to the KV manager
    assert pool is not None and mr.kv.state_pool is pool
    assert pool.num_layers == 2 and pool.slots_per_row == (spec_steps or 0) + 1
    assert pool.max_rows == mr.max_running == mr.req_to_token.max_reqs
    assert pool.conv.shape[3:] == FAKE_STATE.conv_shape and pool.ssm.shape[3:] == FAKE_STATE.ssm_shape

    reqs = _requests(seed=5)
    for r in reqs:
        sched.add_request(r)
    victim = reqs[2]  # aborted once it is decoding
    victim.sampling.max_new_tokens = 200
    victim.sampling.ignore_eos = True
    aborted = False
    holding: dict[str, int] = {}  # rid -> state row it held at the last look
    max_held = 0
    for _ in range(2000):
        if not sched.has_work:
            break
        sched.step()
        if not aborted and victim.state is ReqState.RUNNING and len(victim.output_ids) >= 3:
            assert victim.kv.state_row
            assert sched.abort(victim.rid) is victim
            assert victim.kv.row == 0 and victim.kv.state_row == 0
            aborted = True
        with_row = [r for r in reqs if r.kv.row]
        n = len(with_row)
        rows = [r.kv.state_row for r in with_row]
        # one state row per request holding a page-table row, and nobody else holds one
        assert all(rows) and len(set(rows)) == len(rows)
        assert all(r.kv.state_row == 0 for r in reqs if not r.kv.row)
        assert pool.max_rows - pool.num_free_rows == n
        assert mr.req_to_token.max_reqs - mr.req_to_token.num_free_rows == n
        now = {r.rid: r.kv.state_row for r in with_row}
        for r in with_row:
            if holding.get(r.rid) != r.kv.state_row:
                # newly handed out (first admission or re-admission after a retraction): the zero state
                assert _row_is_zero(pool, r.kv.state_row), f"{r.rid} got a dirty state row"
            _scribble(pool, r.kv.state_row, float(int(r.rid[1:]) + 1))  # what a model's layers would write
        holding = now
        max_held = max(max_held, n)
    assert not sched.has_work
    assert aborted and victim.finished_reason["type"] == "abort"
    assert sched.stats.num_retractions > 0, "the pool was not tight enough to force a retraction"
    assert any(r.retractions for r in reqs)
    assert max_held > 1
    assert all(r.finished and r.kv.row == 0 and r.kv.state_row == 0 for r in reqs)
    sched.check_idle_invariants()  # pages, page-table rows and mr.caches.state rows all back
    assert pool.num_free_rows == pool.max_rows
    assert sorted(pool._free) == list(range(1, pool.max_rows + 1))


def test_idle_invariants_catch_a_leaked_state_row(tiny_models):
    sched = _scheduler_with_state_rows(tiny_models["llama"], None, context_length=64, max_total_tokens=256,
                                       max_running_requests=4)
    sched.check_idle_invariants()
    row = sched.model_runner.caches.state.alloc()
    with pytest.raises(AssertionError, match="state row leak"):
        sched.check_idle_invariants()
    sched.model_runner.caches.state.free(row)
    sched.check_idle_invariants()
