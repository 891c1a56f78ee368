"""The deployment record: a passing preflight, retained with everything it checked.

``narwhal check --record DIR`` writes, only when every check passed::

    DIR/
      record.json                       the index (written last)
      fleet.json                        the fleet document, byte for byte
      check.json                        the check's JSON result (as --json prints it)
      profiles/<name>.json              the profile pair in use, file names kept
      profiles/<name>.samples.json
      profiles-original/<name>.json     the pair a refit was made from (refits only)
      profiles-original/<name>.samples.json

``record.json`` holds the SHA-256 of every other file, the fleet document's hash
(:func:`fleet_sha256`: of its canonical form, so formatting and spelled-out defaults
do not change it), each engine's generation and the time. :func:`load_record`
verifies every file against it; :func:`record_matches` tells whether a record was made
for a given fleet document (and, by default, the profile pair it names now).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import attrs

from narwhal import __version__
from narwhal.check.results import CheckReport, ProfilePair, jsonable
from narwhal.config import FleetConfig, load_fleet, parse_as, parse_fleet, unstructure_fleet
from narwhal.engines.client import EngineIdentity
from narwhal.errors import ConfigError
from narwhal.profile.store import file_sha256, read_json, write_json

__all__ = [
    "INDEX",
    "RECORD_KIND",
    "RECORD_SCHEMA",
    "DeploymentRecord",
    "RecordError",
    "fleet_sha256",
    "load_record",
    "record_matches",
    "write_record",
]

INDEX: Final = "record.json"
RECORD_KIND: Final = "narwhal.deployment-record"
RECORD_SCHEMA: Final = 1
_FLEET: Final = "fleet.json"
_CHECK: Final = "check.json"
_PAIR_DIRS: Final = ("profiles", "profiles-original")


class RecordError(Exception):
    """A record cannot be written (the check failed, the directory is in use, files changed)."""


@attrs.frozen(kw_only=True)
class DeploymentRecord:
    """A verified deployment record (what :func:`load_record` returns).

    Attributes:
        directory: Where the record lies.
        created_at: When it was written (UTC, ISO 8601).
        narwhal: The narwhal version that wrote it.
        fleet_sha256: The fleet document's hash (:func:`fleet_sha256`).
        fleet_source: The file the fleet document was read from, when it was.
        profiles: The profile pair in use, as files of the record (relative paths).
        profiles_source: Where that pair was, with its SHA-256s at check time.
        refit_original: The original pair of a refit, as files of the record.
        engines: Each engine's generation during the check.
        files: SHA-256 of every file of the record but the index, by relative path.
    """

    directory: Path
    created_at: str
    narwhal: str
    fleet_sha256: str
    fleet_source: str | None
    profiles: ProfilePair
    profiles_source: ProfilePair
    refit_original: ProfilePair | None
    engines: dict[str, EngineIdentity | None]
    files: dict[str, str]

    def path(self, name: str) -> Path:
        """The absolute path of the record's file ``name`` (``fleet.json``, ``check.json``, ...)."""
        return self.directory / name

    def check(self) -> dict[str, Any]:
        """The retained check result."""
        data: dict[str, Any] = read_json(self.path(_CHECK), "check result")
        return data


def _canonical_sha256(data: Any) -> str:
    text = json.dumps(
        data,
        sort_keys=True,
        separators=(",", ":"),
        allow_nan=False,  # pragma: no mutate (equivalent: a validated fleet holds finite numbers only)
    )
    return hashlib.sha256(text.encode()).hexdigest()


def fleet_sha256(fleet: FleetConfig | str | os.PathLike[str] | Mapping[str, Any]) -> str:
    """The hash of a fleet document: SHA-256 of its canonical JSON.

    The canonical form is the validated document with every default filled in
    (:func:`~narwhal.config.unstructure_fleet`), keys sorted, no whitespace: the same
    fleet hashes the same whatever its formatting.

    Raises:
        ConfigError: The document does not load.
    """
    if isinstance(fleet, FleetConfig):
        config = fleet
    elif isinstance(fleet, Mapping):
        config = parse_fleet(dict(fleet))
    else:
        config = load_fleet(fleet)
    return _canonical_sha256(unstructure_fleet(config))


def _copy_pair(pair: ProfilePair, directory: Path, sub: str) -> ProfilePair:
    target = directory / sub
    target.mkdir()  # in the record's new or empty directory
    copies = []
    for source, expected in (
        (pair.profiles, pair.profiles_sha256),
        (pair.samples, pair.samples_sha256),
    ):
        copy = target / Path(source).name
        shutil.copyfile(source, copy)
        if expected is not None and file_sha256(copy) != expected:
            raise RecordError(f"{source} changed after the check read it; run the check again")
        copies.append(f"{sub}/{copy.name}")
    return ProfilePair(profiles=copies[0], samples=copies[1])


def _prepare(directory: Path) -> None:
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise RecordError(
            f"{directory} exists and is not an empty directory; a record is "
            "never written over another"
        )
    directory.mkdir(parents=True, exist_ok=True)


