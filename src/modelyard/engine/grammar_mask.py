"""Per-step grammar masks: one bitmask for every row that has a grammar, one masked op on logits.

The sampler calls `apply_grammar_masks` before it picks tokens. Rows without a grammar pay a
list scan and nothing else (no tensor is allocated when no row of the step has one). The
bitmasks of all grammar rows are filled into one tensor (with a GPU model, by llguidance's
thread pool in parallel, off the GIL; with a CPU model row by row, since the pool's threads
would fight torch's for the cores), unpacked on the logits' device, and applied to those rows
only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from modelyard.engine.grammar import Closers, GrammarState, GrammarViolation

if TYPE_CHECKING:
    from modelyard.engine.sequence import Sequence

# A row allowing more than this fraction of the vocabulary is inside free text (a string).
FREE_TEXT_FRACTION = 4
PARALLEL_MIN_ROWS = 4
_executor: Any = None
_shifts: dict[torch.device, torch.Tensor] = {}


def _parallel_executor() -> Any:
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


def _bit_shifts(device: torch.device) -> torch.Tensor:
    shifts = _shifts.get(device)
    if shifts is None:
        shifts = _shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def fill_bitmasks(states: list[GrammarState], parallel: bool = False) -> torch.Tensor:
    """`[len(states), words]` int32 bitmasks (bit t of a row: token t allowed), on the CPU;
    `parallel`: by llguidance's thread pool, else one row after the other on this thread."""
    words = states[0].words
    bitmask = torch.empty((len(states), words), dtype=torch.int32)
    row_bytes = words * 4
    if not parallel or len(states) < PARALLEL_MIN_ROWS:
        for i, state in enumerate(states):
            state.matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), row_bytes)
    else:
        pairs = [(s.matcher, i) for i, s in enumerate(states)]
        _parallel_executor().unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), row_bytes, len(states)
        )
    return bitmask


def allowed_tokens(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """The bitmask unpacked to `[rows, vocab]` booleans on `device`."""
    packed = bitmask.to(device, non_blocking=True)
    bits = (packed.unsqueeze(-1) >> _bit_shifts(device)) & 1
    allowed = bits.view(packed.shape[0], -1).bool()
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=device)
    return torch.cat([allowed, pad], dim=1)


def prefer_closers(allowed: torch.Tensor, rows: list[int], closers: Closers) -> torch.Tensor:
    """In `rows` (sequences at the end of their budget), keep only the allowed tokens that close
    what is open, where the grammar allows any: inside a free string (most of the vocabulary
    allowed) those that end it, elsewhere those made of `}` and `]`."""
    vocab, device = allowed.shape[1], allowed.device
    index = torch.tensor(rows, device=device)
    sub = allowed[index]
    in_string = sub.sum(dim=1, keepdim=True) > vocab // FREE_TEXT_FRACTION
    quote = sub & closers.quote[:vocab].to(device)
    brace = sub & closers.brace[:vocab].to(device)
    use_quote = in_string & quote.any(dim=1, keepdim=True)
    use_brace = ~in_string & brace.any(dim=1, keepdim=True)
    chosen = torch.where(use_quote, quote, torch.where(use_brace, brace, sub))
    return allowed.index_put((index,), chosen)


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """`logits` with every logit a row's grammar forbids at -inf (a new tensor: the model's are
    inference tensors; the same one when no row has a grammar). A matcher that broke, or
    allows nothing, raises `GrammarViolation` (the step is then retried request by request,
    so only that request fails)."""
    grammars = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
    for i, state in grammars:
        state.sync(seqs[i].output_token_ids)
        state.check()
    grammars = [(i, state) for i, state in grammars if state.masks]  # none inside a thinking
    if not grammars:
        return logits
    rows = [i for i, _ in grammars]
    states = [state for _, state in grammars]
    # The thread pool only where the model does not run on these cores: on a CPU engine its
    # threads fight torch's (measured: a batch of 32 at 0.2x instead of 0.95x on 2 cores).
    bitmask = fill_bitmasks(states, parallel=logits.device.type != "cpu")
    for state in states:  # a matcher that broke computing its mask allows only its end
        state.check()
    dead = (bitmask == 0).all(dim=1)
    if bool(dead.any()):
        raise GrammarViolation("the grammar allows no next token")
    allowed = allowed_tokens(bitmask, logits.shape[1], logits.device)
    for j, state in enumerate(states):
        if (opener := state.opener) is not None and opener < allowed.shape[1]:
            allowed[j, opener] = True  # a reasoning model may open its thinking instead
    closing = [j for j, state in enumerate(states) if state.closing]
    if closing:
        allowed = prefer_closers(allowed, closing, states[0].closers)
    forbidden = ~allowed
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(forbidden, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    return logits.index_put((index,), logits[index].masked_fill(forbidden, float("-inf")))
