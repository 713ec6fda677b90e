"""Megatron's peak within a step, predict-only: the recompute knobs' validation, what the
faithful ledger's peak is made of (ledger/faithful/megatron/peak.py), the textbook formulas, the
acceptance command's printout. The real runs that confirm the peak are tests/test_megatron.py's
matrix (every steady peak_bytes row within 1%, the recompute jobs' activations as predicted)."""
from __future__ import annotations


import pytest
from omegaconf import OmegaConf

from conf.schema import MegatronConfig
from ledger.faithful.megatron.rules import validate_recompute
from ledger import textbook as T
from ledger.faithful.megatron import states as L
from ledger.faithful.megatron import peak as P
from ledger.faithful.megatron import activations as A
from ledger.faithful.megatron import knobs as K
from ledger.layout import ConfigError
from ledger.model import preset
from ledger.placement import PEAK_PARTS
from tests.conftest import launch


# the Megatron framework config and layout the ledger tests build (one place: tests/test_megatron.py)
from tests.conftest import megatron_fw as _fw, megatron_layout as _lay  # noqa: E402


def _rc(**kw):
    return OmegaConf.merge(OmegaConf.structured(MegatronConfig), kw)


@pytest.mark.parametrize("kw, field", [
    (dict(recompute_granularity="partial"), "recompute_granularity"),
    (dict(recompute_method="uniform"), "recompute_method"),
    (dict(recompute_granularity="full", recompute_num_layers=1), "recompute_method"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "recompute_num_layers"),
    (dict(recompute_granularity="full", recompute_method="cyclic", recompute_num_layers=1), "recompute_method"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=0), "recompute_num_layers"),
    (dict(recompute_granularity="selective", recompute_num_layers=2), "recompute_num_layers"),
    (dict(recompute_granularity="selective", recompute_modules=["moe"]), "recompute_modules"),
    (dict(recompute_granularity="selective", recompute_modules=["attn"]), "recompute_modules"),
])
def test_recompute_knobs_are_validated_naming_the_field(kw, field):
    with pytest.raises(ConfigError, match=f"framework.{field}"):
        validate_recompute(_rc(**kw))


def test_recompute_knobs_megatron_accepts():
    for kw in (dict(), dict(recompute_granularity="selective"),
               dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
               dict(recompute_granularity="selective", recompute_method="uniform"),  # unused, as TransformerConfig
               dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
               dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)):
        validate_recompute(_rc(**kw))
    # and TransformerConfig itself takes them (the launcher passes them by these names)
    from megatron.core.transformer.transformer_config import TransformerConfig

    TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, recompute_granularity="full",
                      recompute_method="block", recompute_num_layers=1)


def test_the_ledger_refuses_recompute_modules_it_does_not_model():
    with pytest.raises(ConfigError, match="framework.recompute_modules"):
        L.place(preset("tiny"), _lay(), _fw(recompute_granularity="selective", recompute_modules=["mlp"]))


def test_peak_parts_sum_and_every_rank_has_one():
    m = preset("tiny", seq_len=128)
    for lay in (_lay(), _lay(tp=2, dp=1, sequence_parallel=True), _lay(pp=2, dp=1, global_batch_size=4),
                _lay(pp=2, vp=2, dp=1, global_batch_size=4)):
        pl = L.place(m, lay, _fw(overlap_grad_reduce=True, bucket_size=100_000))
        for r in range(pl.world):
            s = pl.rank_state(r)
            pk = s.peak
            assert set(pk.parts) == set(PEAK_PARTS) and sum(pk.parts.values()) == pk.bytes
            assert pk.parts["resident"] == s.resident_bytes and pk.bytes > s.resident_bytes
            assert pk.phase in ("forward", "backward", "optimizer")


def _stage0_act(m, lay, **fw):
    """The saved activations at stage 0's heaviest backward moment (its peak may be the optimizer's)."""
    k = K.knobs(_fw(**fw))
    from ledger.faithful.megatron.pipeline import padded_shape

    ms = P.stage_moments(padded_shape(m, lay.tp, 128), lay, k, 0, 0)
    return max((x for x in ms if x[2] == "backward"), key=lambda x: x[0])[1]["activations"]


