"""``narwhal profile`` / ``narwhal-profile``: sweep engines, or refit a saved sidecar.

Exit status: 0 when every selected engine got an accepted profile, 1 when a fit was
rejected or an engine failed (the pair is still written, with every sample taken),
2 on a usage or configuration error, printed as one line.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import trio

from narwhal.config import FleetConfig, load_default_fleet, load_fleet
from narwhal.errors import ConfigError
from narwhal.profile.progress import Progress
from narwhal.profile.refit import refit_pair
from narwhal.profile.runner import ProfileRun, ProfileSettings, run_profile
from narwhal.profile.stability import profile_repeatedly, stability_lines, stability_path

__all__ = ["main"]

PROG = "narwhal profile"
_SWEEP_OPTIONS = ("prefill_lens", "decode_input_lens", "decode_concurrency")
_DEFAULT_OUT = "runs/profiles.json"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _fraction_list(text: str) -> tuple[float, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions or 'none', got {text!r}") from None
    if not values or any(not 0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected fractions strictly between 0 and 1, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated engine names")
    return names


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Profile engines (prefill TTFT curve, decode TPOT model, KV capacity) and "
        "write profiles.json with its profiles.samples.json sidecar.",
    )
    p.add_argument("--fleet", help="fleet document (default: the embedded simulated fleet)")
    p.add_argument("--prefill-lens", type=_int_list, metavar="A,B,C,D",
                   help="prompt lengths of the prefill sweep (at least four, for the "
                        "leave-one-length-out check; include the longest production inputs)")  # fmt: skip
    p.add_argument("--decode-input-lens", type=_int_list, metavar="X,Y",
                   help="prompt lengths of the decode sweep (at least two)")  # fmt: skip
    p.add_argument("--decode-concurrency", type=_int_list, metavar="1,4,8",
                   help="streams per decode cell (at least two values)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=5, help="measured requests per prefill length")
    p.add_argument("--warmup", type=int, default=1,
                   help="unrecorded warm-up requests per prefill length (default 1)")  # fmt: skip
    p.add_argument("--decode-tokens", type=int, default=32,
                   help="decode steps each cell keeps the whole cohort resident (default 32)")  # fmt: skip
    p.add_argument("--min-window-steps", type=int, default=8,
                   help="fewest whole-cohort steps for a decode cell to count (default 8)")  # fmt: skip
    p.add_argument("--engines", type=_names, metavar="E1,E2",
                   help="engines to profile (default: every engine of the fleet)")  # fmt: skip
    p.add_argument(
        "--out", help=f"profiles file; the sidecar goes beside it (default {_DEFAULT_OUT})"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing pair")
    p.add_argument("--refit-samples", metavar="SAMPLES",
                   help="refit the TTFT curves of this saved sidecar into a new pair at --out")  # fmt: skip
    p.add_argument("--seed", type=int, help="seed of the probe prompts (default: random)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the whole sweep N times to measure run-to-run stability: run 1 "
                        "is the pair at --out, run k the pair <stem>.run<k>.json; the "
                        "comparison goes to <stem>.stability.json (default 1)")  # fmt: skip
    p.add_argument("--accept-rejected-cells", action="store_true",
                   help="exit 0 although some decode cells were rejected (the profile is "
                        "fitted without them either way)")  # fmt: skip
    p.add_argument("--prefix-fractions", type=_fraction_list, default=(0.25, 0.5, 0.875),
                   metavar="F1,F2",
                   help="cached-prefix sweep on engines reporting prefix caching: the cached "
                        "share of each prefill length, rounded down to whole blocks (default "
                        "0.25,0.5,0.875; 'none' skips the sweep)")  # fmt: skip
    p.add_argument("--queue-burst", type=int, default=4, metavar="N",
                   help="prompts sent at once, --repeats times, to each prefilling engine to "
                        "tell whether it computes its waiting prompts together (chunked "
                        "prefill) or one at a time, which placement prices differently "
                        "(default 4; 0 skips the probe: the router then learns it from its "
                        "requests)")  # fmt: skip
    p.add_argument("--decode-shared-prefix", type=int, default=0, metavar="N",
                   help="on engines reporting prefix caching, every prompt of a decode cell "
                        "starts with the same N tokens, computed once before the cohort: the "
                        "streams then read more KV than the engine holds, as streams of a "
                        "shared system prompt do (default 0: prompts unique from their start)")  # fmt: skip
    p.add_argument("--quiet", "--no-progress", action="store_true", help="no progress output")
    p.add_argument("--plot", action="store_true",
                   help="also write PNGs of the fits beside the pair (needs the [plot] extra)")  # fmt: skip
    return p


def _load(path: str | None) -> FleetConfig:
    return load_fleet(path) if path is not None else load_default_fleet()


def _report(run: ProfileRun, *, plot: bool) -> int:
    if run.wrote_profiles:
        print(f"wrote {run.profiles_path} and {run.samples_path}")
    else:
        print(f"wrote {run.samples_path} only (what each engine's sweep measured, and why it failed)")
    for o in run.outcomes:
        text = f"  {o.name}: {o.status}" + (f": {o.reason}" if o.reason else "")
        if o.rejected_cells:
            text += f" ({len(o.rejected_cells)} decode cell(s) rejected: "
            text += "; ".join(o.rejected_cells) + ")"
            if not o.success:
                text += "; pass --accept-rejected-cells to accept the profile"
        print(text)
    if plot:
        from narwhal.plots import PlotUnavailable, plot_profile

        try:
            for path in plot_profile(run.samples_path, Path(run.samples_path).parent / "plots"):
                print(f"  plot: {path}")
        except PlotUnavailable as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
    if not run.wrote_profiles:
        print(f"{PROG}: error: no engine was profiled, so no profiles file was written at "
              f"{run.profiles_path} (serve and check would have nothing to price by): see each "
              "engine's reason above", file=sys.stderr)  # fmt: skip
    return 0 if run.ok else 1


def _repeated(config: FleetConfig, settings: ProfileSettings, repeat: int, progress: Progress,
              source: str | None, *, plot: bool) -> int:  # fmt: skip
    """``--repeat N``: N runs, each its own pair, then the stability report."""
    runs, doc = trio.run(functools.partial(profile_repeatedly, config, settings, repeat,
                                           progress=progress, config_source=source))  # fmt: skip
    status = 0
    for k, run in enumerate(runs, 1):
        print(f"run {k} of {repeat}")
        status = max(status, _report(run, plot=plot and k == 1))
    print(f"run-to-run stability over {repeat} runs (wrote {stability_path(settings.out)}):")
    for line in stability_lines(doc):
        print(line)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``narwhal-profile`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit:  # --help (argparse's only exit here: its errors raise _UsageError)
        return 0
    progress = Progress(quiet=args.quiet)
    try:
        config = _load(args.fleet)
        if args.refit_samples is not None:
            given = [f"--{o.replace('_', '-')}" for o in _SWEEP_OPTIONS if getattr(args, o)]
            if given:
                raise _UsageError(f"{', '.join(given)} do not apply to --refit-samples")
            if args.out is None:
                raise _UsageError("--refit-samples needs --out for the new pair "
                                  "(e.g. runs/profiles-refit.json)")  # fmt: skip
            run = refit_pair(config, args.refit_samples, args.out, overwrite=args.overwrite,
                             engines=args.engines, progress=progress)  # fmt: skip
            return _report(run, plot=args.plot)
        missing = [f"--{o.replace('_', '-')}" for o in _SWEEP_OPTIONS if not getattr(args, o)]
        if missing:
            raise _UsageError(f"{', '.join(missing)} required (or --refit-samples)")
        try:
            settings = ProfileSettings(
                prefill_lens=args.prefill_lens,
                decode_input_lens=args.decode_input_lens,
                decode_concurrency=args.decode_concurrency,
                repeats=args.repeats,
                warmup=args.warmup,
                decode_tokens=args.decode_tokens,
                min_window_steps=args.min_window_steps,
                engines=args.engines,
                out=args.out if args.out is not None else _DEFAULT_OUT,
                overwrite=args.overwrite,
                seed=args.seed,
                accept_rejected_cells=args.accept_rejected_cells,
                prefix_fractions=args.prefix_fractions,
                queue_burst=args.queue_burst,
                decode_shared_prefix=args.decode_shared_prefix,
            )
        except ValueError as exc:
            raise _UsageError(str(exc)) from None
        if args.repeat < 1:
            raise _UsageError("--repeat must be at least 1")
        if args.repeat == 1:
            run = trio.run(functools.partial(run_profile, config, settings, progress=progress,
                                             config_source=args.fleet))  # fmt: skip
            return _report(run, plot=args.plot)
        return _repeated(config, settings, args.repeat, progress, args.fleet, plot=args.plot)
    except (_UsageError, ConfigError) as exc:
        progress.close()
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        progress.close()
        print(f"{PROG}: interrupted; engines completed so far are in the sidecar", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
