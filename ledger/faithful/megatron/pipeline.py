"""A Megatron Core 0.18.0 pipeline stage's parameters: the vocab Megatron pads (padded_vocab,
padded_shape), the split of the decoder layers over pipeline stages and their virtual-pipeline
chunks (split_error, stage_layers, stage_shape), and each model chunk's parameters per TP rank in
GPTModel.named_parameters() order (pieces, head, shared_embedding, stage_params; as numels: sizes).
It follows models/gpt/gpt_model.py, transformer/transformer_layer.py, transformer/attention.py,
transformer/mlp.py, transformer/transformer_config.py, transformer/transformer_block.py
get_num_layers_to_build and Megatron-LM's training/training.py get_model (paths under megatron/core/
unless said otherwise); ledger.faithful.megatron.buffers lays these parameters out in DDP buffers.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np

from ledger.model import ModelShape
from ledger.units import round_up


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    """The rows of the embedding and output layer that Megatron-LM builds for a vocab of `vocab`
    tokens: pretrain_gpt.py (gpt_builders.py) builds GPTModel with args.padded_vocab_size, which
    megatron/core/tokenizers/utils/build_tokenizer.py _set_padded_vocab_size sets (pad_vocab_size
    defaults True) to vocab_size_with_padding: the vocab rounded up to a multiple of
    make_vocab_size_divisible_by * tensor_model_parallel_size (NullTokenizer's vocab_size is
    --vocab-size itself). The padded rows are real parameters: every vocab-sized state counts them."""
    multiple = divisible_by * tp
    return round_up(vocab, multiple)


@lru_cache(maxsize=256)
def padded_shape(model: ModelShape, tp: int, divisible_by: int) -> ModelShape:
    """The shape Megatron trains: `model` with its vocab padded (padded_vocab); `model` itself when the
    vocab needs no padding. Cached: a search's layouts of one tp share one shape (and its cached hash)."""
    vocab = padded_vocab(model.vocab, tp, divisible_by)
    return model if vocab == model.vocab else dataclasses.replace(model, vocab=vocab)


