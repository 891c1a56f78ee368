"""The deployment record's rules on hand-made reports (no engines): what is refused, every
field of the index, and each way a record fails to verify or to match."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from narwhal import __version__
from narwhal.check.record import (
    INDEX,
    RecordError,
    fleet_sha256,
    load_record,
    record_matches,
    write_record,
)
from narwhal.check.results import CheckReport, CheckResult, ProfilePair
from narwhal.config import parse_fleet, unstructure_fleet
from narwhal.errors import ConfigError
from narwhal.profile.store import file_sha256
from tests.checkkit import fleet_doc, identity_of

NOW = datetime(2026, 1, 2, 3, 4, 5, 678, tzinfo=UTC)
OK = CheckResult(name="reachable", engine="e0", ok=True)


def pair(tmp_path: Path, name: str = "profiles", *, hashed: bool = True) -> ProfilePair:
    runs = tmp_path / "runs"
    runs.mkdir(exist_ok=True)
    profiles, samples = runs / f"{name}.json", runs / f"{name}.samples.json"
    profiles.write_text(f'{{"profiles": "{name}"}}\n')
    samples.write_text(f'{{"samples": "{name}"}}\n')
    return ProfilePair(
        profiles=str(profiles),
        samples=str(samples),
        profiles_sha256=file_sha256(profiles) if hashed else None,
        samples_sha256=file_sha256(samples) if hashed else None,
    )


def report(tmp_path: Path, *, source: bool = True, **kw: Any) -> CheckReport:
    doc = fleet_doc()
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_text(json.dumps(doc, indent=3))
    base: dict[str, Any] = dict(
        results=(OK, CheckResult(name="pool", engine=None, ok=True)),
        source=str(fleet_file) if source else None,
        document=doc,
        identities={"e0": identity_of("e0", 8101), "e1": None},
        profiles=pair(tmp_path),
        started_at="2026-01-02T03:04:00+00:00",
        duration_s=1.25,
    )
    return CheckReport(**(base | kw))


def index(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((directory / INDEX).read_text())
    return data


def test_a_failing_or_incomplete_check_writes_nothing(tmp_path: Path) -> None:
    bad = CheckResult(name="x", engine="e1", ok=False)
    for results, failed in (((OK, bad, bad), 2), ((), 0)):
        with pytest.raises(RecordError) as info:
            write_record(report(tmp_path, results=results), tmp_path / "r")
        assert str(info.value) == (f"the check failed ({failed} failed checks); "
                                   "no record is written for a failing fleet")  # fmt: skip
    nothing: list[dict[str, Any]] = [{"document": None}, {"profiles": None}]
    for missing in nothing:
        with pytest.raises(RecordError, match=r"^the check holds no fleet document or profile pair to record$"):
            write_record(report(tmp_path, **missing), tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_a_record_goes_only_into_a_new_or_empty_directory(tmp_path: Path) -> None:
    r = report(tmp_path)
    (tmp_path / "file").write_text("")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    for target in (tmp_path / "file", full):
        with pytest.raises(RecordError) as info:
            write_record(r, target)
        assert str(info.value) == (f"{target} exists and is not an empty directory; a record is "
                                   "never written over another")  # fmt: skip
    (tmp_path / "empty").mkdir()
    assert write_record(r, tmp_path / "empty").directory == (tmp_path / "empty").resolve()
    assert write_record(r, tmp_path / "new" / "deep").directory.is_dir()


def test_the_index_holds_every_field(tmp_path: Path) -> None:
    r = report(tmp_path)
    written = write_record(r, tmp_path / "rec", now=NOW)
    rec = tmp_path / "rec"
    got = index(rec)
    fleet_file = tmp_path / "fleet.json"
    assert (rec / "fleet.json").read_bytes() == fleet_file.read_bytes()  # byte for byte
    assert json.loads((rec / "check.json").read_text()) == json.loads(json.dumps(r.to_json()))
    files = ["fleet.json", "check.json", "profiles/profiles.json", "profiles/profiles.samples.json"]
    assert got == {
        "kind": "narwhal.deployment-record",
        "schema_version": 1,
        "created_at": "2026-01-02T03:04:05+00:00",
        "narwhal": __version__,
        "fleet": {"file": "fleet.json", "source": str(fleet_file), "sha256": fleet_sha256(r.document or {})},
        "profiles": {"profiles": files[2], "samples": files[3], "profiles_sha256": None, "samples_sha256": None},
        "profiles_source": json.loads(json.dumps(r.to_json()["profiles"])),
        "refit_original": None,
        "refit_original_source": None,
        "check": {"file": "check.json", "ok": True, "started_at": "2026-01-02T03:04:00+00:00",
                  "duration_s": 1.25, "results": 2},
        "engines": {"e0": got["engines"]["e0"], "e1": None},
        "files": {name: file_sha256(rec / name) for name in files},
    }  # fmt: skip
    assert got["engines"]["e0"]["url"] == "http://e0.test:8101"
    assert written.created_at == "2026-01-02T03:04:05+00:00" and written.narwhal == __version__
    assert written.fleet_source == str(fleet_file)
    assert written.profiles == ProfilePair(profiles=files[2], samples=files[3])
    assert written.profiles_source == r.profiles and written.refit_original is None
    assert written.engines == {"e0": identity_of("e0", 8101), "e1": None}
    assert written.files == got["files"]
    assert written.path("fleet.json") == rec.resolve() / "fleet.json"
    assert written.check() == json.loads((rec / "check.json").read_text())


def test_the_time_defaults_to_now(tmp_path: Path) -> None:
    before = datetime.now(UTC).replace(microsecond=0)
    created = datetime.fromisoformat(write_record(report(tmp_path), tmp_path / "rec").created_at)
    assert before <= created <= datetime.now(UTC) and created.microsecond == 0


def test_a_refit_keeps_its_original_pair(tmp_path: Path) -> None:
    original = pair(tmp_path, "orig")
    written = write_record(report(tmp_path, refit_original=original), tmp_path / "rec")
    assert written.refit_original == ProfilePair(profiles="profiles-original/orig.json",
                                                 samples="profiles-original/orig.samples.json")  # fmt: skip
    assert set(written.files) == {"fleet.json", "check.json", "profiles/profiles.json",
                                  "profiles/profiles.samples.json", "profiles-original/orig.json",
                                  "profiles-original/orig.samples.json"}  # fmt: skip
    got = index(tmp_path / "rec")
    assert got["refit_original_source"]["profiles"] == original.profiles
    assert (tmp_path / "rec" / "profiles-original" / "orig.json").read_text() == '{"profiles": "orig"}\n'


def test_a_document_without_a_file_is_written_as_json(tmp_path: Path) -> None:
    r = report(tmp_path, source=False)
    written = write_record(r, tmp_path / "rec")
    assert json.loads((tmp_path / "rec" / "fleet.json").read_text()) == r.document
    assert written.fleet_source is None and index(tmp_path / "rec")["fleet"]["source"] is None


def test_files_changed_since_the_check_are_refused(tmp_path: Path) -> None:
    r = report(tmp_path)
    fleet_file = tmp_path / "fleet.json"
    # Reformatted, same fleet: fine.
    fleet_file.write_text(json.dumps(r.document))
    write_record(r, tmp_path / "a")
    fleet_file.write_text(json.dumps(fleet_doc(engine={"first_token_timeout_s": 6.0})))
    with pytest.raises(RecordError, match=f"^{re.escape(str(fleet_file))} changed after the check read it; run the check again$"):
        write_record(r, tmp_path / "b")
    r = report(tmp_path)
    assert r.profiles is not None
    Path(r.profiles.samples).write_text("{}")
    with pytest.raises(RecordError, match=f"^{re.escape(r.profiles.samples)} changed after the check read it"):
        write_record(r, tmp_path / "c")
    r = report(tmp_path, profiles=pair(tmp_path))
    assert r.profiles is not None
    Path(r.profiles.profiles).write_text("{}")
    with pytest.raises(RecordError, match=f"^{re.escape(r.profiles.profiles)} changed after"):
        write_record(r, tmp_path / "d")
    # A pair read without hashes is copied as it is.
    r = report(tmp_path, profiles=pair(tmp_path, hashed=False))
    write_record(r, tmp_path / "e")


def rewrite(directory: Path, **changes: Any) -> None:
    data = index(directory) | changes
    (directory / INDEX).write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": "other"}, r"not a narwhal deployment record @ \$\.kind"),
        ({"schema_version": 2}, r"record schema_version 2 is not 1 @ \$\.schema_version"),
        ({"schema_version": "1"}, r"record schema_version '1' is not 1 @ \$\.schema_version"),
        ({"files": []}, r"expected dict @ \$\.files"),
        ({"files": {"/etc/hostname": "x"}}, r"file '/etc/hostname' lies outside the record @ \$\.files"),
        ({"files": {"../fleet.json": "x"}}, r"file '\.\./fleet\.json' lies outside the record @ \$\.files"),
        ({"files": {"nope.json": "x"}}, r"the record's file nope\.json is missing @ \$\.files\['nope\.json'\]"),
        ({"files": {"fleet.json": "0" * 64}},
         r"the record's file fleet\.json differs from its recorded SHA-256 @ \$\.files\['fleet\.json'\]"),
        ({"fleet": None}, r"expected dict @ \$\.fleet"),
        ({"engines": []}, r"expected dict @ \$\.engines"),
        ({"profiles": "p"}, r"expected dict @ \$\.profiles"),
        ({"profiles_source": None}, r"expected dict @ \$\.profiles_source"),
    ],
)
def test_a_record_that_does_not_verify_is_refused(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    write_record(report(tmp_path), tmp_path / "rec")
    rewrite(tmp_path / "rec", **changes)
    with pytest.raises(ConfigError, match=message) as info:
        load_record(tmp_path / "rec")
    assert str(tmp_path / "rec" / INDEX) in str(info.value)


def test_a_record_that_is_no_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / INDEX).write_text("[]")
    with pytest.raises(ConfigError, match=r"not a narwhal deployment record @ \$\.kind"):
        load_record(tmp_path)


def test_a_loaded_record_takes_what_the_index_says(tmp_path: Path) -> None:
    write_record(report(tmp_path), tmp_path / "rec")
    rewrite(tmp_path / "rec", fleet={"sha256": "abc", "source": 5}, refit_original={},
            created_at=None)  # fmt: skip
    rec = load_record(tmp_path / "rec")
    assert (rec.fleet_sha256, rec.fleet_source, rec.refit_original, rec.created_at) == ("abc", None, None, "None")


def test_record_matches_fleet_and_pair(tmp_path: Path) -> None:
    r = report(tmp_path)
    assert r.profiles is not None
    doc = fleet_doc() | {"profiles": {"path": r.profiles.profiles}}
    r = report(tmp_path, document=doc, source=False)
    assert r.profiles is not None
    rec = write_record(r, tmp_path / "rec")
    assert record_matches(rec, doc) and record_matches(rec, parse_fleet(doc))
    fleet_file = tmp_path / "f.json"
    fleet_file.write_text(json.dumps(doc))
    assert record_matches(rec, fleet_file) and record_matches(rec, str(fleet_file))
    assert fleet_sha256(fleet_file) == fleet_sha256(doc) == fleet_sha256(parse_fleet(doc)) == rec.fleet_sha256
    other = fleet_doc(engine={"first_token_timeout_s": 6.0}) | {"profiles": {"path": r.profiles.profiles}}
    assert not record_matches(rec, other) and not record_matches(rec, other, check_profiles=False)
    # Each file of the pair counts.
    profiles, samples = Path(r.profiles.profiles), Path(r.profiles.samples)
    for changed in (profiles, samples):
        text = changed.read_text()
        changed.write_text(text + " ")
        assert not record_matches(rec, doc) and record_matches(rec, doc, check_profiles=False)
        changed.write_text(text)
        assert record_matches(rec, doc)
    samples.unlink()
    assert not record_matches(rec, doc)
    # A document that names no pair matches on its hash alone.
    bare = write_record(report(tmp_path, source=False), tmp_path / "bare")
    assert record_matches(bare, fleet_doc())


def test_the_fleet_hash_is_of_the_documented_canonical_form(tmp_path: Path) -> None:
    """SHA-256 of the validated document with every default, keys sorted, no whitespace:
    what another tool must compute to compare a fleet with a record."""
    doc = fleet_doc()
    canonical = json.dumps(unstructure_fleet(parse_fleet(doc)), sort_keys=True, separators=(",", ":"))
    assert fleet_sha256(doc) == hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def test_a_record_whose_check_result_went_missing_says_so(tmp_path: Path) -> None:
    rec = write_record(report(tmp_path), tmp_path / "rec")
    (tmp_path / "rec" / "check.json").unlink()
    with pytest.raises(ConfigError, match=r"check\.json: cannot read check result: "):
        rec.check()


@pytest.mark.parametrize(
    "changes",
    [
        {"profiles": {"profiles": 5, "samples": "s"}},
        {"profiles_source": {"profiles": "p"}},
        {"refit_original": {"profiles": ["x"], "samples": "s"}},
        {"engines": {"e0": {"url": 5}}},
    ],
)
def test_a_malformed_entry_names_the_record(tmp_path: Path, changes: dict[str, Any]) -> None:
    write_record(report(tmp_path), tmp_path / "rec")
    rewrite(tmp_path / "rec", **changes)
    with pytest.raises(ConfigError) as info:
        load_record(tmp_path / "rec")
    assert str(tmp_path / "rec" / INDEX) in str(info.value)
