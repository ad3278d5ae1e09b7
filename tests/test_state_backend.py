"""The recurrent-state backend and the accept commit, on a target that declares recurrent layers beside its
attention ones (their backend builds metadata; no layer of the tiny model reads the state):
- eager and graph metadata give each request's state row (through row_state) and its current slot; padded rows
  get the dummy state row 0; page-table rows bound and unbound with the request;
- after a speculative step (phase by phase, and as one graph) the current slot of every row is its accept length;
- per-runner isolation covers both kinds: a draft replay leaves the target runners' MHA and recurrent metadata
  untouched, and back."""

import torch
from test_runners import _snapshot, check_isolation
from test_state_pool import _scheduler_with_state_rows

from specserve.batch import CacheKind, ForwardBatch, ForwardMode
from specserve.graphs.phase_runners import replay_phase
from specserve.kvcache.manager import KVHandle
from specserve.layers.sampler import GREEDY
from specserve.speculative.spec_step import spec_step_device


def _runner(tiny_models, n=3):
    sched = _scheduler_with_state_rows(tiny_models["llama_mtp"], n, max_total_tokens=4096, max_running_requests=12,
                                       cuda_graph_bs=[1, 2, 4, 8], context_length=512)
    return sched.model_runner


def _take(mr, n):
    hs = []
    for _ in range(n):
        h = KVHandle()
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [64])
        hs.append(h)
    return hs


def test_row_state_binding_and_metadata(tiny_models):
    mr = _runner(tiny_models)
    pool = mr.caches.state
    hs = _take(mr, 3)
    assert [int(pool.row_state[h.row]) for h in hs] == [h.state_row for h in hs]
    pool.current[torch.tensor([h.state_row for h in hs])] = torch.tensor([2, 0, 3])
    runner = mr.spec.phases.target_verify
    backend = runner.backends[CacheKind.RECURRENT]
    eager = runner.eager_backends[CacheKind.RECURRENT]
    assert backend is not eager and backend.pool is pool
    rows = torch.tensor([hs[2].row, hs[0].row, 0, hs[1].row])  # a padded (row 0) request in the middle
    fb = ForwardBatch(mode=ForwardMode.TARGET_VERIFY, batch_size=4, input_ids=torch.zeros(16, dtype=torch.int64),
                      positions=torch.zeros(16, dtype=torch.int64), out_cache_loc=torch.zeros(16, dtype=torch.int64),
                      req_pool_indices=rows, seq_lens=torch.full((4,), 20), max_seq_len=20, width=4)
    eager.init_forward_metadata(fb)
    backend.init_forward_metadata_graph(fb)
    want_rows = [hs[2].state_row, hs[0].state_row, 0, hs[1].state_row]
    for meta in (eager.meta, backend.meta):
        assert meta.state_rows.tolist() == want_rows
        assert meta.start_slots.tolist() == [3, 2, int(pool.current[0]), 0]
        assert meta.per_position  # verify writes the state after token i into slot i
        assert meta.starts.tolist() == [0, 4, 8, 12] and meta.lens.tolist() == [4, 4, 4, 4]
    assert backend.meta.state_rows.data_ptr() == backend.graph_buffers["state_rows"].data_ptr()  # its own buffers
    released = hs[1].row
    mr.kv.release(hs[1])
    assert int(pool.row_state[released]) == 0  # a freed page-table row points at no state
    for h in (hs[0], hs[2]):
        mr.kv.release(h)
    assert pool.num_free_rows == pool.max_rows


def test_accept_commit_sets_current_slot(tiny_models):
    mr = _runner(tiny_models)
    pool = mr.caches.state

    def phases(rows, s):
        return spec_step_device(mr.spec, replay_phase, rows, s, s, int(s.max()), GREEDY)

    for one_graph in (False, True):
        hs = _take(mr, 5)
        rows = torch.tensor([h.row for h in hs])
        srows = torch.tensor([h.state_row for h in hs])
        s = torch.tensor([9, 17, 3, 30, 12])
        g = torch.Generator().manual_seed(int(one_graph))
        last = torch.randint(3, 250, (5,), generator=g)
        mr.last_token[rows] = last
        mr.spec.state.draft_token[rows] = torch.randint(3, 250, (5,), generator=g)
        _, verified = phases(rows, s)  # the target's greedy token after `last` (the KV written is the same again)
        mr.last_token[rows] = last
        mr.spec.state.draft_token[rows] = verified[:, 0]  # so d1 is accepted in every row
        pool.current[srows] = 0  # stale slots: the commit must overwrite every row's
        if one_graph:
            accept = mr.spec.spec_step_graph.run(rows.tolist(), s.tolist(), s.tolist())[:, 0]
        else:
            accept, _ = phases(rows, s)
        assert bool((accept >= 1).all()), accept
        assert torch.equal(pool.current[srows], accept)
        for h in hs:
            mr.kv.release(h)


def test_isolation_covers_every_kind(tiny_models):
    mr = _runner(tiny_models)
    target = mr.spec.phases.target_verify
    assert set(target.backends) == {CacheKind.MHA, CacheKind.RECURRENT}
    assert any(k.startswith("backend.recurrent.") for k in _snapshot(target))
    check_isolation(mr)
