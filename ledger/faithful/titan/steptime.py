"""How a torchtitan 0.3.0 step runs, for the step-time model (ledger/timing/step.py).

  schedule   no pipelining at pp = 1; with PP framework.pipeline_parallel_schedule (torch.distributed.
             pipelining's schedules, ledger/timing/pipeline.py simulates each order): 1F1B, GPipe (every
             forward, then every backward), Interleaved1F1B with vp stages a rank (Megatron's interleaved
             order where the micro-batches are a multiple of pp, else torch's own), LoopedBFS with vp stages a rank
             (stage by stage, breadth first); InterleavedZeroBubble in torch's own order
             (ScheduleInterleavedZeroBubble: schedules.RUNTIME_ORDERS), each backward split into its
             input-grad half I and its weight-grad half W (stage.py backward_one_chunk full_backward=False,
             backward_weight_one_chunk), W filling the bubble; ZBVZeroBubble and DualPipeV in torch's own
             orders (schedules.runtime_order; DualPipeV's overlapped forward-backward as its two actions one after
             the other, some of its backwards whole) over their V placement (a rank's chunks are stages r and
             2 pp - 1 - r: pipeline.virtual_stage)
  recompute  activation_checkpoint: full re-runs every block's forward in backward (a split backward's W once
             more per param group of the block: TimePolicy.weight_recomputes); selective
             (distributed/activation_checkpoint.py SelectiveAC) re-runs every op its save list does not
             keep: the save list holds the compute-intensive ops (aten.mm, FlexAttention) and the
             reduce-scatters, but its policy recomputes every second mm of a block's forward (the mm
             count restarts per block: wq 1, wk 2, wv 3, wo 4, w1 5, w3 6, w2 7), so wk, wo and w3 run
             again, with the norms, RoPE, SwiGLU's silu and product and the residual adds; on the CPU
             the harness's math attention is not saved either (SELECTIVE_RECOMPUTE); with fuse_qkv the
             count runs wqkv 1, wo 2, w1 3, w3 4, w2 5: wo and w3 run again, and the split's copies
             (SELECTIVE_RECOMPUTE_FUSED). The torchtitan of 2024 (the published runs') also had a per-layer
             selective option, selective_ac_option N: every N-th block fully checkpointed, the others
             not (parallelisms/parallelize_llama.py _apply_ac_to_transformer_block: a counter over the
             blocks from 1, `_count % ac_freq == 0`): timed as full recompute of those blocks
             (TimePolicy.recompute_every); 0.3.0 has no such option and its ledger refuses it (rules.py)
  attention  models/llama3 model_registry: attn_backend "flex", FlexAttention's compiled kernel on
             CUDA (the causal block mask skips the masked blocks); on the CPU the math kernel computes
             the whole [s, s] scores
  kernels    the model's own eager ops (models/common/): wq wk wv (or, with framework.fuse_qkv, one wqkv
             whose output FusedQKVLinear splits into contiguous q, k, v copies) and w1 w3 separate linears; GQA by
             enable_gqa (no K / V copy); RoPE in complex fp32 (rope.py apply_rotary_emb: query.float(),
             view_as_complex, the product with the cache, view_as_real, type_as: a bf16 read and fp32
             write, an fp32 read and write, an fp32 read and bf16 write, 20 bytes an element each way);
             SwiGLU as F.silu(w1(x)) * w3(x) (feed_forward.py: silu reads and writes 4 bytes, the product
             reads 4 and writes 2; backward: the product's two grads read 6 and write 4, silu's reads 4
             and writes 2); the norms nn.RMSNorm, one fused kernel on CUDA (target.py fused_rms_norm)
  DP         FSDP2 (_fsdp_param_group.py): each unit's all-gather is prefetched under the previous
             unit's compute, each unit's reduce-scatter runs behind the next unit's backward: both
             hidden by the passes' compute as far as it lasts. Around them, on the compute stream
             (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): every all-gather's copy-out
             (foreach_all_gather_copy_out: split_with_sizes_copy reads the gathered buffer and writes
             each parameter's unsharded tensor, 2 bytes moved per byte of the buffer) and every
             reduce-scatter's copy-in (foreach_reduce_scatter_copy_in: chunk_cat reads the unsharded
             grads in the param dtype and writes the buffer in the reduce dtype: 1 + 2 / 4 bytes per
             byte of an fp32 buffer from bf16 grads); HSDP's all-reduce runs in place on the output.
             The edges (distributed/fsdp.py apply_fsdp_to_decoder: tok_embeddings a unit of its own, or
             with the norm and lm_head where tied; each block one; [norm, lm_head] one, not resharded
             after forward; the root none): a micro-batch's forward starts with tok_embeddings' all-gather
             and then block 0's, with only the embedding's lookup between, and its backward ends with
             block 0's reduce-scatter and then tok_embeddings', with only the embedding's backward
             between, and FSDP2's finalize_backward makes the compute stream wait for the last one
             (_fsdp_state.py _root_post_backward_final_callback): exposed (TimePolicy.dp_edge_units;
             without PP, where every micro-batch gathers and reduces: under PP not modelled). The tied unit's
             norm (hidden parameters) is left out of the edge. HSDP's replicate all-reduce of those units
             is not counted at the edge; with EP (a block's experts on a mesh of their own) no edge is modelled
  optimizer  torch AdamW over the fp32 shards (exp_avg and exp_avg_sq: 8 bytes of state an element;
             foreach on CUDA): reads param, grad, exp_avg, exp_avg_sq and writes three, 28 bytes
"""
from __future__ import annotations

