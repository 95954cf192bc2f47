"""The lean runtime: loading an ONNX engine and running it (generate, stream, k="auto", the continuous batcher,
the Triton model's initialize, the OpenAI server's app) imports neither torch nor transformers, and gives exactly
the tokens the same engine gives in this (torch-side) process, and greedy tokens equal to the eager torch
backend's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SHAPES, make_tiny, word_tokenizer
from specexport import SpeculativeDecoder

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(96)]
CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"

# Run the same way here and in the lean subprocess (exec'd in both), so both sides run identical calls.
RUN = r'''
import threading

def run_all(dec, text):
    from specexport import SamplingParams
    from specexport.serve.batcher import ContinuousBatcher
    prompts = [[5, 17, 3, 88, 41, 5, 17], [7, 7, 7, 20, 21, 22, 23, 20, 21]]
    sampled = [SamplingParams(0.9, top_k=20, top_p=0.9, seed=5), SamplingParams(1.2, seed=6)]
    ids = lambda outs: [o.token_ids for o in outs]  # noqa: E731
    out = {"greedy": ids(dec.generate(prompts, 16)),
           "target_only": ids(dec.generate(prompts, 16, speculative=False)),
           "auto": [dec.generate(p, 16, k="auto")[0].token_ids for p in prompts],  # (batch 1: k=0 steps exact)
           "stream": [[e.index, e.token_ids] for e in dec.stream(prompts, 12)]}
    if dec.can_sample:
        out["sampled"] = ids(dec.generate(prompts, 16, sampling=sampled))
    if text:
        outs = dec.generate(["w1 w2 w3 w1 w2", "w4 w5"], 12, chat=True)
        out["text"] = [[o.token_ids, o.text] for o in outs] + [dec.encode("w1 w2 w3")]
    # the batcher admits requests as they come (timing), so only requests whose tokens cannot depend on their
    # batch: greedy ones, and sampled ones where drafts come from the history (prompt lookup)
    reqs = [(p, None) for p in prompts]
    if dec.can_sample and dec.drafter.name == "prompt-lookup":
        reqs += list(zip(prompts, sampled))
    batcher = ContinuousBatcher(dec)
    got, fin, done = {}, set(), threading.Event()

    def collect(i):
        def cb(chunk):
            got.setdefault(i, []).extend(chunk.token_ids)
            if chunk.finished:
                fin.add(i)
                if len(fin) == len(reqs):
                    done.set()
        return cb

    for i, (p, sp) in enumerate(reqs):
        batcher.submit(p, collect(i), max_new_tokens=14, sampling=sp)
    assert done.wait(120), "the batcher did not finish"
    batcher.close()
    out["batcher"] = [got[i] for i in range(len(reqs))]
    return out
'''

LEAN = r'''
import json, sys, types
engine, text = sys.argv[1], sys.argv[2] == "1"
pb = types.ModuleType("triton_python_backend_utils")  # the Triton python backend's module, outside Triton
pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class MetricFamily:  # the metrics API's shape: families of labelled series that increment
    COUNTER, GAUGE = "counter", "gauge"

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):
        return types.SimpleNamespace(increment=lambda v: None, set=lambda v: None)


pb.MetricFamily = MetricFamily
sys.modules["triton_python_backend_utils"] = pb
from specexport import SpeculativeDecoder
import specexport.triton.model as tm
model = tm.TritonPythonModel()  # Triton's model: its imports, the decoder and its batcher, then shut down
model.initialize({"model_config": json.dumps({"parameters": {"engine": {"string_value": engine}}}),
                  "model_name": "specexport", "model_version": "1"})
model.finalize()
if text:  # the OpenAI server's app over the engine (it needs a tokenizer), then shut down
    from specexport.serve.openai_server import OpenAIServer
    OpenAIServer(SpeculativeDecoder.load(engine, backend="onnxruntime"), "m").close()
ns = {}
exec(RUN, ns)
out = ns["run_all"](SpeculativeDecoder.load(engine, backend="onnxruntime"), text)
out["modules"] = sorted(m for m in sys.modules if m.startswith(("torch", "transformers")))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def texty_engine(tmp_path_factory):
    """A tiny engine with a tokenizer (word level) and a chat template, prompt lookup, sampling graphs."""
    from specexport.config import BuildConfig
    from specexport.export.build import build
    d = tmp_path_factory.mktemp("lean")
    tok = word_tokenizer(WORDS)
    tok.chat_template = CHAT
    make_tiny(d / "t", "llama", seed=4, tokenizer=tok, logit_scale=4.0, tie_word_embeddings=False)
    return build(BuildConfig(target=str(d / "t"), ks=(1, 3), out=str(d / "e"), **SHAPES), progress=False)["out"]


def _lean(engine: str, text: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", f"RUN = {RUN!r}\n" + LEAN, engine, "1" if text else "0"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("which", ["draft_model", "prompt_lookup_text"])
def test_onnx_runtime_imports_no_torch_and_gives_the_same_tokens(engines, texty_engine, which):
    engine, text = (engines["llama"], False) if which == "draft_model" else (texty_engine, True)
    lean = _lean(engine, text)
    assert lean.pop("modules") == []  # no torch*, no transformers* module was imported
    ns = {}
    exec(RUN, ns)
    here = ns["run_all"](SpeculativeDecoder.load(engine, backend="onnxruntime"), text)
    assert lean == json.loads(json.dumps(here))  # the lean path is exact: the same tokens (and text) as here
    assert lean["greedy"] == lean["target_only"] == lean["auto"]
    eager = SpeculativeDecoder.load(engine, backend="torch")
    assert [o.token_ids for o in eager.generate([[5, 17, 3, 88, 41, 5, 17], [7, 7, 7, 20, 21, 22, 23, 20, 21]],
                                                16)] == lean["greedy"]


def test_package_import_needs_no_torch():
    code = ("import sys; import specexport, specexport.runtime, specexport.serve.batcher, specexport.tokenizer; "
            "print([m for m in sys.modules if m.startswith(('torch', 'transformers', 'onnx.'))] + "
            "[m for m in sys.modules if m == 'onnx'])")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr



def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package's modules that `module` imports anywhere (lazy imports in functions too; not the ones under
    `if TYPE_CHECKING:`, which never run)."""
    import ast
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for body in node.body for n in ast.walk(body)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - n.level + 1] if n.level else []
            target = ".".join(base + ([n.module] if n.module else [])) if n.level else (n.module or "")
            names = [target] + [f"{target}.{a.name}" for a in n.names]
        elif isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        else:
            continue
        out |= {m for m in names if m in modules and m != module}
    return out


def test_imports_flow_one_way():
    """No import circle between the package's modules, lazy imports included: a reader can order the modules
    from the CLI down to the models."""
    pkg = ROOT / "specexport"
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in pkg.rglob("*.py")}
    graph = {m: _imports(p, m, set(paths)) for m, p in paths.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    # ... and none between the sub-packages and the top-level modules, each package taken whole (export's build
    # runs the runtime to check what it wrote, so nothing the runtime stands on may import export)
    group = {m: ".".join(m.split(".")[:2]) for m in graph}
    packages: dict[str, set[str]] = {}
    for m, ns in graph.items():
        packages.setdefault(group[m], set()).update(group[n] for n in ns if group[n] != group[m])
    graph, state = packages, {}
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert {m for m, ns in packages.items() if "specexport.export" in ns} == {"specexport.cli"}
