"""The tiny model's character tokenizer, built with HF `tokenizers` and saved beside the checkpoint.

One token per printable ASCII character, plus `\\boxed{` as a single token (answers are short and the box
is the part a reward depends on) and the specials `<bos>` (0), `<eos>` (1), `<pad>` (2), `<unk>` (3). The
saved directory loads with `transformers.AutoTokenizer.from_pretrained(dir)`.

    python -c "from engines.model.tokenizer import build_tokenizer; build_tokenizer().save_pretrained('tok')"
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<unk>")
BOX_TOKEN = "\\boxed{"
CHARACTERS = tuple(c for c in string.printable if c in string.printable[:95])  # printable ASCII incl. space
VOCAB_SIZE = 128
"""Embedding rows of the tiny model: the 100 real tokens padded to a round size (ids >= 100 never appear)."""


def vocabulary() -> dict[str, int]:
    tokens = list(SPECIAL_TOKENS) + [BOX_TOKEN] + list(CHARACTERS)
    assert len(tokens) <= VOCAB_SIZE, "vocabulary outgrew VOCAB_SIZE"
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token="<unk>"))
    specials = "|".join(t.replace("<", "\\<").replace(">", "\\>") for t in SPECIAL_TOKENS)
    pattern = Regex(f"{specials}|\\\\boxed\\{{|[\\s\\S]")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern, behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=4096)