def test_recompute_reduces_the_activations_as_megatron_does():
    """Selective core_attn drops the s^2 probabilities of every layer but the one being recomputed;
    full uniform recompute keeps one [s, b, h] per checkpointed chunk (recompute.py) and the recomputed
    chunk's layers."""
    m = preset("llama3_1b", seq_len=1024)
    lay = _lay(tp=2, pp=2, dp=1, sequence_parallel=True, global_batch_size=4)
    none = _stage0_act(m, lay)
    sel = _stage0_act(m, lay, recompute_granularity="selective")
    full = _stage0_act(m, lay, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert none > sel > full
    sh = A.shape_of(m, lay, K.knobs(_fw()))
    per_layer = sum(A.layer_groups(sh, A.Recompute()).values())
    # full: each in-flight micro-batch keeps one sequence-sharded [s, b, h] input per layer
    assert full < 2 * 8 * 2 * sh.sbh_n + 2 * per_layer
    # block with every layer checkpointed equals uniform with chunks of one layer
    blk = _stage0_act(m, lay, recompute_granularity="full", recompute_method="block", recompute_num_layers=8)
    assert blk == full


def test_transformer_engine_saves_no_s2_probabilities():
    m = preset("llama3_1b", seq_len=8192)
    lay = _lay(tp=2, pp=2, dp=2, sequence_parallel=True, global_batch_size=16)
    local = L.place(m, lay, _fw()).rank_state(0).peak
    te = L.place(m, lay, _fw(transformer_impl="transformer_engine")).rank_state(0).peak
    sh = A.shape_of(m, lay, K.knobs(_fw()))
    s2 = (4 + 2) * sh.b * sh.a * sh.s ** 2  # fp32 softmax + its bf16 copy, one layer
    assert local.parts["activations"] - te.parts["activations"] > 8 * s2  # 8 layers of stage 0, 2 micro-batches


def test_schedule_in_flight_micro_batches():
    # 1F1B: stage k holds pp - k - 1 warm-up forwards
    assert P.schedule(4, 1, 0, 8)[0] == 3 and P.schedule(4, 1, 3, 8)[0] == 0 and P.schedule(1, 1, 0, 8)[0] == 0
    # interleaved: (pp - k - 1) * 2 + (vp - 1) * pp, at most m * vp; chunks in groups of pp
    w, fwd, bwd = P.schedule(2, 2, 0, 4)
    assert w == 4 and fwd == [0, 0, 1, 1, 0, 0, 1, 1] and bwd == [1, 1, 0, 0, 1, 1, 0, 0]
    assert P.schedule(2, 2, 0, 2)[0] == 4


def test_textbook_korthikanti_formulas():
    s, b, h, a = 2048, 1, 4096, 32
    sbh = s * b * h
    assert T.layer_activation_bytes(s, b, h, a) == sbh * 34 + 5 * a * s * s * b
    assert T.layer_activation_bytes(s, b, h, a, t=8) == 10 * sbh + (24 * sbh + 5 * a * s * s * b) // 8
    assert T.layer_activation_bytes(s, b, h, a, t=8, sp=True) == (34 * sbh + 5 * a * s * s * b) // 8
    assert T.layer_activation_bytes(s, b, h, a, t=8, recompute="selective") == 10 * sbh + 24 * sbh // 8
    assert T.layer_activation_bytes(s, b, h, a, t=8, sp=True, recompute="selective") == 34 * sbh // 8
    assert T.layer_activation_bytes(s, b, h, a, t=8, sp=True, recompute="full") == 2 * sbh // 8
    # the paper's first stage in 1F1B holds p micro-batches of L/p layers: L layers' worth
    m = preset("llama3_1b", seq_len=2048)
    lay = _lay(tp=2, pp=4, dp=1, sequence_parallel=True, global_batch_size=8)
    per = T.layer_activation_bytes(2048, 1, m.hidden, m.heads, 2, True)
    assert T.activation_bytes(m, lay) == per * m.layers


def test_textbook_and_faithful_side_by_side():
    """Both modes predict a peak for the same job; the textbook's has no temporaries and counts the
    s^2 term for the whole first stage, the faithful one follows the spec."""
    from ledger.parallel import predict

    m = preset("llama3_1b", seq_len=8192)
    lay = _lay(tp=2, pp=2, dp=2, sequence_parallel=True, global_batch_size=16)
    tb = predict(m, lay, _fw(recompute_granularity=None), "textbook").rank_state(0).peak
    fa = L.place(m, lay, _fw(transformer_impl="transformer_engine")).rank_state(0).peak
    assert tb.parts["activations"] > 0 and fa.parts["activations"] > 0 and tb.parts.get("temporary", 0) == 0
    full = predict(m, lay, _fw(recompute_granularity="full"), "textbook").rank_state(0).peak
    assert full.parts["activations"] < tb.parts["activations"] / 10


def test_acceptance_command_prints_the_peak_per_stage():
    base = ("mode=predict", "model=llama3_1b", "model.seq_len=8192", "framework=megatron", "layout.tp=2",
            "layout.pp=2", "layout.dp=2", "layout.sequence_parallel=true", "layout.global_batch_size=16")
    p = launch(*base, "hydra.run.dir=/tmp/train-ledger-test-peak-accept", check=True)
    out = p.stdout
    assert "peak within a step per stage" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("│     0 │") or ln.startswith("│     1 │")]
    assert len([r for r in rows if "backward" in r or "forward" in r or "optimizer" in r]) >= 2, out
    # with full recompute the activation part drops (the same layouts, predicted in-process)
    m = preset("llama3_1b", seq_len=8192)
    lay = _lay(tp=2, pp=2, dp=2, sequence_parallel=True, global_batch_size=16)
    te = dict(transformer_impl="transformer_engine")
    # stage 0: the layers' activations of 2 micro-batches in flight; stage 1 keeps the fp32 logits
    # (cross-entropy, [s, b, vocab/tp]) whatever the recompute
    for stage_rank, factor in ((0, 4), (4, 2)):
        none = L.place(m, lay, _fw(**te)).rank_state(stage_rank).peak
        full = L.place(m, lay, _fw(**te, recompute_granularity="full", recompute_method="uniform",
                                   recompute_num_layers=1)).rank_state(stage_rank).peak
        assert full.parts["activations"] < none.parts["activations"] / factor, (none.parts, full.parts)


