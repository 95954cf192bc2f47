"""`specexport bench`: every decoding mode side by side on one prompt set, in one process.

runner.py  the modes (transformers baselines, specexport target-only, each drafter x each k, auto) and the
           alternating run: every mode on a prompt before the next prompt (Williams-design orders), warm-up
           excluded
report.py  per-category and geometric-mean tables, Leviathan's predicted speedup vs the measured one,
           JSON, Markdown and PNG plots
load.py    bench --clients: throughput and latency under load (the continuous batcher)
peers.py, versus.py  bench --peers: llama.cpp and ONNX Runtime GenAI on the same model, side by side
replay.py  k="auto" and fixed k replayed over a recorded trace, without the machine's noise
"""
