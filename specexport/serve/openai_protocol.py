"""The OpenAI API's request and response shapes, checked by hand (no schema library): a bad field gets an
OpenAI-shaped 400 that names it, and parameters this server cannot honour (n > 1, logprobs, tools, penalties)
are refused by name rather than ignored. Fields OpenAI clients send that do not change the tokens (user,
metadata, store, ...) and unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field

from ..config import SamplingParams
from ..request import GenerationStats

MAX_STOP = 4  # as OpenAI: up to 4 stop sequences
ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """An error response: HTTP status, OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@dataclass
class GenRequest:
    """One parsed completion or chat request."""

    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict] | None  # chat: [{"role", "content": str}]
    max_tokens: int | None  # None: up to the context length (chat) / 16 (completions, as OpenAI)
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension: EOS does not end the answer (fixed-length benchmarks)


# ---- field checks ---------------------------------------------------------------------------------------

def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer, got {type(v).__name__} {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad(f"'{name}' must be {rng}, got {v}", name)
    return v


def _num(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise bad(f"'{name}' must be a number, got {type(v).__name__} {v!r}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {v!r}", name)
    return v


def _unsupported(body: dict) -> None:
    """Parameters that would change the output in ways this server cannot give: refused by name."""
    checks = [
        ("n", lambda v: v not in (None, 1), "n > 1 is not supported: send one request per completion"),
        ("best_of", lambda v: v not in (None, 1), "best_of > 1 is not supported"),
        ("logprobs", lambda v: v not in (None, False, 0), "logprobs are not supported"),
        ("top_logprobs", lambda v: v not in (None, 0), "top_logprobs are not supported"),
        ("echo", lambda v: v not in (None, False), "echo is not supported"),
        ("suffix", lambda v: v is not None, "suffix is not supported"),
        ("tools", lambda v: v not in (None, []), "tools are not supported"),
        ("functions", lambda v: v not in (None, []), "functions are not supported"),
        ("tool_choice", lambda v: v not in (None, "none"), "tool_choice is not supported"),
        ("function_call", lambda v: v not in (None, "none"), "function_call is not supported"),
        ("presence_penalty", lambda v: v not in (None, 0, 0.0), "presence_penalty is not supported (lossless "
         "decoding keeps the target's distribution): leave it 0"),
        ("frequency_penalty", lambda v: v not in (None, 0, 0.0), "frequency_penalty is not supported (lossless "
         "decoding keeps the target's distribution): leave it 0"),
        ("logit_bias", lambda v: v not in (None, {}), "logit_bias is not supported"),
        ("response_format", lambda v: v is not None and (not isinstance(v, dict) or v.get("type") != "text"),
         "response_format other than {\"type\": \"text\"} is not supported"),
        ("audio", lambda v: v is not None, "audio output is not supported"),
        ("modalities", lambda v: v not in (None, ["text"]), "only the text modality is supported"),
        ("min_tokens", lambda v: v not in (None, 0), "min_tokens is not supported (it would mask EOS inside the "
         "target's distribution): use ignore_eos for fixed-length answers"),
    ]
    for name, refused, message in checks:
        if name in body and refused(body[name]):
            raise bad(message, name)


def _sampling(body: dict, default_temperature: float) -> SamplingParams:
    t = _num(body, "temperature", 0.0, 2.0)
    top_p = _num(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", -1)
    seed = _int(body, "seed", -2**63, 2**64 - 1)
    temperature = default_temperature if t is None else t
    if seed is None:  # a fresh stream per request, as OpenAI does without a seed
        seed = secrets.randbits(63)
    return SamplingParams(temperature, max(top_k or 0, 0), 1.0 if top_p is None else top_p, seed % 2**63)


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    return stops


def _common(body: dict, default_temperature: float) -> dict:
    _unsupported(body)
    a = _int(body, "max_tokens", 1)
    b = _int(body, "max_completion_tokens", 1)
    if a is not None and b is not None and a != b:
        raise bad(f"'max_tokens' ({a}) and 'max_completion_tokens' ({b}) disagree: pass one", "max_tokens")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        include_usage = _bool(opts, "include_usage")
    return dict(max_tokens=b if b is not None else a, sampling=_sampling(body, default_temperature),
                stop=_stop(body), stream=stream, include_usage=include_usage, ignore_eos=_bool(body, "ignore_eos"))


def parse_completion(body: dict, default_temperature: float) -> GenRequest:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):  # a batch of one
        p = p[0]
    if isinstance(p, list) and p and all(isinstance(t, list) for t in p):
        raise bad("batched prompts are not supported: send one prompt per request", "prompt")
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, str) for t in p):
        raise bad("batched prompts are not supported: send one prompt per request", "prompt")
    if isinstance(p, list):
        if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise bad("'prompt' must be a string or a non-empty list of token ids", "prompt")
    elif not isinstance(p, str):
        raise bad("'prompt' is required: a string or a list of token ids", "prompt")
    c = _common(body, default_temperature)
    if c["max_tokens"] is None:
        c["max_tokens"] = 16  # OpenAI's default for completions
    return GenRequest(prompt=p, messages=None, **c)


def parse_chat(body: dict, default_temperature: float) -> GenRequest:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' is required: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content parts must be {{\"type\": \"text\", \"text\": ...}}; "
                              "images, audio and files are not supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return GenRequest(prompt=None, messages=out, **_common(body, default_temperature))


# ---- responses ------------------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def extension(stats: GenerationStats) -> dict:
    """The `specexport` object: this request's speculation stats."""
    d = stats.as_dict()
    d["k_steps"] = {str(k): v for k, v in stats.k_steps.items()}
    return d


def completion_body(rid: str, model: str, chat: bool, text: str, finish_reason: str | None,
                    stats: GenerationStats) -> dict:
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(stats), "specexport": extension(stats)}


def chunk_body(rid: str, model: str, chat: bool, created: int, text: str | None, finish_reason: str | None,
               role: bool = False, with_usage: bool = False) -> dict:
    """One streamed event; with_usage adds "usage": null to content chunks (as OpenAI does when asked)."""
    choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if chat:
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}
    if with_usage:
        body["usage"] = None
    return body


def usage_chunk(rid: str, model: str, chat: bool, created: int, stats: GenerationStats) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(stats), "specexport": extension(stats)}