from dataclasses import replace

from ledger.dtypes import nbytes
from ledger.faithful.titan.fsdp import fuses_qkv
from ledger.faithful.titan.schedules import RUNTIME_ORDERS, block_param_groups, interleaved_order, schedule_of
from ledger.timing.ops import EAGER_FP32_RMSNORM_BYTES
from ledger.timing.step import TimePolicy

# SelectiveAC's recompute of a block (module docstring): every forward op but the kept mms (wq, wv, w1,
# w2: ops.layer_forward's q, v, w1, fc2) and the attention
SELECTIVE_RECOMPUTE = ("attention_norm", "k", "rope", "proj", "residual_add", "ffn_norm", "w3", "swiglu")
# the same with fuse_qkv: the kept mms are wqkv, w1 and w2 (ops.layer_forward's qkv, w1, fc2)
SELECTIVE_RECOMPUTE_FUSED = ("attention_norm", "qkv_split", "rope", "proj", "residual_add", "ffn_norm", "w3",
                             "swiglu")
# the pipeline order each schedule the ledger models runs (module docstring; ledger/timing/pipeline.py)
PIPELINE_ORDER = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved", "LoopedBFS": "looped_bfs",
                  "InterleavedZeroBubble": "interleaved",  # (its own order, split backwards: time_policy)
                  "ZBVZeroBubble": "v", "DualPipeV": "v"}  # (their own orders over a V placement: time_policy)
# FSDP2's units at a micro-batch's edges (module docstring): gathered first, reduced last
EDGE_UNITS = (("embedding", "layer"), ("layer", "embedding"))
# the torchtitan of 2024's (time_policy_2024): its root unit held tok_embeddings, norm and output
EDGE_UNITS_2024 = (("embedding", "head", "layer"), ("layer", "embedding", "head"))
# the eager kernels' bytes per element (forward, backward), module docstring
KERNEL_BYTES = (("rope", (20, 20)), ("swiglu", (10, 16)))


