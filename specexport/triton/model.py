"""The specexport python-backend model for Triton (installed as <repo>/<name>/1/model.py).

It embeds the runtime in-process (no BLS call per step): one SpeculativeDecoder over the engine folder beside
this file, and one ContinuousBatcher that merges concurrent requests at step boundaries. Decoupled: each
request gets a response per step that commits tokens (stream=true) or one response (stream=false); the final
response carries the request's stats. A bad request gets an error response; the model keeps serving.
"""

import json
import os
import sys

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
        if params.get("prepack") == "true":
            options["prepack"] = True
        if params.get("backend", "onnxruntime") == "onnxruntime":
            options["preload"] = True  # every session before the first request
        self.dec = SpeculativeDecoder.load(engine, backend=params.get("backend", "onnxruntime"), **options)
        k = params.get("k") or None
        k = k if k in (None, "auto") else int(k)
        self.batcher = ContinuousBatcher(self.dec, speculative=params.get("speculative", "true") == "true", k=k,
                                         max_waiting=int(params.get("max_waiting", "256")))

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
        sampling = self.SamplingParams(float(_scalar(request, "temperature", 0.0)), int(_scalar(request, "top_k", 0)),
                                       float(_scalar(request, "top_p", 1.0)), int(_scalar(request, "seed", 0)))
        stop_t = pb_utils.get_input_tensor_by_name(request, "stop")
        stop = [s.decode("utf-8") if isinstance(s, bytes) else str(s)
                for s in (stop_t.as_numpy().reshape(-1) if stop_t is not None else [])]
        stream = bool(_scalar(request, "stream", False))
        chat = bool(_scalar(request, "chat", False))
        acc = {"ids": [], "text": ""}

        def on_chunk(c):
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
            outputs = [pb_utils.Tensor("text_output", np.array([text_out.encode("utf-8")], dtype=np.object_)),
                       pb_utils.Tensor("output_ids", np.array(ids_out, dtype=np.int64))]
            if c.finished:
                st = c.stats
                outputs += [pb_utils.Tensor("finish_reason", np.array([c.finish_reason.encode()], dtype=np.object_)),
                            pb_utils.Tensor("prompt_tokens", np.array([st.prompt_tokens], dtype=np.int64)),
                            pb_utils.Tensor("completion_tokens", np.array([st.new_tokens], dtype=np.int64)),
                            pb_utils.Tensor("drafted", np.array([st.drafted], dtype=np.int64)),
                            pb_utils.Tensor("accepted", np.array([st.accepted], dtype=np.int64)),
                            pb_utils.Tensor("acceptance_rate", np.array([st.acceptance_rate], dtype=np.float32)),
                            pb_utils.Tensor("mean_tokens_per_step",
                                            np.array([st.mean_committed_per_step], dtype=np.float32))]
            sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL if c.finished else 0)

        cancelled = getattr(sender, "is_cancelled", None)  # the client went away: free the row at the next step
        self.batcher.submit(prompt, on_chunk, max_new_tokens=max_tokens, sampling=sampling, chat=chat, stop=stop,
                            is_cancelled=cancelled)

    def finalize(self):
        self.batcher.close()
