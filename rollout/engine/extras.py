"""The per-request extras a plan carries beyond sampling settings, and applying what comes back. No torch.

Top logprobs and penalties ride on a sampling ``SeqPlan``; prompt logprobs (``prompt_logprobs`` and
``Engine.score``) ask for the logits of every prompt position a step computes, each scoring the next
prompt token. Kept out of the scheduler so its hot loop only pays for a request that asks.
"""

from __future__ import annotations

from rollout.engine.plan import SampleResult, SeqPlan
from rollout.engine.sequence import Request, Sequence


def add_sample_extras(plan: SeqPlan, seq: Sequence) -> None:
    p = seq.params
    plan.num_top_logprobs = p.logprobs or 0
    if p.has_penalties:
        plan.penalties = (float(p.repetition_penalty), float(p.presence_penalty), float(p.frequency_penalty))
        plan.history, plan.num_prompt_tokens = seq.token_ids, seq.num_prompt_tokens


def add_prompt_targets(plan: SeqPlan, seq: Sequence, start: int, n: int) -> bool:
    """Score the prompt tokens whose predicting position this chunk computes; True if there are any.

    Position p's logits score token p + 1, for tokens ``prompt_lp_start`` (at least 1) .. the prompt's end."""
    lo = max(start, seq.prompt_lp_start - 1, 0)
    hi = min(start + n, seq.num_prompt_tokens - 1)
    if hi <= lo:
        return False
    p = seq.params
    plan.prompt_first, plan.prompt_targets, plan.prompt_top = lo, seq.token_ids[lo + 1 : hi + 1], p.prompt_logprobs or 0
    plan.temperature, plan.top_k, plan.top_p, plan.min_p = p.temperature, p.effective_top_k, p.top_p, p.min_p
    plan.logprobs_mode = p.logprobs_mode
    return True


def apply_prompt_logprobs(requests: dict[str, Request], seqs: dict[int, Sequence], result: SampleResult) -> None:
    """Store each scored prompt token's logprob (and alternatives) at its position; a recompute overwrites."""
    for seq_id, first, lps, tops in result.prompt_logprobs:
        seq = seqs.get(seq_id)
        request = requests.get(seq.request_id) if seq is not None else None
        if request is None or request.prompt_logprobs is None:
            continue  # aborted meanwhile
        first_token = first + 1
        request.prompt_logprobs[first_token : first_token + len(lps)] = lps
        if tops is not None and request.prompt_top_logprobs is not None:
            request.prompt_top_logprobs[first_token : first_token + len(tops)] = tops
