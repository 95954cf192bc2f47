"""Incremental detokenization (specexport/detokenize.py) gives, at every step, the text decoding the whole output
gives: on a byte-level BPE (multi-byte characters split across tokens), a SentencePiece-style Metaspace
tokenizer (the first token's leading space) and a word-level one; and stop strings and streamed text behave as
before, on the runtime with a tokenizer."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from specexport.detokenize import REPLACEMENT, IncrementalText

CORPUS = ["hello world, the quick brown fox", "naïve café — ünïcödé ✓", "数学 and 日本語のテキスト",
          "emoji 🙂🚀 and combining é", "def f(x):\n    return [y * 2 for y in x]\n", "  spaces  and\ttabs"]


def _byte_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 30, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _metaspace():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(CORPUS * 30, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    return tok


def _words():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "a", "b", "hello", "world", "ünï"])},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


@pytest.mark.parametrize("make", [_byte_bpe, _metaspace, _words])
def test_incremental_text_equals_the_whole_decode_at_every_step(make):
    tok = make()
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    rng = random.Random(0)
    V = tok.get_vocab_size()
    cases = [tok.encode(t).ids for t in CORPUS] + [[rng.randrange(V) for _ in range(60)] for _ in range(40)]
    for ids in cases:
        inc, n = IncrementalText(decode), 0
        while n < len(ids):
            n = min(len(ids), n + rng.randint(1, 3))  # a step commits 1-3 tokens
            whole = decode(ids[:n])
            stable = inc.update(ids[:n])
            assert whole.startswith(stable)
            if not whole.endswith(REPLACEMENT):
                assert stable == whole, (ids[:n], stable, whole)
            assert inc.final(ids[:n]) == whole


def test_stop_strings_and_stream_text_on_a_real_run(texty_engine):
    """Streamed deltas add up to the final text, which ends before the stop string."""
    from specexport import SpeculativeDecoder
    dec = SpeculativeDecoder.load(texty_engine)
    plain = dec.generate("w1 w2 w3 w4", 24, speculative=False)[0]
    words = plain.text.split()
    assert len(words) > 4
    stop = " ".join(words[2:4])
    out = dec.generate("w1 w2 w3 w4", 24, stop=[stop])[0]
    assert out.finish_reason == "stop" and out.text == plain.text[:plain.text.index(stop)]
    events = list(dec.stream("w1 w2 w3 w4", 24, stop=[stop]))
    assert "".join(e.text for e in events) == out.text and events[-1].finish_reason == "stop"
