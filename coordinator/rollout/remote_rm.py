"""`--rm-type remote_rm`: rewards from an HTTP service at `--rm-url` (slime's remote reward model).

Owns the request of one sample's reward: `POST <rm-url>` with the JSON body `{"prompt", "response", "label"}`;
the JSON answer (a number, or an object of numbers chosen by `--reward-key`) is the reward.

Invariants (those of our engine client, `coordinator.engines.client`, which carries the requests):
- every request has a deadline (`timeout` per attempt) and the retries a total budget;
- only transport errors and 5xx are retried (slime retries up to 10 times with backoff up to 30 s; so do we,
  within the budget); a 4xx fails the sample at once with the service's own message;
- the engines' `--sglang-api-key` is never sent to the reward service (its own client, no credentials);
- the samples of one group are scored concurrently, and one failure cancels the others and is raised alone,
  as a `RewardError` naming `--rm-url` and the sample;
- the answer is read under `REPLY_BYTES` and decoded bounded (the boundary layer), then checked by the reward
  model (`rewards.RewardModel._check`: a finite number, or an object of finite numbers with `--reward-key`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from coordinator.engines.errors import EngineError, EngineHTTPError, EngineReplyError
from coordinator.engines.policy import RetryPolicy
from coordinator.rewards.rules import RewardError
from replay.sample import Sample
from workers.boundary.json_input import JsonObject

#: slime's remote rm: up to 10 attempts, backoff min(2**attempt, 30) s; a total budget bounds them here.
REMOTE_RETRY = RetryPolicy(attempts=10, backoff=1.0, backoff_max=30.0, budget=300.0)
REMOTE_TIMEOUT = 120.0
#: a reward is a number or a small object of numbers; a reply past this is refused unread
REPLY_BYTES = 1 << 20


def _where(sample: Sample) -> str:
    return f"sample {sample.group_index}/{sample.sample_index}"


class RemoteReward:
    """Scores samples by asking the reward service at `url`."""

    def __init__(self, url: str, *, timeout: float = REMOTE_TIMEOUT, retry: RetryPolicy = REMOTE_RETRY,
                 max_connections: int = 64) -> None:
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"--rm-url {url!r} must start with http:// or https://")
        self.url = url
        self.timeout = timeout
        self.retry = retry
        self.max_connections = max_connections

    @staticmethod
    def payload(sample: Sample) -> JsonObject:
        return {"prompt": sample.prompt, "response": sample.response, "label": sample.label}

    async def score(self, samples: Sequence[Sample]) -> list[Any]:
        """The service's answer for each sample, in order (one connection pool for the call)."""
        from coordinator.engines.client import (
            EngineClient,  # here: a run without remote_rm never imports httpx
        )

        results: list[Any] = [None] * len(samples)
        failure: RewardError | None = None
        async with EngineClient(max_connections=min(self.max_connections, max(len(samples), 1)),
                                read_timeout=self.timeout, retry=self.retry) as client:
            async with anyio.create_task_group() as group:

                async def one(index: int, sample: Sample) -> None:
                    # Errors are carried out by hand: raised inside, they would arrive in an ExceptionGroup.
                    nonlocal failure
                    try:
                        results[index] = await client.request_json(self.url, "POST", "", max_bytes=REPLY_BYTES,
                                                                   json_body=self.payload(sample))
                    except EngineReplyError as error:  # too large, too deep, not JSON: no retry helps
                        failure = RewardError(f"--rm-url {self.url} sent a refused reply for {_where(sample)}: "
                                              f"{error.reason}")
                        group.cancel_scope.cancel()
                    except EngineHTTPError as error:
                        if error.status < 500 and error.status != 200:
                            failure = RewardError(f"--rm-url {self.url} refused {_where(sample)}: HTTP "
                                                  f"{error.status}: {error.server_message}")
                        else:
                            failure = RewardError(f"--rm-url {self.url} failed {_where(sample)}: {error.message}")
                        group.cancel_scope.cancel()
                    except EngineError as error:
                        failure = RewardError(f"--rm-url {self.url}: no answer for {_where(sample)} within the "
                                              f"retry budget ({error.message})")
                        group.cancel_scope.cancel()

                for index, sample in enumerate(samples):
                    group.start_soon(one, index, sample)
        if failure is not None:
            raise failure
        return results
