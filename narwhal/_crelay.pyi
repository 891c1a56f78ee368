# The token relay's loop in C (narwhal/_crelay.c); narwhal/router/relay.py drives it.
from collections.abc import Callable
from typing import Final, final

RAW: Final[int]
EOF: Final[int]
ERROR: Final[int]
UNSENT: Final[int]
SILENT: Final[int]
RELEASED: Final[int]
CLOSED: Final[int]

@final
class Job:
    @property
    def tokens(self) -> int: ...
    @property
    def last_token(self) -> float: ...
    @property
    def last_activity(self) -> float: ...
    @property
    def reason(self) -> int: ...
    @property
    def errno(self) -> int: ...
    @property
    def raw(self) -> bytes: ...
    @property
    def unsent(self) -> bytes: ...
    @property
    def done(self) -> bool: ...

@final
class Relay:
    def __init__(self) -> None: ...
    def run(self) -> None: ...
    def adopt(
        self,
        src: int,
        dst: int,
        id_prefix: bytes,
        strip_ids: bool,
        chunked: bool,
        max_event: int,
        silence_s: float,
        last_activity: float,
        callback: Callable[[], object],
        /,
    ) -> Job: ...
    def release(self, job: Job, /) -> None: ...
    def close(self) -> None: ...

def shape(
    data: bytes, id_prefix: bytes, strip_ids: bool, chunked: bool, max_event: int, /
) -> tuple[int, bytes] | None: ...
