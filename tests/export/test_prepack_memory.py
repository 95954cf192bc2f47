"""Pre-packed weights are held once, and only while an engine uses them: the onnxruntime backend's pre-packing
CPU sessions share ONNX Runtime's pre-packed weights container (backends/ort_capi.py), which the last session
to go releases. Measured as resident memory in fresh
processes, against the same engine opened through the Python API, where every session packs its own copy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import make_tiny
from specexport.backends import hugepages, ort_capi
from specexport.config import BuildConfig
from specexport.export.build import build

MEASURE = """
import json, sys
from specexport import SpeculativeDecoder
def rss(key="Rss:"):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/smaps_rollup") if l.startswith(key))
before, anon = rss(), rss("Anonymous:")
dec = SpeculativeDecoder.load(sys.argv[1], max_batch=1, prepack=True, preload=True)
outs = [dec.generate([5, 6, 7, 8, 9, 10, 11, 5, 6, 7], 24, speculative=s)[0].token_ids for s in (True, False)]
out = {"extra": rss() - before, "capi": dec.target.capi, "sessions": len(dec.target._sessions), "tokens": outs,
       "huge": dec.target.huge_bytes, "anon": rss("Anonymous:") - anon}
del dec  # no reference cycles: freed at once, with no garbage collection
out["left"] = rss() - before
print(json.dumps(out))
"""


def _measure(engine: str, capi: bool) -> dict:
    env = {"SPECEXPORT_ORT_CAPI": "1" if capi else "0"}
    r = subprocess.run([sys.executable, "-c", MEASURE, engine], capture_output=True, text=True, check=True,
                       env={**os.environ, **env})
    return json.loads(r.stdout)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
@pytest.mark.skipif(not ort_capi.available(), reason="this onnxruntime wheel has no usable C library")
def test_prepacked_weights_are_held_once(tmp_path):
    kw = dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, tie_word_embeddings=False)
    make_tiny(tmp_path / "t", "llama", **kw)
    # (the full head: the certified head's rescoring reads rows of the mapped original, below)
    out = build(BuildConfig(target=str(tmp_path / "t"), ks=(2, 3), max_seq_len=128, max_batch=1, prefill_chunk=16,
                            sampling=False, dtype="fp32", target_head="full", out=str(tmp_path / "e")),
                progress=False)
    weights = out["files"]["target/weights.safetensors"]
    shared, own = _measure(out["out"], True), _measure(out["out"], False)
    assert shared["capi"] and not own["capi"] and shared["sessions"] == own["sessions"] >= 4
    assert shared["tokens"] == own["tokens"] and shared["tokens"][0] == shared["tokens"][1]  # exact either way
    # one packed copy (the mapped original's pages go back once packed; the rest is ONNX Runtime's own library
    # and arenas), against one packed copy per session of everything but the embedding (39% of these weights,
    # read by Gather and never packed): measured 1.0x against 3.3x with 5 sessions
    assert shared["extra"] < 1.3 * weights, (shared["extra"], weights)
    assert own["extra"] - shared["extra"] > 0.5 * (own["sessions"] - 1) * weights, (own["extra"], weights)
    # freed, the decoder gives its packed copy back: the container lives as long as its sessions (stop 44; it
    # lived as long as the process: measured 1.02x these weights left, now 0.39x, ONNX Runtime's library and arenas)
    assert shared["left"] < 0.6 * weights, (shared["left"], weights)
    if hugepages.enabled():  # the packed copy went to 2 MB pages (backends/hugepages.py), within the memory above
        assert shared["huge"] > 0.3 * weights, (shared["huge"], weights)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
@pytest.mark.skipif(not ort_capi.available(), reason="this onnxruntime wheel has no usable C library")
def test_the_certified_head_adds_its_codes_not_a_copy_of_the_head(tmp_path):
    """The certified head (models/certified.py) holds its 8-bit codes, scales and bound as the process's own memory
    (the codes pre-packed once), and no copy of the float head: its rescoring Gathers read rows of the mapped
    weights file, whose pages the kernel maps as they are read (file-backed page cache, at most the head's
    bytes). Against the same engine built with the full head, in fresh processes."""
    kw = dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, tie_word_embeddings=False)
    make_tiny(tmp_path / "t", "llama", **kw)
    outs = {h: build(BuildConfig(target=str(tmp_path / "t"), ks=(2, 3), max_seq_len=128, max_batch=1, prefill_chunk=16,
                                 sampling=False, dtype="fp32", target_head=h, out=str(tmp_path / h)), progress=False)
            for h in ("full", "certified")}
    own = outs["certified"]["files"]["target/weights.safetensors"] - outs["full"]["files"]["target/weights.safetensors"]
    head = 32000 * 512 * 4
    assert 0.2 * head < own < 0.4 * head  # codes (a byte a weight), scales and the bound
    full, cert = (_measure(outs[h]["out"], True) for h in ("full", "certified"))
    assert full["tokens"] == cert["tokens"]
    assert cert["anon"] - full["anon"] < 1.5 * own, (cert["anon"], full["anon"], own)
    file_backed = (cert["extra"] - cert["anon"]) - (full["extra"] - full["anon"])
    assert file_backed < 1.1 * head, (file_backed, head)


def test_c_api_errors_name_the_problem(tmp_path):
    if not ort_capi.available():
        with pytest.raises(ort_capi.OrtError, match="cannot be used here"):
            ort_capi.api()
        return
    with pytest.raises(ort_capi.OrtError, match="onnxruntime error"):
        ort_capi.Session(str(tmp_path / "missing.onnx"), ort_capi.SessionOptions(1))
    import numpy as np
    with pytest.raises(ValueError, match="C-contiguous and writeable"):
        ort_capi.Value(np.zeros((4, 4), np.float32)[:, ::2], writeable=True)


def test_prepacking_is_the_default_where_packs_are_shared(engines, full_head_engines, monkeypatch):
    """Pre-packing (the fastest option) is on by default when the sessions can share their packed weights, and
    off by default on the Python API fallback (one packed copy per session); prepack= overrides either way. An
    engine with MatMulNBits, an fp32 target's certified head included, pre-packs whatever is asked: unpacked, the
    certified head's coarse kernel took 95 ms of a 134 ms SmolLM2 step."""
    from specexport import SpeculativeDecoder
    full, certified = full_head_engines["lookup"], engines["lookup"]  # the same build but for the head
    dec = SpeculativeDecoder.load(full)
    assert dec.target.prepack == dec.target.capi == ort_capi.available()
    off = SpeculativeDecoder.load(full, prepack=False)
    assert not off.target.prepack and not off.target.capi
    assert off.generate([5, 6, 7, 5, 6], 12)[0].token_ids == dec.generate([5, 6, 7, 5, 6], 12)[0].token_ids
    packs = SpeculativeDecoder.load(certified, prepack=False)
    assert packs.target.prepack and packs.target.capi == ort_capi.available()
    assert packs.generate([5, 6, 7, 5, 6], 12)[0].token_ids == dec.generate([5, 6, 7, 5, 6], 12)[0].token_ids
    monkeypatch.setenv("SPECEXPORT_ORT_CAPI", "0")
    fallback = SpeculativeDecoder.load(full)
    assert not fallback.target.prepack and not fallback.target.capi
    forced = SpeculativeDecoder.load(full, prepack=True)
    assert forced.target.prepack and not forced.target.capi
    packs = SpeculativeDecoder.load(certified)
    assert packs.target.prepack and not packs.target.capi
