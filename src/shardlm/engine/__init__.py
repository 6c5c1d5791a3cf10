"""The driver side: runs a Plan's ranks and owns the requests (no torch is imported here).

- `engine.py`: LocalEngine(plan, source), the rank processes and the messages to and from them.
- `session.py`: one `generate` job: which Plan runs, checks before any rank starts, the summary.
- `checks.py`: what the local runtime can run of a Plan, refused by manifest field.
- `text.py`: tokenizer, prompts and streamed text.
"""

from shardlm.engine.checks import UserError
from shardlm.engine.engine import GenerateResult, LocalEngine, RankFailure

__all__ = ["GenerateResult", "LocalEngine", "RankFailure", "UserError"]
