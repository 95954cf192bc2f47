"""config.pbtxt from typed data (never from text templates)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str  # TYPE_STRING, TYPE_INT64, TYPE_INT32, TYPE_FP32, TYPE_BOOL, ...
    dims: tuple[int, ...]
    optional: bool = False


@dataclass
class ModelConfig:
    name: str
    backend: str  # python | onnxruntime
    inputs: list[Tensor]
    outputs: list[Tensor]
    max_batch_size: int = 0  # 0: the model batches by itself (continuous batching)
    decoupled: bool = False
    instances: int = 1
    parameters: dict[str, str] = field(default_factory=dict)

    def to_pbtxt(self) -> str:
        q = json.dumps  # protobuf text strings take JSON-style escapes
        lines = [f"name: {q(self.name)}", f"backend: {q(self.backend)}", f"max_batch_size: {self.max_batch_size}"]
        if self.decoupled:
            lines.append("model_transaction_policy { decoupled: true }")
        for kind, tensors in (("input", self.inputs), ("output", self.outputs)):
            for t in tensors:
                body = f"name: {q(t.name)} data_type: {t.data_type} dims: [ {', '.join(map(str, t.dims))} ]"
                if t.optional:
                    body += " optional: true"
                lines.append(f"{kind} [ {{ {body} }} ]")
        lines.append(f"instance_group [ {{ kind: KIND_CPU count: {self.instances} }} ]")
        for key, value in self.parameters.items():
            lines.append(f"parameters {{ key: {q(key)} value: {{ string_value: {q(value)} }} }}")
        return "\n".join(lines) + "\n"
