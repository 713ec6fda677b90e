"""Local assets torchtitan's Trainer needs: a tokenizer and a small text dataset, made here.

torchtitan 0.3.0's HuggingFaceTokenizer (components/tokenizer.py) loads `tokenizer.json` +
`tokenizer_config.json` from `hf_assets_path`; HuggingFaceTextDataLoader (hf_datasets/
text_datasets.py, dataset "c4_test") calls `datasets.load_dataset(path, split="train")` on a
local folder of JSON lines with a "text" field. Nothing is downloaded: the text is generated
from a seeded RNG and a byte-level BPE of exactly the model's vocabulary size is trained on it
with the `tokenizers` package. Building is idempotent and safe when several ranks race
(each file is written to a temp name and renamed).
"""
from __future__ import annotations

import json
import os
import random

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# the BPE trainer sizes its tables by vocab_size (a vocab of 2^32 asks for hundreds of GB), yet the
# generated text affords only a few thousand merges: asking for more than this learns the same merges
TRAINER_VOCAB_CAP = 1 << 16
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "ba", "do", "fu", "ge", "hi", "ju", "pe")


def generated_text(n_docs: int = 400, seed: int = 0) -> list[str]:
    """Documents of pseudo-words: enough distinct byte pairs to fill a small BPE vocabulary."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    docs = []
    for _ in range(n_docs):
        sents = []
        for _ in range(rng.randint(4, 12)):
            ws = [rng.choice(words) for _ in range(rng.randint(5, 14))]
            sents.append(" ".join(ws).capitalize() + rng.choice(".!?;"))
        docs.append(" ".join(sents))
    return docs


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def build(cache_dir: str, vocab: int, seed: int = 0) -> tuple[str, str]:
    """Make (tokenizer_dir, dataset_dir) under cache_dir for a model of `vocab` tokens."""
    tok_dir = os.path.join(cache_dir, f"tokenizer_v{vocab}")
    data_dir = os.path.join(cache_dir, f"text_s{seed}")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    docs = None
    data_file = os.path.join(data_dir, "train.jsonl")
    if not os.path.exists(data_file):
        docs = generated_text(seed=seed)
        _atomic_write(data_file, "".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok_file = os.path.join(tok_dir, "tokenizer.json")
    if not os.path.exists(tok_file):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=min(vocab, TRAINER_VOCAB_CAP), special_tokens=[BOS, EOS],
                                      show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(docs or generated_text(seed=seed), trainer)
        if tok.get_vocab_size() > vocab:
            raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > model.vocab={vocab}")
        _atomic_write(os.path.join(tok_dir, "tokenizer_config.json"),
                      json.dumps({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
                                  "add_eos_token": False}))
        tmp = f"{tok_file}.tmp.{os.getpid()}"
        tok.save(tmp)
        os.replace(tmp, tok_file)
    return tok_dir, data_dir
