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
