"""The specexport python-backend model for Triton (installed as <repo>/<name>/1/model.py).

It embeds the runtime in-process (no BLS call per step): one SpeculativeDecoder over the engine folder beside
this file, and one ContinuousBatcher that merges concurrent requests at step boundaries. Decoupled: each
request gets a response per step that commits tokens (stream=true) or one response (stream=false); the final
response carries the request's stats. A bad request gets an error response; the model keeps serving.

Inputs take our names and TensorRT-LLM's ensemble names where they mean the same (random_seed = seed,
stop_words = stop, end_id: one more stop token id; beam_width 1 and exclude_input_in_output true, what we do).
max_batch_size is 1, so tensors carry a batch dimension of 1 (as TensorRT-LLM's clients send them; Triton's
generate endpoints add it themselves). The batcher's SpecMetrics are mirrored into Triton's metrics endpoint
through the python backend's metrics API.
"""

import json
import os
import sys
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy().reshape(-1)
    if a.size != 1:
        raise ValueError(f"input {name} takes one value, got {a.size}")
    v = a[0]
    return v.decode() if isinstance(v, bytes) else v.item()


def _strings(request, name):
    """A string list input, empty strings dropped (TensorRT-LLM clients send stop_words "" for none); None if absent."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    out = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in t.as_numpy().reshape(-1)]
    return [s for s in out if s] or None


def _either(ours, theirs, a, b):
    """One value from our input name or TensorRT-LLM's alias; both given and different is an error."""
    if a is not None and b is not None and a != b:
        raise ValueError(f"{ours} and {theirs} (its TensorRT-LLM name) differ ({a!r} vs {b!r}): pass one of them")
    return a if a is not None else b


def _tensor(name, values, dtype):
    """An output with the batch dimension (max_batch_size 1): [1, n]."""
    return pb_utils.Tensor(name, np.array([values], dtype=dtype))


