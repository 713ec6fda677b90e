"""Megatron context parallelism with TransformerEngine's p2p attention, from sources
(ledger/faithful/megatron/cp.py): no CPU run can confirm it (TE needs CUDA), so these tests check the
prediction against the rules it states, and that every output says "from sources"."""
from __future__ import annotations

import dataclasses

import pytest

from ledger.errors import ConfigError
from ledger.faithful.megatron import cp as CP
from ledger.faithful.megatron import states as L
from ledger.model import preset
from tests.conftest import megatron_fw, megatron_layout

TE = "transformer_engine"


def _pair(model, **lay):
    """The CP placement and the flat one it stands on (dp x cp ranks, s / cp tokens)."""
    lay = megatron_layout(**lay)
    m_flat, lay_flat = CP.flat(model, lay)
    fw = megatron_fw(transformer_impl=TE)
    return L.place(model, lay, fw, "cuda-nccl"), L.place(m_flat, lay_flat, fw, "cuda-nccl"), lay


def test_states_are_the_dp_x_cp_layouts_and_the_ring_is_added():
    """Every rank's states and peak are the flat layout's (the weights are not sharded by CP; the grads and
    the distributed optimizer over dp x cp); its collectives the flat ones with the dp group relabelled
    cp-dp, plus TE's ring: 3 (cp - 1) K/V exchanges per layer and micro-batch, an isend and an irecv each."""
    m = dataclasses.replace(preset("llama3_1b"), seq_len=4096)
    pl, flat, lay = _pair(m, tp=2, pp=2, dp=2, cp=2, sequence_parallel=True, global_batch_size=8)
    assert pl.world == flat.world == 16 and lay.num_microbatches == 4
    for r in range(pl.world):
        a, b = pl.rank_state(r), flat.rank_state(r)
        assert (a.params_bytes, a.grads_bytes, a.optim_bytes, a.other_bytes, a.stage) == \
            (b.params_bytes, b.grads_bytes, b.optim_bytes, b.other_bytes, b.stage)
        assert a.peak.bytes == b.peak.bytes
        ring = [c for c in a.comm if c.dim == "cp"]
        layers = m.layers // lay.pp
        kv = 2 * (m.seq_len // 2) * 1 * (m.kv_heads // 2) * m.head_dim * 2
        n = 3 * (2 - 1) * layers * lay.num_microbatches
        assert len(ring) == 1 and (ring[0].kind, ring[0].count, ring[0].buffer_bytes, ring[0].wire_bytes) == \
            ("send_recv", 2 * n, 2 * n * kv, n * kv)
        rest = {(c.dim, c.kind, c.dtype): (c.count, c.buffer_bytes) for c in a.comm if c.dim != "cp"}
        want = {(c.dim.replace("dp", "cp-dp") if c.dim.split("-").count("dp") else c.dim, c.kind, c.dtype):
                (c.count, c.buffer_bytes) for c in b.comm}
        assert rest == want
    assert "cp-dp" in {c.dim for c in pl.rank_state(0).comm}


def test_a_cp_prediction_says_from_sources_everywhere(tmp_path):
    import json

    from tests.conftest import launch

    p = launch("mode=predict", "model=llama3_1b", "framework=megatron", "layout.cp=2", "layout.dp=2",
               f"hydra.run.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    pred = json.load(open(tmp_path / "prediction.json"))
    assert pred["basis"] == CP.CP_BASIS and pred["layout"]["cp"] == 2 and "from sources)" in p.stdout
    assert pred["model"]["seq_len"] == 8192  # llama3_1b's, as configured, not the per-rank slice


def test_the_planner_rows_of_cp_layouts_say_from_sources():
    from ledger.plan import Hardware, Space, search

    m = preset("llama3_1b")
    hw = Hardware(8, 8, int(80e9), 0.9, 989.0, 0.4, 3600.0, 400.0, target="cuda-nccl")
    from omegaconf import OmegaConf

    from conf.schema import MegatronConfig

    base = OmegaConf.to_container(OmegaConf.structured(MegatronConfig))
    plan = search(m, hw, Space(16, (1,), (1,), 2, (1,), (False,), False), {"megatron": base})
    cp_rows = [r for r in plan.rows if r.status != "refused" and r.layout["cp"] > 1]
    assert cp_rows and all(r.basis == CP.CP_BASIS and r.to_dict()["basis"] == CP.CP_BASIS for r in cp_rows)
    assert all(not r.basis for r in plan.rows if r.status != "refused" and r.layout["cp"] == 1)


@pytest.mark.parametrize("impl,seq,why", [("local", 2048, "only supported by TEDotProductAttention"),
                                          (TE, 2050, "must be divisible by 2 x cp = 4")])
def test_what_megatron_refuses_with_cp(impl, seq, why):
    m = dataclasses.replace(preset("llama3_1b"), seq_len=seq)
    with pytest.raises(ConfigError, match=why):
        L.place(m, megatron_layout(dp=2, cp=2), megatron_fw(transformer_impl=impl), "cuda-nccl")


def _cp_rows(fw_kw, **lay_kw):
    """The cp-dim collectives of every rank of a llama3_1b CP layout (seq 4096) with the comm type's knobs,
    beside the layout and its flat twin's collectives."""
    m = dataclasses.replace(preset("llama3_1b"), seq_len=4096)
    lay = megatron_layout(**lay_kw)
    fw = megatron_fw(transformer_impl=TE, **fw_kw)
    pl = L.place(m, lay, fw, "cuda-nccl")
    return m, lay, pl


def test_all_gather_cp_gathers_k_and_v_twice_and_reduce_scatters_their_grads():
    """TE's all_gather attention: per layer and micro-batch K and V all-gathered in forward and again in
    backward (the gathered K/V are not saved), dK and dV reduce-scattered: each of cp x the local
    [s/cp, b, kv_heads/tp, head_dim] bf16."""
    m, lay, pl = _cp_rows({"cp_comm_type": "all_gather"}, tp=2, pp=2, dp=1, cp=4, sequence_parallel=True,
                          global_batch_size=4)
    local = (m.seq_len // 4) * 1 * (m.kv_heads // 2) * m.head_dim * 2
    n = (m.layers // 2) * lay.num_microbatches
    rows = {c.kind: c for c in pl.rank_state(0).comm if c.dim == "cp"}
    assert set(rows) == {"all_gather", "reduce_scatter"}
    assert (rows["all_gather"].count, rows["all_gather"].buffer_bytes, rows["all_gather"].wire_bytes) == \
        (4 * n, 4 * n * 4 * local, 4 * n * 3 * local)
    assert (rows["reduce_scatter"].count, rows["reduce_scatter"].buffer_bytes, rows["reduce_scatter"].wire_bytes) == \
        (2 * n, 2 * n * 4 * local, 2 * n * 3 * local)
    assert "all_gather context parallelism" in pl.basis and "from sources" in pl.basis


def test_a2a_cp_moves_q_k_v_o_and_their_grads_once_each():
    """TE's a2a (Ulysses) attention: 8 all_to_all_single calls per layer and micro-batch, Q, O, dO, dQ of
    the local [s/cp, b, heads/tp, head_dim] and K, V, dK, dV of kv_heads/tp; each rank keeps 1/cp of
    what it sends."""
    m, lay, pl = _cp_rows({"cp_comm_type": "a2a"}, tp=1, pp=1, dp=2, cp=4, global_batch_size=4)
    q = (m.seq_len // 4) * 1 * m.heads * m.head_dim * 2
    kv = (m.seq_len // 4) * 1 * m.kv_heads * m.head_dim * 2
    n = m.layers * lay.num_microbatches
    (row,) = [c for c in pl.rank_state(0).comm if c.dim == "cp"]
    assert (row.kind, row.count, row.buffer_bytes, row.wire_bytes) == \
        ("all_to_all", 8 * n, n * (4 * q + 4 * kv), n * (4 * q + 4 * kv) * 3 // 4)
    # the states are the flat layout's, whatever the attention
    p2p = L.place(m, lay, megatron_fw(transformer_impl=TE), "cuda-nccl")
    assert pl.rank_state(0).params_bytes == p2p.rank_state(0).params_bytes
    assert pl.rank_state(0).optim_bytes == p2p.rank_state(0).optim_bytes


def test_a2a_p2p_runs_the_all_to_alls_inside_its_groups_and_the_ring_over_the_rest():
    """a2a+p2p with hierarchical sizes [2, 2] of cp 4: the 8 all-to-alls over 2 ranks, then the ring over 2
    on heads / 2 of s / 2 tokens: 3 (2 - 1) K/V exchanges per layer and micro-batch; [1, 4] is TE's p2p
    and [4, 1] its a2a (attn_forward_func_with_cp collapses them)."""
    m, lay, pl = _cp_rows({"cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 2]},
                          dp=1, cp=4, global_batch_size=2)
    q = (m.seq_len // 4) * m.heads * m.head_dim * 2
    kv = (m.seq_len // 4) * m.kv_heads * m.head_dim * 2
    n = m.layers * lay.num_microbatches
    rows = {c.kind: c for c in pl.rank_state(0).comm if c.dim == "cp"}
    assert (rows["all_to_all"].count, rows["all_to_all"].wire_bytes) == (8 * n, n * (4 * q + 4 * kv) // 2)
    ring_kv = 2 * (m.seq_len // 2) * (m.kv_heads // 2) * m.head_dim * 2
    assert (rows["send_recv"].count, rows["send_recv"].wire_bytes) == (2 * 3 * n, 3 * n * ring_kv)
    for sizes, same in (([1, 4], "p2p"), ([4, 1], "a2a")):
        _, _, hier = _cp_rows({"cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": sizes},
                              dp=1, cp=4, global_batch_size=2)
        _, _, plain = _cp_rows({"cp_comm_type": same}, dp=1, cp=4, global_batch_size=2)
        assert hier.rank_state(0).comm == plain.rank_state(0).comm and hier.basis == plain.basis


@pytest.mark.parametrize("kw,lay_kw,why", [
    ({"cp_comm_type": "a2a+p2p"}, {}, "needs framework.hierarchical_context_parallel_sizes"),
    ({"cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 4]}, {}, "a2a x p2p = cp=4"),
    ({"cp_comm_type": "p2p", "hierarchical_context_parallel_sizes": [2, 3]}, {}, "must multiply to cp=4"),
    ({"cp_comm_type": "a2a"}, {"tp": 8, "dp": 1, "cp": 4}, "kv_heads=8 / tp=8 must be divisible by the a2a size 4"),
])
def test_what_te_refuses_of_the_cp_comm_types(kw, lay_kw, why):
    m = dataclasses.replace(preset("llama3_1b"), seq_len=4096)
    with pytest.raises(ConfigError, match=why.replace("(", r"\(").replace("[", r"\[")):
        L.place(m, megatron_layout(**{"dp": 2, "cp": 4, **lay_kw}), megatron_fw(transformer_impl=TE, **kw),
                "cuda-nccl")


def test_a_bad_cp_comm_type_is_refused_before_anything_runs(tmp_path):
    from tests.conftest import launch

    p = launch("mode=predict", "model=llama3_1b", "framework=megatron", "layout.cp=2", "layout.dp=2",
               "framework.cp_comm_type=ring", f"hydra.run.dir={tmp_path}", timeout=300)
    assert p.returncode != 0 and "framework.cp_comm_type='ring' must be one of p2p, all_gather, a2a, a2a+p2p" in \
        (p.stdout + p.stderr)