@pytest.mark.parametrize("model,lay,fw", [
    (preset("tiny"), dict(tp=1, pp=1, dp=2, global_batch_size=8), {}),
    (preset("tiny"), dict(tp=2, pp=2, dp=1, sequence_parallel=True, global_batch_size=8), {}),
    (preset("tiny"), dict(tp=1, pp=2, dp=1, vp=2, global_batch_size=8), {}),
    (preset("tiny", layers=8), dict(tp=1, pp=4, dp=1, vp=2, global_batch_size=12), {"recompute_granularity": "selective"}),
    (preset("llama3_1b", seq_len=1024), dict(tp=2, pp=2, dp=1, global_batch_size=6),
     {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}),
    (preset("llama3_1b", seq_len=1024), dict(tp=1, pp=4, dp=1, global_batch_size=3),
     {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}),
    # where a forward's softmax cast is the peak (softmax_forward): pp1, 1F1B, the article's run
    (preset("tiny", seq_len=512), dict(tp=2, pp=1, dp=1, sequence_parallel=True, global_batch_size=2), {}),
    (preset("tiny", seq_len=512), dict(tp=1, pp=2, dp=1, global_batch_size=4), {}),
    (preset("tiny", seq_len=512), dict(tp=1, pp=2, dp=1, vp=2, global_batch_size=4), {}),  # interleaved
    (preset("tiny", seq_len=512, layers=8), dict(tp=1, pp=4, dp=1, vp=2, global_batch_size=8), {}),
    (preset("llama3_1b", seq_len=8192), dict(tp=2, pp=2, dp=2, sequence_parallel=True, global_batch_size=16), {}),
    # full recompute: a recomputed layer's softmax cast in backward (the article's run), a forward's
    # softmax cast beside a checkpointed layer 0 (block)
    (preset("llama3_1b", seq_len=8192), dict(tp=2, pp=2, dp=2, sequence_parallel=True, global_batch_size=16),
     {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
    (preset("tiny", seq_len=512), dict(tp=1, pp=2, dp=1, global_batch_size=4),
     {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}),
])
def test_fast_step_moments_keep_the_references_peak(model, lay, fw):
    """_step_moments_fast (the planner's path) against _step_moments, the readable reference: the same
    largest moment (bytes, parts, phase, what), first in order as max() takes it, on every stage, and the
    same largest backward moment."""
    from ledger.faithful.megatron.pipeline import padded_shape

    lay = _lay(**lay)
    k = K.knobs(_fw(**fw))
    m = padded_shape(model, lay.tp, 128)
    for st in range(lay.pp):
        ref, fast = P._step_moments(m, lay, k, st), P._step_moments_fast(m, lay, k, st)
        assert ref[-1] == fast[-1]
        assert max(ref[:-1], key=lambda x: x[0]) == max(fast[:-1], key=lambda x: x[0])
        bw = [x for x in ref[:-1] if x[2] == "backward"]
        assert max(bw, key=lambda x: x[0]) == max((x for x in fast[:-1] if x[2] == "backward"), key=lambda x: x[0])
        fw_ref = [x for x in ref[:-1] if x[2] == "forward"]
        fw_fast = [x for x in fast[:-1] if x[2] == "forward"]
        assert (max(fw_ref, key=lambda x: x[0]) if fw_ref else None) == (
            max(fw_fast, key=lambda x: x[0]) if fw_fast else None)


def test_te_spec_norms_save_what_layernorm_linear_saves():
    """TransformerEngine's LayerNormLinear (linear_qkv, linear_fc1 with their norms fused) saves the
    norm's input, its normalised output (the GEMM's input) and rsigma (fp32, a token); its fused
    rmsnorm_bwd has none of torch's fp32 intermediates. The local spec's torch RMSNorm saves its fp32
    copies (measured on every CPU run): the two specs differ by exactly that in each norm."""
    from ledger.faithful.megatron.activations import Shape, _layer_moments, layer_groups

    for sp in (False, True):
        local = Shape(512, 2, 256, 256, 64, 704, 8, 1000, 32, 2, sp, 2, False)
        te = local._replace(te=True)
        n = local.sbh_n
        g_local, g_te = layer_groups(local, P.recompute_of(K.knobs(_fw()))), layer_groups(te, P.recompute_of(K.knobs(_fw())))
        for norm in ("norm1", "norm2"):
            assert g_te[norm] == 2 * 2 * n + 4 * (n // 256)
            assert g_local[norm] - g_te[norm] == 4 * n + 4 * n + 2 * n - 2 * 2 * n
        gin = 2 * n
        te_moments = dict((name, tmp) for name, _live, tmp, _g in _layer_moments(te, P.recompute_of(K.knobs(_fw())))[1])
        local_moments = dict((name, tmp) for name, _live, tmp, _g in _layer_moments(local, P.recompute_of(K.knobs(_fw())))[1])
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            assert te_moments[name] == 2 * gin and local_moments[name] == 2 * gin + 16 * n


def test_te_attention_saves_k_and_v_at_kv_heads():
    """TransformerEngine's attention under GQA (from sources: TE's get_qkv_layout and FusedAttnFunc): k and
    v saved at kv heads, v as a contiguous copy of linear_qkv's view, the output and fp32 softmax
    statistics; the rotated q counted with RoPE. Llama-3-8B (32 heads, 8 kv, head 128), s 8192, tp 1."""
    m = preset("llama3_8b", seq_len=8192)
    sh = A.Shape(8192, 1, m.hidden, 32 * 128, 8 * 128, m.ffn_hidden, 32, m.vocab, 128, 1, False, 2, True)
    e, sb = 2, 8192
    assert A.layer_groups(sh, A.Recompute())["core"] == e * sb * 2 * 8 * 128 + e * sb * 32 * 128 + 4 * 32 * 8192
    # multi-head attention: k and v at every head, as the local spec's expanded ones
    mha = sh._replace(hkv=sh.hq)
    assert A.layer_groups(mha, A.Recompute())["core"] == e * sb * 3 * 32 * 128 + 4 * 32 * 8192