def time_policy(fw, lay, device: str) -> TimePolicy:
    ac = getattr(fw, "activation_checkpoint", "none") or "none"
    sched = schedule_of(fw)
    cuda = device == "cuda"
    fused = fuses_qkv(fw)
    option = str(getattr(fw, "selective_ac_option", "op"))
    every = int(option) if ac == "selective" and option.isdigit() else 1  # the per-layer option (docstring)
    if every > 1:
        recompute, what = "full", f" (one block in {every} fully checkpointed: the per-layer option)"
    else:
        recompute = ac
        what = ((" (SelectiveAC re-runs wo, w3 and the memory-bound ops)" if fused else
                 " (SelectiveAC re-runs wk, wo, w3 and the memory-bound ops)") if ac == "selective" else "")
    # FSDP2's copy-out and copy-in per byte of the gathered / reduce-scattered buffer (module docstring)
    grad_per_reduce = (nbytes(getattr(fw, "mixed_precision_param", "bfloat16"))
                       / nbytes(getattr(fw, "mixed_precision_reduce", "float32")))
    schedule = "none" if lay.pp == 1 else PIPELINE_ORDER[sched]
    # torch's Interleaved1F1B is Megatron's interleaved order where the micro-batches are a multiple of pp
    # (tests/test_timing.py compares them); otherwise its own flexible rounds
    # the zero-bubble schedules and DualPipeV: torch's own order, backwards split (module docstring); the V ones
    # over their V placement
    split = sched in RUNTIME_ORDERS and lay.pp > 1
    own = (RUNTIME_ORDERS[sched] if split else
           interleaved_order if schedule == "interleaved" and lay.num_microbatches % lay.pp else None)
    # a split backward under full AC: its W re-runs each block's forward once a param group (torch's
    # stage_backward_weight, one autograd.grad a group; torch/utils/checkpoint.py, a recompute per graph task, the
    # whole forward: torchtitan's early_stop=False), beside its I's recompute (measured: the TP collectives of those
    # recomputes, tests/test_titan.py)
    w_recomputes = block_param_groups(fused) if split and recompute == "full" else 0
    return TimePolicy(schedule=schedule, pipeline_order=own, split_backward=split, recompute=recompute,
                      weight_recomputes=w_recomputes,
                      recompute_every=every,
                      causal_kernel=cuda,
                      attention_kernel="flex" if cuda else "math",
                      recompute_ops=(SELECTIVE_RECOMPUTE_FUSED if fused else SELECTIVE_RECOMPUTE)
                      + (() if cuda else ("attention",)),
                      split_projections=True, fused_qkv=fused, kernel_bytes=KERNEL_BYTES,
                      dp_grad="every_pass", dp_param="every_pass",
                      dp_copy_bytes=(("all_gather", 2.0), ("reduce_scatter", 1.0 + grad_per_reduce)),
                      dp_edge_units=EDGE_UNITS if lay.pp == 1 and getattr(lay, "ep", 1) == 1 else ((), ()),
                      optimizer_state_bytes=8,
                      optimizer_traffic_bytes=28,
                      sources=(f"titan time policy: FSDP2 prefetch and reduce-scatter behind the passes' compute, "
                               f"activation_checkpoint={ac}" + what
                               + (", q / k / v fused (one wqkv GEMM, its output split into copies)" if fused else "")
                               + f", attention {'FlexAttention (CUDA)' if cuda else 'math (CPU)'}, eager complex RoPE "
                               "and SwiGLU (ledger/faithful/titan/steptime.py)"
                               + _pipeline_note(sched, lay.pp),))


def _pipeline_note(sched: str, pp: int) -> str:
    """The sources line's word on the pipeline order the step was simulated in (module docstring)."""
    if pp == 1:
        return ""
    if sched == "InterleavedZeroBubble":
        return ("; InterleavedZeroBubble's order simulated, each backward as its input-grad half and its weight-grad "
                "GEMMs apart")
    if PIPELINE_ORDER[sched] == "v":
        return (f"; {sched}'s order simulated over its V (a rank's chunks are stages r and 2 pp - 1 - r), its split "
                "backwards as input-grad half and weight-grad GEMMs apart")
    return f"; {sched}'s order simulated"


def time_policy_2024(fw, lay, device: str, norm_type: str) -> TimePolicy:
    """The step of the torchtitan of 2024 that the published runs ran (commits 157a12c56 of April and
    9dec370 of December 2024: torchtitan/models/llama/model.py, torchtitan/models/norms.py), where its
    model differs from 0.3.0's: Attention.forward repeats GQA's K and V to the query heads (repeat_kv: a
    copy) and calls F.scaled_dot_product_attention(is_causal=True), whose flash kernel is
    FlashAttention-2's on CUDA; build_norm(norm_type) runs "rmsnorm" as the eager fp32 chain (its RMSNorm:
    x.float(), x * rsqrt(pow(2).mean + eps), type_as, the weight) and "fused_rmsnorm" as one Triton
    kernel. Its wq / wk / wv are three linears (framework.fuse_qkv=false); its per-layer option is
    selective_ac_option N; its per-op policy's save list kept the mms and SDPA's flash attention, so the
    repeat's copies are recomputed with the other memory-bound ops."""
    if norm_type not in ("rmsnorm", "fused_rmsnorm"):
        raise ValueError(f"norm_type {norm_type!r}: the published runs' torchtitan ran rmsnorm or fused_rmsnorm")
    base = time_policy(fw, lay, device)
    cuda = device == "cuda"
    norm = (("norm", EAGER_FP32_RMSNORM_BYTES),) if norm_type == "rmsnorm" else ()
    return replace(base, attention_kernel="flash2" if cuda else base.attention_kernel, repeat_kv=True,
                   dp_edge_units=EDGE_UNITS_2024 if base.dp_edge_units[0] else base.dp_edge_units,
                   recompute_ops=base.recompute_ops + ("kv_repeat",),
                   kernel_bytes=base.kernel_bytes + norm,
                   sources=(base.sources[0] + "; the torchtitan of 2024: "
                            + ("SDPA's flash kernel in FlexAttention's place, " if cuda else "")
                            + f"repeat_kv, norm_type {norm_type}",))