class _TritonMetrics:
    """SpecMetrics mirrored into Triton's metrics endpoint (pb_utils.MetricFamily): the same names, help texts and
    labels as SpecMetrics.samples() (counters get Prometheus' _total suffix, which Triton does not add), plus
    Triton's model and version labels. Triton counters only increment, so both kinds move by the difference
    from the last value this instance exported (instances of one model then add up)."""

    def __init__(self, metrics, labels: dict):
        self.metrics, self.labels = metrics, labels
        self._families: dict = {}
        self._series: dict = {}  # (name, labels) -> [pb_utils Metric, last exported value]
        self._lock = threading.Lock()

    def update(self) -> None:
        with self._lock:
            for s in self.metrics.samples():
                entry = self._series.get((s.name, s.labels))
                if entry is None:
                    fam = self._families.get(s.name)
                    if fam is None:
                        counter = s.kind == "counter"
                        fam = self._families[s.name] = pb_utils.MetricFamily(
                            name=s.name + "_total" if counter else s.name, description=s.help,
                            kind=pb_utils.MetricFamily.COUNTER if counter else pb_utils.MetricFamily.GAUGE)
                    entry = self._series[(s.name, s.labels)] = [fam.Metric(labels={**self.labels, **dict(s.labels)}),
                                                                0.0]
                if s.value != entry[1]:
                    entry[0].increment(s.value - entry[1])
                    entry[1] = s.value

    def close(self) -> None:
        with self._lock:  # Metric objects go before their families
            self._series.clear()
            self._families.clear()


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        for path in reversed(json.loads(params.get("python_path", "[]"))):
            if path not in sys.path:
                sys.path.insert(0, path)
        from specexport import SamplingParams, SpeculativeDecoder
        from specexport.errors import SpecExportError
        from specexport.serve.batcher import ContinuousBatcher
        self.SamplingParams, self.SpecExportError = SamplingParams, SpecExportError
        here = os.path.dirname(os.path.abspath(__file__))
        engine = os.path.join(here, params.get("engine", "engine"))
        options = {}
        if params.get("threads"):
            options["threads"] = int(params["threads"])
        if params.get("max_batch"):
            options["max_batch"] = int(params["max_batch"])
        if params.get("prepack") in ("true", "false"):  # ("auto": the runtime's default)
            options["prepack"] = params["prepack"] == "true"
        if params.get("backend", "onnxruntime") == "onnxruntime":
            options["preload"] = True  # every session before the first request
        self.dec = SpeculativeDecoder.load(engine, backend=params.get("backend", "onnxruntime"), **options)
        k = params.get("k") or None
        k = k if k in (None, "auto") else int(k)
        self.batcher = ContinuousBatcher(self.dec, speculative=params.get("speculative", "true") == "true", k=k,
                                         max_waiting=int(params.get("max_waiting", "256")))
        self.vocab_size = self.dec.target.vocab_size
        self.metrics = _TritonMetrics(self.batcher.metrics, {"model": args["model_name"],
                                                             "version": str(args["model_version"])})
        self._update_metrics()  # the gauges show from the start

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as e:  # every request gets exactly one final response, whatever went wrong
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(msg)),
                            flags=FINAL)
        return None

    def _submit(self, request, sender):
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if (text is None) == (ids is None):
            raise ValueError("pass exactly one of text_input (string) or input_ids (int64 list)")
        if text is not None:
            raw = text.as_numpy().reshape(-1)
            if raw.size != 1:
                raise ValueError(f"text_input takes one string, got {raw.size}")
            prompt = raw[0].decode("utf-8") if isinstance(raw[0], bytes) else str(raw[0])
        else:
            prompt = [int(t) for t in ids.as_numpy().reshape(-1)]
            if not prompt:
                raise ValueError("input_ids is empty: pass at least one token id")
        max_tokens = int(_scalar(request, "max_tokens", 128))
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        seed = _either("seed", "random_seed", _scalar(request, "seed", None), _scalar(request, "random_seed", None))
        sampling = self.SamplingParams(float(_scalar(request, "temperature", 0.0)), int(_scalar(request, "top_k", 0)),
                                       float(_scalar(request, "top_p", 1.0)), int(seed or 0))
        stop = _either("stop", "stop_words", _strings(request, "stop"), _strings(request, "stop_words")) or []
        end_id = _scalar(request, "end_id", None)
        if end_id is not None and end_id != -1 and not 0 <= end_id < self.vocab_size:  # -1: none (TensorRT-LLM)
            raise ValueError(f"end_id {end_id} is outside the vocabulary [0, {self.vocab_size})")
        stop_ids = [end_id] if end_id is not None and end_id >= 0 else []
        if _scalar(request, "beam_width", 1) != 1:
            raise ValueError(f"beam_width must be 1 (no beam search), got {_scalar(request, 'beam_width', 1)}")
        if not _scalar(request, "exclude_input_in_output", True):
            raise ValueError("exclude_input_in_output=false is not supported: outputs hold the generated text only")
        stream = bool(_scalar(request, "stream", False))
        chat = bool(_scalar(request, "chat", False))
        acc = {"ids": [], "text": "", "started": False}

        def on_chunk(c):
            if not acc["started"] or c.finished:  # admitted (the running gauge moved) or finished (counters moved)
                acc["started"] = True
                self._update_metrics()
            if c.finish_reason == "cancelled":  # nobody is listening; Triton still wants the stream closed
                sender.send(flags=FINAL)
                return
            if c.error:
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(c.error)),
                            flags=FINAL)
                return
            if not stream:
                acc["ids"] += c.token_ids
                acc["text"] += c.text
                if not c.finished:
                    return
                ids_out, text_out = acc["ids"], acc["text"]
            else:
                ids_out, text_out = c.token_ids, c.text
            outputs = [_tensor("text_output", [text_out.encode("utf-8")], np.object_),
                       _tensor("output_ids", ids_out, np.int64)]
            if c.finished:
                st = c.stats
                outputs += [_tensor("finish_reason", [c.finish_reason.encode()], np.object_),
                            _tensor("prompt_tokens", [st.prompt_tokens], np.int64),
                            _tensor("completion_tokens", [st.new_tokens], np.int64),
                            _tensor("drafted", [st.drafted], np.int64),
                            _tensor("accepted", [st.accepted], np.int64),
                            _tensor("acceptance_rate", [st.acceptance_rate], np.float32),
                            _tensor("mean_tokens_per_step", [st.mean_committed_per_step], np.float32)]
            sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL if c.finished else 0)

        cancelled = getattr(sender, "is_cancelled", None)  # the client went away: free the row at the next step
        self.batcher.submit(prompt, on_chunk, max_new_tokens=max_tokens, sampling=sampling, chat=chat, stop=stop,
                            stop_token_ids=stop_ids, is_cancelled=cancelled)
        self._update_metrics()  # the waiting gauge

    def _update_metrics(self):
        if self.metrics is None:
            return
        try:
            self.metrics.update()
        except Exception as e:  # metrics never fail a request (e.g. a Triton without the python metrics API)
            self.metrics = None
            pb_utils.Logger.log_warn(f"specexport: exporting metrics to Triton failed, stopped: {e}")

    def finalize(self):
        self.batcher.close()
        if self.metrics is not None:
            self.metrics.close()
