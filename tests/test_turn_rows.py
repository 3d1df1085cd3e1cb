"""``engine.turn_rows_max_tokens``: a resumed conversation's environment reply (given tokens after its prompt) is
computed as one-token rows of a decode step, each row attending to the KV the rows before it wrote in the same
layer, so the step stays a decode step (a CUDA-graph replay on the GPU) instead of an eager step for a few
tokens of prefill. Tokens and logprobs are the prefill path's; decoding sequences are never displaced."""

from __future__ import annotations

import pytest

from rollout import Engine, SamplingParams
from rollout.config import EngineConfig
from rollout.engine import scheduler as scheduler_mod
from rollout.engine.turns import Conversations
from tests.tiny_models import make_tiny_hf_model

TURN = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
REPLY = [20, 21, 22, 23, 24, 25, 26]


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama")


def _engine(hf, rows: int, **kw) -> Engine:
    kw.setdefault("max_model_len", 128)
    return Engine.from_pretrained(hf, dtype="float32", device="cpu", block_size=4, turn_rows_max_tokens=rows, **kw)


def _watch(engine: Engine) -> list:
    plans, schedule = [], engine.scheduler.schedule

    def watch(*a, **k):
        plan = schedule(*a, **k)
        if plan is not None:
            plans.append(plan)
        return plan

    engine.scheduler.schedule = watch
    return plans


def _conversations(hf, rows: int, n_conv: int = 3, reply: list[int] = REPLY, **kw):
    """``n_conv`` conversations plus one long decoder; each conversation gets ``reply`` after its first turn,
    the replies landing one step apart. Returns (each conversation's tokens and logprobs, the plans after the
    first turn, the decoder's seq_id)."""
    engine = _engine(hf, rows, **kw)
    plans = _watch(engine)
    conv = Conversations(engine)
    rids = [conv.start([3 + i, 7, 11, 13, 17], TURN, f"c{i}") for i in range(n_conv)]
    engine.add_request([5, 9, 2], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), "decoder")
    while len(engine.scheduler.parked) < len(rids):
        engine.step()
    decoder = engine.scheduler.requests["decoder"].seqs[0].seq_id
    plans.clear()
    for i, rid in enumerate(rids):
        while not conv.resume(rid, [t + i for t in reply], TURN, 3):
            engine.step()
        engine.step()
    while len(engine.scheduler.parked) < len(rids):
        engine.step()
    seqs = [engine.scheduler.parked[r].seqs[0] for r in rids]
    return [(s.token_ids, s.logprobs) for s in seqs], plans, decoder


@pytest.mark.parametrize("async_mode", [False, True])
def test_replies_run_as_decode_rows_with_the_prefill_paths_tokens_and_logprobs(hf, async_mode):
    ref, ref_plans, _ = _conversations(hf, 0, async_mode=async_mode)
    got, plans, _ = _conversations(hf, 64, async_mode=async_mode)
    assert any(len(s.input_ids) > 1 for p in ref_plans for s in p.seqs)  # off: replies are prefill chunks
    assert all(p.decode_only for p in plans)  # on: every step is a decode step
    assert any(len([s for s in p.seqs if s.seq_id == p.seqs[0].seq_id]) > 1 or
               len({s.seq_id for s in p.seqs}) < len(p.seqs) for p in plans)  # some sequence had several rows
    for (ref_ids, ref_lps), (ids, lps) in zip(ref, got, strict=True):
        assert ids == ref_ids
        assert lps == pytest.approx(ref_lps, abs=1e-5)


def test_rows_never_displace_decoding_sequences(hf):
    """max_num_seqs = max_num_rows = 4: three conversations and the decoder fill it, so a reply gets one row per
    step (drip), and the decoder is in every step."""
    got, plans, decoder = _conversations(hf, 64, max_num_seqs=4, max_num_rows=4)
    ref, _, _ = _conversations(hf, 0, max_num_seqs=4)
    assert [ids for ids, _ in got] == [ids for ids, _ in ref]
    for p in plans:
        assert len(p.seqs) <= 4 and p.decode_only
    live = [p for p in plans if any(s.seq_id == decoder for s in p.seqs)]
    assert len(live) >= len(plans) - 1  # every step until the decoder's last one


def test_a_reply_beside_max_num_seqs_decoders_takes_the_rows_above_them(hf):
    """max_num_seqs 4 filled by three conversations and the decoder: with max_num_rows 68 a reply's rows go in one
    step above the four sequences' rows; by default (max_num_rows = max_num_seqs) a row per step."""
    got, plans, decoder = _conversations(hf, 64, max_num_seqs=4, max_num_rows=68)
    drip, drip_plans, _ = _conversations(hf, 64, max_num_seqs=4)
    assert [ids for ids, _ in got] == [ids for ids, _ in drip]
    assert max(len(p.seqs) for p in plans) > 4 and all(len(p.seqs) <= 4 + 64 for p in plans)
    assert all(p.decode_only for p in plans)
    assert all(len({s.seq_id for s in p.seqs}) <= 4 for p in plans)  # max_num_seqs still caps the sequences
    assert len(plans) < len(drip_plans)
    live = [p for p in plans if any(s.seq_id == decoder for s in p.seqs)]
    assert len(live) >= len(plans) - 1