def write_record(
    report: CheckReport, directory: str | os.PathLike[str], *, now: datetime | None = None
) -> DeploymentRecord:
    """Retain a passing check as a deployment record in ``directory`` (new or empty).

    Raises:
        RecordError: The check failed, the directory is not empty, or a profile file
            changed since the check read it.
    """
    if not report.ok:
        raise RecordError(
            f"the check failed ({len(report.failures)} failed checks); "
            "no record is written for a failing fleet"
        )
    if report.document is None or report.profiles is None:
        raise RecordError("the check holds no fleet document or profile pair to record")
    target = Path(directory)
    _prepare(target)
    fleet_copy = target / _FLEET
    if report.source is not None:
        shutil.copyfile(report.source, fleet_copy)
        if _canonical_sha256(unstructure_fleet(load_fleet(fleet_copy))) != fleet_sha256(
            report.document
        ):
            raise RecordError(
                f"{report.source} changed after the check read it; run the check again"
            )
    else:
        write_json(fleet_copy, report.document)
    in_use = _copy_pair(report.profiles, target, _PAIR_DIRS[0])
    original = (
        _copy_pair(report.refit_original, target, _PAIR_DIRS[1])
        if report.refit_original is not None
        else None
    )
    write_json(target / _CHECK, report.to_json())
    files = [_FLEET, _CHECK, in_use.profiles, in_use.samples]
    if original is not None:
        files += [original.profiles, original.samples]
    created = (now or datetime.now(UTC)).isoformat(timespec="seconds")
    index = {
        "kind": RECORD_KIND,
        "schema_version": RECORD_SCHEMA,
        "created_at": created,
        "narwhal": __version__,
        "fleet": {"file": _FLEET, "source": report.source, "sha256": fleet_sha256(report.document)},
        "profiles": jsonable(in_use),
        "profiles_source": jsonable(report.profiles),
        "refit_original": jsonable(original),  # None stays None
        "refit_original_source": jsonable(report.refit_original),
        "check": {
            "file": _CHECK,
            "ok": report.ok,
            "started_at": report.started_at,
            "duration_s": report.duration_s,
            "results": len(report.results),
        },
        "engines": {n: jsonable(i) for n, i in report.identities.items()},
        "files": {name: file_sha256(target / name) for name in files},
    }
    write_json(target / INDEX, index)
    return load_record(target)


def _field(index: Mapping[str, Any], key: str, kind: type, source: str) -> Any:
    value = index.get(key)
    if not isinstance(value, kind):
        raise ConfigError(f"expected {kind.__name__}", path=f"$.{key}", source=source)
    return value


def load_record(directory: str | os.PathLike[str]) -> DeploymentRecord:
    """Read a deployment record and verify every file against its SHA-256.

    Raises:
        ConfigError: No ``record.json``, another kind or schema, or a file that is
            missing or differs from its recorded SHA-256.
    """
    base = Path(directory)
    source = os.fspath(base / INDEX)
    index = read_json(source, "deployment record")
    if not isinstance(index, dict) or index.get("kind") != RECORD_KIND:
        raise ConfigError("not a narwhal deployment record", path="$.kind", source=source)
    if index.get("schema_version") != RECORD_SCHEMA:
        raise ConfigError(
            f"record schema_version {index.get('schema_version')!r} is not {RECORD_SCHEMA}",
            path="$.schema_version",
            source=source,
        )
    files: dict[str, str] = _field(index, "files", dict, source)
    for name, digest in files.items():
        path = base / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ConfigError(
                f"file {name!r} lies outside the record", path="$.files", source=source
            )
        if not path.is_file():
            raise ConfigError(
                f"the record's file {name} is missing", path=f"$.files[{name!r}]", source=source
            )
        if file_sha256(path) != digest:
            raise ConfigError(
                f"the record's file {name} differs from its recorded SHA-256",
                path=f"$.files[{name!r}]",
                source=source,
            )
    fleet = _field(index, "fleet", dict, source)
    engines = _field(index, "engines", dict, source)
    original = index.get("refit_original")
    return DeploymentRecord(
        directory=base.resolve(),
        created_at=str(index.get("created_at")),
        narwhal=str(index.get("narwhal")),
        fleet_sha256=str(fleet.get("sha256")),
        fleet_source=fleet.get("source") if isinstance(fleet.get("source"), str) else None,
        profiles=parse_as(ProfilePair, _field(index, "profiles", dict, source), source=source),
        profiles_source=parse_as(
            ProfilePair, _field(index, "profiles_source", dict, source), source=source
        ),
        refit_original=parse_as(ProfilePair, original, source=source) if original else None,
        engines={
            n: parse_as(EngineIdentity, i, source=source) if i is not None else None
            for n, i in engines.items()
        },
        files=dict(files),
    )


def record_matches(
    record: DeploymentRecord,
    fleet: FleetConfig | str | os.PathLike[str] | Mapping[str, Any],
    *,
    check_profiles: bool = True,
) -> bool:
    """Whether ``record`` was made for this fleet document.

    The fleet document's hash must equal the record's. With ``check_profiles`` the
    pair the document names (``profiles.path``, taken from the working directory) must
    also be, byte for byte, the pair the record retains: a fleet re-profiled in place
    no longer matches.

    Raises:
        ConfigError: The fleet document does not load.
    """
    if isinstance(fleet, FleetConfig):
        config = fleet
    elif isinstance(fleet, Mapping):
        config = parse_fleet(dict(fleet))
    else:
        config = load_fleet(fleet)
    if fleet_sha256(config) != record.fleet_sha256:
        return False
    if not check_profiles or config.profiles.path is None:
        return True
    profiles = Path(config.profiles.path)
    try:
        samples = profiles.with_name(Path(record.profiles.samples).name)
        return file_sha256(profiles) == record.files.get(record.profiles.profiles) and file_sha256(
            samples
        ) == record.files.get(record.profiles.samples)
    except OSError:
        return False
