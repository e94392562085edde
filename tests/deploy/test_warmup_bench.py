"""warmup_bench's figures from hand-made requests: a stream's output rate over a phase is its
tokens over its seconds (not a mean of per-request rates), and the warm-up's ratios."""

from raylm.benchmarks.warmup_bench import Served, comparison, stream_rate


def test_a_streams_rate_and_the_warm_ups_ratios():
    during = [Served(0.0, 1.5, 1.0, 16, 6.0), Served(6.0, 0.5, 0.1, 16, 2.0), Served(8.0, 0.1, 0.1, 16, 4.0)]
    after = [Served(20.0, 0.1, 0.05, 16, 1.0), Served(21.0, 0.1, 0.05, 16, 1.0)]
    assert stream_rate(during) == 48 / 12 and stream_rate(after) == 16.0
    assert comparison(during, after) == ("during the warm-up / after it: TTFT median 5.00x, "
                                         "output tokens/s a stream 0.25x")
