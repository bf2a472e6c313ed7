"""The estimate of a request's work left (Progress.eta_ms)."""

from __future__ import annotations

import pytest

from actors.pace import WEIGHT, Pace
from actors.states import RequestState
from transfer.protocol import GenParams

PX = 64 * 64


def paced(encode_ms: float = 10.0, step_ms: float = 20.0, latents_ms: float = 2.0, decode_ms: float = 40.0,
          steps: int = 10) -> Pace:
    """A pace that has seen one request of PX pixels go through every stage at these times."""
    pace = Pace()
    pace.encoded(encode_ms - 1.0, 1.0)
    pace.denoised(step_ms * steps, latents_ms, steps=steps, px=PX)
    pace.decoded(decode_ms, px=PX)
    return pace


def test_nothing_is_promised_before_a_request_went_through_every_stage() -> None:
    pace = Pace()
    pace.encoded(10.0, 1.0)
    pace.denoised(200.0, 2.0, steps=10, px=PX)
    assert pace.remaining_ms(RequestState.ENCODING, px=PX, steps=10) is None


def test_each_state_is_left_the_stages_still_ahead_of_it() -> None:
    pace = paced()
    assert pace.remaining_ms(RequestState.DECODING, px=PX, steps=10) == pytest.approx(40.0)
    assert pace.remaining_ms(RequestState.DENOISING, px=PX, steps=10, done=4) == pytest.approx(6 * 20 + 2 + 40)
    assert pace.remaining_ms(RequestState.ENCODING, px=PX, steps=10) == pytest.approx(10 + 10 * 20 + 2 + 40)


def test_time_grows_with_pixels_and_steps_and_the_requests_own_pace_wins_once_known() -> None:
    pace = paced()
    big = GenParams(prompt="p", width=128, height=128, num_images=2).pixels
    assert big == 8 * PX
    assert pace.remaining_ms(RequestState.DENOISING, px=big, steps=50) == pytest.approx(8 * (50 * 20 + 2 + 40))
    assert pace.remaining_ms(RequestState.DENOISING, px=PX, steps=10, done=8, own_step_ms=100.0) == \
        pytest.approx(2 * 100 + 2 + 40)


def test_a_new_time_moves_the_mean_by_its_weight() -> None:
    pace = paced(decode_ms=40.0)
    pace.decoded(140.0, px=PX)
    assert pace.remaining_ms(RequestState.DECODING, px=PX, steps=10) == pytest.approx(40 + WEIGHT * 100)
