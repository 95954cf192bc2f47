"""Drafters from checkpoints (torch): the flat factory `make_drafter`, a draft model's loading and vocabulary
check, and the quantized copy of the target. The runtime's drafters themselves are in drafters.py (numpy)."""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from .config import HYBRID_PREFIX, PROMPT_LOOKUP, DecoderConfig, QuantSpec, is_quant_spec
from .drafters import Drafter, HybridDrafter, ModelDrafter, PromptLookupDrafter
from .errors import SpecExportError
from .models import LoadedModel, load_model, read_config, resolve_path
from .models.quant import quantize_model
from .models.layer_spec import LayerSpec, is_layers_spec


def check_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft must share the target's vocabulary; padded embedding tails are allowed (and masked)."""
    tt, dt = target.tokenizer, draft.tokenizer
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if tt is not None and dt is not None:
        a, b = tt.get_vocab(), dt.get_vocab()
        if a != b:
            diff = sorted(set(a.items()) ^ set(b.items()))
            raise SpecExportError(
                f"draft vocabulary differs from the target's ({len(diff)} token/id pairs differ, e.g. {diff[0]}): "
                "choose a draft that uses the target's tokenizer")
        real = len(tt)
        if min(vt, vd) < real:
            raise SpecExportError(f"embedding sizes {vt} (target) and {vd} (draft) cannot both hold the "
                                  f"{real}-token vocabulary: choose a draft that uses the target's tokenizer")
    elif vt != vd:
        raise SpecExportError(f"draft vocabulary size {vd} differs from the target's {vt} and there is no "
                              "tokenizer to show the tail is padding: choose a draft with the target's vocabulary")


def make_drafter(spec: str | None, target: LoadedModel, cfg: DecoderConfig, make_engine) -> Drafter:
    """spec: None or 'prompt-lookup' -> n-gram; 'quant:int8|int4' -> quantized target copy; 'layers:...' -> the
    target with fewer layers; else a model path;
    'prompt-lookup+<one of those>' -> the hybrid. make_engine(loaded) builds the draft's engine."""
    if spec is None or spec == PROMPT_LOOKUP:
        return PromptLookupDrafter(cfg.ngram_min, cfg.ngram_max)
    hybrid = spec.startswith(HYBRID_PREFIX)
    loaded = load_draft(spec.removeprefix(HYBRID_PREFIX), target, cfg)
    model = ModelDrafter(make_engine(loaded), name=loaded.source, min_margin=cfg.min_margin)
    return HybridDrafter(PromptLookupDrafter(cfg.ngram_min, cfg.ngram_max), model, cfg.min_match,
                         cfg.handover) if hybrid else model


def quantized_copy(target: LoadedModel, spec: QuantSpec) -> LoadedModel:
    """The target's own weights, every linear layer block-quantized (models/quant.py); with spec.smooth, its
    inputs' ranges moved into the weights first (models/smooth.py); with spec.head, its lm_head at that width with
    its top candidates rescored by the target's float head (models/rescore.py). A target whose head is stored
    quantized (a GGUF's Q8_0 codes as stored) has no float head to share: there the copy's head stays as its body
    (:head0, and the name says so)."""
    if spec.smooth:
        from .models.smooth import smoothed_copy
        model = smoothed_copy(target, spec.smooth)
    else:
        model = copy.deepcopy(target.model)
    exact = target.model.lm_head
    if spec.head and not (type(exact) is nn.Linear and exact.weight.dtype == torch.float32):
        spec = dataclasses.replace(spec, head=0)
    head = model.lm_head  # the copy's float head (smoothed), before quantize_model replaces it
    model = quantize_model(model, spec)
    record = {}
    if spec.head:
        from .models.rescore import BLOCK, rescored_head
        model.lm_head = rescored_head(head, spec.head, target.model, model)
        record["rescored_head"] = {"bits": spec.head, "block": BLOCK, "top": model.lm_head.n}
    return LoadedModel(model, target.config, target.tokenizer, spec.name, record)


def layer_draft(spec: str, target: LoadedModel, ks: tuple[int, ...] | None = None, show: bool = True) -> LoadedModel:
    """'layers:<list>|auto[:int8|:int4]': the target with fewer layers, over its own modules (models/skip.py);
    auto searches on calibration text (models/layer_search.py) for the k values ks (None: 1..8)."""
    from .models.skip import quantized_skip, skip_layers
    ls = LayerSpec.parse(spec)
    record: dict = {}
    if ls.keep is None and target.config.num_layers < 2:
        raise SpecExportError(f"draft {spec!r}: the target has {target.config.num_layers} layer, so there is none to "
                              "skip: use prompt-lookup or quant:int8")
    if ls.keep is None:  # (a quantized variant's set is chosen on the float layers)
        from .models.layer_search import KS, search_layers
        keep, record["layer_search"] = search_layers(target, tuple(ks or KS), show)
    else:
        keep = ls.check(target.config.num_layers, spec)
    model = quantized_skip(target.model, keep, ls.quant) if ls.quant else skip_layers(target.model, keep)
    record["layers"] = list(keep)
    return LoadedModel(model, model.cfg, target.tokenizer, ls.name(keep), record)


def load_draft(spec: str, target: LoadedModel, cfg: DecoderConfig, gguf_stored: bool = False,
               accuracy_level: int = 4, ks: tuple[int, ...] | None = None) -> LoadedModel:
    """Load a draft model and check that it fits the target (before any heavy work on it). gguf_stored: a GGUF
    draft keeps its quantized weights as stored (see load_model)."""
    if is_quant_spec(spec):
        return quantized_copy(target, QuantSpec.parse(spec))
    if is_layers_spec(spec):
        return layer_draft(spec, target, ks)
    path = resolve_path(spec, role="draft")
    read_config(path)  # unsupported architectures fail here, before the weights load
    loaded = load_model(path, cfg.dtype, cfg.cache_len, role="draft", gguf_stored=gguf_stored,
                        accuracy_level=accuracy_level)
    check_vocab(target, loaded)
    return loaded
