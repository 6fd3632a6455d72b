"""bench_fleet's ``--pd`` arithmetic without a server: its timings of a stream, its pooled percentiles, its derived
910B figures, and a ``--help`` that explains every flag.

Oracles: timings and percentiles written out by hand from the given arrival times; the derived figures from the
formula in ``npu_figures``' docstring evaluated by hand for issue 51's inputs (1.4 s prefill, 12 ms steps, 256-token
chats) with the Poisson quantile taken from scipy, not from the bench's own summation.
"""

from __future__ import annotations

import math

import pytest
from scipy.stats import poisson

from benchmarks.bench_fleet import Streamed, npu_figures, parser, poisson_quantile, pooled


def test_a_streams_ttft_tpot_and_gaps_come_from_its_chunk_arrivals():
    # Sent at 10 s; tokens 1, 2, 4 (one chunk carried two tokens) and 5 arrived at 10.5, 10.6, 11.6, 11.7 s.
    stream = Streamed(sent=10.0, arrivals=[10.5, 10.6, 11.6, 11.7], tokens=[1, 2, 4, 5], prompt_tokens=30)
    assert stream.ttft_ms == pytest.approx(500.0)
    assert stream.tpot_ms == pytest.approx(1200.0 / 4)  # 1.2 s over the 4 tokens after the first
    assert stream.gaps_ms == pytest.approx([100.0, 1000.0, 100.0])


def test_pooled_percentiles_span_every_round_and_report_the_per_round_spread():
    def one(ttft_ms):
        return Streamed(sent=0.0, arrivals=[ttft_ms / 1000], tokens=[1], prompt_tokens=1)

    rounds = [[one(10), one(20)], [one(30), one(40), one(50)]]
    # Nearest rank over the 5 values 10..50: p50 is the 3rd (30), p99 the 5th (50); per round p50 is 10 and 40.
    assert pooled(rounds, lambda stream: [stream.ttft_ms], 50) == pytest.approx((30.0, 10.0, 40.0))
    assert pooled(rounds, lambda stream: [stream.ttft_ms], 99) == pytest.approx((50.0, 20.0, 50.0))
    two_tokens = Streamed(sent=0.0, arrivals=[0.1, 0.13], tokens=[1, 2], prompt_tokens=1)
    # One-token answers have no TPOT: only the two-token answer's 30 ms counts.
    assert pooled([[one(10), two_tokens], [one(20)]], lambda stream: [stream.tpot_ms], 50) == pytest.approx((30.0,) * 3)


@pytest.mark.parametrize("mean", [0.0, 0.357, 1.0, 5.12, 30.0])
@pytest.mark.parametrize("q", [0.5, 0.99])
def test_the_poisson_quantile_equals_scipys(mean, q):
    assert poisson_quantile(mean, q) == int(poisson.ppf(q, mean))


def test_derived_figures_for_one_aggregated_card_at_half_a_video_per_second():
    # rho = 0.5 * 1.4 = 0.7; steps at 0.3 / 12 ms; 0.5 * 0.012 / 0.3 = 2 % of the gaps hold a 1.4 s prefill (> 1 %, so
    # the ITL p99 is 1412 ms); a 256-token chat lives 256 * 0.012 / 0.3 = 10.24 s and meets Poisson(5.12) prefills.
    figures = npu_figures(prefill_s=1.4, step_s=0.012, chat_tokens=256, rate=0.5, cards=1)
    assert figures["rho"] == pytest.approx(0.7)
    assert figures["stalled_gaps"] == pytest.approx(0.02)
    assert figures["tpot_mean_ms"] == pytest.approx(40.0)
    assert figures["itl_p99_ms"] == pytest.approx(1412.0)
    assert figures["tpot_p50_ms"] == pytest.approx(12 + poisson.ppf(0.5, 5.12) * 1400 / 256)
    assert figures["tpot_p99_ms"] == pytest.approx(12 + poisson.ppf(0.99, 5.12) * 1400 / 256)


def test_two_aggregated_cards_split_the_videos_and_a_saturated_card_has_no_finite_tpot():
    # Two cards at 0.5 videos/s each see 0.25/s: rho = 0.35, 0.25 * 0.012 / 0.65 of the gaps stalled (< 1 %).
    figures = npu_figures(prefill_s=1.4, step_s=0.012, chat_tokens=256, rate=0.5, cards=2)
    assert figures["rho"] == pytest.approx(0.35)
    assert figures["stalled_gaps"] == pytest.approx(0.25 * 0.012 / 0.65)
    assert figures["itl_p99_ms"] == pytest.approx(12.0)
    assert math.isinf(npu_figures(prefill_s=1.4, step_s=0.012, chat_tokens=256, rate=1.0, cards=1)["tpot_p99_ms"])


def test_help_explains_every_flag():
    undocumented = [action.option_strings for action in parser()._actions if action.option_strings and not action.help]
    assert undocumented == []
    args = parser().parse_args(["--pd", "--rounds", "1", "--npu-rates", "0.1", "0.2"])
    assert args.pd and args.rounds == 1 and args.npu_rates == [0.1, 0.2]
