"""The driver side: runs a Plan's ranks and owns the requests (no torch is imported here).

- `service.py`: Engine(plan, source), the long-lived engine: ranks started once, requests submitted,
  streamed and cancelled at any time, scheduled into KV-cache slots step by step (what `serve` runs).
- `engine.py`: LocalEngine, the Engine as `generate` uses it (a batch of prompts, then close).
- `ranks.py`: the rank processes, their inboxes and heartbeats; a failed, dead or hung rank is named.
- `scheduler.py`, `requests.py`: admission, chunked prefill, stop conditions; one request's state.
- `session.py`: one `generate` job: which Plan runs, checks before any rank starts, the summary.
- `checks.py`: what the local runtime can run of a Plan, refused by manifest field.
- `text.py`: tokenizer, prompts and streamed text.
"""

from shardlm.engine.checks import UserError
from shardlm.engine.engine import GenerateResult, LocalEngine, RankFailure
from shardlm.engine.requests import GenerationParams, RequestError, TokenEvent
from shardlm.engine.service import Engine, EngineClosed, QueueFull
from shardlm.engine.session import plan_run

__all__ = ["Engine", "EngineClosed", "GenerateResult", "GenerationParams", "LocalEngine", "QueueFull", "RankFailure",
           "RequestError", "TokenEvent", "UserError", "plan_run"]
