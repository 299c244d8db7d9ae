"""The periodic tfm stats line (runtime/metrics.py ``interval_report``): counts are the deltas since
the previous line, per-step times are per step of the interval, nothing before the interval."""

from __future__ import annotations

from vllm_tfm.vllm_plugin.runtime.metrics import Metrics


def _steps(m: Metrics, n: int, trees: int, proposal: str, propose_s: float) -> None:
    for i in range(n):
        m.steps += 1
        m.tree_steps += int(i < trees)
        m.hook(f"proposer.{proposal}")
        m.seconds["propose"] += propose_s


def test_interval_report_gives_deltas_once_per_interval():
    m = Metrics(max_depth=4)
    assert m.interval_report(100.0, 10.0) is None  # starts the clock
    _steps(m, 6, 2, "tfm", 0.05)
    m.hook("proposer.context_reorder")
    assert m.interval_report(105.0, 10.0) is None  # interval not over
    line = m.interval_report(110.0, 10.0)
    assert line == "vllm-tfm: last 10.0 s: 6 steps, 2 with trees; proposals: tfm 6; host ms per step: propose 50.0"
    _steps(m, 4, 0, "chain", 0.01)
    line = m.interval_report(121.0, 10.0)
    assert line == "vllm-tfm: last 11.0 s: 4 steps, 0 with trees; proposals: chain 4; host ms per step: propose 10.0"
    assert m.interval_report(140.0, 10.0) is None  # no step in the interval: no line


def test_interval_report_ends_with_the_allocator_when_asked():
    m = Metrics(max_depth=4)
    reads = []

    def memory() -> tuple[float, float]:
        reads.append(1)
        return 812.4, 1100.0

    assert m.interval_report(100.0, 10.0, memory) is None
    _steps(m, 6, 2, "tfm", 0.05)
    assert m.interval_report(105.0, 10.0, memory) is None and reads == []  # read only for a line
    line = m.interval_report(110.0, 10.0, memory)
    assert line == ("vllm-tfm: last 10.0 s: 6 steps, 2 with trees; proposals: tfm 6; host ms per step: propose 50.0; "
                    "GPU MiB allocated 812, reserved 1100")
    assert reads == [1]
    assert m.interval_report(140.0, 10.0, memory) is None and reads == [1]  # no step, no line, no read


def test_interval_report_counts_the_cuda_graphs_of_the_interval():
    m = Metrics(max_depth=4)
    assert m.interval_report(100.0, 10.0) is None
    _steps(m, 3, 3, "tfm", 0.02)
    for _ in range(3):
        m.hook("cudagraph.tree.FULL")
        m.hook("cudagraph.tree.full_replay")
    m.hook("cudagraph.other.PIECEWISE")
    line = m.interval_report(110.0, 10.0)
    assert line == ("vllm-tfm: last 10.0 s: 3 steps, 3 with trees; proposals: tfm 3; host ms per step: propose 20.0; "
                    "graphs: other.PIECEWISE 1, tree.FULL 3, tree.full_replay 3")
    _steps(m, 2, 2, "tfm", 0.02)
    m.hook("cudagraph.tree.PIECEWISE")
    m.hook("cudagraph.tree.PIECEWISE")  # only this interval's counts, none of the previous one's
    line = m.interval_report(120.0, 10.0)
    assert line.endswith("; graphs: tree.PIECEWISE 2")
    _steps(m, 1, 0, "chain", 0.01)  # no graph counter moved: no graphs segment
    assert m.interval_report(130.0, 10.0).endswith("host ms per step: propose 10.0")
