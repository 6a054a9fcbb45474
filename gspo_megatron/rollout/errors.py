"""What can go wrong in a rollout, as exceptions a trainer can tell apart. Every message names the server,
request or sample concerned; none of these is ever turned into a partial batch."""


class RolloutError(RuntimeError):
    """A rollout could not be completed. ``url``: the server concerned, where one is (the engine restarts or
    waits for that one)."""

    def __init__(self, message: str = "", url: str | None = None):
        super().__init__(message)
        self.url = url


class ServerStartError(RolloutError):
    """An SGLang server did not become healthy in time, or exited while starting (the message has its log tail)."""


class StartInterrupted(ServerStartError):
    """A stop signal (a scheduler's SIGTERM) came while waiting for servers to start: they were shut down.
    ``signum``: that signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class ServerDied(RolloutError):
    """An SGLang server process exited, or stopped accepting connections, while it was needed."""


class TooManyRestarts(ServerDied):
    """A launched server failed again after ``max_server_restarts`` restarts within ``restart_window_s``, or an
    attached server did not come back within ``attached_wait_s``."""


class ServerUnresponsive(RolloutError):
    """An SGLang server stopped answering (health probes or a request timed out): hung or overloaded."""


class RequestFailed(RolloutError):
    """The server rejected a request (4xx), or kept failing it (5xx) after every retry."""


class BadResponse(RolloutError):
    """The server answered with something that does not match the request (count, order, lengths, abort)."""


class WeightSyncError(RolloutError):
    """A weight update failed or the server does not report the new weight version afterwards."""


class StaleWeights(WeightSyncError):
    """A restarted server serves its launch weights, and the current ones came by distributed sync: only the
    trainer can send them again (``train/sampling/broadcast.collect`` does, then generates again)."""


class RewardError(RuntimeError):
    """A reward function raised or returned a non-finite value (the message names the sample)."""
