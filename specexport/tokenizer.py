"""An engine folder's tokenizer without transformers: the `tokenizers` library over tokenizer.json, and jinja2
for the chat template.

It reproduces what transformers' fast tokenizer does with the same folder, for what the runtime uses: the named
and extra special tokens are registered as special (so decoding skips them), a missing post-processor becomes
transformers' BOS/EOS template (add_bos_token / add_eos_token), and the chat template renders in a sandboxed
jinja2 environment set up as transformers' chat_template_utils sets it up (trim_blocks, lstrip_blocks,
loopcontrols, raise_exception, strftime_now, a non-escaping tojson, the special tokens as variables).
tests/test_tokenizer.py checks ids and text against transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from .errors import SpecExportError

# transformers' SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template passes to the template by name
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _content(token) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


class Tokenizer:
    """encode / decode / apply_chat_template / get_vocab / len, as the runtime calls them on transformers'
    PreTrainedTokenizerFast (same ids, same text)."""

    def __init__(self, backend, config: dict, chat_template: str | None = None):
        from tokenizers import AddedToken, processors
        self._tok = backend
        self.config = config
        self.chat_template = chat_template
        self.special_tokens_map = {k: _content(config[k]) for k in NAMED_SPECIAL if _content(config.get(k))}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, dict):  # {name: token} (transformers 5 also reads this form)
            extra = list(extra.values())

        def added(t):  # as transformers adds them: special, not normalized (an AddedToken dict keeps its flags)
            if isinstance(t, dict):
                return AddedToken(t["content"], single_word=t.get("single_word", False), lstrip=t.get("lstrip", False),
                                  rstrip=t.get("rstrip", False), normalized=t.get("normalized", False), special=True)
            return AddedToken(t, special=True, normalized=False)

        specials = [config[k] for k in NAMED_SPECIAL if _content(config.get(k))] + list(extra)
        if specials:
            backend.add_special_tokens([added(t) for t in specials])
        add_bos, add_eos = bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False))
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            bos, eos = self.special_tokens_map.get("bos_token"), self.special_tokens_map.get("eos_token")
            add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
            single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
            pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
            special = ([(bos, backend.token_to_id(bos))] if add_bos else []) + \
                      ([(eos, backend.token_to_id(eos))] if add_eos else [])
            backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Tokenizer":
        """A tokenizer folder as transformers saves it: tokenizer.json, tokenizer_config.json, and the chat
        template inside the config or beside it (chat_template.jinja)."""
        from tokenizers import Tokenizer as Backend
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise SpecExportError(f"{folder} has no tokenizer.json: rebuild the engine with specexport build")
        cfg_path = folder / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():  # as transformers reads it: the file beside the config wins
            template = jinja.read_text(encoding="utf-8")
        return cls(Backend.from_file(str(path)), config, template)

    # ---- what the runtime calls ------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        """clean_up_tokenization_spaces: accepted for transformers' signature; the runtime never cleans up (and
        transformers does not for BPE tokenizers either)."""
        if clean_up_tokenization_spaces:
            raise SpecExportError("this tokenizer does not clean up tokenization spaces: pass "
                                  "clean_up_tokenization_spaces=False")
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False, **kwargs):
        """The chat as text (tokenize=True: its ids, without special tokens added), as transformers renders it."""
        if not self.chat_template:
            raise SpecExportError("this tokenizer has no chat template: pass chat=False")
        text = self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def _template(self):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # no HTML escaping
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)