@lru_cache(maxsize=256)
def pieces(model: ModelShape, tp: int) -> tuple[tuple, tuple, tuple]:
    """(embedding, one decoder layer, final norm + output) as (name, local numel) in
    GPTModel.named_parameters() order; layer names are suffixes of decoder.layers.<i>.

    models/gpt/gpt_model.py GPTModel.__init__: embedding (pre_process), decoder, output_layer
    (post_process, untied); transformer/transformer_layer.py registers input_layernorm,
    self_attention, pre_mlp_layernorm, mlp; transformer/attention.py: Attention.__init__ builds
    linear_proj before SelfAttention.__init__ builds linear_qkv; transformer/mlp.py: linear_fc1
    (2*ffn when gated) then linear_fc2. Column-parallel weights split dim 0, row-parallel dim 1;
    a row-parallel bias is not split (tensor_parallel/layers.py RowParallelLinear)."""
    h, hd = model.hidden, model.head_dim

    def norm(name):  # a LayerNorm is two tensors (weight, bias) of h each
        return [(f"{name}.weight", h), (f"{name}.bias", h)] if model.norm == "layernorm" else [(f"{name}.weight", h)]

    def hnorm(name):  # a per-head norm: head_dim elements per tensor
        return [(f"{name}.weight", hd), (f"{name}.bias", hd)] if model.norm == "layernorm" else [(f"{name}.weight", hd)]

    def lin(name, out_f, in_f, bias_len, bias=model.bias):
        return [(f"{name}.weight", out_f * in_f)] + ([(f"{name}.bias", bias_len)] if bias else [])

    qkv = (model.heads + 2 * model.kv_heads) * hd // tp
    fc1 = (2 if model.swiglu else 1) * model.ffn_hidden // tp
    # transformer/attention.py SelfAttention.__init__: q_layernorm and k_layernorm (over head_dim, not
    # split by tp) after linear_qkv (qk_layernorm)
    qk = (hnorm("self_attention.q_layernorm") + hnorm("self_attention.k_layernorm")) if model.qk_layernorm else []
    layer = (norm("input_layernorm") + lin("self_attention.linear_proj", h, model.heads * hd // tp, h)
             # transformer_config.py add_qkv_bias: linear_qkv's bias without the others' (add_bias_linear)
             + lin("self_attention.linear_qkv", qkv, h, qkv, model.bias or model.qkv_bias) + qk + norm("pre_mlp_layernorm")
             + lin("mlp.linear_fc1", fc1, h, fc1) + lin("mlp.linear_fc2", h, model.ffn_hidden // tp, h))
    emb = [("embedding.word_embeddings.weight", model.vocab // tp * h)]
    head = norm("decoder.final_layernorm") + [("output_layer.weight", model.vocab // tp * h)]
    return tuple(emb), tuple(layer), tuple(head)


# the pipeline split: (num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage,
# account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split) of TransformerConfig
# (Megatron-LM --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers,
# --account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split); None, None = even
EVEN_SPLIT = (None, None, False, False)


def split_error(layers: int, pp: int, vp: int, split: tuple = EVEN_SPLIT) -> str | None:
    """Megatron's own reason for refusing this split of `layers` over pp stages of vp chunks, None
    where it builds it: transformer/transformer_config.py TransformerConfig.__post_init__ (uneven PP,
    account_for_*), else transformer/transformer_block.py get_num_layers_to_build's asserts (an even
    split; Megatron-LM's training/arguments.py validate_args asserts the same divisibility)."""
    first, last, emb, loss = split
    v = vp if vp > 1 else None  # virtual_pipeline_model_parallel_size (None without interleaving)
    if (first is not None or last is not None) and (emb or loss):
        return ("num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage cannot be set at the "
                "same time with account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split")
    if first is not None or last is not None:
        n, stages = layers, pp
        for x, where in ((first, "first"), (last, "last")):
            if x is None:
                continue
            if x <= 0:
                return f"num_layers_in_{where}_pipeline_stage must be larger than 0"
            if v is not None and x % v:
                return (f"number of layers at {where} stage: {x} must be divisible by virtual pipeline parallel "
                        f"degree {v}")
            n, stages = n - x, stages - 1
        if bool(n) != bool(stages):
            return f"Mismatch: {n} middle layers remaining but {stages} middle PP stages available."
        if stages and n % stages:
            return (f"number of layers at middle stage: {n} must be divisible by the middle pipeline model "
                    f"parallel size {stages}")
        if stages and v is not None and (n // stages) % v:
            return (f"number of layers on each middle pipeline rank: {n // stages} must be divisible by virtual "
                    f"pipeline parallel degree {v}")
        return None
    n = layers + emb + loss
    if (emb or loss) and v is None and n % pp:
        return f"number of middle layers: {n} must be divisible by middle pipeline_model_parallel_size {pp}"
    if (emb or loss) and n % pp:
        return (f"num_layers: {n} after enable account_for_embedding_in_pipeline_split or "
                f"account_for_loss_in_pipeline_split must be divisible by pipeline_model_parallel_size {pp}")
    if (emb or loss) and v is not None and (n // pp) % v:
        return (f"number of layers on each pipeline rank: {n // pp} (after enable "
                "account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split) must be divisible "
                f"by virtual_pipeline_model_parallel_size {v}")
    if n % pp:
        return f"num_layers={n} should be divisible by config.pipeline_model_parallel_size={pp}"
    if v is not None and pp > 1 and (n // pp) % v:
        return f"num_layers_per_pipeline_rank {n // pp} should be divisible by vp_size {v}"
    return None  # (its "Not enough layers" asserts cannot fire then: each chunk's share is >= 1)


def stage_layers(layers: int, pp: int, vp: int, stage: int, chunk: int, split: tuple = EVEN_SPLIT) -> int:
    """Decoder layers model chunk `chunk` of stage `stage` builds: transformer/transformer_block.py
    get_num_layers_to_build (a valid split, split_error). Uneven PP: the first (last) stage builds
    num_layers_in_first (last)_pipeline_stage, the middle stages share the rest evenly; else the layers
    plus one for each of the embedding / the loss counted in the split (account_for_*) shared evenly,
    and the stage holding it builds one fewer. With vp > 1 each chunk a stage's layers / vp."""
    first, last, emb, loss = split
    if first is not None or last is not None:
        mid = layers - (first or 0) - (last or 0)
        stages = pp - (first is not None) - (last is not None)
        n = mid // stages if stages > 0 else 0
        if stage == 0 and first is not None:
            n = first
        if stage == pp - 1 and last is not None:
            n = last
    else:
        n = (layers + emb + loss) // pp
    if vp > 1 and pp > 1:
        n //= vp
    if emb and stage == 0 and chunk == 0:
        n -= 1
    if loss and stage == pp - 1 and chunk == vp - 1:
        n -= 1
    return n


def layer_range(model: ModelShape, pp: int, stage: int, split: tuple) -> range:
    """The global indexes of a stage's decoder layers (one chunk, vp = 1): an MoE model's pattern
    (moe_layer_freq) is over global layers."""
    first = sum(stage_layers(model.layers, pp, 1, s, 0, split) for s in range(stage))
    return range(first, first + stage_layers(model.layers, pp, 1, stage, 0, split))


def stage_shape(model: ModelShape, pp: int, stage: int, vp: int, chunk: int,
                split: tuple = EVEN_SPLIT) -> tuple[int, bool, bool]:
    """(layers, holds the embedding, holds the output) of one model chunk of one stage.

    training/training.py get_model: with vp > 1 each stage builds vp GPTModels, each of its share of
    the layers (stage_layers); pre_process (embedding) only on chunk 0 of stage 0, post_process
    (final norm, output layer) only on chunk vp-1 of the last stage (pipeline_parallel/utils.py
    is_vp_first_stage / is_vp_last_stage)."""
    return (stage_layers(model.layers, pp, vp, stage, chunk, split), stage == 0 and chunk == 0,
            stage == pp - 1 and chunk == vp - 1)


def head(model: ModelShape, tp: int, first: bool) -> tuple:
    """The final norm and output layer of the chunk holding post_process.

    Tied embeddings (share_embeddings_and_output_weights): models/gpt/gpt_model.py builds
    output_layer with skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
    so the chunk that also holds the embedding (pp=1) has no output_layer.weight (the output
    projection uses embedding.word_embeddings.weight); a last stage without the embedding
    (pp > 1) allocates its own copy (models/common/language_module/language_module.py
    setup_embeddings_and_output_layer: zeroed, then all-reduced with the first stage at init)."""
    head = pieces(model, tp)[2]
    return head[:-1] if model.tied_embeddings and first else head


def shared_embedding(model: ModelShape, pp: int, stage: int, vp: int, chunk: int) -> tuple[bool, bool]:
    """(the embedding weight, the output weight) of this chunk marked `shared_embedding`:
    language_module.py setup_embeddings_and_output_layer, tied embeddings with pp > 1 only (the
    first stage's word embeddings, the last stage's duplicated output weight)."""
    if not model.tied_embeddings or pp == 1:
        return False, False
    _, first, last = stage_shape(model, pp, stage, vp, chunk)
    return first, last


def stage_params(model: ModelShape, tp: int, pp: int, stage: int, vp: int = 1, chunk: int = 0,
                 split: tuple = EVEN_SPLIT) -> list[tuple[str, int]]:
    """(name, local numel) in GPTModel.named_parameters() order for one PP stage (model chunk `chunk`
    of vp with interleaving) and TP rank."""
    n, first, last = stage_shape(model, pp, stage, vp, chunk, split)
    emb, layer, _ = pieces(model, tp)
    out = list(emb) if first else []
    out += [(f"decoder.layers.{i}.{name}", k) for i in range(n) for name, k in layer]
    return out + (list(head(model, tp, first)) if last else [])


@lru_cache(maxsize=1024)
def sizes(model: ModelShape, tp: int, layers: int, first: bool, last: bool) -> np.ndarray:
    """stage_params' numels as an array (read-only; one per distinct stage shape)."""
    emb, layer, head = _piece_sizes(model, tp, first)
    a = np.concatenate(([emb] if first else []) + [np.tile(layer, layers)] + ([head] if last else []))
    a.flags.writeable = False
    return a


@lru_cache(maxsize=256)
def _piece_sizes(model: ModelShape, tp: int, first: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pieces' numels as arrays (embedding, one layer, the head of a chunk that holds the embedding
    or not): shared by the stage shapes of one tp."""
    emb, layer, _ = pieces(model, tp)
    return tuple(np.array([k for _, k in part], np.int64) for part in (emb, layer, head(model, tp, first)))
