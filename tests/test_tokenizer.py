"""specexport.tokenizer (tokenizers + jinja2, no transformers) gives the ids and text transformers' fast tokenizer
gives for the same folder: plain prompts (special tokens added as transformers adds them), chat prompts
(apply_chat_template, then encoded without special tokens), unicode, and decoding arbitrary id lists."""

import json
import random

import pytest

from helpers import word_tokenizer
from specexport.tokenizer import Tokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                "{{ raise_exception('roles must be user or assistant') }}{% endif %}\n"
                "  {{ m['role'] }}: {{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
TEXTS = ["hello world", "  leading and trailing spaces  ", "tabs\tand\nnewlines\n\n", "naïve café — ünïcödé ✓",
         "数学 and 日本語のテキスト", "emoji 🙂🚀 and combining é", "<|im_start|> inside text <|im_end|>", "",
         "w1 w2 w3 w17 unknownword w95"]
CHATS = ["hello", "What is the capital of France?", "multi\nline\n  indented", "ünïcödé 🙂"]


def _bpe_dir(tmp_path, add_bos: bool):
    """A small byte-level BPE tokenizer (ChatML specials) saved by transformers, as specexport build saves one."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = TEXTS * 20 + CHATS * 20 + ["the quick brown fox jumps over the lazy dog"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                           "<|im_end|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    kw = dict(bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>")
    if add_bos:
        kw["add_bos_token"] = True
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    hf.chat_template = CHATML
    out = tmp_path / ("bpe_bos" if add_bos else "bpe")
    hf.save_pretrained(str(out))
    return out


def _word_dir(tmp_path):
    hf = word_tokenizer([f"w{i}" for i in range(96)])
    hf.add_special_tokens({"bos_token": "w1", "eos_token": "w2"})
    hf.chat_template = BOS_TEMPLATE
    out = tmp_path / "word"
    hf.save_pretrained(str(out))
    cfg = json.loads((out / "tokenizer_config.json").read_text())  # as tests/helpers.make_tiny saves it
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def _compare(folder, texts=TEXTS, chats=CHATS, n_random=200):
    from transformers import PreTrainedTokenizerFast
    ref = PreTrainedTokenizerFast.from_pretrained(str(folder))  # what the engine loader used before
    ours = Tokenizer.from_dir(folder)
    assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab()
    for t in texts:
        assert ours.encode(t) == list(ref(t).input_ids), t
        assert ours.encode(t, add_special_tokens=False) == list(ref(t, add_special_tokens=False).input_ids), t
    assert bool(ours.chat_template) == bool(ref.chat_template)
    if ref.chat_template:
        for c in chats:
            for gen in (True, False):
                msgs = [{"role": "user", "content": c}] + ([] if gen else [{"role": "assistant", "content": c[::-1]}])
                want = ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
                got = ours.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
                assert got == want
                assert ours.encode(got, add_special_tokens=False) == list(ref(want, add_special_tokens=False).input_ids)
    rng = random.Random(0)
    V = len(ref)
    ids = [[rng.randrange(V) for _ in range(rng.randrange(1, 30))] for _ in range(n_random)]
    ids += [ref(t).input_ids for t in texts]
    for seq in ids:
        for skip in (True, False):
            assert ours.decode(seq, skip_special_tokens=skip) == \
                ref.decode(seq, skip_special_tokens=skip, clean_up_tokenization_spaces=False), seq


@pytest.mark.parametrize("add_bos", [False, True])
def test_bpe_tokenizer_matches_transformers(tmp_path, add_bos):
    _compare(_bpe_dir(tmp_path, add_bos))


def test_word_tokenizer_matches_transformers(tmp_path):
    _compare(_word_dir(tmp_path), texts=[t for t in TEXTS if "w1" in t or not t] + ["w5 w6  w7\nw8"],
             chats=["w3 w4", "  w5  "])
    with pytest.raises(Exception, match="roles must be user or assistant"):
        Tokenizer.from_dir(tmp_path / "word").apply_chat_template([{"role": "system", "content": "w3"}])


def test_missing_tokenizer_json_is_one_clear_error(tmp_path):
    from specexport.errors import SpecExportError
    with pytest.raises(SpecExportError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2_path, tmp_path):
    """The real model's tokenizer as specexport build saves it into an engine folder."""
    from pathlib import Path

    from transformers import AutoTokenizer
    p = Path(smollm2_path)
    AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).save_pretrained(str(tmp_path / "tokenizer"))
    _compare(tmp_path / "tokenizer", n_random=1000)
