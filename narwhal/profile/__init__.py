"""The profiler: sweeps, fits and the profile pair (``narwhal profile``).

:func:`run_profile` sweeps engines and writes ``profiles.json`` with its
``profiles.samples.json`` sidecar; :func:`refit_pair` refits a saved sidecar into a new
pair; :func:`load_profiles` reads a profiles file for the preflight and placement::

    profiles = load_profiles("runs/profiles.json")
    p = profiles["decode-0"]
    p.predict_ttft(2048), p.predict_tpot(active=8, kv_tokens=40_000), p.identity
"""

from __future__ import annotations

from narwhal.profile.fit import (
    TPOT_MODEL,
    TTFT_MODEL,
    DecodeFit,
    DecodePoint,
    TTFTFit,
    fit_decode,
    fit_ttft,
    ttft_rejection,
)
from narwhal.profile.progress import Progress
from narwhal.profile.refit import refit_pair
from narwhal.profile.runner import EngineOutcome, ProfileRun, ProfileSettings, run_profile
from narwhal.profile.store import (
    SCHEMA_VERSION,
    DecodeAxis,
    DecodeDomain,
    DecodeModel,
    EngineProfile,
    KVCapacity,
    Profiles,
    SamplesRef,
    TTFTCurve,
    load_profiles,
    pair_paths,
)

__all__ = [
    "SCHEMA_VERSION",
    "TPOT_MODEL",
    "TTFT_MODEL",
    "DecodeAxis",
    "DecodeDomain",
    "DecodeFit",
    "DecodeModel",
    "DecodePoint",
    "EngineOutcome",
    "EngineProfile",
    "KVCapacity",
    "ProfileRun",
    "ProfileSettings",
    "Profiles",
    "Progress",
    "SamplesRef",
    "TTFTCurve",
    "TTFTFit",
    "fit_decode",
    "fit_ttft",
    "load_profiles",
    "pair_paths",
    "refit_pair",
    "run_profile",
    "ttft_rejection",
]
