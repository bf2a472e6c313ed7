"""How long a request has left: the recent pace of each stage, and a denoising request's own.

The tracker's estimate for ``Progress.eta_ms``: the work still to do at the pace of the
requests that went before (a running mean per stage), or, while denoising, at the
request's own step rate once two of its step reports are in. A stage's time is taken to
grow with the pixels it makes (width x height x frames x images; the denoiser's also
with its steps), so a large image after small ones is not promised a small one's time.
Waits for a slot are left out: a request that waits hears its place in line instead.
"""

from __future__ import annotations

from actors.states import RequestState

# The newest request's weight in each running mean: a change of load or model shows within
# a few requests, one odd request moves the estimate little.
WEIGHT = 0.2


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


class Pace:
    """Running means of the stages' times, per unit of their work."""

    def __init__(self) -> None:
        self._encode_ms: float | None = None  # encoding and the embeddings' hand-off, per request
        self._step_ms_per_px: float | None = None  # one denoising step
        self._latents_ms_per_px: float | None = None  # the latents' hand-off to a decoder
        self._decode_ms_per_px: float | None = None

    def encoded(self, compute_ms: float, transfer_ms: float) -> None:
        self._encode_ms = _mean(self._encode_ms, compute_ms + transfer_ms)

    def denoised(self, compute_ms: float, transfer_ms: float, *, steps: int, px: int) -> None:
        self._step_ms_per_px = _mean(self._step_ms_per_px, compute_ms / steps / px)
        self._latents_ms_per_px = _mean(self._latents_ms_per_px, transfer_ms / px)

    def decoded(self, compute_ms: float, *, px: int) -> None:
        self._decode_ms_per_px = _mean(self._decode_ms_per_px, compute_ms / px)

    def remaining_ms(self, state: RequestState, *, px: int, steps: int, done: int = 0,
                     own_step_ms: float | None = None) -> float | None:
        """The work left to a request in ``state`` making ``px`` pixels in ``steps`` steps, of
        which ``done`` are done; None until a request has gone through every stage."""
        if self._encode_ms is None or self._step_ms_per_px is None or self._latents_ms_per_px is None \
                or self._decode_ms_per_px is None:
            return None
        decode_ms = self._decode_ms_per_px * px
        if state == RequestState.DECODING:
            return decode_ms
        step_ms = own_step_ms if own_step_ms is not None else self._step_ms_per_px * px
        denoise_ms = max(0, steps - done) * step_ms + self._latents_ms_per_px * px + decode_ms
        if state == RequestState.DENOISING:
            return denoise_ms
        return self._encode_ms + denoise_ms