def test_max_num_rows_is_checked():
    assert EngineConfig(max_num_seqs=8, turn_rows_max_tokens=64).num_rows == 8
    assert EngineConfig(max_num_seqs=8, max_num_rows=12).num_rows == 12
    for bad in (4, 0, -1, True, 2.5):
        with pytest.raises((ValueError, TypeError), match="max_num_rows"):
            EngineConfig(max_num_seqs=8, max_num_rows=bad)


def test_rows_per_step_are_capped_by_context(hf, monkeypatch):
    monkeypatch.setattr(scheduler_mod, "TURN_ROWS_CONTEXT", 40)  # ~3 rows at a ~12-token context
    got, plans, decoder = _conversations(hf, 64)
    ref, _, _ = _conversations(hf, 0)
    assert [ids for ids, _ in got] == [ids for ids, _ in ref]
    for p in plans:
        by_seq: dict[int, list] = {}
        for s in p.seqs:
            by_seq.setdefault(s.seq_id, []).append(s)
        for rows in by_seq.values():
            assert len(rows) * rows[-1].seq_len <= 40 or len(rows) == 1


def test_a_reply_longer_than_the_limit_is_a_prefill_chunk(hf):
    _, plans, _ = _conversations(hf, len(REPLY) - 1)  # the turn's last token + the reply: one over the limit
    assert any(len(s.input_ids) == len(REPLY) + 1 for p in plans for s in p.seqs)


def test_turn_rows_max_tokens_is_checked():
    for bad in (-1, 5000, True, 1.5):
        with pytest.raises(ValueError, match="turn_rows_max_tokens"):
            EngineConfig(turn_rows_max_tokens=bad)


def _first_turns(engine: Engine) -> tuple[Conversations, list[str]]:
    """Three conversations and a long decoder, stepped until every conversation's first turn is parked."""
    conv = Conversations(engine)
    rids = [conv.start([3 + i, 7, 11, 13, 17], TURN, f"c{i}") for i in range(3)]
    engine.add_request([5, 9, 2], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), "decoder")
    while len(engine.scheduler.parked) < len(rids):
        engine.step()
    return conv, rids


def _drain_and_end(engine: Engine, conv: Conversations, kept_rids: list[str]) -> tuple[dict, object]:
    """Step to the end; (each kept conversation's tokens, the block manager) after every conversation ended."""
    while engine.has_unfinished_requests():
        engine.step()
    kept = {r: engine.scheduler.parked[r].seqs[0].token_ids for r in kept_rids}
    for r in list(engine.scheduler.parked):
        conv.end(r)
    return kept, engine.block_manager


def _assert_abort_changes_nothing_else(run) -> None:
    ref, _ = run(False)
    got, bm = run(True)
    assert got == ref
    assert all(b.ref_count == 0 for b in bm.blocks), "a block is still held after every conversation ended"


@pytest.mark.parametrize("async_mode", [False, True])
def test_a_conversation_aborted_mid_reply_frees_its_blocks_and_the_others_go_on(hf, async_mode):
    """max_num_seqs = max_num_rows = 4 makes the replies drip a row per step; aborting one halfway through its
    reply (rows of it in flight in async mode) frees its blocks, and the other conversations end as they do
    without it."""
    def run(abort: bool):
        engine = _engine(hf, 64, max_num_seqs=4, max_num_rows=4, async_mode=async_mode)
        conv, rids = _first_turns(engine)
        for i, rid in enumerate(rids):
            while not conv.resume(rid, [t + i for t in REPLY], TURN, 3):
                engine.step()
        engine.step()
        engine.step()
        seq = engine.scheduler.requests["c0"].seqs[0]
        assert 0 < seq.num_tokens - seq.num_computed_tokens < len(REPLY)  # halfway through its reply
        if abort:
            conv.abort("c0")
        return _drain_and_end(engine, conv, rids[1:])

    _assert_abort_changes_nothing_else(run)


@pytest.mark.parametrize("async_mode", [False, True])
def test_a_conversation_aborted_with_its_burst_of_rows_in_flight_frees_its_blocks(hf, async_mode):
    """max_num_rows above max_num_seqs: a reply's rows go in one step beside the full batch; aborting the
    conversation right after that step is planned (its rows in flight in async mode) frees its blocks, and the
    other conversations end as they do without it."""
    def run(abort: bool):
        engine = _engine(hf, 64, max_num_seqs=4, max_num_rows=68, async_mode=async_mode)
        plans = _watch(engine)
        conv, rids = _first_turns(engine)
        c0 = engine.scheduler.parked["c0"].seqs[0].seq_id
        while not conv.resume("c0", REPLY, TURN, 3):
            engine.step()
        plans.clear()
        while not any(len([s for s in p.seqs if s.seq_id == c0]) > 1 for p in plans):
            engine.step()  # until the step holding c0's burst of rows is planned
        if abort:
            conv.abort("c0")
        for i, rid in enumerate(rids[1:], 1):
            while not conv.resume(rid, [t + i for t in REPLY], TURN, 3):
                engine.step()
        return _drain_and_end(engine, conv, rids[1:])

    _assert_abort_changes_nothing_else(run)
