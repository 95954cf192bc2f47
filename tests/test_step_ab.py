"""tools/step_ab.py: modes interleaved step by step, each over its own copy of the engine (real ONNX Runtime)."""

from helpers import load_tool


def _tool():
    return load_tool("step_ab")


def _modes(tool, engine, specs, max_batch):
    opts = dict(threads=2, max_batch=max_batch, prepack=True)
    return [tool.Mode(s, engine, opts) for s in specs]


def test_streams_interleave_to_the_same_tokens_and_time_only_decode_steps(texty_engine):
    tool = _tool()
    modes = _modes(tool, texty_engine, ["0", "0", "auto", "3:model", "3:prompt-lookup"], 1)
    assert [m.speculative for m in modes] == [False, False, True, True, True]
    runs = [tool.Stream(m, "w3 w4 w5 w3 w4 w5 w3", 20) for m in modes]
    assert all(r.tokens == 1 and r.seconds == 0.0 for r in runs)  # prefill and the first token: untimed
    order, fewest = [], []
    for r in runs:  # record each turn, and whether it went to a run with the fewest tokens then
        def turn(r=r, f=r.advance):
            order.append(r)
            fewest.append(r.tokens == min(x.tokens for x in runs if not x.done))
            f()
        r.advance = turn
    tool.interleave(runs, [0, 1, 2, 3, 4])
    assert all(fewest) and len(order) >= 20
    assert all(r.done and r.seconds > 0 and r.rate > 0 for r in runs)
    assert all(r.req.out == runs[0].req.out for r in runs)  # greedy: every mode the target's tokens
    assert order[:2] == [runs[0], runs[1]]  # ties go in the given order


def test_closed_loops_keep_the_clients_in_flight_and_finish_every_request(texty_engine):
    tool = _tool()
    modes = _modes(tool, texty_engine, ["0", "auto"], 4)
    prompts = [f"w{3 + i} w4 w5" for i in range(6)]
    loops = [tool.Loop(m, prompts, 3, 12) for m in modes]
    tool.interleave(loops, [1, 0])
    for loop in loops:
        assert loop.done and len(loop.reqs) == 6 and loop.rate > 0
        assert all(len(r.out) == 12 for r in loop.reqs)  # EOS ignored: fixed lengths, as bench --clients
    assert [r.out for r in loops[0].reqs] == [r.out for r in loops[1].reqs]


def test_an_auto_mode_tracks_what_it_believes_after_each_step(texty_engine):
    tool = _tool()
    mode = _modes(tool, texty_engine, ["auto:model"], 1)[0]
    mode.track()
    run = tool.Stream(mode, "w3 w4 w5 w3 w4 w5 w3", 20)
    while not run.done:
        run.advance()
    assert len(mode.widths) == run.req.stats.steps and mode.widths[0] == 0  # c(0) is measured first
    assert mode.believed and all(x > 0 for x in mode.believed)
