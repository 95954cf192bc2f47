"""A small gRPC streaming client for the specexport Triton model (tests and tools/triton_bench.py use it)."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import numpy as np

STATS = ("finish_reason", "prompt_tokens", "completion_tokens", "drafted", "accepted", "acceptance_rate",
         "mean_tokens_per_step")


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    stats: dict = field(default_factory=dict)
    error: str | None = None
    ttft_s: float | None = None  # request sent -> first response with tokens
    latency_s: float | None = None  # request sent -> final response


TYPES = {"max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32), "top_k": ("INT32", np.int32),
         "top_p": ("FP32", np.float32), "seed": ("UINT64", np.uint64), "random_seed": ("UINT64", np.uint64),
         "end_id": ("INT32", np.int32), "stream": ("BOOL", np.bool_), "chat": ("BOOL", np.bool_),
         "beam_width": ("INT32", np.int32), "exclude_input_in_output": ("BOOL", np.bool_)}


def inputs(prompt: str | list[int] | None = None, **params) -> list:
    """prompt: text (text_input) or ids (input_ids); params: max_tokens, temperature, top_k, top_p, seed (or
    random_seed), stop or stop_words (lists of strings), end_id, stream, chat, beam_width, exclude_input_in_output.
    Every tensor gets the batch dimension of 1 that the model's config (max_batch_size 1) asks for; a value given
    as (numpy array, triton dtype) is sent as is."""
    import tritonclient.grpc as g
    out = []

    def add(name, arr, dtype):
        x = g.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        out.append(x)

    if isinstance(prompt, str):
        add("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES")
    elif prompt is not None:
        add("input_ids", np.array([prompt], dtype=np.int64), "INT64")
    for name, value in params.items():
        if isinstance(value, tuple):
            add(name, *value)
        elif name in ("stop", "stop_words"):
            add(name, np.array([[s.encode() for s in value]], dtype=np.object_), "BYTES")
        else:
            add(name, np.array([[value]], dtype=TYPES[name][1]), TYPES[name][0])
    return out


def generate(url: str, model: str, prompt=None, timeout: float = 300.0, **params) -> Result:
    """One request over its own gRPC stream; collects every response until the final one."""
    import tritonclient.grpc as g
    client = g.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error, time.perf_counter())))
    res = Result()
    t0 = time.perf_counter()
    try:
        client.async_stream_infer(model, inputs(prompt, **params))
        while True:
            result, error, t = q.get(timeout=timeout)
            if error is not None:
                res.error = str(error)
                break
            ids = result.as_numpy("output_ids")  # [1, n]: the batch dimension, then the tokens
            text = result.as_numpy("text_output")
            if ids is not None and ids.size:
                res.ttft_s = res.ttft_s if res.ttft_s is not None else t - t0
                res.token_ids += [int(x) for x in ids.reshape(-1)]
            if text is not None:
                res.text += text.reshape(-1)[0].decode("utf-8")
            res.chunks += 1
            if result.as_numpy("finish_reason") is not None:
                for name in STATS:
                    v = result.as_numpy(name).reshape(-1)[0]
                    res.stats[name] = v.decode() if isinstance(v, bytes) else v.item()
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        res.latency_s = time.perf_counter() - t0
        client.stop_stream()
        client.close()
    return res
