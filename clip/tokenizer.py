"""CLIP's byte-level BPE tokenizer and `tokenize`.

The merges file `bpe_simple_vocab_16e6.txt.gz` beside this file is OpenAI CLIP's vocabulary
(MIT licence), taken unchanged from the open-clip-torch 3.3.0 wheel on PyPI (MIT licence);
SHA256 924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a.

Vocabulary (49,408 ids): 256 byte symbols, the same 256 with the end-of-word marker "</w>",
48,894 merges in file order, then <|startoftext|> = 49406 and <|endoftext|> = 49407.
"""

import gzip
import hashlib
import html
import os
from functools import lru_cache
from typing import List, Union

import ftfy
import regex
import torch

VOCAB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "bpe_simple_vocab_16e6.txt.gz")
VOCAB_SHA256 = "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"
NUM_MERGES = 49152 - 256 - 2  # the 48,894 merges CLIP uses (the file holds many more)
SOT, EOT = "<|startoftext|>", "<|endoftext|>"


@lru_cache()
def bytes_to_unicode() -> dict:
    """Map each of the 256 bytes to a printable unicode character.

    BPE then works on strings with no whitespace or control characters, and every byte
    sequence (any UTF-8 text) has a spelling, so there is never an unknown token. Printable
    Latin-1 bytes map to themselves; the other 68 bytes map to code points 256, 257, ...
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    # printable bytes first, then the others in order: this order fixes the ids of the 256 symbols
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def get_pairs(word: tuple) -> set:
    """The set of adjacent symbol pairs in a word (a tuple of symbols)."""
    return set(zip(word[:-1], word[1:]))


def clean_text(text: str) -> str:
    """ftfy repair (which also unescapes HTML, unless the text contains "<"), HTML unescape twice
    (web text is often escaped more than once), whitespace collapsed to single spaces,
    lower-case."""
    text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text))
    text = regex.sub(r"\s+", " ", text).strip()
    return text.lower()


class SimpleTokenizer:
    def __init__(self, bpe_path: str = VOCAB_PATH):
        with open(bpe_path, "rb") as f:
            data = f.read()
        # another vocabulary gives other ids: refuse it
        if hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
            raise ValueError(f"{bpe_path} is not CLIP's vocabulary (SHA256 {VOCAB_SHA256})")
        lines = gzip.decompress(data).decode("utf-8").split("\n")
        # line 0 is a version header
        merges = [tuple(line.split()) for line in lines[1 : NUM_MERGES + 1]]
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        symbols = list(self.byte_encoder.values())
        vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + [SOT, EOT]
        self.encoder = {tok: i for i, tok in enumerate(vocab)}
        self.decoder = {i: tok for tok, i in self.encoder.items()}
        # lower rank = merged first
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.cache = {SOT: SOT, EOT: EOT}
        self.sot_token, self.eot_token = self.encoder[SOT], self.encoder[EOT]
        # words: the two specials, contractions, letter runs, single digits, runs of other symbols
        specials = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d"""
        self.pat = regex.compile(specials + r"|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+", regex.IGNORECASE)

    def bpe(self, token: str) -> str:
        """Apply the merges to one word; returns its symbols joined by spaces."""
        if token in self.cache:
            return self.cache[token]
        # the last symbol carries the end-of-word marker
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        while len(word) > 1:
            # merge the adjacent pair that was learned first, everywhere it occurs
            best = min(get_pairs(word), key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        out = " ".join(word)
        self.cache[token] = out
        return out

    def encode(self, text: str) -> List[int]:
        ids = []
        for word in self.pat.findall(clean_text(text)):
            word = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids.extend(self.encoder[sym] for sym in self.bpe(word).split(" "))
        return ids

    def decode(self, ids) -> str:
        """Token ids back to text; each end of word becomes a space. Padding zeros decode as "!"."""
        symbols = "".join(self.decoder[int(i)] for i in ids)
        # "</w>" is itself made of byte symbols
        data = bytearray(self.byte_decoder[c] for c in symbols)
        return data.decode("utf-8", errors="replace").replace("</w>", " ")


@lru_cache()
def get_tokenizer() -> SimpleTokenizer:
    """The shared tokenizer (reading the vocabulary takes about a second, so it is done once)."""
    return SimpleTokenizer()


def tokenize(texts: Union[str, List[str]], context_length: int = 77,
             truncate: bool = False) -> torch.Tensor:
    """Token ids of one text or a list of texts.

    Parameters
    ----------
    texts : str or list of str
    context_length : int
        The length of every row (77 for all CLIP models).
    truncate : bool
        Cut texts that are too long, keeping <|endoftext|> as the last token, instead of raising.

    Returns
    -------
    torch.IntTensor of shape [len(texts), context_length]: <|startoftext|>, the text, <|endoftext|>,
    then zeros. (0 is the id of "!", so find the end with argmax, never by counting non-zeros.)
    """
    if isinstance(texts, str):
        texts = [texts]
    tok = get_tokenizer()
    result = torch.zeros(len(texts), context_length, dtype=torch.int)
    for i, text in enumerate(texts):
        ids = [tok.sot_token] + tok.encode(text) + [tok.eot_token]
        if len(ids) > context_length:
            if not truncate:
                raise RuntimeError(f"Input {text!r} is too long for context length "
                                   f"{context_length}")  # OpenAI's type and words
            ids = ids[:context_length]
            ids[-1] = tok.eot_token
        result[i, : len(ids)] = torch.tensor(ids, dtype=torch.int)
    return result
